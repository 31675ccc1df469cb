#!/usr/bin/env bash
# One GPU session for the reduction family: prebuild the kernels the GPU tests and the spec
# workloads use (parallel processes; the row count is a launch-time size but the reduced
# length is compiled in, and scaling a workload down shrinks its leading dim, which is the
# reduced one of the dim=0 and dim=None rows, so the workloads are prebuilt at full size;
# each distinct program is compiled once), the GPU tests of the kernels and of the harness, then
# the side-by-side benchmarks of the bars (tileops bench against torch eager and a fresh
# torch.compile per workload). Logs and results go to $OUT (or ./gpu-out). STAGES picks stages
# (default: prebuild tests bench). About 10 minutes on one H200.
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table, named reduction_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "reduction_$name" \
    --out "$OUT" --no-plot "$@"
}
OPS="SumFwdOp MeanFwdOp ProdFwdOp AmaxFwdOp AminFwdOp VarFwdOp StdFwdOp VarMeanFwdOp L2NormFwdOp AllFwdOp AnyFwdOp ArgmaxFwdOp ArgminFwdOp"
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=2 run prebuild_tests.log python3 tests/kernels/test_reduction_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_ops.log python3 benchmarks/prebuild_ops.py --family reduction --workers 15 --max-elements 0 ;;
  tests)
    TAIL=15 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_reduction_cuda.py -q -p no:cacheprovider --maxfail=40
    # shellcheck disable=SC2086
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -q -p no:cacheprovider --maxfail=40 \
      -k "$(echo $OPS | sed 's/ / or /g')" ;;
  bench)
    bench bars SumFwdOp MeanFwdOp AmaxFwdOp -w m32768-n8192-last -w m32768-n8192-dim0 --dtype bf16
    # shellcheck disable=SC2086
    bench all $OPS ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench)" ;;
esac; done
