"""LongRoPE with position_ids at decode-like batches around ``SCAN_POSITIONS``: the op (whose
kernel finds the largest position by the CTAs' own scan up to that many positions, by one
``amax`` launch past it) beside torch eager and a fresh torch.compile per shape, to check
where the scan pays.

    python benchmarks/sweep_rope_switch.py [--out DIR]

q ``[B, 1, 32, 128]``, k ``[B, 1, 8, 128]`` bf16 (a decode step of Llama-3 8B's heads) for
``B`` tokens, positions random up to 20000 (the long table). Device time from CUDA-graph
replays; every result is checked against the op's float64 reference (relative error
of the norm under 1e-2). Writes
``rope_switch.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]

from _common import graph_events  # noqa: E402

TOKENS = (64, 256, 512, 1024, 1025, 2048, 4096, 16384)
FACTORS = {"short_factor": [1.0 + 0.05 * i for i in range(64)],
           "long_factor": [1.0 + 0.9 * i for i in range(64)]}


def _row(n: int, scan: int) -> str:
    """One table row: the op, torch.compile and eager at ``n`` tokens."""
    import torch

    from tileops.ops import RopeLongRopeFwdOp

    op = RopeLongRopeFwdOp(**FACTORS)
    q = torch.randn(n, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    p = torch.randint(0, 20000, (n, 1), device="cuda")
    ref = op.fp64_reference(q, k, p)
    eager = op.eager()
    torch._dynamo.reset()
    compiled = torch.compile(eager, dynamic=False)
    cells = []
    for fn in (lambda: op(q, k, p), lambda: compiled(q, k, p), lambda: eager(q, k, p)):
        out = fn()
        ok = all(((o.double() - r).norm() / r.norm()).item() < 1e-2
                 for o, r in zip(out, ref, strict=True))
        cells.append(f"{graph_events(fn, 20) * 1e3:7.2f}{'' if ok else '!'}")
    path = "scan" if n <= scan else "amax"
    return f"{n:>7} {path:>5} " + " ".join(f"{c:>8}" for c in cells)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    import torch

    from tileops.kernels.rope import SCAN_POSITIONS

    lines = [f"LongRoPE forward with position_ids, q [B, 1, 32, 128], k [B, 1, 8, 128] bf16, on "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}; us a call (CUDA-graph replay); SCAN_POSITIONS "
             f"= {SCAN_POSITIONS}; ! marks a result off its float64 reference",
             f"{'tokens':>7} {'path':>5} {'tileops':>8} {'compile':>8} {'eager':>8}"]
    print(lines[-1], flush=True)
    for n in TOKENS:
        lines.append(_row(n, SCAN_POSITIONS))
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rope_switch.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
