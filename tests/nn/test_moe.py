"""tileops.nn.MoE on the CPU (the reference target serves its ops): the Mixtral and DeepSeek-V3
configs against the block written token by token in float64 as the models' reference code
computes it, the parameters and buffers it saves, and the op rebuilt by ``.to()``; in
training, the gradients of x and of every parameter against a float64 loop over the experts
in torch (Mixtral's and DeepSeek-V3's routing, empty experts, a masked layout's drops), SGD
steps whose losses follow the loop's, and inference still on the fused composite."""

from __future__ import annotations

import copy

import pytest
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


@pytest.mark.parametrize("shape", [(4, 8), (3, 5), (2, 16, 4), ()])
@pytest.mark.parametrize("grad", [False, True])
def test_another_hidden_size_is_refused_by_name(shape, grad) -> None:
    """x's last axis must be hidden_size: reshaping by the layer's size would regroup the
    tokens (4 x 8 into 2 rows of 16) and answer silently, on either path."""
    layer = MoE(16, 8, 8, 2)
    x = torch.randn(shape, requires_grad=grad)
    with pytest.raises(ValueError) as exc:
        layer(x)
    seen = f"float32[{', '.join(map(str, shape))}]"
    assert str(exc.value) == ("MoE: argument x expected a tensor [..., 16] (its last axis is "
                              f"hidden_size), seen {seen}")
    assert layer(torch.randn(2, 3, 16)).shape == (2, 3, 16)


def test_to_rebuilds_the_op_and_keeps_the_config() -> None:
    layer = MoE.mixtral(hidden_size=8, intermediate_size=4, num_experts=4)
    op = layer.op
    layer.to(torch.float64)
    assert layer.op is not op and layer.op.num_experts == 4 and layer.w13.dtype == torch.float64
    assert repr(layer).startswith("MoE(\n  hidden_size=8, intermediate_size=4, num_experts=4, "
                                  "top_k=2, scoring='softmax'")


# --- training -------------------------------------------------------------------------------


def _expert_loop(layer: MoE, x: torch.Tensor, max_m: int | None = None) -> torch.Tensor:
    """The layer's routed experts in float64 torch, differentiable in ``x`` and every
    parameter: the routing of ``_token_loop`` for all tokens at once, then a loop over the
    experts, each applied to the tokens routed to it (a masked layout of ``max_m`` rows keeps
    an expert's first ``max_m`` slots in token order, the rest dropped)."""
    e, k, inter = layer.num_experts, layer.top_k, layer.intermediate_size
    logits = x @ layer.gate.weight.T
    scores = torch.softmax(logits, -1) if layer.scoring == "softmax" else torch.sigmoid(logits)
    bias = layer.e_score_correction_bias
    choice = scores.detach() + (bias.double() if bias is not None else 0.0)
    if layer.num_groups > 1:
        per = e // layer.num_groups
        sums = choice.view(-1, layer.num_groups, per).topk(2, -1).values.sum(-1)
        keep = torch.sort(sums, dim=-1, descending=True, stable=True).indices
        keep = keep[:, :layer.topk_groups]
        mask = torch.zeros_like(sums, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(per, 1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    w = scores.gather(1, ids)
    if layer.renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * layer.routed_scaling_factor
    out = torch.zeros_like(x)
    flat = ids.reshape(-1)
    for i in range(e):
        slots = (flat == i).nonzero().squeeze(1)
        if max_m is not None:
            slots = slots[:max_m]
        if slots.numel() == 0:
            continue
        tok = slots // k
        h = x[tok] @ layer.w13[i].T
        o = (F.silu(h[:, :inter]) * h[:, inter:]) @ layer.w2[i].T
        out = out.index_add(0, tok, o * w.reshape(-1)[slots, None])
    return out


def _params(layer: MoE) -> dict[str, torch.Tensor]:
    return {"gate.weight": layer.gate.weight, "w13": layer.w13, "w2": layer.w2}


#: Mixtral-like softmax top-2; DeepSeek-like sigmoid grouped top-k with a correction bias and
#: scaling; more experts than one batch's picks reach (empty experts); a masked layout whose
#: blocks drop the slots past them
TRAIN_CONFIGS = {
    "mixtral": (lambda: MoE.mixtral(hidden_size=12, intermediate_size=10, num_experts=4,
                                    dtype=torch.float64), None),
    "deepseek": (lambda: MoE.deepseek_v3(hidden_size=12, intermediate_size=6, num_experts=16,
                                         top_k=4, num_groups=4, topk_groups=2,
                                         dtype=torch.float64), None),
    "empty-experts": (lambda: MoE(12, 6, 32, 1, dtype=torch.float64), None),
    "masked-drops": (lambda: MoE(12, 6, 4, 2, layout=MaskedLayoutSpec(3),
                                 dtype=torch.float64), 3),
}


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                                  lambda m: m.double(), lambda m: m.float()])
def test_a_cast_keeps_the_correction_bias_float32_and_the_layer_running(cast) -> None:
    """``.to(dtype)``, ``.half()``, ``.double()`` cast the experts, not the correction bias:
    the routing ops take it in float32 (a bf16 bias failed every call after the cast); its
    values are the float32 ones, not rounded through the cast's dtype; inference and a
    backward both run."""
    torch.manual_seed(0)
    layer = MoE.deepseek_v3(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                            num_groups=4, topk_groups=2)
    with torch.no_grad():
        layer.e_score_correction_bias.copy_(torch.linspace(0.0, 1e-3, 8) + 1 / 3)
    want = layer.e_score_correction_bias.clone()
    layer = cast(layer)
    bias = dict(layer.named_buffers())["e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, want)
    x = torch.randn(3, 16, dtype=layer.w13.dtype)
    with torch.no_grad():
        assert layer(x).dtype == x.dtype
    layer(x).float().sum().backward()
    assert layer.w13.grad is not None and layer.e_score_correction_bias.grad is None


@pytest.mark.parametrize("config", list(TRAIN_CONFIGS))
def test_every_gradient_matches_the_float64_expert_loop(config) -> None:
    build, max_m = TRAIN_CONFIGS[config]
    torch.manual_seed(3)
    layer = build()
    if layer.e_score_correction_bias is not None:
        with torch.no_grad():
            layer.e_score_correction_bias.copy_(torch.randn(layer.num_experts) / 10)
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 5, 12, dtype=torch.float64)
    out = layer(x)
    assert out.shape == x.shape
    got = torch.autograd.grad(out, [x, *_params(layer).values()], upstream)
    xr = x.detach().clone().requires_grad_(True)
    ref = _expert_loop(layer, xr.view(-1, 12), max_m).view(x.shape)
    want = torch.autograd.grad(ref, [xr, *_params(layer).values()], upstream)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, g, w in zip(["x", *_params(layer)], got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")
    if config == "empty-experts":  # 10 tokens, one pick each, 32 experts: some get none
        assert (got[2].abs().sum((1, 2)) == 0).any()
    if config == "masked-drops":  # 20 slots over 4 blocks of 3: the drops change the output
        assert not torch.allclose(ref, _expert_loop(layer, xr.view(-1, 12)).view(x.shape))


def test_inference_keeps_the_fused_composite() -> None:
    layer = MoE.mixtral(hidden_size=8, intermediate_size=4, num_experts=4, dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    assert layer.op.last_call is None
    with torch.no_grad():
        layer(x)
    assert layer.op.last_call.s_x == (3, 8)  # the composite ran
    stages = layer.__dict__["_stages"][1]  # built with the layer, for a compiled step
    assert stages.route.last_call is None  # and none of them ran
    staged = layer(x)  # parameters require grad: the training path
    assert staged.grad_fn is not None and layer.__dict__["_stages"][1] is stages
    assert stages.route.last_call is not None
    with torch.no_grad():
        torch.testing.assert_close(staged, layer(x), rtol=1e-12, atol=1e-14)


def test_training_steps_follow_the_expert_loop() -> None:
    """Five SGD steps of the layer and of the loop's copy from the same weights: the losses
    agree step by step and fall."""
    torch.manual_seed(4)
    layer = MoE.deepseek_v3(hidden_size=12, intermediate_size=6, num_experts=8, top_k=2,
                            num_groups=4, topk_groups=2, dtype=torch.float64)
    twin = copy.deepcopy(layer)
    x = torch.randn(16, 12, dtype=torch.float64)
    target = torch.randn(16, 12, dtype=torch.float64)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (layer, twin)]
    losses: list[tuple[float, float]] = []
    for _ in range(5):
        pair = []
        for m, opt, f in ((layer, opts[0], layer), (twin, opts[1], None)):
            opt.zero_grad()
            out = m(x) if f is not None else _expert_loop(m, x)
            loss = F.mse_loss(out, target)
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append((pair[0], pair[1]))
    for a, b in losses:
        assert a == pytest.approx(b, rel=1e-9)
    assert losses[-1][0] < losses[0][0]
    torch.testing.assert_close(layer.w13, twin.w13, rtol=1e-9, atol=1e-11)


def test_pickling_leaves_the_stage_ops_out() -> None:
    layer = MoE.mixtral(hidden_size=8, intermediate_size=4, num_experts=4, dtype=torch.float64)
    layer(torch.randn(2, 8, dtype=torch.float64))
    assert "_stages" in layer.__dict__
    assert "_stages" not in layer.__getstate__()
    restored = copy.deepcopy(layer)  # its own, built again with its op
    assert restored.__dict__["_stages"][1] is not layer.__dict__["_stages"][1]
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(restored(x), layer(x), rtol=0, atol=0)


def test_a_fresh_layer_trains_under_torch_compile() -> None:
    """The training path's stage ops are built with the layer (a compiled step cannot
    construct them)."""
    torch._dynamo.reset()
    layer = MoE(16, 8, 4, 2, dtype=torch.float64)
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    y = torch.compile(lambda a: layer(a), fullgraph=True)(x)
    torch.testing.assert_close(y, _token_loop(layer, x.detach()))
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.w13.grad is not None


def test_a_new_expert_count_is_refused_by_name_and_the_layer_kept() -> None:
    """num_experts is the weights' leading dim: assigning another count is refused naming the
    layer, the attribute and the weights (it failed in the grouped GEMM's signature at the next
    call); the same count and the other routing attributes are taken."""
    layer = MoE(8, 6, 4, 2, dtype=torch.float64)
    x = torch.randn(2, 8, dtype=torch.float64)
    with torch.no_grad():
        want = layer(x)
    with pytest.raises(ValueError, match=r"MoE.num_experts is the experts' weights' count, 4 "
                                         r"\(w13 is \[4, 12, 8\]\), not 3"):
        layer.num_experts = 3
    layer.num_experts = 4
    assert layer.num_experts == 4
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    layer.top_k = 1
    with torch.no_grad():
        assert layer(x).shape == (2, 8)
