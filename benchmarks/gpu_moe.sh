#!/usr/bin/env bash
# One GPU session for the mixture-of-experts family: prebuild the kernels the GPU tests and
# the spec workloads use (parallel processes), the GPU tests of the kernels and the harness,
# then the side-by-side benchmarks of the bars (tileops bench against torch eager, a fresh
# torch.compile per workload and torch._grouped_mm where torch has it): the grouped GEMM at
# E64 x 512 rows x K4096 x N2048 (>= 730 TFLOP/s, and >= torch._grouped_mm on uneven loads),
# the permutations (>= 0.9 of the copy bandwidth), the routing, and the fused layer at the
# Mixtral-8x7B and DeepSeek-V3-like shapes at 1, 64 and 8192 tokens (faster than the torch
# pipeline with torch._grouped_mm); the routing's and the permutation's gradients (the
# permutation's at the unpermutation's bandwidth); tileops.nn.MoE's training step is in the
# kernel tests. Stage sweep times the grouped GEMM's two programs (the warp-specialized TMA one,
# the default where it holds, and the pipelined one) and other tiles of the warp-specialized one
# (WS_CANDIDATES in tests/kernels/test_moe_cuda.py) beside torch._grouped_mm on the bar's shapes
# (E64 x 512 x 4096 -> 2048 even and uneven, Mixtral-8x7B up and down, DeepSeek-V3 aligned and
# masked), TFLOP/s, each cell checked against float64 (grouped_gemm_sweep.json). Stage ep runs
# examples/expert_parallel_moe.py under torchrun on two GPUs (NCCL, bfloat16: ExpertParallelMoE
# against the one-device layer, forward and backward) where the machine has two. Stage stages
# times the fused layer's stages one by one on its workloads (benchmarks/moe_stages.py: which
# stage holds a call's time, against each stage's floor). Logs and
# results go to $OUT (or ./gpu-out). STAGES picks stages (default: prebuild tests sweep bench stages ep),
# BENCHES the bench stage's groups (default: grouped_gemm permute gating fused gradients; the
# grouped GEMM's takes some 4 minutes, its torch contenders timed without CUDA graphs).
STAGES=${STAGES:-prebuild tests sweep bench stages ep}
BENCHES=${BENCHES:-grouped_gemm permute gating fused gradients}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table of the bars, named moe_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "moe_$name" \
    --out "$OUT" --no-plot "$@"
}
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=3 run prebuild_tests.log python3 tests/kernels/test_moe_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_ops.log python3 benchmarks/prebuild_ops.py --family moe --workers 15 ;;
  sweep)
    TAIL=60 run sweep_grouped_gemm.log python3 tests/kernels/test_moe_cuda.py --sweep --out "$OUT" ;;
  tests)
    TAIL=25 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_moe_cuda.py -q -p no:cacheprovider
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "Moe or GroupedGemm" -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    for group in $BENCHES; do case $group in
      grouped_gemm) bench grouped_gemm GroupedGemmFwdOp -w 'e64-*' -w mixtral-up-uneven-m8192 -w deepseek-up-aligned128 -w deepseek-down-masked64 -w odd-uneven --dtype bf16 ;;
      permute) bench permute MoePermuteAlignFwdOp MoeUnpermuteFwdOp -w 'mixtral-*' -w 'deepseek-*' ;;
      gating) bench gating MoeTopkGatingFwdOp -w 'mixtral-*' -w 'deepseek-*' -w qwen3-m8192 ;;
      fused) bench fused FusedMoeFwdOp -w 'mixtral-*' -w 'deepseek-*' ;;
      gradients) bench gradients MoeTopkGatingBwdOp MoePermuteAlignBwdOp -w 'mixtral-*' -w 'deepseek-*' -w no-renorm-m8192 ;;
      *) echo "unknown bench group $group" ;;
    esac; done ;;
  stages)
    TAIL=50 run stages.log python3 benchmarks/moe_stages.py --out "$OUT" ;;
  ep)
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      run ep_example.log python3 -m torch.distributed.run --nproc-per-node 2 examples/expert_parallel_moe.py
    else
      echo "== ep: skipped, one GPU (the example needs two)"
    fi ;;
  *) echo "unknown stage $stage (stages: prebuild tests sweep bench stages ep)" ;;
esac; done
