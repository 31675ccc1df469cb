#!/usr/bin/env bash
# One GPU session for the RoPE family: unpack the bundle, prebuild the kernels the GPU tests
# and the spec workloads use (parallel processes), the GPU tests of the kernels (every variant
# against float64) and the harness's CUDA cases of the rope ops, then the side-by-side
# benchmarks (tileops bench against torch eager, a fresh torch.compile per workload and
# Liger-Kernel's rope where it covers the call: neox, whole head, not in place). Logs and
# results go to $OUT (or ./gpu-out). STAGES picks stages (default: prebuild tests bench).
# About 12 minutes on one H200.
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table, named rope_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "rope_$name" \
    --out "$OUT" --no-plot "$@"
}
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=2 run prebuild_tests.log python3 tests/kernels/test_rope_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_ops.log python3 benchmarks/prebuild_ops.py --family rope --workers 15 ;;
  tests)
    TAIL=15 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_rope_cuda.py -q -p no:cacheprovider
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "Rope" -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    bench neox RopeNeoxFwdOp
    bench nonneox RopeNonNeoxFwdOp
    # every workload of every op: the bar is every variant and layout on every workload
    bench scaled RopeLlama31FwdOp RopeYarnFwdOp RopeLongRopeFwdOp
    bench bwd RopeNeoxBwdOp RopeNonNeoxBwdOp RopeLlama31BwdOp RopeYarnBwdOp RopeLongRopeBwdOp
    # LongRoPE's decode steps around SCAN_POSITIONS (the CTAs' own scan against amax first)
    TAIL=12 run switch.log python3 benchmarks/sweep_rope_switch.py --out "$OUT" ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench)" ;;
esac; done
