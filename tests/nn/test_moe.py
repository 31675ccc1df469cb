"""tileops.nn.MoE on the CPU (the reference target serves its op): the Mixtral and DeepSeek-V3
configs against the block written token by token in float64 as the models' reference code
computes it, the parameters and buffers it saves, and the op rebuilt by ``.to()``."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tileops.nn.moe import MoE
from tileops.ops.moe import MaskedLayoutSpec


def _token_loop(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its experts: the routing of the layer's config spelled out."""
    e, inter = layer.num_experts, layer.intermediate_size
    logits = x @ layer.gate.weight.T
    scores = torch.softmax(logits, -1) if layer.scoring == "softmax" else torch.sigmoid(logits)
    bias = layer.e_score_correction_bias
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        choice = scores[t] + (bias.double() if bias is not None else 0.0)
        if layer.num_groups > 1:
            per = e // layer.num_groups
            sums = choice.view(layer.num_groups, per).topk(2).values.sum(-1)
            keep = torch.sort(sums, descending=True, stable=True).indices[:layer.topk_groups]
            mask = torch.zeros(layer.num_groups, dtype=torch.bool)
            mask[keep] = True
            choice = choice.masked_fill(~mask.repeat_interleave(per), float("-inf"))
        ids = torch.sort(choice, descending=True, stable=True).indices[:layer.top_k]
        w = scores[t, ids]
        if layer.renormalize:
            w = w / w.sum()
        w = w * layer.routed_scaling_factor
        for j, i in enumerate(ids.tolist()):
            h = layer.w13[i] @ x[t]
            out[t] += w[j] * (layer.w2[i] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def test_mixtral_config_matches_the_token_loop() -> None:
    torch.manual_seed(0)
    layer = MoE.mixtral(hidden_size=16, intermediate_size=12, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        out = layer(x)
        assert out.shape == x.shape
        torch.testing.assert_close(out.view(-1, 16), _token_loop(layer, x.view(-1, 16)),
                                   rtol=1e-10, atol=1e-10)
    assert sorted(layer.state_dict()) == ["gate.weight", "w13", "w2"]
    assert layer.op.top_k == 2 and layer.op.scoring == "softmax"


def test_deepseek_config_matches_the_token_loop() -> None:
    torch.manual_seed(1)
    layer = MoE.deepseek_v3(hidden_size=16, intermediate_size=8, num_experts=16, top_k=4,
                            topk_groups=2, num_groups=4, dtype=torch.float64)
    with torch.no_grad():
        layer.e_score_correction_bias.copy_(torch.randn(16) / 10)
        x = torch.randn(7, 16, dtype=torch.float64)
        torch.testing.assert_close(layer(x), _token_loop(layer, x), rtol=1e-10, atol=1e-10)
    assert sorted(layer.state_dict()) == ["e_score_correction_bias", "gate.weight", "w13", "w2"]
    assert layer.e_score_correction_bias.dtype == torch.float32


def test_a_masked_layout_drops_tokens_past_the_blocks() -> None:
    torch.manual_seed(2)
    x = torch.randn(9, 8, dtype=torch.float64)
    full = MoE(8, 6, 2, 1, dtype=torch.float64)
    tight = copy.deepcopy(full)
    full.layout = MaskedLayoutSpec(9)  # room for every token: the same as contiguous
    with torch.no_grad():
        torch.testing.assert_close(full(x), tight(x), rtol=1e-12, atol=1e-12)
        full.layout = MaskedLayoutSpec(1)  # one token an expert: the rest get nothing
        out = full(x)
    assert int((out.abs().sum(-1) > 0).sum()) <= 2


def test_to_rebuilds_the_op_and_keeps_the_config() -> None:
    layer = MoE.mixtral(hidden_size=8, intermediate_size=4, num_experts=4)
    op = layer.op
    layer.to(torch.float64)
    assert layer.op is not op and layer.op.num_experts == 4 and layer.w13.dtype == torch.float64
    assert repr(layer).startswith("MoE(\n  hidden_size=8, intermediate_size=4, num_experts=4, "
                                  "top_k=2, scoring='softmax'")
