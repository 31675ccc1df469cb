#!/usr/bin/env bash
# One GPU session for the softmax family: unpack the bundle, prebuild the kernels the GPU tests
# and the spec workloads use (parallel processes), the GPU tests of the kernels and of the ops
# through the harness, then the side-by-side benchmarks of the bars (tileops bench against
# torch eager, a fresh torch.compile per workload and Liger-Kernel's softmax where it covers
# the call) and of the gradients and the odd sizes. Logs and results go to $OUT (or
# ./gpu-out). STAGES picks stages (default: prebuild tests bench; also: sweep, which times the
# launch-plan choices not yet measured: the register softmax keeping its exponentials or not,
# holding less a thread or capping its registers for two CTAs an SM; the looped kernel's held
# head and its chunks staged in shared memory, copied early or in the walk). The GPU tests
# check each swept plan against float64 (test_other_plans_match_float64). About 10 minutes on
# one H200, the sweep 3 more.
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
  sweep) TAIL=40 run sweep.log python3 - <<'PY'
# Each plan choice on the bars' shapes in bf16, through the kernels' builders: TB/s counted as
# the bytes read and written once, timed by CUDA events over 50 calls after 5 warm-up calls.
import torch
from tileops.kernels import softmax as S

L = S.Layout


def tbps(prog, args, nbytes):
    for _ in range(5):
        prog(*args)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50):
        prog(*args)
    b.record()
    torch.cuda.synchronize()
    return nbytes / (a.elapsed_time(b) / 50 * 1e-3) / 1e12


def row(what, layout, m, n, plan):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    prog = S.build_fwd(layout, "softmax", n, 1, "bfloat16", plan)
    print(f"{what:>34} {m:>6} x {n:<7} plan {plan}: {tbps(prog, (x, y), 4 * m * n):.2f} TB/s",
          flush=True)


for m, n in ((32768, 8192), (16384, 1024), (4096, 32000)):
    base = S.register_plan(n, "bfloat16")
    for keep in (False, True):
        row("register, keep exp" if keep else "register, recompute exp", L.REGISTER, m, n,
            (*base, keep))
# more rows in flight: a row's threads holding less (more CTAs an SM), or registers capped
# (__launch_bounds__' second argument) so that two 512-thread CTAs of 32000 columns fit an SM
for what, m, n, plan in (("register, 256 threads x 4, keep", 32768, 8192, (256, 1, 8, 4, True)),
                         ("register, 32 lanes x 4, keep", 16384, 1024, (32, 8, 8, 4, True)),
                         ("register, 64 lanes x 2, keep", 16384, 1024, (64, 4, 8, 2, True)),
                         ("register, 2 CTAs an SM", 4096, 32000, (512, 1, 8, 8, False, 2)),
                         ("register, 2 CTAs an SM, keep", 4096, 32000, (512, 1, 8, 8, True, 2)),
                         ("register, 1024 threads x 4", 4096, 32000, (1024, 1, 8, 4, False))):
    row(what, L.REGISTER, m, n, plan)
threads, vec, per, _ = S.looped_plan(128256, "bfloat16")
for hold in (1, 2, 4):
    row("looped, head held", L.LOOPED, 4096, 128256, (threads, vec, per, hold))
# the row kept on chip: chunks past the head staged in shared memory for the second pass
staged = S.looped_staged_plan(S.SoftmaxKind.SOFTMAX, 128256, "bfloat16")
row("looped, staged", L.LOOPED, 4096, 128256, staged)
row("looped, staged, early copies", L.LOOPED, 4096, 128256, (*staged, True))
row("looped, 2 of 6 staged", L.LOOPED, 4096, 128256, (*staged[:4], 2))
row("looped, 4 x 4 staged 3", L.LOOPED, 4096, 128256, (threads, vec, per, 4, 3))
row("looped, 4 x 4 staged 3, early", L.LOOPED, 4096, 128256, (threads, vec, per, 4, 3, True))
# 32000 columns whole on chip at fewer threads, registers capped for 2 or 3 CTAs an SM
row("looped 512, staged 2, 2 CTAs an SM", L.LOOPED, 4096, 32000, (512, 8, 2, 4, 2, True, 2))
row("looped 256, staged 3, 3 CTAs an SM", L.LOOPED, 4096, 32000, (256, 8, 4, 4, 3, True, 3))
PY
    ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench sweep)" ;;
esac; done
