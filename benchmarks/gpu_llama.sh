#!/usr/bin/env bash
# One GPU session for the transformers integration: unpack the bundle (it must hold
# transformers and its dependencies, and liger-kernel for the Liger contender: Liger-Kernel
# 0.8.5 refuses transformers below 5, so with the integration's transformers 4.57 its 0.6.4
# wheel unpacked in a directory named by GPU_EXTRA_PATH, e.g. .gpu/liger064), prebuild the
# kernels of each patch flag at the benchmark's shapes (parallel processes), the integration's
# GPU tests, then the training step of the 4-layer Llama-3-8B-shaped stack at 8 x 4096 tokens:
# tileops against unpatched eager, unpatched torch.compile and Liger-Kernel's patch
# (benchmarks/llama.py), and the examples (training for a few steps, a paged decode); then
# greedy decode of the same stack at batch 32 x 2048-token prompts, 128 new tokens, over the
# paged KV cache against unpatched eager generate and torch.compile's static-cache generate
# (llama.py --decode, its kernels prebuilt first). Logs and results go to $OUT (or ./gpu-out).
# STAGES picks stages (default: prebuild tests bench example prebuild_decode decode; also
# profile: the device time of a step by kernel for the PROFILE contenders, default
# tileops,eager);
# BENCH_ARGS goes to llama.py (e.g. BENCH_ARGS="--against eager --steps 12"), DECODE_ARGS to
# llama.py --decode (e.g. DECODE_ARGS="--against eager --new 64"). About 25 minutes on one
# H200, most of it the prebuilds and torch.compile's compiles.
STAGES=${STAGES:-prebuild tests bench example prebuild_decode decode}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1 t=$SECONDS; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}, $((SECONDS - t)) s"
}
for stage in $STAGES; do case $stage in
  prebuild) TAIL=8 run prebuild_llama.log python3 benchmarks/llama.py --prebuild --workers 6 ;;
  tests) TAIL=25 run integrations_cuda.log python3 -m pytest -m cuda tests/integrations -q -p no:cacheprovider ;;
  prebuild_decode) TAIL=8 run prebuild_llama_decode.log python3 benchmarks/llama.py --decode --prebuild --workers 4 ;;
  decode) eval "TAIL=20 run bench_llama_decode.log python3 benchmarks/llama.py --decode --out \"\$OUT\" ${DECODE_ARGS:-}" ;;
  bench) eval "TAIL=20 run bench_llama.log python3 benchmarks/llama.py --out \"\$OUT\" ${BENCH_ARGS:-}" ;;
  profile) eval "TAIL=40 run llama_profile.log python3 benchmarks/llama.py --out \"\$OUT\" --profile ${PROFILE:-tileops,eager}" ;;
  example) TAIL=12 run example_llama.log python3 examples/llama_train.py --layers 2 --steps 10
           TAIL=12 run example_llama_decode.log python3 examples/llama_decode.py --layers 2 --new 32 ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench profile example prebuild_decode decode)" ;;
esac; done
