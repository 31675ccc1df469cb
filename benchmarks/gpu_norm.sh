#!/usr/bin/env bash
# One GPU session for the norm ops: unpack the bundle, prebuild kernels in parallel, run the
# cuda tests, then the benchmark. Logs go to $OUT (or ./gpu-out). STAGES picks stages
# (default: prebuild tests bench; also: sweep).
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
for stage in $STAGES; do case $stage in
  prebuild) python3 benchmarks/prebuild_norm.py --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/prebuild.log" | tail -3 ;;
  sweep) python3 benchmarks/sweep_norm.py --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/sweep.log" ;;
  tests) python3 -m pytest -m cuda tests -x -q -p no:cacheprovider 2>&1 | tail -n 15 | tee "$OUT/pytest.log" ;;
  bench) python3 benchmarks/norm.py ${NORM_ARGS:-} --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/bench.log" | tail -n 32 ;;
esac; done
