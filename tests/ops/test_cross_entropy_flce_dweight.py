"""The fused linear cross-entropy's weight gradient on the GEMM ops (CPU, several blocks a
call): the forward's first block writes dweight (GemmFwdOp, its product is the kept gradient),
the next blocks add theirs to it in place (GemmAccumulateFwdOp); the backward op adds every
block's to its zeroed dweight; no torch product runs in a training step; the sums match
float64 torch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tileops.ops.cross_entropy as ce
from tileops.ops import (
    CrossEntropyBwdOp,
    CrossEntropyFwdOp,
    FusedLinearCrossEntropyBwdOp,
    FusedLinearCrossEntropyFwdOp,
    GemmAccumulateFwdOp,
    GemmFwdOp,
)
from tileops.runtime import targets

#: the delegates' references serve the blocks, so the composite walks them itself on the CPU
BLOCKS = "flce-dweight-blocks"


@pytest.fixture(scope="module", autouse=True)
def _blocks_target():
    targets.register_target(BLOCKS, ("cpu",))
    for cls in (GemmFwdOp, GemmAccumulateFwdOp, CrossEntropyFwdOp, CrossEntropyBwdOp):
        targets.register_builder(BLOCKS, cls, targets.builder_for(targets.REFERENCE, cls))
    yield
    del targets._targets[BLOCKS], targets._builders[BLOCKS]


@pytest.fixture
def no_torch_products(monkeypatch):
    """Fail on any torch product the composite itself could call for dweight (the delegates'
    references compute theirs through torch.matmul, which stays)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the fused loss called a torch product for dweight")
    for name in ("mm", "addmm"):
        monkeypatch.setattr(torch, name, refuse)
    monkeypatch.setattr(torch.Tensor, "addmm_", refuse)


def _inputs(n, h, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    target = torch.randint(0, v, (n,), generator=g)
    target[1] = -100
    return hidden, weight, target


def _torch_dweight(hidden, weight, target, reduction="mean", upstream=None):
    w = weight.clone().requires_grad_(True)
    loss = F.cross_entropy(F.linear(hidden, w), target, reduction=reduction)
    loss.backward(upstream)
    return w.grad


def _dweight_calls(call):
    """``(stage, op name, written inputs)`` of each dweight product of a call."""
    return [(s.name, c.op, c.written_inputs) for s in call.stages
            if s.name.startswith("dweight") for c in s.calls]


def test_the_forward_writes_the_first_block_and_adds_the_next(monkeypatch, no_torch_products):
    monkeypatch.setattr(ce, "BLOCK_BYTES", 4 * 9 * 8)  # blocks of 4 rows: 3 blocks of 10
    hidden, weight, target = _inputs(10, 6, 9)
    w = weight.clone().requires_grad_(True)
    op = FusedLinearCrossEntropyFwdOp(target=BLOCKS)
    op(hidden, w, target).backward()
    assert _dweight_calls(op.last_call) == [
        ("dweight", "GemmFwdOp", ()), ("dweight_sum", "GemmAccumulateFwdOp", ("c",)),
            ("dweight_sum", "GemmAccumulateFwdOp", ("c",))]
    torch.testing.assert_close(w.grad, _torch_dweight(hidden, weight, target), rtol=1e-10,
                               atol=1e-12)


def test_the_backward_op_adds_every_block_to_its_zeroed_dweight(monkeypatch, no_torch_products):
    monkeypatch.setattr(ce, "BLOCK_BYTES", 3 * 5 * 8)
    hidden, weight, target = _inputs(7, 4, 5)
    up = torch.randn(7, dtype=torch.float64)
    bwd = FusedLinearCrossEntropyBwdOp(target=BLOCKS, reduction="none")
    dh, dw = bwd(hidden, weight, target, up)
    assert [stage for stage, _, _ in _dweight_calls(bwd.last_call)] == ["dweight_sum"] * 3
    want = _torch_dweight(hidden, weight, target, "none", up)
    torch.testing.assert_close(dw, want, rtol=1e-10, atol=1e-12)


def test_the_backward_op_zeroes_the_dweight_it_is_handed():
    """Its first block adds to dweight: the values of the memory dweight was allocated from
    never reach the sum (a NaN-filled dweight handed to the op's forward)."""
    hidden, weight, target = _inputs(5, 3, 5, seed=4)
    dloss = torch.tensor(1.0, dtype=torch.float64)
    bwd = FusedLinearCrossEntropyBwdOp(target=BLOCKS, reduction="sum", grad_hidden=False)
    bwd(hidden, weight, target, dloss)  # binds the target (the composite walks the blocks)
    dw = torch.full_like(weight, float("nan"))
    inputs = (hidden, weight, target, dloss)
    bwd._forward_in_stages(bwd._point.check(*inputs), inputs, (None, dw))
    torch.testing.assert_close(dw, _torch_dweight(hidden, weight, target, "sum"), rtol=1e-10,
                               atol=1e-12)


def test_no_rows_give_a_zero_dweight():
    hidden, target = torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    weight = torch.randn(5, 3, dtype=torch.float64)
    w = weight.clone().requires_grad_(True)
    FusedLinearCrossEntropyFwdOp(target=BLOCKS, reduction="sum")(hidden, w, target).backward()
    assert torch.equal(w.grad, torch.zeros_like(weight))
    bwd = FusedLinearCrossEntropyBwdOp(target=BLOCKS, reduction="sum")
    _, dw = bwd(hidden, weight, target, torch.tensor(1.0, dtype=torch.float64))
    assert torch.equal(dw, torch.zeros_like(weight))
