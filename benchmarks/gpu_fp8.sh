#!/usr/bin/env bash
# One GPU session for the fp8 family: unpack the bundle, prebuild the programs the GPU tests
# and the spec workloads use (parallel processes; the workloads at full size, as the GEMM
# compiles N and K in and picks its tiles by M), the kernels' GPU tests and the harness's
# for Fp8QuantFwdOp and GemmFp8FwdOp, then the side-by-side benchmarks of the bars: tileops
# bench of each scaling's workloads against torch eager (the dequantised matmul), a fresh
# torch.compile per workload, torch._scaled_mm (per tensor, per row; with and without
# use_fast_accum) and F.scaled_mm's block-wise form where the installed torch has it; the
# quantiser against torch eager and torch.compile; and (stage sweep) the GEMM's tile
# configurations against torch._scaled_mm on the bars' shapes (benchmarks/fp8.py). Logs and
# results go to $OUT (or ./gpu-out). STAGES picks stages (default: prebuild tests bench; also:
# sweep).
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table of the bars, named fp8_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "fp8_$name" \
    --out "$OUT" --no-plot "$@"
}
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=3 run prebuild_tests.log python3 tests/kernels/test_fp8_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_ops.log python3 benchmarks/prebuild_ops.py --family fp8 --workers 15 --max-elements 0 ;;
  tests)
    TAIL=15 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_fp8_cuda.py -q -p no:cacheprovider --maxfail=40
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "Fp8" -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    bench gemm_tensor GemmFp8FwdOp -w 'tensor-*'
    bench gemm_row GemmFp8FwdOp -w 'row-*'
    bench gemm_block GemmFp8FwdOp -w 'block-*'
    bench quant Fp8QuantFwdOp ;;
  sweep)
    TAIL=3 run prebuild_sweep.log python3 benchmarks/fp8.py --prebuild --workers 15
    TAIL=80 run sweep.log python3 benchmarks/fp8.py --out "$OUT" ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench sweep)" ;;
esac; done
