#!/usr/bin/env bash
# One GPU session for GemmFwdOp: unpack the bundle, prebuild the kernels in parallel, run the
# cuda tests, then the side-by-side benchmark (tileops bench: every spec workload against
# cuBLAS and torch.compile, inputs rotated past L2). Logs and results go to $OUT (or
# ./gpu-out). STAGES picks stages (default: prebuild tests bench); BENCH_ARGS is passed to
# tileops bench (default: --compile-mode max-autotune-no-cudagraphs; add --tune to tune).
STAGES=${STAGES:-prebuild tests bench}
BENCH_ARGS=${BENCH_ARGS:---compile-mode max-autotune-no-cudagraphs}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
python3 -c "import matplotlib" 2>/dev/null && PLOT= || PLOT=--no-plot
for stage in $STAGES; do case $stage in
  prebuild) python3 benchmarks/gemm.py --prebuild --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/prebuild.log" | tail -3 ;;
  tests) python3 -m pytest -m cuda tests/ops/test_gemm_cuda.py -x -q -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/pytest.log" ;;
  bench) python3 -m tileops.ops.cli bench GemmFwdOp --name gemm --out "$OUT" $PLOT $BENCH_ARGS 2>&1 | grep -v "TileLang" | tee "$OUT/bench.log" | tail -n 50 ;;
esac; done
