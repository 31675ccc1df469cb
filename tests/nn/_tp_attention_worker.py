"""One rank of test_parallel.py's torchrun run of :class:`tileops.nn.TensorParallelAttention`
against Llama's attention block on one device, forward and backward, on gloo and the
``reference`` target.

Every rank builds the full projections and the input from one seed, shards them with
``from_linears`` and runs forward and backward of ``(y * g).sum()`` for a fixed random ``g``.
The single-device block is written here in plain torch, in float64, the way Hugging Face's
``LlamaAttention`` computes it: the projections, ``rotate_half`` RoPE from ``inv_freq =
theta ** (-2i / D)``, causal ``scaled_dot_product_attention`` with ``enable_gqa``, ``o_proj``.
The sharded float32 results must match it within float32 tolerance: the output, the input
gradient, and each shard's weight (and bias) gradients against the matching rows or columns of
the full ones. Any mismatch exits non-zero with a line naming the rank, the case and the
tensor (the run and the comparison are _tp_worker.py's).
"""

from __future__ import annotations

import copy
import functools

import torch
from _llama_attention import llama_attention
from _tp_worker import _check as check
from _tp_worker import _Mismatch, _randn, finish, run
from torch import nn

from tileops.nn import TensorParallelAttention

TARGET = "reference"
RTOL, ATOL = 1e-4, 1e-5  # float32 against float64 through a softmax over at most 7 keys
HIDDEN, THETA = 32, 500.0


_check = functools.partial(check, rtol=RTOL, atol=ATOL)


def _llama_attention(x, q, k, v, o, heads, kv_heads, positions):
    return llama_attention(x, q, k, v, o, heads, kv_heads, positions, THETA)


def attention(heads: int, kv_heads: int, bias: bool, given_positions: bool, rank: int,
              world: int) -> None:
    case = (f"TensorParallelAttention({heads}:{kv_heads} heads, bias={bias}, "
            f"position_ids={'given' if given_positions else 'default'})")
    torch.manual_seed(0)
    d = HIDDEN // heads
    q = nn.Linear(HIDDEN, heads * d, bias=bias)
    k = nn.Linear(HIDDEN, kv_heads * d, bias=bias)
    v = nn.Linear(HIDDEN, kv_heads * d, bias=bias)
    o = nn.Linear(heads * d, HIDDEN, bias=False)
    b, s = 2, 7
    x, g = _randn(b, s, HIDDEN, seed=7), _randn(b, s, HIDDEN, seed=8)
    # a packed batch's positions: the second sequence starts at 3
    positions = torch.stack([torch.arange(s), torch.arange(s) + 3])
    full = nn.ModuleList([q, k, v, o])
    ref = [m.double() for m in copy.deepcopy(full)]
    x64 = x.double().requires_grad_()
    y_ref = _llama_attention(x64, *ref, heads, kv_heads, positions)
    (y_ref * g.double()).sum().backward()

    block = TensorParallelAttention.from_linears(q, k, v, o, heads, kv_heads, rope_theta=THETA,
                                                 target=TARGET)
    xs = x.clone().requires_grad_()
    y = block(xs, positions if given_positions else None)
    if not given_positions:  # the default positions are 0 .. S-1 in every sequence
        y_ref2 = _llama_attention(x.double(), *ref, heads, kv_heads,
                                  torch.arange(s).expand(b, s))
        _check(case, "output", y, y_ref2.detach())
        return
    (y * g).sum().backward()
    _check(case, "output", y, y_ref.detach())
    _check(case, "input gradient", xs.grad, x64.grad)
    for name, full_layer, local_heads in (("q_proj", ref[0], heads // world),
                                          ("k_proj", ref[1], kv_heads // world),
                                          ("v_proj", ref[2], kv_heads // world)):
        rows = slice(rank * local_heads * d, (rank + 1) * local_heads * d)
        ours = getattr(block, name)
        _check(case, f"{name}.weight gradient", ours.weight.grad, full_layer.weight.grad[rows])
        if bias:
            _check(case, f"{name}.bias gradient", ours.bias.grad, full_layer.bias.grad[rows])
    cols = slice(rank * (heads // world) * d, (rank + 1) * (heads // world) * d)
    _check(case, "o_proj.weight gradient", block.o_proj.weight.grad, ref[3].weight.grad[:, cols])


def indivisible(world: int) -> None:
    """The head-count errors at this world size, exact text."""
    expected = (f"TensorParallelAttention: argument num_kv_heads is 1, not divisible by the "
                f"tensor-parallel world size {world}; expected a multiple of {world}")
    try:
        TensorParallelAttention(HIDDEN, 4, 1)
    except ValueError as e:
        if str(e) != expected:
            raise _Mismatch(f"1 key/value head: error {str(e)!r}, expected {expected!r}") from e
    else:
        raise _Mismatch(f"1 key/value head on {world} ranks was not refused")


def main() -> int:
    cases = [(4, 2, False, True), (4, 4, True, True), (8, 2, False, True), (4, 2, False, False)]
    return run([(attention, args) for args in cases], [indivisible])


if __name__ == "__main__":
    finish(main())
