#!/usr/bin/env bash
# One GPU session for the decode-attention family: unpack the bundle, prebuild every program the
# GPU tests and the spec workloads use (parallel processes; the programs are compiled per batch
# size and cache shape, so the scaled calls of benchmarks/prebuild_ops.py would build others),
# the GPU tests of the kernels and the harness, then the side-by-side benchmarks of the bars
# (tileops bench against torch eager, a fresh torch.compile per workload and SDPA's flash and
# cuDNN backends on the dense, for the paged op gathered, tensors) and the sweep of split counts
# and tile plans (keys a tile, pipeline depth, CTAs an SM) at the bars' shapes. Bars (bf16):
# B64 x 8192 keys 32:8 D128 >= 4.4 TB/s of KV read, the paged op in 64-token pages within 5% of
# the contiguous op, B8 x 32768 >= 4.3. Logs and results go to $OUT (or ./gpu-out). STAGES
# picks stages (default: prebuild tests bench; also: sweep). About 10 minutes on one H200.
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table of the bars, named attention_decode_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "attention_decode_$name" \
    --out "$OUT" --no-plot "$@"
}
GQA=GroupedQueryAttentionDecodeWithKVCacheFwdOp
PAGED=GroupedQueryAttentionDecodePagedWithKVCacheFwdOp
MHA=MultiHeadAttentionDecodeWithKVCacheFwdOp
MHA_PAGED=MultiHeadAttentionDecodePagedWithKVCacheFwdOp
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=3 run prebuild_tests.log python3 tests/kernels/test_attention_decode_cuda.py --prebuild --workers 15 ;;
  tests)
    TAIL=20 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_attention_decode_cuda.py -q -p no:cacheprovider
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "AttentionDecode" -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    bench bars $GQA $PAGED -w b64-s8192-32x8 -w b64-s8192-32x8-page64 -w b8-s32768-32x8 -w b8-s32768-32x8-page64
    bench mha $MHA $MHA_PAGED -w b16-s8192-h32 -w b16-s8192-h32-page64
    bench mixed $GQA $PAGED -w mixed-s301 -w d64-mixed -w d256-mixed -w softcap-30 -w mixed-page16 -w mixed-page256 -w softcap-page128 ;;
  sweep)
    TAIL=60 run sweep.log python3 tests/kernels/test_attention_decode_cuda.py --sweep --workers 15 ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench sweep)" ;;
esac; done
