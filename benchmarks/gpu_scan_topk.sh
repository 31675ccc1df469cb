#!/usr/bin/env bash
# One GPU session for the scan and top-k families: unpack the bundle, prebuild the programs
# the GPU tests and the spec workloads (at full size) use, in parallel processes; the GPU
# tests of the kernels and the harness's; then the side-by-side benchmarks (tileops bench
# against torch eager and a fresh torch.compile per workload). Logs and results go to $OUT (or
# ./gpu-out). STAGES picks stages (default: prebuild tests bench; also: sweep, which times the
# top-k plans side by side, the lean default against the earlier one and the lean plan's
# choices one at a time, benchmarks/sweep_topk.py; its programs are compiled in the
# prebuild). About 10 minutes on one H200, the sweep 2 more.
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table, named NAME
  local name=$1; shift
  TAIL=30 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "$name" \
    --out "$OUT" --no-plot "$@"
}
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=3 run prebuild_topk.log python3 tests/kernels/test_topk_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_scan.log python3 tests/kernels/test_scan_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_sweep.log python3 benchmarks/sweep_topk.py --prebuild --workers 15 ;;
  tests)
    TAIL=20 run topk_cuda.log python3 -m pytest -m cuda tests/kernels/test_topk_cuda.py -q -p no:cacheprovider --maxfail=20
    TAIL=20 run scan_cuda.log python3 -m pytest -m cuda tests/kernels/test_scan_cuda.py -q -p no:cacheprovider --maxfail=20
    TAIL=20 run harness_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "Topk or Cumsum or Cumprod" -q -p no:cacheprovider --maxfail=20 ;;
  bench)
    bench topk TopkFwdOp
    bench scan CumsumFwdOp CumprodFwdOp ;;
  sweep)
    TAIL=40 run sweep_topk.log python3 benchmarks/sweep_topk.py --out "$OUT" --workers 15 ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench sweep)" ;;
esac; done
