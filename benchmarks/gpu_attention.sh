#!/usr/bin/env bash
# One GPU session for the prefill attention family: unpack the bundle, prebuild the programs
# the GPU tests and the spec workloads use (parallel processes; a program serves every batch
# and length of its head configuration and options), the GPU tests of the kernel and of the
# ops through the harness, then the side-by-side benchmarks of the bars (tileops bench against
# torch eager, a fresh torch.compile per workload and scaled_dot_product_attention under its
# cuDNN and FlashAttention backends) and of the edges. Logs and results go to $OUT (or
# ./gpu-out). STAGES picks stages (default: prebuild tests bench). The bars (bf16, H200):
# B4 S4096 H32 D128 >= 640 TFLOP/s, causal >= 600, GQA B2 S8192 32:8 causal >= 560,
# B16 S1024 D64 causal >= 340; the achieved column of the tables is TFLOP/s by the rooflines
# (4 B H S_q S_kv D, halved for causal when S_q == S_kv); varlen over mixed lengths within 10%
# of the dense op's rate at the same total tokens.
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table, named attention_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "attention_$name" \
    --out "$OUT" --no-plot "$@"
}
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=3 run prebuild_tests.log python3 tests/kernels/test_attention_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_ops.log python3 - <<'PY'
# The programs of every spec workload at its full size (the masked flag depends on S_kv), from
# the op's own window, scale and layout, built in parallel.
import sys
sys.path[:0] = ["tests/kernels"]
import torch  # noqa: F401
import tileops.ops as ops
from tileops.kernels import attention as A
from tileops.ops.workloads import cases_of
from _prebuild import build_all

keys = {}
for name in ("MultiHeadAttentionFwdOp", "GroupedQueryAttentionFwdOp"):
    cls = getattr(ops, name)
    for case in cases_of(cls):
        if case.dtype not in ("bfloat16", "float16"):
            continue  # the reference target's
        op, v = cls(**case.params), case.values
        left, right = op._bounds
        spec = A.AttentionFwdSpec(
            device=torch.device("cuda", 0), batch=v["B"], seq_q=v["S_q"], seq_kv=v["S_kv"],
            heads=v["H"], heads_kv=v.get("H_kv", v["H"]), dim=v["D"], dim_v=v["D_v"],
            dtype=case.dtype, layout=A.AttentionLayout(op.layout),
            scale=op.softmax_scale(v["D"]), window_left=left, window_right=right,
            softcap=op.softcap)
        keys[("fwd", A.program_key(spec))] = None
cls = ops.GroupedQueryAttentionVarlenFwdOp
for case in cases_of(cls):
    if case.dtype not in ("bfloat16", "float16"):
        continue
    op, v = cls(**case.params), case.values
    left, right = op._bounds
    spec = A.AttentionVarlenFwdSpec(
        device=torch.device("cuda", 0), total_q=v["Z_q"], total_kv=v["Z_kv"], batch=v["B"],
        heads=v["H"], heads_kv=v["H_kv"], dim=v["D"], dim_v=v["D_v"], dtype=case.dtype,
        scale=op.softmax_scale(v["D"]), window_left=left, window_right=right,
        softcap=op.softcap)
    keys[("varlen", A.varlen_program_key(spec))] = None
from test_attention_cuda import _build, _describe
sys.exit(build_all(list(keys), _build, _describe, 15))
PY
    ;;
  tests)
    TAIL=20 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_attention_cuda.py -q -p no:cacheprovider --maxfail=40
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "MultiHeadAttentionFwdOp or GroupedQueryAttentionFwdOp or GroupedQueryAttentionVarlenFwdOp" -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    bench bars MultiHeadAttentionFwdOp -w b4-s4096-d128 -w b4-s4096-d128-causal -w b16-s1024-d64-causal -w b2-s4096-d256-causal --dtype bf16
    bench gqa GroupedQueryAttentionFwdOp -w gqa-b2-s8192-32x8-causal -w gqa-b4-s4096-32x8 --dtype bf16
    # varlen against the dense bar at the same 16384 tokens: four sequences of 4096 (the dense
    # bar's flops exactly), then mixed lengths 32-4096 (flops by the equal-length floor)
    bench varlen GroupedQueryAttentionVarlenFwdOp -w 'varlen-*' --dtype bf16
    bench edges MultiHeadAttentionFwdOp -w sq1-skv4096 -w odd-s1000 -w causal-sq1000-skv3001 -w window-256 -w softcap-50 -w d192-dv128 -w lse -w bhsd-causal ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench)" ;;
esac; done
