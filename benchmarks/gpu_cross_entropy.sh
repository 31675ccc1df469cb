#!/usr/bin/env bash
# One GPU session for the cross-entropy family: unpack the bundle, prebuild the kernels the GPU
# tests and the spec workloads use (parallel processes), the GPU tests of the kernels, the ops
# and the harness, then the benchmarks: tileops bench of the spec workloads (against torch
# eager, a fresh torch.compile per workload and Liger-Kernel) and benchmarks/cross_entropy.py,
# forward + backward and peak memory of the loss and the fused linear loss at the bars (the
# fused loss's GPU tests first run each case once in parallel processes, building its
# blocks' GEMM and cross-entropy programs at their full sizes). Logs
# and results go to $OUT (or ./gpu-out). STAGES picks stages (default: prebuild tests bench;
# also: sweep, the gradient programs' plans and the cluster programs at the bar's shape;
# cluster, the cluster program's variants against float64, then the sweep, each under a time
# limit: a variant whose exchange of triples stalled would hang its kernel).
# About 10 minutes on one H200.
STAGES=${STAGES:-prebuild tests bench}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=3 run prebuild_tests.log python3 tests/kernels/test_cross_entropy_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_ops.log python3 benchmarks/prebuild_ops.py --family cross_entropy --workers 15
    TAIL=8 run prebuild_flce.log python3 tests/ops/test_flce.py --prebuild --workers 6 ;;
  tests)
    TAIL=20 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_cross_entropy_cuda.py -q -p no:cacheprovider
    TAIL=20 run flce_cuda.log python3 -m pytest -m cuda tests/ops/test_flce.py -q -p no:cacheprovider
    TAIL=20 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k CrossEntropy -q -p no:cacheprovider --maxfail=20 ;;
  bench)
    TAIL=40 run bench_ce.log python3 -m tileops.ops.cli bench --name cross_entropy_fwd --out "$OUT" --no-plot CrossEntropyFwdOp
    TAIL=20 run bench_flce.log python3 -m tileops.ops.cli bench --name cross_entropy_flce --out "$OUT" --no-plot FusedLinearCrossEntropyFwdOp
    TAIL=40 run train_ce.log python3 benchmarks/cross_entropy.py --out "$OUT" ;;
  sweep)  # the kept program's launch plans, the cluster programs and the training step with
    # each, at the bar's shape (8192 x 128256 bf16), ms and the HBM rate of one read + one write
    TAIL=20 run sweep.log python3 tests/kernels/test_cross_entropy_cuda.py --sweep --workers 15 ;;
  cluster)
    TAIL=12 run cluster_cuda.log timeout 300 python3 -m pytest -m cuda \
      tests/kernels/test_cross_entropy_cuda.py -k "cluster_program" -q -p no:cacheprovider -x
    TAIL=30 run sweep.log timeout 420 python3 tests/kernels/test_cross_entropy_cuda.py --sweep \
      --workers 15 ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench sweep cluster)" ;;
esac; done
