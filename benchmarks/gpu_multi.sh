#!/usr/bin/env bash
# One session on a host of two GPUs (the device tool's nvidia-h200-x2) for the several-GPU
# layer: the per-device tests (one op instance over cuda:0 and cuda:1, one thread a device,
# request_tune on each), the torchrun examples on NCCL through the in-tree kernels, and the
# tensor-parallel MLP's training step on two GPUs against one, side by side with the same
# block as torch ops (DTensor's parallelize_module). Logs and results go to $OUT (or
# ./gpu-out). STAGES picks stages (default: tests examples bench).
STAGES=${STAGES:-tests examples bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
torchrun2() {  # torchrun2 SCRIPT ARGS...: two ranks on this host, a GPU each
  python3 -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \
    --master-port $((29500 + RANDOM % 1000)) "$@"
}
for stage in $STAGES; do case $stage in
  tests)
    TAIL=20 run two_gpus.log python3 -m pytest -m "cuda2" tests/ops/test_two_gpus.py tests/nn/test_parallel.py -q -p no:cacheprovider ;;
  examples)
    for example in examples/tensor_parallel_mlp.py examples/expert_parallel_moe.py; do
      [ -f "$example" ] && TAIL=6 run "$(basename "$example" .py).log" torchrun2 "$example"
    done ;;
  bench)
    TAIL=20 run tp_mlp.log torchrun2 benchmarks/tp_mlp.py --out "$OUT" ;;
  *) echo "unknown stage $stage (stages: tests examples bench)" ;;
esac; done
