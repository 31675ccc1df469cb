#!/usr/bin/env bash
# One GPU session for the norm ops: unpack the bundle, prebuild kernels in parallel, run the
# cuda tests, the side-by-side benchmark (tileops bench: every spec workload against torch
# eager, torch.compile and Liger-Kernel), then the host cost and first call. Logs and results
# go to $OUT (or ./gpu-out). STAGES picks stages (default: prebuild tests bench host; also:
# sweep); BENCH_ARGS is passed to tileops bench (e.g. -w 'm32768-*').
STAGES=${STAGES:-prebuild tests bench host}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
python3 -c "import matplotlib" 2>/dev/null && PLOT= || PLOT=--no-plot
for stage in $STAGES; do case $stage in
  prebuild) python3 benchmarks/prebuild_norm.py --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/prebuild.log" | tail -3 ;;
  sweep) python3 benchmarks/sweep_norm.py --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/sweep.log" ;;
  tests) python3 -m pytest -m cuda tests -x -q -p no:cacheprovider 2>&1 | tail -n 15 | tee "$OUT/pytest.log" ;;
  bench) python3 -m tileops.ops.cli bench RMSNormFwdOp FusedAddRMSNormFwdOp LayerNormFwdOp --name norm --out "$OUT" $PLOT ${BENCH_ARGS:-} 2>&1 | grep -v "TileLang" | tee "$OUT/bench.log" | tail -n 40 ;;
  host) python3 benchmarks/norm.py --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/host.log" | tail -n 6 ;;
esac; done
