"""The fused linear cross-entropy (FusedLinearCrossEntropyFwdOp / BwdOp): the composite's walk
over blocks of rows against torch in float64 (several blocks a call: BLOCK_BYTES shrunk), the
gradients kept by the forward against those the backward op recomputes, what one autograd node
saves, and (marked cuda) the bar's shape on the GPU: numerics against float64, the memory held
beyond the inputs and gradients. ``python3 tests/ops/test_flce.py --prebuild --workers 6`` runs
each GPU case's training step once in spawned processes first (the GEMM and cross-entropy
programs of its blocks land in TileLang's disk cache), so the tests load them.

On the CPU the ops run on a target that composes them with their delegates' references, so
these tests run the composite's own orchestration: the blocks, the sums, the mean's count, the
kept gradients.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

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

#: a target with builders for the fused loss's delegates (their references) and none for it,
#: so the composite runs its own walk over the blocks on the CPU (bound by device there, the
#: reference target would serve it whole)
BLOCKS = "flce-blocks"


@pytest.fixture(scope="module", autouse=True)
def _blocks_target():
    targets.register_target(BLOCKS, ("cpu",))
    for cls in (GemmFwdOp, GemmAccumulateFwdOp, CrossEntropyFwdOp, CrossEntropyBwdOp):
        targets.register_builder(BLOCKS, cls, targets.builder_for(targets.REFERENCE, cls))
    yield
    del targets._targets[BLOCKS], targets._builders[BLOCKS]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of ``rows`` rows for a vocabulary of ``classes`` in float64."""
    def set_rows(rows: int, classes: int) -> None:
        monkeypatch.setattr(ce, "BLOCK_BYTES", rows * classes * 8)
    return set_rows


def _torch_loss(h, w, t, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                lse_square_scale=0.0, softcap=None):
    """The loss in plain torch: F.cross_entropy of F.linear, the z-loss and softcap spelled
    out."""
    z = F.linear(h, w)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    rows = F.cross_entropy(z, t, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    valid = t != ignore_index
    rows = rows + torch.where(valid, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    if reduction == "none":
        return rows
    return rows.sum() if reduction == "sum" else rows.sum() / valid.sum()


def _inputs(n, h, v, ignored=(), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) / math.sqrt(max(h, 1))
    target = torch.randint(0, v, (n,), generator=g)
    for i in ignored:
        target[i] = -100
    return hidden, weight, target


def _grads(loss_fn, hidden, weight, target, upstream):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = loss_fn(h, w, target)
    loss.backward(upstream)
    return loss.detach(), h.grad, w.grad


def _stages(call) -> Counter:
    """How many times each stage was entered (once a block)."""
    return Counter(s.name for s in call.stages)


def test_block_rows() -> None:
    assert ce.block_rows(8192, 128256, 2) == 1024  # the bar: eight blocks of 256 MiB at most
    assert ce.block_rows(8192, 32000, 2) == 4096   # a multiple of 128 rows
    assert ce.block_rows(300, 1 << 20, 2) == 128
    assert ce.block_rows(300, 1 << 21, 2) == 64    # fewer than a tile: as many as fit
    assert ce.block_rows(5, 1 << 30, 4) == 1       # at least one row
    assert ce.block_rows(10, 7, 2) == 10           # at most every row
    assert ce.block_rows(0, 7, 2) == 1


options = st.fixed_dictionaries({
    "reduction": st.sampled_from(["mean", "sum", "none"]),
    "label_smoothing": st.sampled_from([0.0, 0.1]),
    "lse_square_scale": st.sampled_from([0.0, 1e-2]),
    "softcap": st.sampled_from([None, 3.0]),
})


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 13), h=st.integers(1, 6), v=st.integers(1, 9), rows=st.integers(1, 5),
       opts=options, data=st.data())
def test_loss_and_gradients_match_torch_in_float64(n, h, v, rows, opts, data):
    ignored = data.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    hidden, weight, target = _inputs(n, h, v, ignored, seed=n * 100 + v)
    upstream = torch.randn(n, dtype=torch.float64) if opts["reduction"] == "none" else \
        torch.tensor(1.7, dtype=torch.float64)
    op = FusedLinearCrossEntropyFwdOp(target=BLOCKS, **opts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ce, "BLOCK_BYTES", rows * v * 8)  # ceil(n / rows) blocks
        got = _grads(op, hidden, weight, target, upstream)
    want = _grads(lambda a, b, c: _torch_loss(a, b, c, **opts), hidden, weight, target, upstream)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, equal_nan=True)
    assert _stages(op.last_call)["logits"] == -(-n // rows)  # the logits of every block


def test_training_keeps_the_gradients_and_the_backward_op_is_not_run(small_blocks) -> None:
    small_blocks(4, 9)
    hidden, weight, target = _inputs(10, 6, 9, ignored=[2, 7])
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    op = FusedLinearCrossEntropyFwdOp(target=BLOCKS)
    loss = op(h, w, target)
    # the node saves the inputs only: no block's logits outlive the call
    assert [t.data_ptr() for t in loss.grad_fn.saved_tensors] == \
        [h.data_ptr(), w.data_ptr(), target.data_ptr()]
    # dweight: the first block's product, then the next blocks' added to it
    assert [s.name for s in op.last_call.stages] == (
        ["logits", "loss", "grad", "dhidden", "dweight"]
        + ["logits", "loss", "grad", "dhidden", "dweight_sum"] * 2)
    (2.0 * loss).backward()
    assert op._backward_ops == {}  # the kept gradients, scaled by dloss
    _, dh, dw = _grads(_torch_loss, hidden, weight, target, torch.tensor(2.0, dtype=torch.float64))
    torch.testing.assert_close(h.grad, dh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, dw, rtol=1e-10, atol=1e-12)


def test_reduction_none_and_a_second_backward_run_the_backward_op(small_blocks) -> None:
    small_blocks(3, 5)
    hidden, weight, target = _inputs(7, 4, 5, ignored=[1])
    up = torch.randn(7, dtype=torch.float64)
    op = FusedLinearCrossEntropyFwdOp(target=BLOCKS, reduction="none")
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = op(h, w, target)
    assert [s.name for s in op.last_call.stages] == ["logits", "loss"] * 3  # nothing kept
    loss.backward(up)
    bwd = op._backward_ops[(True, True)]
    assert [s.name for s in bwd.last_call.stages] == ["logits", "grad", "dhidden",
                                                      "dweight_sum"] * 3
    _, dh, dw = _grads(lambda a, b, c: _torch_loss(a, b, c, reduction="none"), hidden, weight,
                       target, up)
    torch.testing.assert_close(h.grad, dh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, dw, rtol=1e-10, atol=1e-12)
    # a mean loss backward twice through a retained graph: kept, then recomputed
    op = FusedLinearCrossEntropyFwdOp(target=BLOCKS, reduction="sum")
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = op(h, w, target)
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    assert op._backward_ops == {}
    second = torch.autograd.grad(loss, (h, w))
    assert list(op._backward_ops) == [(True, True)]
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_only_the_gradient_asked_for(small_blocks) -> None:
    small_blocks(2, 5)
    hidden, weight, target = _inputs(5, 3, 5)
    h = hidden.clone().requires_grad_(True)
    loss = FusedLinearCrossEntropyFwdOp(target=BLOCKS, reduction="sum")(h, weight, target)
    (dh,) = torch.autograd.grad(loss, h)
    _, want, _ = _grads(lambda a, b, c: _torch_loss(a, b, c, reduction="sum"), hidden, weight,
                        target, torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(dh, want, rtol=1e-10, atol=1e-12)
    w = weight.clone().requires_grad_(True)
    bwd = FusedLinearCrossEntropyBwdOp(target=BLOCKS, grad_hidden=False)
    dh, dw = bwd(hidden, w.detach(), target, torch.tensor(1.0))
    assert dh is None and dw.shape == weight.shape


def test_no_rows() -> None:
    hidden, weight, target = _inputs(0, 3, 5)
    w = weight.clone().requires_grad_(True)
    loss = FusedLinearCrossEntropyFwdOp(target=BLOCKS, reduction="sum")(hidden, w, target)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(w.grad, torch.zeros_like(weight))
    mean = FusedLinearCrossEntropyFwdOp(target=BLOCKS)(hidden, weight, target)
    assert mean.isnan()  # 0 / 0, as torch's


def test_by_device_on_the_cpu_the_reference_serves_it_whole() -> None:
    hidden, weight, target = _inputs(5, 3, 4)
    op = FusedLinearCrossEntropyFwdOp()
    torch.testing.assert_close(op(hidden, weight, target),
                               _torch_loss(hidden, weight, target), rtol=1e-12, atol=1e-12)
    assert op.serving_target == "reference" and op.last_call.stages == ()
    assert op._delegates == {}


def test_the_eager_contender_computes_the_loss() -> None:
    hidden, weight, target = _inputs(6, 4, 7, ignored=[0])
    op = FusedLinearCrossEntropyFwdOp(target=BLOCKS, label_smoothing=0.1, softcap=2.0,
                                      lse_square_scale=0.1)
    torch.testing.assert_close(op.eager()(hidden, weight, target), op(hidden, weight, target),
                               rtol=1e-12, atol=1e-12)


# --- dweight on the GEMM ops: the forward's first block writes it (GemmFwdOp), the next
# blocks add theirs in place (GemmAccumulateFwdOp); the backward op adds every block's to
# its zeroed dweight; no torch product runs for it ---------------------------------------


@pytest.fixture
def no_torch_products(monkeypatch):
    """Fail on any torch product the composite itself could call for dweight (the delegates'
    references compute theirs through torch.matmul, which stays)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the fused loss called a torch product for dweight")
    for name in ("mm", "addmm"):
        monkeypatch.setattr(torch, name, refuse)
    monkeypatch.setattr(torch.Tensor, "addmm_", refuse)


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
    hidden, weight, target = _inputs(10, 6, 9, ignored=(1,))
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
    hidden, weight, target = _inputs(7, 4, 5, ignored=(1,))
    up = torch.randn(7, dtype=torch.float64)
    bwd = FusedLinearCrossEntropyBwdOp(target=BLOCKS, reduction="none")
    dh, dw = bwd(hidden, weight, target, up)
    assert [stage for stage, _, _ in _dweight_calls(bwd.last_call)] == ["dweight_sum"] * 3
    want = _torch_dweight(hidden, weight, target, "none", up)
    torch.testing.assert_close(dw, want, rtol=1e-10, atol=1e-12)


def test_the_backward_op_zeroes_the_dweight_it_is_handed():
    """Its first block adds to dweight: the values of the memory dweight was allocated from
    never reach the sum (a NaN-filled dweight handed to the op's forward)."""
    hidden, weight, target = _inputs(5, 3, 5, ignored=(1,), seed=4)
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


# --- on the GPU ----------------------------------------------------------------------------------


def _gpu_inputs(n, h, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device="cuda").bfloat16()
    # a language model's head: logits of a few units, not sqrt(h)
    weight = (torch.randn(v, h, generator=g, device="cuda") * 0.02).bfloat16()
    target = torch.randint(0, v, (n,), generator=g, device="cuda")
    target[::32] = -100
    return hidden, weight, target


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


GPU_SHAPES = [(8192, 4096, 128256), (1000, 1000, 32001), (333, 999, 4097)]
GPU_REDUCTIONS = ["mean", "none"]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["bar", "odd", "unaligned"])
@pytest.mark.parametrize("reduction", GPU_REDUCTIONS)
def test_gpu_loss_and_gradients_against_float64(shape, reduction):
    n, h, v = shape
    hidden, weight, target = _gpu_inputs(n, h, v)
    up = torch.randn(n, device="cuda") if reduction == "none" else torch.tensor(1.0, device="cuda")
    op = FusedLinearCrossEntropyFwdOp(reduction=reduction)
    hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = op(hh, ww, target)
    loss.backward(up)
    assert op.serving_target == "tileops"
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    # the logits stored in bfloat16, as F.linear stores them (the loss's definition)
    p = h64 @ w64.T
    z = p + (p.detach().bfloat16().double() - p.detach())  # rounded, differentiated as p
    want = F.cross_entropy(z, target, reduction=reduction)
    want.backward(up.double())
    assert _rel(loss.detach(), want.detach()) < 1e-3
    assert _rel(hh.grad, h64.grad) < 1e-2  # bfloat16 gradients: a rounding is ~2e-3
    assert _rel(ww.grad, w64.grad) < 1e-2


@pytest.mark.cuda
def test_gpu_memory_beyond_inputs_and_gradients():
    n, h, v = 8192, 4096, 128256
    hidden, weight, target = _gpu_inputs(n, h, v)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    op = FusedLinearCrossEntropyFwdOp()
    op(hidden, weight, target).backward()  # builds every kernel
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    op(hidden, weight, target).backward()
    torch.cuda.synchronize()
    grads = hidden.grad.nbytes + weight.grad.nbytes
    extra = torch.cuda.max_memory_allocated() - base - grads
    assert extra <= 0.5 * 2**30, f"{extra / 2**30:.2f} GiB beyond the inputs and gradients"


@pytest.mark.cuda
def test_gpu_float32_is_refused_by_name():
    hidden, weight, target = _gpu_inputs(4, 8, 16)
    with pytest.raises(TypeError, match=r"^FusedLinearCrossEntropyFwdOp: the in-tree GEMM "
                                        r"kernels serve bfloat16, float16, not float32; "
                                        r"construct the op with target='reference'"):
        FusedLinearCrossEntropyFwdOp()(hidden.float(), weight.float(), target)


# --- the prebuild ----------------------------------------------------------------------------


def _build(job):
    import time

    (n, h, v), reduction = job
    t = time.perf_counter()
    try:
        hidden, weight, target = _gpu_inputs(n, h, v)
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        loss = FusedLinearCrossEntropyFwdOp(reduction=reduction)(hidden, weight, target)
        loss.backward(torch.ones_like(loss))
        torch.cuda.synchronize()
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, the others go on
        status = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    return f"{n} x {h} x {v} {reduction}", time.perf_counter() - t, status


def main(argv=None) -> int:
    import argparse
    import time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    ap = argparse.ArgumentParser(description="run each GPU case once, in parallel")
    ap.add_argument("--prebuild", action="store_true", required=True)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args(argv)
    jobs = [(s, r) for s in GPU_SHAPES for r in GPU_REDUCTIONS]
    t, failed = time.perf_counter(), 0
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        for what, secs, status in pool.map(_build, jobs):
            failed += status != "ok"
            print(f"{what} {secs:.1f}s {status}", flush=True)
    print(f"ran {len(jobs)} cases in {time.perf_counter() - t:.0f}s, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
