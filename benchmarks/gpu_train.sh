#!/usr/bin/env bash
# One GPU session for training: unpack the bundle, build our forward and backward kernels for
# every shape in parallel processes, then forward + backward of the row norms against torch
# eager, torch.compile and Liger-Kernel (train_norm.py), the GEMM backward against cuBLAS
# (train_gemm.py) and the host cost of autograd on a cached call (host_cost_grad.py). Logs and
# results go to $OUT (or ./gpu-out); every script writes its results after each shape, so a
# stage cut short leaves the shapes it finished.
#
# STAGES picks stages (default: prebuild norm gemm host). NORM_ARGS, GEMM_ARGS and HOST_ARGS
# are passed to the scripts (e.g. NORM_ARGS="--ops RMSNormFwdOp -w 'm32768-*'" to split the
# norm stage across calls); BEFORE names a checkout (its packages/*/src) whose grad-off host
# cost the host stage compares with (host_cost_grad.py --before), e.g. the tree before
# autograd unpacked under .gpu/. About 30-45 minutes in all on one H200, most of it the
# prebuild and torch.compile's fresh compile per norm shape.
STAGES=${STAGES:-prebuild norm gemm host}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, the stage's time after
  local log=$1 t=$SECONDS; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-60}"
  echo "== $log: exit ${PIPESTATUS[0]}, $((SECONDS - t)) s"
}
for stage in $STAGES; do case $stage in
  prebuild) TAIL=3 run prebuild_norm.log python3 benchmarks/train_norm.py --prebuild --workers 14
            TAIL=3 run prebuild_gemm.log python3 benchmarks/train_gemm.py --prebuild --workers 14 ;;
  norm) eval "run train_norm.log python3 benchmarks/train_norm.py --out \"\$OUT\" ${NORM_ARGS:-}" ;;
  gemm) eval "run train_gemm.log python3 benchmarks/train_gemm.py --out \"\$OUT\" ${GEMM_ARGS:-}" ;;
  host) eval "run host_cost_grad.log python3 benchmarks/host_cost_grad.py --out \"\$OUT\"" \
             "${BEFORE:+--before \"\$BEFORE\"} ${HOST_ARGS:-}" ;;
  *) echo "unknown stage $stage (stages: prebuild norm gemm host)" ;;
esac; done
