#!/usr/bin/env bash
# One GPU session for the prefill attention family: unpack the bundle, prebuild the programs
# the GPU tests and the spec workloads use (parallel processes; a program serves every batch
# and length of its head configuration and options), the GPU tests of the kernel and of the
# ops through the harness, then the side-by-side benchmarks of the bars (tileops bench against
# torch eager, a fresh torch.compile per workload and scaled_dot_product_attention under its
# cuDNN and FlashAttention backends) and of the edges. Logs and results go to $OUT (or
# ./gpu-out). STAGES picks stages (default: prebuild tests bench train; also: sweep, the forward
# program's plans side by side with cuDNN, for choosing attention_plan; bwd_sweep, the
# backward's implementations side by side with cuDNN's backward; bwd_schedules, the sm_90
# backward's schedules, gradients and forward + backward, against cuDNN's). The bars (bf16, H200):
# B4 S4096 H32 D128 >= 640 TFLOP/s, causal >= 600, GQA B2 S8192 32:8 causal >= 560,
# B16 S1024 D64 causal >= 340; the achieved column of the tables is TFLOP/s by the rooflines
# (4 B H S_q S_kv D, halved for causal when S_q == S_kv); varlen over mixed lengths within 10%
# of the dense op's rate at the same total tokens; forward + backward >= cuDNN's (train.log).
STAGES=${STAGES:-prebuild tests bench train}
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
    TAIL=3 run prebuild_ops.log python3 benchmarks/prebuild_attention.py --workers 15
    ;;
  tests)
    TAIL=20 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_attention_cuda.py -q -p no:cacheprovider --maxfail=40
    TAIL=10 run op_cuda.log python3 -m pytest -m cuda tests/ops/test_attention.py tests/nn/test_attention.py -q -p no:cacheprovider
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "MultiHeadAttention or GroupedQueryAttention" -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    bench bars MultiHeadAttentionFwdOp -w b4-s4096-d128 -w b4-s4096-d128-causal -w b16-s1024-d64-causal -w b2-s4096-d256-causal --dtype bf16
    bench gqa GroupedQueryAttentionFwdOp -w gqa-b2-s8192-32x8-causal -w gqa-b4-s4096-32x8 --dtype bf16
    # varlen against the dense bar at the same 16384 tokens: four sequences of 4096 (the dense
    # bar's flops exactly), then mixed lengths 32-4096 (flops by the equal-length floor)
    bench varlen GroupedQueryAttentionVarlenFwdOp -w 'varlen-*' --dtype bf16
    # the gradients alone (stage train: forward + backward against cuDNN's; the bar is >= cuDNN)
    bench bwd MultiHeadAttentionBwdOp GroupedQueryAttentionBwdOp --dtype bf16
    bench edges MultiHeadAttentionFwdOp -w sq1-skv1500 -w odd-s333 -w causal-sq300-skv901 -w window-256 -w softcap-50 -w d192-dv128 -w bhsd-causal ;;
  train)  # forward + backward of a training step against cuDNN's and FlashAttention's
    TAIL=40 run train.log python3 - <<'PY'
# forward + backward of one training step: the op (its autograd node: the forward kernel, the
# gradients' kernel) against scaled_dot_product_attention under the cuDNN and FlashAttention
# backends, bf16, CUDA events over 20 steps after 3; TFLOP/s by 3.5 x the forward's products
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import tileops.ops as ops


def step_ms(fn, q, k, v, dout):
    for _ in range(3):
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 20


for b, s, h, h_kv, d, causal in ((4, 4096, 32, 32, 128, False), (4, 4096, 32, 32, 128, True),
                                 (2, 8192, 32, 8, 128, True), (16, 1024, 32, 32, 64, True)):
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    op = ops.GroupedQueryAttentionFwdOp(is_causal=causal)
    flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    rows = {"tileops": lambda q, k, v: op(q, k, v)}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                    enable_gqa=h != h_kv).transpose(1, 2)
        rows[name] = sdpa
    for name, fn in rows.items():
        try:
            ms = step_ms(fn, q, k, v, dout)
            print(f"b{b} s{s} h{h}:{h_kv} d{d} causal={causal} {name:>8}: {ms:.3f} ms "
                  f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as exc:  # noqa: BLE001 - a backend that refuses the shape
            print(f"b{b} s{s} h{h}:{h_kv} d{d} causal={causal} {name:>8}: {type(exc).__name__}: "
                  f"{str(exc)[:120]}", flush=True)
PY
    ;;
  sweep)  # its programs built in parallel first (loaded from the cache when built)
    TAIL=2 run prebuild_sweep.log python3 benchmarks/prebuild_attention.py --fwd-sweep --workers 15
    TAIL=30 run sweep.log python3 - <<'PY'
# The forward program's plans on the bars' shapes, side by side: fast math on (the default)
# and off, two and three stages, the plain schedule (no spare step), and the persistent grid
# (A.SMS CTAs walking the work tiles) with the served and the plain schedule; each checked
# against SDPA (cuDNN) first, then timed from CUDA graph replays. TFLOP/s by the roofline
# (4 B H S^2 D, halved for causal), and the microseconds of the short-row bar.
import sys
sys.path.insert(0, "benchmarks")
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tileops.kernels import attention as A
from _common import graph_events
from prebuild_attention import fwd_sweep_plans

CASES = [(4, 4096, 32, 32, 128, False), (4, 4096, 32, 32, 128, True),
         (2, 8192, 32, 8, 128, True), (16, 1024, 32, 32, 64, True)]
for b, s, h, h_kv, d, causal in CASES:
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            enable_gqa=h != h_kv).transpose(1, 2)
    spec = A.AttentionFwdSpec(device=q.device, batch=b, seq_q=s, seq_kv=s, heads=h,
                              heads_kv=h_kv, dim=d, dim_v=d, dtype="bfloat16",
                              layout=A.AttentionLayout.BSHD, scale=d ** -0.5, window_left=-1,
                              window_right=0 if causal else -1, softcap=None)
    key = A.program_key(spec)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    cells = []
    for label, plan in fwd_sweep_plans(d):
        try:
            prog = A.build_attention_fwd(key, None, plan)
            o, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
            prog(q, k, v, o, lse)
            err = ((o.float() - want.float()).norm() / want.float().norm()).item()
            ms = graph_events(lambda: prog(q, k, v, o, lse), 10)
            cells.append(f"{label} {flops / ms / 1e9:4.0f}{'' if err < 1e-2 else ' WRONG'}"
                         + (f" ({ms * 1e3:.0f} us)" if s <= 1024 else ""))
        except Exception as exc:  # noqa: BLE001 - a plan that does not fit or compile
            cells.append(f"{label} {type(exc).__name__}")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = graph_events(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            enable_gqa=h != h_kv), 10)
    cells.append(f"cudnn {flops / ms / 1e9:4.0f}" + (f" ({ms * 1e3:.0f} us)" if s <= 1024 else ""))
    print(f"b{b} s{s} h{h}:{h_kv} d{d} causal={causal} TFLOP/s: " + " | ".join(cells),
          flush=True)
PY
    ;;
  bwd_sweep)  # its programs built in parallel first (loaded from the cache when built)
    TAIL=2 run prebuild_bwd_sweep.log python3 benchmarks/prebuild_attention.py --sweep-only --workers 12
    TAIL=20 run bwd_sweep.log python3 - <<'PY'
# The backward's implementations on the bars' shapes, side by side: dQ added in its rows' order
# (the default), in the product fragment's order (AttentionBwdFragmentKernel) and by a TMA
# reduce-add of 64-row tiles (AttentionBwdTmaKernel), each checked against the first, then
# timed by CUDA events over 10 calls; TFLOP/s by 2.5 x the forward's
# products (halved for causal), beside SDPA's cuDNN backward of the same inputs.
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tileops.kernels import attention as A, attention_bwd as AB
from tileops.runtime import select

def events(fn, iters=10):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / iters

CASES = [(4, 4096, 32, 32, 128, False), (4, 4096, 32, 32, 128, True),
         (2, 8192, 32, 8, 128, True), (16, 1024, 32, 32, 64, True)]
for b, s, h, h_kv, d, causal in CASES:
    t = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    q, k, v, do = t(b, s, h, d), t(b, s, h_kv, d), t(b, s, h_kv, d), t(b, s, h, d)
    spec = A.AttentionFwdSpec(device=q.device, batch=b, seq_q=s, seq_kv=s, heads=h,
                              heads_kv=h_kv, dim=d, dim_v=d, dtype="bfloat16",
                              layout=A.AttentionLayout.BSHD, scale=d ** -0.5, window_left=-1,
                              window_right=0 if causal else -1, softcap=None)
    fwd = select(A.AttentionFwdInterface, (A.AttentionFwdKernel,), spec).entry_for(spec, None)
    o, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
    fwd(q, k, v, o, lse)
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    cells, first = [], None
    for kernel in (AB.AttentionBwdKernel, AB.AttentionBwdFragmentKernel,
                   AB.AttentionBwdTmaKernel):
        entry = select(AB.AttentionBwdInterface, (kernel,), spec).entry_for(spec, None)
        grads = [torch.empty_like(x) for x in (q, k, v)]
        run = lambda: entry(do, q, k, v, o, lse, None, *grads)
        ms = events(run)
        same = "" if first is None else " (dq off by %.1e)" % (
            (grads[0].float() - first).abs().max().item())
        first = grads[0].float() if first is None else first
        cells.append(f"{kernel.__name__} {flops / ms / 1e9:4.0f}{same}")
    leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                               enable_gqa=h != h_kv)
        ms = events(lambda: torch.autograd.grad(out, leaves, do.transpose(1, 2),
                                                retain_graph=True))
    cells.append(f"cudnn {flops / ms / 1e9:4.0f}")
    print(f"b{b} s{s} h{h}:{h_kv} d{d} causal={causal} backward TFLOP/s: " + " | ".join(cells),
          flush=True)
PY
    ;;
  bwd_schedules)  # the sm_90 backward's schedules (STATS_TMA, OVERLAP) against cuDNN's
    TAIL=12 run bwd_schedules.log python3 benchmarks/attention_bwd_schedules.py --workers 15 ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench train sweep bwd_sweep bwd_schedules)" ;;
esac; done
