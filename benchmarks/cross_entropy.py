"""Cross-entropy in training: forward + backward of the loss over logits, and of the fused
linear cross-entropy over hidden states and the LM head's weight, side by side with torch
eager, torch.compile and Liger-Kernel.

    python benchmarks/cross_entropy.py [--out DIR] [--only ce|flce] [--iters N]

- Shapes: cross-entropy over 8192 x 128256 bfloat16 logits (the bar: Llama-3's vocabulary),
  4096 x 32000 and 1024 x 262144; the fused linear cross-entropy over 8192 x 4096 hidden
  states and a 128256 x 4096 weight (the bar), and over 4096 x 4096 and 32000 x 4096
  (Llama-2's head, one block). Targets are uniform over the vocabulary, one
  row in 32 ignored (-100).
- One cell times ``torch.autograd.grad(loss_fn(*inputs), differentiable inputs)``: the forward
  and the backward of a mean loss.
- Contenders: ``tileops`` (CrossEntropyFwdOp, and with ``inplace_grad``, its gradient written
  over the logits; FusedLinearCrossEntropyFwdOp, its gradients computed in the forward
  while each block's logits are in hand), ``torch`` (``F.cross_entropy`` on the logits as they are; for the fused form
  ``F.cross_entropy(hidden @ weight.T, target)``), ``torch.compile`` of that function
  (``torch._dynamo.reset()`` then ``dynamic=False``, compiled by a first call outside the
  timing) and ``liger`` (``liger_cross_entropy``, ``liger_fused_linear_cross_entropy``).
  Liger's cross-entropy writes the gradient into the logits: the loop passes them again,
  which changes their values but not the work.
- Timing: CUDA events around ``--iters`` back-to-back calls, median of 5 (``_common.events``;
  Liger's host-side checks do not capture in a CUDA graph).
- Memory: ``torch.cuda.max_memory_allocated`` over one call, less what was allocated before it
  (the inputs) and the gradients the call returns: what the loss holds beyond them.
- Check: each contender's loss against torch eager's on the same inputs (relative).

Results: ``cross_entropy-<device>.json`` and ``.md`` under ``--out`` (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), *(str(p) for p in sorted((HERE.parent / "packages").glob("*/src")))]

import _common  # noqa: E402

CE_SHAPES = [(8192, 128256), (4096, 32000), (1024, 262144)]
FLCE_SHAPES = [(8192, 4096, 128256), (4096, 4096, 32000)]


def _targets(torch, n, v, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    t = torch.randint(0, v, (n,), generator=g, device=dev)
    t[::32] = -100
    return t


def _inputs(torch, kind, dims, dev):
    """Fresh inputs of one cell: ``[logits, target]`` or ``[hidden, weight, target]``."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    if kind == "ce":
        n, v = dims
        return [torch.randn(n, v, device=dev, dtype=bf16).requires_grad_(True),
                _targets(torch, n, v, dev)]
    n, h, v = dims
    return [torch.randn(n, h, device=dev, dtype=bf16).requires_grad_(True),
            (torch.randn(v, h, device=dev, dtype=bf16) / h ** 0.5).requires_grad_(True),
            _targets(torch, n, v, dev)]


def _ce_contenders(torch, F):
    from tileops.ops import CrossEntropyFwdOp

    out = {"tileops": CrossEntropyFwdOp(), "tileops inplace_grad": CrossEntropyFwdOp(
        inplace_grad=True), "torch": lambda x, t: F.cross_entropy(x, t)}
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        def liger(x, t):
            r = liger_cross_entropy(x, t)
            return r[0] if isinstance(r, tuple) else getattr(r, "loss", r)

        out["liger"] = liger
    except ImportError:
        pass
    return out


def _flce_contenders(torch, F):
    out = {}
    try:
        from tileops.ops import FusedLinearCrossEntropyFwdOp

        out["tileops"] = FusedLinearCrossEntropyFwdOp()
    except ImportError:
        pass
    out["torch"] = lambda h, w, t: F.cross_entropy(h @ w.T, t)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger(h, w, t):
            r = liger_fused_linear_cross_entropy(h, w, t)
            return r[0] if isinstance(r, tuple) else getattr(r, "loss", r)

        out["liger"] = liger
    except ImportError:
        pass
    return out


def _cell(torch, fn, inputs, wrt, iters):
    """``(ms, extra GiB, loss)`` of forward + backward of ``fn`` on ``inputs``."""
    def step():
        loss = fn(*inputs)
        return loss, torch.autograd.grad(loss, [inputs[i] for i in wrt])

    loss, grads = step()  # warm-up: builds, compiles
    loss = float(loss.float())
    del grads
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _, grads = step()
    torch.cuda.synchronize()
    given = {t.untyped_storage().data_ptr() for t in inputs}
    held = sum(g.numel() * g.element_size() for g in grads  # a gradient written over an
               if g.untyped_storage().data_ptr() not in given)  # input holds nothing new
    extra = (torch.cuda.max_memory_allocated() - base - held) / 2**30
    del grads
    ms = _common.events(step, iters)
    return ms, extra, loss


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--only", choices=["ce", "flce"])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    dev = _common.parse_device("cuda")
    head = _common.header("cross_entropy", dev)
    rows, cells, failed = [], [], 0
    jobs = []
    if args.only in (None, "ce"):
        for n, v in CE_SHAPES:
            jobs.append(("ce", f"{n} x {v}", (n, v)))
    if args.only in (None, "flce"):
        for n, h, v in FLCE_SHAPES:
            jobs.append(("flce", f"{n} x {h} x {v}", (n, h, v)))
    for kind, label, dims in jobs:
        if kind == "ce":
            wrt, contenders = [0], _ce_contenders(torch, F)
        else:
            wrt, contenders = [0, 1], _flce_contenders(torch, F)
        eager = contenders["torch"]
        torch._dynamo.reset()
        contenders["torch.compile"] = torch.compile(eager, dynamic=False)
        ref = None
        # torch first: the others' check
        for name in ("torch", "tileops", "tileops inplace_grad", "torch.compile", "liger"):
            if name not in contenders:
                continue
            inputs = _inputs(torch, kind, dims, dev)
            try:
                ms, extra, loss = _cell(torch, contenders[name], inputs, wrt, args.iters)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                failed += name.startswith("tileops")
                rows.append([kind, label, name, "-", "-", _common.first_line(exc)])
                cells.append({"kind": kind, "shape": label, "contender": name,
                              "error": _common.first_line(exc)})
                continue
            finally:
                del inputs
                torch.cuda.empty_cache()
            if name == "torch":
                ref = loss
            diff = "" if ref is None or name == "torch" else f"{abs(loss - ref) / abs(ref):.1e}"
            rows.append([kind, label, name, f"{ms:.3f}", f"{extra:.2f}", diff])
            cells.append({"kind": kind, "shape": label, "contender": name, "ms": ms,
                          "extra_gib": extra, "loss": loss})
            print(f"{kind} {label} {name}: {ms:.3f} ms, +{extra:.2f} GiB", flush=True)
    md = _common.title(head, "Cross-entropy forward + backward") + _common.md_table(
        ["loss", "shape", "contender", "fwd+bwd ms", "extra GiB", "loss vs torch"], rows)
    _common.write_results(args.out, "cross_entropy", dev, {**head, "cells": cells},
                          "\n".join(md) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
