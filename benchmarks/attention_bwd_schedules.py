"""The sm_90 attention backward's schedules side by side with cuDNN on the bars' shapes (bf16,
[B, S, H, D]): the gradients alone and forward + backward, in TFLOP/s.

    python benchmarks/attention_bwd_schedules.py [--workers 15] [--iters 10]

The schedules are :class:`~tileops.kernels.attention_bwd.AttentionBwdTmaKernel` under its
module flags (``STATS_TMA``, ``OVERLAP``): the plain program (served today), the log-sum-exp and ``Delta``
loaded by TMA, and that with the last three products issued back to back. Their programs (and
the forward's) are compiled first in parallel processes (loaded from the cache when built).
Each schedule's gradients are checked against cuDNN's (the largest difference over the
largest element of each gradient), then timed by CUDA events (the median of 5 runs of
``--iters`` calls): the gradients alone are the kernel's entry (the ``Delta`` program, the
main program, the casts), forward + backward the forward kernel's entry and then the
gradients'. cuDNN is ``scaled_dot_product_attention`` under its backend through autograd: the
backward of a kept graph, and a forward with its backward. TFLOP/s by 2.5 (gradients) and 3.5
(forward + backward) times the forward's products, 4 B H S^2 D, halved for causal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from prebuild_attention import BWD_SCHEDULES, BWD_SWEEP, bar_spec  # noqa: E402

NAMES = {(False, False): "plain", (True, False): "stats-tma", (True, True): "overlap"}


def keys() -> list:
    from tileops.kernels import attention as A
    from tileops.kernels import attention_bwd as AB

    out = {}
    for shape in BWD_SWEEP:
        spec = bar_spec(*shape)
        out[("fwd", A.program_key(spec))] = None
        for schedule in BWD_SCHEDULES:
            out[("bwd_tma", AB.bwd_program_key(spec) + schedule)] = None
    return list(out)


def shape_rows(b: int, s: int, h: int, h_kv: int, d: int, causal: bool, iters: int) -> list:
    """The two lines of one shape: the gradients' TFLOP/s and forward + backward's."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from _common import events
    from tileops.kernels import attention as A
    from tileops.kernels import attention_bwd as AB
    from tileops.runtime import select

    spec = bar_spec(b, s, h, h_kv, d, causal)

    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    q, k, v, do = t(b, s, h, d), t(b, s, h_kv, d), t(b, s, h_kv, d), t(b, s, h, d)
    fwd = select(A.AttentionFwdInterface, (A.AttentionFwdKernel,), spec).entry_for(spec, None)
    o, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
    fwd(q, k, v, o, lse)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    grad_cells, train_cells = [], []

    # cuDNN: the gradients of a kept graph, and a forward with its backward
    leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
    do_t = do.transpose(1, 2)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            *leaves, is_causal=causal, enable_gqa=h != h_kv)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = sdpa()
        want = [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, do_t,
                                                                retain_graph=True)]
        ms_grad = events(lambda: torch.autograd.grad(out, leaves, do_t, retain_graph=True),
                         iters)
        ms_train = events(lambda: torch.autograd.grad(sdpa(), leaves, do_t), iters)
    cudnn = (f"cudnn {2.5 * flops / ms_grad / 1e9:4.0f}",
             f"cudnn {3.5 * flops / ms_train / 1e9:4.0f}")

    served = (AB.STATS_TMA, AB.OVERLAP)
    for schedule in BWD_SCHEDULES:
        AB.STATS_TMA, AB.OVERLAP = schedule
        name = NAMES[schedule]
        try:
            entry = select(AB.AttentionBwdInterface, (AB.AttentionBwdTmaKernel,),
                           spec).entry_for(spec, None)
            grads = [torch.empty_like(x) for x in (q, k, v)]
            entry(do, q, k, v, o, lse, None, *grads)
            torch.cuda.synchronize()
            err = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                      for g, w in zip(grads, want, strict=True))
            flag = "" if err < 2e-2 else f" WRONG({err:.1e})"

            def backward(entry=entry, grads=grads):
                entry(do, q, k, v, o, lse, None, *grads)

            def train(backward=backward):
                fwd(q, k, v, o, lse)
                backward()

            ms_grad = events(backward, iters)
            ms_train = events(train, iters)
            grad_cells.append(f"{name} {2.5 * flops / ms_grad / 1e9:4.0f}{flag}")
            train_cells.append(f"{name} {3.5 * flops / ms_train / 1e9:4.0f}{flag}")
        except Exception as exc:  # noqa: BLE001 - a schedule that fails is reported
            grad_cells.append(f"{name} {type(exc).__name__}: {str(exc)[:80]}")
            train_cells.append(f"{name} -")
        finally:
            AB.STATS_TMA, AB.OVERLAP = served
    label = f"b{b} s{s} h{h}:{h_kv} d{d} causal={causal}"
    return [f"{label} gradients TFLOP/s: " + " | ".join([*grad_cells, cudnn[0]]),
            f"{label} fwd+bwd   TFLOP/s: " + " | ".join([*train_cells, cudnn[1]])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)

    from _prebuild import build_all
    from test_attention_cuda import _build, _describe

    build_all(keys(), _build, _describe, args.workers)

    import torch

    torch.manual_seed(0)
    for shape in BWD_SWEEP:
        for line in shape_rows(*shape, args.iters):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
