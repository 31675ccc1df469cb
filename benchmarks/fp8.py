"""The fp8 GEMM's tile configurations side by side with torch._scaled_mm (and F.scaled_mm's
block-wise form), on the shapes of the bars: 8192^3 and the Llama-3 8B projections at prefill
(per tensor, per row, in blocks) and at decode (M = 1, 16). Each configuration runs the
in-tree program directly (``build_fp8_gemm_kernel``) on the same inputs, is checked against
torch._scaled_mm's output where it has one (the dequantised float32 product for blocks) and
timed from CUDA graph replays, as ``tileops bench`` times; the table gives TFLOP/s and the
bytes of the operands and output a second (what bounds a decode call: ``b`` streamed once),
and marks the heuristic's choice (``choose_fp8_config``), so a run shows whether its default is
the fastest candidate. Calls of at most ``SWAP_M`` rows also run the swapped tiles (``t``:
``b``'s rows on wgmma's 64-row side, ``s2``: K split over two CTAs and a reduction, ``x2``:
two CTAs an SM), the swapped tile the heuristic would take (``swapped_decode_config``) among
them; torch._scaled_mm is timed with and without ``use_fast_accum``.

    python3 benchmarks/fp8.py --prebuild --workers 15   # compile every candidate first
    python3 benchmarks/fp8.py --out gpu-out              # the sweep
    # the decode shapes only (a few minutes on an H100, compiles included)
    python3 benchmarks/fp8.py --prebuild --shapes decode && python3 benchmarks/fp8.py --shapes decode
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]

from _common import graph_events, header, md_table, prebuild, title, write_results  # noqa: E402
from tileops.kernels import fp8_gemm as G  # noqa: E402
from tileops.kernels.fp8_gemm import Fp8Config, Scaling  # noqa: E402

#: (label, M, N, K): the bars' shapes (``--shapes decode``: those of at most 64 rows)
SHAPES = [("square-8k", 8192, 8192, 8192), ("up-m8192", 8192, 14336, 4096),
          ("down-m8192", 8192, 4096, 14336), ("qo-m2048", 2048, 4096, 4096),
          ("decode-m16-8k", 16, 8192, 8192), ("decode-m16-up", 16, 14336, 4096),
          ("decode-m1-qo", 1, 4096, 4096), ("decode-m1-up", 1, 14336, 4096)]
#: candidates beside the heuristic's, by region (all fit sm_90's shared memory)
CANDIDATES = {
    "prefill": [Fp8Config(128, 256, 128, 3, 256), Fp8Config(128, 128, 128, 4, 256),
                Fp8Config(128, 256, 64, 4, 256), Fp8Config(128, 128, 128, 5, 256, 16),
                Fp8Config(256, 128, 128, 3, 256), Fp8Config(128, 256, 128, 3, 256, persistent=True),
                Fp8Config(128, 128, 128, 4, 256, persistent=True),
                Fp8Config(128, 256, 128, 3, 256, policy="row"),
                Fp8Config(128, 256, 128, 3, 256, persistent=True, policy="row"),
                Fp8Config(128, 128, 128, 4, 256, policy="row", promote=True)],
    "decode": [Fp8Config(64, 64, 256, 4, 128, 0), Fp8Config(64, 128, 256, 3, 128, 0),
               Fp8Config(64, 32, 256, 6, 128, 0), Fp8Config(64, 64, 128, 8, 128, 0)],
    "block": [Fp8Config(128, 128, 128, 4, 256, policy="row"), Fp8Config(128, 128, 128, 4, 256),
              Fp8Config(128, 128, 128, 3, 256, 16, policy="row"),
              Fp8Config(128, 64, 128, 6, 256), Fp8Config(64, 128, 128, 4, 128)],
    "block-decode": [Fp8Config(64, 64, 128, 6, 128, 0), Fp8Config(64, 32, 128, 8, 128, 0),
                     Fp8Config(64, 128, 128, 4, 128, 0)],
}
#: swapped tiles beside those of each region, for calls of at most ``SWAP_M`` rows (one CTA an
#: SM with eight stages; two an SM unsplit and split in two; three an SM split in three; the
#: 128-row tile of b split in four)
SWAPPED = {
    "decode": [Fp8Config(16, 64, 256, 8, 128, 0, swap=True),
               Fp8Config(16, 64, 256, 4, 128, 0, swap=True, resident=2),
               Fp8Config(16, 64, 256, 4, 128, 0, swap=True, split=2, resident=2),
               Fp8Config(16, 64, 256, 3, 128, 0, swap=True, split=3, resident=3),
               Fp8Config(16, 128, 256, 3, 128, 0, swap=True, split=4, resident=2)],
    "block-decode": [Fp8Config(16, 64, 128, 8, 128, 0, swap=True, resident=2),
                     Fp8Config(16, 64, 128, 8, 128, 0, swap=True, split=2, resident=2)],
}
E4M3 = "float8_e4m3fn"


def _spec(m, n, k, scaling):
    import torch

    return G.GemmFp8Spec(device=torch.device("cpu"), m=m, n=n, k=k, a_dtype=E4M3, b_dtype=E4M3,
                         out_dtype="bfloat16", scaling=scaling, has_bias=False)


def candidates(m: int, n: int, k: int, scaling: Scaling) -> list[Fp8Config]:
    """The configurations swept at a shape: its region's, and at most ``SWAP_M`` rows the
    swapped ones with the heuristic's swapped tile (deduplicated, in order)."""
    region = _region(m, scaling)
    cands = list(CANDIDATES[region])
    if m <= G.SWAP_M:
        cands += SWAPPED[region] + [G.swapped_decode_config(_spec(m, n, k, scaling))]
    return list(dict.fromkeys(cands))


def _shapes(which: str):
    return [s for s in SHAPES if which == "all" or (which == "decode" and s[1] <= G.DECODE_M)
            or s[0] == which]


def _region(m: int, scaling: Scaling) -> str:
    decode = m <= G.DECODE_M
    if scaling is Scaling.BLOCK:
        return "block-decode" if decode else "block"
    return "decode" if decode else "prefill"


def _jobs(which: str = "all"):
    jobs = [(n, k, s, cfg) for _, m, n, k in _shapes(which) for s in Scaling
            for cfg in candidates(m, n, k, s)]
    return list(dict.fromkeys(jobs))


def _build(job):
    n, k, scaling, cfg = job
    t = time.perf_counter()
    try:
        G.fp8_gemm_launch(n, k, E4M3, E4M3, "bfloat16", scaling, False, cfg)
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, the others go on
        status = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    return f"{scaling.value} n{n} k{k} {cfg.label()}", time.perf_counter() - t, status


def _operands(m, n, k, scaling, torch):
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    kb = -(-k // 128)
    sa, sb = {Scaling.TENSOR: ((), ()), Scaling.ROW: ((m, 1), (n, 1)),
              Scaling.BLOCK: ((m, kb), (-(-n // 128), kb))}[scaling]
    return a, b, torch.rand(sa, device="cuda") + 0.5, torch.rand(sb, device="cuda") + 0.5


def _torch_reference(a, b, sa, sb, scaling, torch):
    """torch's result (None, name) where it has one for this scaling."""
    F = torch.nn.functional
    if scaling is not Scaling.BLOCK:
        sbv = sb.view(1, -1) if scaling is Scaling.ROW else sb
        return (lambda fast=False: torch._scaled_mm(
            a, b.t(), scale_a=sa, scale_b=sbv, out_dtype=torch.bfloat16,
            use_fast_accum=fast)), "torch._scaled_mm"
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        sat = sa.t().contiguous().t()
        st = F.ScalingType
        return (lambda: F.scaled_mm(a, b.t(), sat, st.BlockWise1x128, sb, st.BlockWise128x128,
                                    output_dtype=torch.bfloat16)), "F.scaled_mm"
    return None, "-"


def sweep(out: Path, which: str = "all") -> int:
    import torch

    dev = torch.device("cuda")
    head = header("fp8", dev)
    rows, doc = [], {**head, "rows": []}
    md = ""
    for label, m, n, k in _shapes(which):
        for scaling in Scaling:
            torch.manual_seed(0)
            a, b, sa, sb = _operands(m, n, k, scaling, torch)
            flops = 2 * m * n * k
            nbytes = m * k + n * k + 2 * m * n
            ref_fn, ref_name = _torch_reference(a, b, sa, sb, scaling, torch)
            ref, ref_ms, fast_ms = None, None, None
            try:
                if ref_fn is not None:
                    ref = ref_fn()
                    ref_ms = graph_events(ref_fn, 20)
                    if scaling is not Scaling.BLOCK:
                        fast_ms = graph_events(lambda f=ref_fn: f(True), 20)
            except Exception as exc:  # noqa: BLE001 - torch does not cover it here
                ref_name = f"{ref_name}: {type(exc).__name__}"
            if ref is None:  # the dequantised product, for the check only
                da = a.float() * sa.repeat_interleave(128, 1)[:, :k]
                db = b.float() * sb.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
                ref = (da @ db.T).to(torch.bfloat16)
            default = G.choose_fp8_config(_spec(m, n, k, scaling))
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            s_a, s_b = (sa.view(1), sb.view(1)) if scaling is Scaling.TENSOR else (sa, sb)
            for cfg in candidates(m, n, k, scaling):
                entry = {"shape": label, "scaling": scaling.value, "config": cfg.label(),
                         "default": cfg == default, "torch": ref_name, "torch_ms": ref_ms,
                         "torch_fast_ms": fast_ms}
                try:
                    prog = G.fp8_gemm_launch(n, k, E4M3, E4M3, "bfloat16", scaling, False, cfg)
                    c.fill_(float("nan"))  # an element a program never writes fails the check
                    prog(a, b, s_a, s_b, c[0], c)
                    err = ((c.double() - ref.double()).norm() / ref.double().norm()).item()
                    args = (a, b, s_a, s_b, c[0], c)
                    ms = graph_events(lambda p=prog, args=args: p(*args), 20)
                    entry.update(ms=ms, rel_err=err)
                except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported
                    entry.update(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                doc["rows"].append(entry)
                tf = f"{flops / entry['ms'] / 1e9:.0f}" if "ms" in entry else entry["error"]
                tbs = f"{nbytes / entry['ms'] / 1e9:.2f}" if "ms" in entry else "-"
                us = f"{entry['ms'] * 1e3:.1f}" if "ms" in entry else "-"
                ref_tf = (f"{flops / ref_ms / 1e9:.0f} ({ref_ms * 1e3:.1f} us)" if ref_ms
                          else "-")
                fast = f"{fast_ms * 1e3:.1f} us" if fast_ms else "-"
                rows.append([label, scaling.value, cfg.label() + (" *" if entry["default"] else ""),
                             tf, us, tbs, f"{entry.get('rel_err', float('nan')):.1e}",
                             f"{ref_name} {ref_tf}", fast])
            md = "\n".join(title(head, "fp8 GEMM configurations (TFLOP/s; * the default)")
                           + md_table(["shape", "scaling", "config", "TFLOP/s", "us", "TB/s",
                                       "rel err", "torch TFLOP/s", "torch fast-accum"],
                                      rows)) + "\n"
            write_results(out, "fp8_sweep" if which == "all" else f"fp8_sweep_{which}", dev,
                          doc, md, echo=False)
    print(md, end="")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("gpu-out"))
    ap.add_argument("--shapes", default="all",
                    help="all, decode (at most 64 rows) or one shape's label")
    args = ap.parse_args(argv)
    if not _shapes(args.shapes):
        ap.error(f"no shape matches {args.shapes!r}")
    if args.prebuild:
        return prebuild(_jobs(args.shapes), _build, args.workers)
    return sweep(args.out, args.shapes)


if __name__ == "__main__":
    sys.exit(main())
