#!/usr/bin/env bash
# One GPU session for GemmFwdOp: unpack the bundle, prebuild the kernels in parallel, run the
# cuda tests, then the benchmark against cuBLAS. Logs go to $OUT (or ./gpu-out). STAGES picks
# stages (default: prebuild tests bench); GEMM_ARGS is passed to the benchmark (e.g. --tune).
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
for stage in $STAGES; do case $stage in
  prebuild) python3 benchmarks/gemm.py --prebuild --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/prebuild.log" | tail -3 ;;
  tests) python3 -m pytest -m cuda tests/ops/test_gemm_cuda.py -x -q -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/pytest.log" ;;
  bench) python3 benchmarks/gemm.py ${GEMM_ARGS:-} --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/bench.log" | tail -n 45 ;;
esac; done
