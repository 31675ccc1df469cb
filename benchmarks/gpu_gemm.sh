#!/usr/bin/env bash
# One GPU session for the GEMM family: unpack the bundle, prebuild the kernels in parallel, run the
# cuda tests, then the side-by-side benchmarks (tileops bench: every spec workload against
# cuBLAS and torch.compile, inputs rotated past L2): GemmFwdOp (stage bench), and the
# accumulating GemmAccumulateFwdOp against torch's c.addmm_ (cuBLAS) on the fused linear
# cross-entropy's dweight (128256 x 4096 += z.T @ h, 1024 to 8192 rows) and the square and
# projection shapes (stage accumulate); every tile configuration against cuBLAS on the products
# of the Llama training step of benchmarks/llama.py, each in its layout (stage llama: the MLP's
# and the fused linear cross-entropy's, where the step's profile puts its GEMMs at 0.8 of
# cuBLAS's). Logs and results go to $OUT (or ./gpu-out). STAGES picks
# stages (default: prebuild tests bench accumulate); BENCH_ARGS is passed to tileops bench
# (default: --compile-mode max-autotune-no-cudagraphs; add --tune to tune).
STAGES=${STAGES:-prebuild tests bench accumulate}
BENCH_ARGS=${BENCH_ARGS:---compile-mode max-autotune-no-cudagraphs}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
python3 -c "import matplotlib" 2>/dev/null && PLOT= || PLOT=--no-plot
for stage in $STAGES; do case $stage in
  prebuild) python3 benchmarks/gemm.py --prebuild --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/prebuild.log" | tail -3
    python3 tests/kernels/test_gemm_cuda.py --prebuild --workers 14 2>&1 | grep -v "TileLang" | tee "$OUT/prebuild_acc.log" | tail -3 ;;
  tests) python3 -m pytest -m cuda tests/ops/test_gemm_cuda.py -x -q -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/pytest.log"
    python3 -m pytest -m cuda tests/kernels/test_gemm_cuda.py -q -p no:cacheprovider --maxfail=20 2>&1 | tail -n 25 | tee "$OUT/pytest_acc.log"
    python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k GemmAccumulate -q -p no:cacheprovider --maxfail=20 2>&1 | tail -n 15 | tee "$OUT/pytest_acc_harness.log" ;;
  bench) python3 -m tileops.ops.cli bench GemmFwdOp --name gemm --out "$OUT" $PLOT $BENCH_ARGS 2>&1 | grep -v "TileLang" | tee "$OUT/bench.log" | tail -n 50 ;;
  accumulate) python3 -m tileops.ops.cli bench GemmAccumulateFwdOp --name gemm_accumulate --out "$OUT" $PLOT $BENCH_ARGS 2>&1 | grep -v "TileLang" | tee "$OUT/bench_acc.log" | tail -n 30 ;;
  llama) python3 benchmarks/sweep_gemm.py --shapes llama-step --name gemm_llama_step --out "$OUT" 2>&1 | grep -v "TileLang" | tee "$OUT/sweep_llama.log" | tail -n 80 ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench accumulate llama)" ;;
esac; done
