"""Host microseconds per cached eager call of the shipped ops on CUDA, through their public
API only, so one script measures any two trees side by side: run it once per tree with that
tree's package sources on PYTHONPATH, alternating, and compare rows (or ratios to the
F.rms_norm column, which the host's state moves as much as anything).

    PYTHONPATH=<old>/packages/*/src python3 benchmarks/host_cost_ops.py before
    PYTHONPATH=<new>/packages/*/src python3 benchmarks/host_cost_ops.py after
"""
import json
import sys
import time

import torch

import tileops.ops as o


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(1, 4096, dtype=bf, device=dev)
    w = torch.randn(4096, dtype=bf, device=dev)
    r = torch.randn(1, 4096, dtype=bf, device=dev)
    a = torch.randn(1, 4096, dtype=bf, device=dev)
    b = torch.randn(4096, 4096, dtype=bf, device=dev)
    a2 = torch.randn(128, 4096, dtype=bf, device=dev)
    rms = o.RMSNormFwdOp(normalized_shape=[4096], eps=1e-6)
    fused = o.FusedAddRMSNormFwdOp()
    ln = o.LayerNormFwdOp(normalized_shape=[4096])
    gv = o.GemmFwdOp(trans_b=True)
    gm = o.GemmFwdOp()
    fns = {"rms 1x4096": lambda: rms(x, w), "fused_add 1x4096": lambda: fused(x, r, w),
           "layer 1x4096": lambda: ln(x, w, w), "gemm 1x4096x4096 nt": lambda: gv(a, b),
           "gemm 128x4096x4096": lambda: gm(a2, b),
           "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, [4096], w, 1e-6)}
    for f in fns.values():  # warm: build, then the fused call
        f()
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(7):  # rounds, each function in turn
        for k, f in fns.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                f()
            torch.cuda.synchronize()
            best[k] = min(best[k], (time.perf_counter() - t) / 200 * 1e6)
    print(sys.argv[1] if len(sys.argv) > 1 else "", json.dumps(
        {k: round(v, 2) for k, v in best.items()}))


if __name__ == "__main__":
    main()
