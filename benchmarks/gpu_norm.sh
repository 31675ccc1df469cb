#!/usr/bin/env bash
# One GPU session for the norm ops: unpack the bundle, prebuild kernels in parallel, run the
# cuda tests, the side-by-side benchmark (tileops bench: every spec workload against torch
# eager, torch.compile and Liger-Kernel), then the host cost and first call. Logs and results
# go to $OUT (or ./gpu-out). STAGES picks stages (default: prebuild tests bench host; also:
# sweep; few_rows, the cluster kernel for fewer rows than SMs beside the one-CTA kernels and
# torch.compile; store, a kernel compiled in one process loaded by the next without TileLang,
# the host stage then timing the first call cold, from the store and from TileLang's cache
# alone; few_rows_sweep, the cluster kernel at every split, also past one CTA an SM, and the
# split kernel at 4-128 CTAs a row, beside the kernels the op picks and torch.compile); BENCH_ARGS is passed to tileops bench (e.g. -w 'm32768-*').
STAGES=${STAGES:-prebuild tests bench host}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
python3 -c "import matplotlib" 2>/dev/null && PLOT= || PLOT=--no-plot
for stage in $STAGES; do case $stage in
  prebuild) python3 benchmarks/prebuild_norm.py --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/prebuild.log" | tail -3 ;;
  sweep) python3 benchmarks/sweep_norm.py --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/sweep.log" ;;
  tests) python3 -m pytest -m cuda tests -x -q -p no:cacheprovider 2>&1 | tail -n 15 | tee "$OUT/pytest.log" ;;
  bench) python3 -m tileops.ops.cli bench RMSNormFwdOp FusedAddRMSNormFwdOp LayerNormFwdOp --name norm --out "$OUT" $PLOT ${BENCH_ARGS:-} 2>&1 | grep -v "TileLang" | tee "$OUT/bench.log" | tail -n 40 ;;
  host) python3 benchmarks/norm.py --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/host.log" | tail -n 6 ;;
  store)  # the kernel store: a second process loads what the first compiled, without TileLang
    python3 -m pytest -m cuda tests/kernels/test_store_cuda.py -q -p no:cacheprovider -rf 2>&1 | tail -n 15 | tee "$OUT/store.log" ;;
  few_rows_sweep)  # the cluster and split kernels at every split beside the op and compile
    python3 benchmarks/sweep_norm_few_rows.py --out "$OUT" --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/few_rows_sweep.log" | tail -n 23 ;;
  few_rows)  # RMSNorm with fewer rows than SMs: the one-CTA-a-row kernels, the cluster kernel
    # (outside its region the op's others) and torch.compile (fresh per shape) side by side,
    # CUDA graphs, TB/s of one read + one write
    python3 - <<'PY' 2>&1 | grep -v "TileLang" | tee "$OUT/few_rows.log" | tail -n 40
import sys
sys.path.insert(0, "benchmarks")
import torch
import torch.nn.functional as F
from tileops.kernels.norm import RowNormClusterKernel, RowNormLoopedKernel, RowNormRegisterKernel
from tileops.ops import RMSNormFwdOp
from _common import graph_events

ONE_CTA = {"row_norm_fwd": (RowNormRegisterKernel, RowNormLoopedKernel)}
CLUSTER = {"row_norm_fwd": (RowNormClusterKernel, RowNormRegisterKernel, RowNormLoopedKernel)}
print(f"{'rows':>5} {'N':>7} {'one CTA':>9} {'cluster':>9} {'compile':>9} {'eager':>9}  TB/s")
for n in (16384, 65536, 100000, 131072, 262144):
    for rows in (1, 4, 8, 16, 32, 64, 128):
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        want = F.rms_norm(x.float(), (n,), w.float(), 1e-6)
        tb = 2 * x.numel() * 2 / 1e12
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: F.rms_norm(t, (n,), w, 1e-6), dynamic=False)
        cells = []
        for fn in (RMSNormFwdOp(normalized_shape=[n], eps=1e-6, kernel_map=ONE_CTA),
                   RMSNormFwdOp(normalized_shape=[n], eps=1e-6, kernel_map=CLUSTER), None, 0):
            f = ((lambda: fn(x, w)) if fn not in (None, 0) else
                 (lambda: compiled(x)) if fn is None else (lambda: F.rms_norm(x, (n,), w, 1e-6)))
            ok = ((f().float() - want).norm() / want.norm()).item() < 1e-2
            ms = graph_events(f, 20)
            cells.append(f"{tb / (ms * 1e-3):8.2f}{'' if ok else '!'}")
        print(f"{rows:>5} {n:>7} " + " ".join(cells), flush=True)
PY
    ;;
esac; done
