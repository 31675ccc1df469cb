"""Prebuild the GEMM kernels in parallel processes, and what the GEMM sweep shares with the
side-by-side benchmark.

    python benchmarks/gemm.py --prebuild [--workers N]

The comparison with cuBLAS (``torch.matmul``) and torch.compile on the spec's workloads is
``tileops bench GemmFwdOp`` (``benchmarks/gpu_gemm.sh`` runs it, ``--compile-mode
max-autotune-no-cudagraphs`` for the committed results): the harness owns the workloads and the
timing method (CUDA-graph replay, inputs rotated past L2). What stays here:

- ``--prebuild`` compiles, in parallel processes, every kernel the GPU tests
  (tests/ops/test_gemm_cuda.py) and the spec workloads select, so the runs that follow load
  them from TileLang's disk cache;
- for ``benchmarks/sweep_gemm.py``: the workloads as rows, the serving implementation and the
  program of a call, and operand sets rotated past L2 the way the harness rotates them.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
for _p in reversed(PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from tileops.ops.cli.timing import MAX_SETS, ROTATE_BYTES, rotating  # noqa: E402

__all__ = ["operand_sets", "prebuild", "program_job", "rotating", "serving", "workloads"]


def workloads(dtypes: set[str] | None = None) -> list[dict]:
    """Rows of (label, M, N, K, trans_a, trans_b, dtype): the spec's workloads of GemmFwdOp
    (:func:`tileops.ops.workloads.cases_of`), in their own dtype cases, those in ``dtypes``
    when given."""
    from tileops.ops import GemmFwdOp
    from tileops.ops.workloads import cases_of

    return [{"label": c.label, "m": c.values["M"], "n": c.values["N"], "k": c.values["K"],
             "trans_a": bool(c.values["trans_a"]), "trans_b": bool(c.values["trans_b"]),
             "dtype": c.dtype}
            for c in cases_of(GemmFwdOp) if not dtypes or c.dtype in dtypes]


# --- prebuild ------------------------------------------------------------------------------------

TRANS = [(False, False), (False, True), (True, False), (True, True)]


def _test_cases() -> list[tuple]:
    """(m, n, k, ta, tb, dtype) of tests/ops/test_gemm_cuda.py (kept in step by hand)."""
    sizes = [(1, 4096, 4096), (48, 256, 512), (128, 4096, 4096), (1000, 1000, 1000),
             (2048, 4096, 4096), (333, 4097, 4095), (7, 13, 1), (1, 1, 1)]
    out = [(m, n, k, ta, tb, "bfloat16") for m, n, k in sizes for ta, tb in TRANS]
    for m, n, k in [(1, 4096, 4096), (2048, 4096, 4096), (333, 4097, 4095)]:
        out += [(m, n, k, False, False, "float16"), (m, n, k, False, True, "float16")]
    out += [(64, 256, 256, False, False, "bfloat16")]  # the offset view (unaligned)
    out += [(256, 512, 384, True, True, "bfloat16")]
    return out


def _spec_for(m, n, k, ta, tb, dtype, aligned=None):
    """The kernels' plan of a call on fresh contiguous tensors (``aligned=False``: an offset
    view, which breaks TMA alignment whatever the row lengths)."""
    from tileops.kernels.gemm import GemmPlan, m_bucket, tma_aligned

    if aligned is None:  # fresh contiguous tensors: only the row lengths can break it
        aligned = tma_aligned(m, n, k, dtype, ta, tb)
    return GemmPlan("cuda", m_bucket(m), n, k, dtype, ta, tb, aligned)


def serving(spec):
    """The implementation that serves ``spec`` on a device of the current kind (the op's own
    selection over its kernel types)."""
    from tileops.kernels.gemm import GemmFwdInterface
    from tileops.ops import GemmFwdOp
    from tileops.runtime.kernel import select

    return select(GemmFwdInterface, GemmFwdOp.kernel_types[GemmFwdInterface], spec)


def program_job(impl, spec, cfg) -> tuple:
    """``(kind, n, k, dtype, trans_a, trans_b, config)``: the program ``impl`` compiles for
    ``spec`` with ``cfg`` (kind "gemv" for the one-row kernel; the padded kernel's sizes)."""
    from tileops.kernels.gemm import GemmGemvKernel, GemmPaddedKernel

    if impl is GemmPaddedKernel:
        spec = GemmPaddedKernel.padded_spec(spec)
    kind = "gemv" if impl is GemmGemvKernel else "gemm"
    return (kind, spec.n, spec.k, spec.dtype, spec.trans_a, spec.trans_b, cfg)


def _program_job(spec) -> tuple:
    """The job of the program that serves ``spec`` with the configuration it picks."""
    impl = serving(spec)
    return program_job(impl, spec, impl.config_for(spec))


def prebuild_jobs() -> list[tuple]:
    from tileops.kernels.gemm import GemmHopperKernel

    jobs = set()
    for m, n, k, ta, tb, dt in _test_cases():
        if m == 64 and n == 256:
            spec = _spec_for(m, n, k, ta, tb, dt, aligned=False)
        else:
            spec = _spec_for(m, n, k, ta, tb, dt)
        if k:
            jobs.add(_program_job(spec))
    for cfg in GemmHopperKernel.tune_candidates:  # test_tune_times_and_caches's candidates
        jobs.add(("gemm", 4096, 4096, "bfloat16", False, False, cfg))
    for param in _test_params("_split_cases") + _test_params("_tile_order_cases"):
        cfg, m, n, k, ta, tb = param.values
        jobs.add(("gemm", n, k, "bfloat16", ta, tb, cfg))
    for param in _test_params("_gemv_cases"):
        cfg, m, n, k, ta, dtype = param.values
        dt = str(dtype).split(".")[1]
        spec = _spec_for(m, n, k, ta, True, dt)
        jobs.add(_program_job(spec) if cfg is None else ("gemv", n, k, dt, ta, True, cfg))
    for w in workloads():
        spec = _spec_for(w["m"], w["n"], w["k"], w["trans_a"], w["trans_b"], w["dtype"])
        jobs.add(_program_job(spec))
    return sorted(jobs, key=repr)


def _test_params(generator: str) -> list:
    """The parameters of tests/ops/test_gemm_cuda.py's ``generator`` (imported: pytest is
    on the GPU host)."""
    sys.path.insert(0, str(ROOT / "tests" / "ops"))
    try:
        import test_gemm_cuda
    except ImportError:  # no pytest or torch here: nothing to prebuild for them
        return []
    finally:
        sys.path.pop(0)
    return list(getattr(test_gemm_cuda, generator)())


def _device_arch() -> tuple[int, int] | None:
    import torch

    from tileops.runtime import device_arch

    return device_arch(torch.device("cuda")) if torch.cuda.is_available() else None


def _build(job: tuple, arch: tuple[int, int] | None = None) -> tuple[tuple, float, str]:
    """Compile one job as the kernels will on a device of compute capability ``arch``."""
    sys.path[:0] = PATHS
    import torch

    from tileops.kernels.gemm import (
        build_gemm_kernel,
        build_gemv_kernel,
        build_reduce_kernel,
        program_sms,
        uses_pdl,
    )

    kind, n, k, dtype, ta, tb, cfg = job
    t = time.perf_counter()
    try:
        if kind == "gemv":
            build_gemv_kernel(n, k, dtype, ta, cfg, None, arch is not None and arch >= (9, 0))
        else:
            pdl = uses_pdl(cfg, arch)
            device = torch.device("cuda") if arch is not None else None
            build_gemm_kernel(n, k, dtype, ta, tb, cfg, None, pdl, program_sms(cfg, device))
            if cfg.split > 1:
                build_reduce_kernel(n, dtype, cfg.split, None, pdl)
        return job, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        return job, time.perf_counter() - t, f"{type(exc).__name__}: {str(exc)[-400:]}"


def prebuild(workers: int) -> int:
    jobs = prebuild_jobs()
    arch = _device_arch()
    t = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        for job, secs, status in pool.map(_build, jobs, [arch] * len(jobs)):
            failed += status != "ok"
            print(f"{job[:6]} {tuple(job[6])[:5]} {secs:.1f}s {status}", flush=True)
    print(f"prebuilt {len(jobs)} kernels in {time.perf_counter() - t:.0f}s, {failed} failed")
    return 1 if failed else 0


# --- operands --------------------------------------------------------------------------------


def operand_sets(w: dict, seed: int = 0) -> list[tuple]:
    """``(a, b, op(a), op(b))`` sets of fresh random operands for workload ``w``, as many as
    span the harness's rotation bytes (at most its set count); ``op(x)`` is the transposed
    view where stored so."""
    import torch

    m, n, k, ta, tb = w["m"], w["n"], w["k"], w["trans_a"], w["trans_b"]
    dtype = getattr(torch, w["dtype"])
    g = torch.Generator(device="cuda").manual_seed(m * 7919 + n * 31 + k + seed)
    nbytes = (m * k + k * n) * torch.finfo(dtype).bits // 8
    sets = []
    for _ in range(max(1, min(MAX_SETS, -(-ROTATE_BYTES // nbytes)))):
        a = torch.randn((k, m) if ta else (m, k), dtype=dtype, device="cuda", generator=g)
        b = torch.randn((n, k) if tb else (k, n), dtype=dtype, device="cuda", generator=g)
        sets.append((a, b, a.T if ta else a, b.T if tb else b))
    return sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prebuild", action="store_true", required=True,
                    help="compile the kernels the GPU tests and the spec workloads select (the "
                         "comparison itself is `tileops bench GemmFwdOp`)")
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args(argv)
    return prebuild(args.workers)


if __name__ == "__main__":
    sys.exit(main())
