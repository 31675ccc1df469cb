#!/usr/bin/env bash
# One GPU session for the softmax family: unpack the bundle, prebuild the kernels the GPU tests
# and the spec workloads use (parallel processes), the GPU tests of the kernels and of the ops
# through the harness, then the side-by-side benchmarks of the bars (tileops bench against
# torch eager, a fresh torch.compile per workload and Liger-Kernel's softmax where it covers
# the call) and of the gradients and the odd sizes. Logs and results go to $OUT (or
# ./gpu-out). STAGES picks stages (default: prebuild tests bench). About 10 minutes on one H200.
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table, named softmax_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "softmax_$name" \
    --out "$OUT" --no-plot "$@"
}
BARS=(-w m32768-n8192 -w m4096-n32000 -w m4096-n128256 -w m16384-n1024)
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=2 run prebuild_tests.log python3 tests/kernels/test_softmax_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_ops.log python3 benchmarks/prebuild_ops.py --family softmax --workers 15 ;;
  tests)
    TAIL=15 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_softmax_cuda.py -q -p no:cacheprovider --maxfail=40
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "Softmax" -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    bench bars SoftmaxFwdOp LogSoftmaxFwdOp LogSumExpFwdOp "${BARS[@]}" --dtype bf16
    bench grads SoftmaxBwdOp LogSoftmaxBwdOp "${BARS[@]}" --dtype bf16
    bench lse_grad LogSumExpBwdOp
    bench odd SoftmaxFwdOp -w odd-n4097 -w tiny-m3-n7 -w wide-n131072 -w wide-n262144 -w dim0-m1024-n4096 -w dim1-8x512x1024 ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench)" ;;
esac; done
