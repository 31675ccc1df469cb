#!/usr/bin/env bash
# One GPU session for the elementwise family: unpack the bundle, prebuild the kernels the GPU
# tests and the spec workloads use (parallel processes), the GPU tests of the kernels, the ops
# and the harness, then the side-by-side benchmarks of the bars (tileops bench against torch
# eager, a fresh torch.compile per workload and Liger-Kernel where it has the op) and the
# kernels' launch-plan sweep. Logs and results go to $OUT (or ./gpu-out). STAGES picks stages
# (default: prebuild tests bench; also: sweep). SWEEP_SHAPES (comma-separated labels of
# benchmarks/sweep_elementwise.py) narrows the sweep, BENCHES (unary gelu_tanh gated binary
# more_unary; all_a and all_b: every unary op and activation of the spec on every bf16 workload,
# some 4 minutes each) the bench stage. About 10 minutes on one H200.
STAGES=${STAGES:-prebuild tests bench}
BENCHES=${BENCHES:-unary gelu_tanh gated binary more_unary}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table of the bars, named elementwise_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "elementwise_$name" \
    --out "$OUT" --no-plot "$@"
}
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=2 run prebuild_tests.log python3 tests/kernels/test_elementwise_cuda.py --prebuild --workers 15
    # sizes are launch-time, so a scaled call builds the programs of the full-size one where
    # it takes the same plan: calls of 2M elements serve the tests; calls of 32M elements the
    # workloads past L2 (a flat call whose traffic fits in L2 takes another plan)
    for cap in $((1 << 21)) $((1 << 25)); do
      TAIL=3 run prebuild_ops_$cap.log python3 benchmarks/prebuild_ops.py --family elementwise \
        --workers 15 --max-elements $cap
    done ;;
  tests)
    TAIL=15 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_elementwise_cuda.py -q -p no:cacheprovider
    # the harness's workloads of the family's ops only (every family's are some 2600 tests)
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/test_elementwise_cuda.py tests/ops/harness/test_cuda.py \
      -k "test_elementwise_cuda or $(python3 benchmarks/prebuild_ops.py --family elementwise --list)" \
      -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    for group in $BENCHES; do case $group in
      unary) bench unary SiluFwdOp GeluFwdOp ReluFwdOp MishFwdOp -w m32768-n8192 -w odd-n4097 -w row-n4096 -w tiny-3 --dtype bf16 ;;
      gelu_tanh) bench gelu_tanh GeluFwdOp -w 'tanh-*' ;;
      gated) bench gated SiluAndMulFwdOp GeluAndMulFwdOp GeluTanhAndMulFwdOp SwiGLUFwdOp -w m16384-n28672 -w m16384-n14336 -w m1-n14336 -w odd-n4097 --dtype bf16 ;;
      binary) bench binary AddFwdOp MulFwdOp -w bias-m32768-n8192 -w scalar-m32768-n8192 -w same-m32768-n8192 -w odd-n4097 ;;
      more_unary) bench more_unary ExpFwdOp Expm1FwdOp LogFwdOp Log1pFwdOp SinFwdOp CosFwdOp ErfFwdOp SigmoidFwdOp TanhFwdOp \
        SoftplusFwdOp EluFwdOp SeluFwdOp HardswishFwdOp AbsFwdOp -w m32768-n8192 --dtype bf16 ;;
      all_a) bench all_a ExpFwdOp Expm1FwdOp LogFwdOp Log1pFwdOp SqrtFwdOp RsqrtFwdOp ReciprocalFwdOp \
        SinFwdOp CosFwdOp TanhFwdOp SigmoidFwdOp ErfFwdOp AbsFwdOp NegFwdOp SignFwdOp FloorFwdOp \
        CeilFwdOp --dtype bf16 ;;
      all_b) bench all_b RoundFwdOp TruncFwdOp IsnanFwdOp IsinfFwdOp IsfiniteFwdOp ReluFwdOp GeluFwdOp \
        SiluFwdOp MishFwdOp SoftplusFwdOp LeakyReluFwdOp EluFwdOp SeluFwdOp HardswishFwdOp \
        HardsigmoidFwdOp HardtanhFwdOp ClampFwdOp --dtype bf16 ;;
      *) echo "unknown bench group $group" ;;
    esac; done ;;
  sweep) run sweep.log python3 benchmarks/sweep_elementwise.py --workers 15 --out "$OUT" \
    ${SWEEP_SHAPES:+--shapes "$SWEEP_SHAPES"} ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench sweep)" ;;
esac; done
