"""One rank of test_expert_parallel.py's torchrun run: tileops.nn.ExpertParallelMoE against the
one-device tileops.nn.MoE built from the same weights, forward and backward, on gloo and the
``reference`` target (the run and the comparison are _tp_worker.py's).

Every rank builds the full layer, the whole batch and a fixed random upstream gradient from one
seed, takes its expert shard with ``from_moe`` and its own slice of the batch's tokens, and
runs forward and backward of ``(y * g).sum()``. The one-device layer runs the whole batch (the
ranks' tokens in rank order) in float64; the shard, in float64 too (so the routing's choices
are the same ones, with no near-tie rounding apart), must give this rank's slice of the output
and of the input gradient, the full layer's slice of each expert gradient (``w13``, ``w2``),
and, summed over the ranks, its router gradient (the module docstring's contract).

Cases: Mixtral's routing; DeepSeek-V3's (sigmoid, groups, a correction bias, a scale); a
correction bias that keeps every token off rank 1's experts (that rank receives no rows: its
output rows still come back, its expert gradients are zero); a masked layout whose blocks drop
slots (the drops are the one-device layer's: the rows arrive in the batch's token order); a last
rank with no tokens of its own (it sends nothing and still serves the others' rows); and the
refusal of an expert count the world size does not divide.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _tp_worker import _check, _Mismatch, _randn, finish, run

from tileops.nn import MoE
from tileops.nn.expert_parallel import ExpertParallelMoE
from tileops.ops.moe import MaskedLayoutSpec

TARGET = "reference"
TOKENS = 6  # a rank's
TOL = dict(rtol=1e-9, atol=1e-11)  # float64 on both sides: only the summation orders differ


def _layer(config: str) -> MoE:
    kw = dict(dtype=torch.float64, target=TARGET)
    if config == "mixtral":
        return MoE.mixtral(hidden_size=8, intermediate_size=6, num_experts=4, **kw)
    if config == "deepseek":
        return MoE.deepseek_v3(hidden_size=8, intermediate_size=4, num_experts=8, top_k=3,
                               num_groups=4, topk_groups=2, **kw)
    if config == "rank-1-idle":
        return MoE(8, 4, 4, 1, scoring="sigmoid", correction_bias=True, **kw)
    if config == "masked":
        return MoE(8, 4, 4, 2, layout=MaskedLayoutSpec(4), **kw)
    if config == "last-rank-no-tokens":
        return MoE(8, 4, 4, 2, **kw)
    raise ValueError(config)


def moe(config: str, rank: int, world: int) -> None:
    case = f"ExpertParallelMoE({config})"
    torch.manual_seed(0)
    full = _layer(config)
    with torch.no_grad():
        if config == "deepseek":
            full.e_score_correction_bias.copy_(_randn(8, seed=3) / 10)
        if config == "rank-1-idle":  # experts 2 and 3 (rank 1's) are never chosen
            full.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, -10.0, -10.0]))
    h = full.hidden_size
    # a rank's tokens: TOKENS each, or none on the last rank (it still joins every exchange)
    counts = [TOKENS] * world if config != "last-rank-no-tokens" else [TOKENS] * (world - 1) + [0]
    x_all = _randn(sum(counts), h, seed=1).double()
    g_all = _randn(sum(counts), h, seed=2).double()
    mine = slice(sum(counts[:rank]), sum(counts[:rank + 1]))

    xr = x_all.clone().requires_grad_()
    y_ref = full(xr)
    (y_ref * g_all).sum().backward()

    layer = ExpertParallelMoE.from_moe(full, group=None)
    n = layer.num_local_experts
    if (n, layer.expert_offset) != (full.num_experts // world, rank * n) or \
            layer.w13.shape != (n, *full.w13.shape[1:]):
        raise _Mismatch(f"{case}: shard of {tuple(layer.w13.shape)} at {layer.expert_offset}")
    x = x_all[mine].clone().view(2, -1, h).requires_grad_()  # leading axes flatten
    y = layer(x)
    (y * g_all[mine].view(x.shape)).sum().backward()
    _check(case, "output", y.detach().view(-1, h), y_ref.detach()[mine], **TOL)
    _check(case, "input gradient", x.grad.view(-1, h), xr.grad[mine], **TOL)
    part = slice(rank * n, (rank + 1) * n)
    _check(case, "w13 gradient", layer.w13.grad, full.w13.grad[part], **TOL)
    _check(case, "w2 gradient", layer.w2.grad, full.w2.grad[part], **TOL)
    router = layer.gate.weight.grad.clone()
    dist.all_reduce(router)
    _check(case, "router gradient (summed over the ranks)", router, full.gate.weight.grad, **TOL)
    idle = config == "rank-1-idle" and rank == 1
    if idle and (layer.w13.grad.abs().sum() != 0 or layer.w2.grad.abs().sum() != 0):
        raise _Mismatch(f"{case}: rank 1 received no rows, yet its experts have gradients")
    if config == "masked":
        _dropped(case, full, x_all)


def _dropped(case: str, full: MoE, x_all: torch.Tensor) -> None:
    """The masked case means something only if its blocks drop slots: the tight layout's
    output differs."""
    with torch.no_grad():
        masked = full(x_all)
        full.layout = MaskedLayoutSpec(x_all.shape[0] * full.top_k)
        roomy = full(x_all)
    if torch.allclose(masked, roomy):
        raise _Mismatch(f"{case}: the masked blocks dropped nothing")


def indivisible(world: int) -> None:
    expected = (f"ExpertParallelMoE: argument num_experts is {2 * world + 1}, not divisible by "
                f"the expert-parallel world size {world}; expected a multiple of {world}")
    try:
        ExpertParallelMoE(8, 4, 2 * world + 1, 1, target=TARGET)
    except ValueError as e:
        if str(e) != expected:
            raise _Mismatch(f"indivisible experts: error {str(e)!r}, expected {expected!r}") \
                from e
    else:
        raise _Mismatch(f"{2 * world + 1} experts on {world} ranks was not refused")


def main() -> int:
    return run([(moe, (c,)) for c in ("mixtral", "deepseek", "rank-1-idle", "masked",
                                      "last-rank-no-tokens")],
               [indivisible])


if __name__ == "__main__":
    finish(main())
