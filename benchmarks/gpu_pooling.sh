#!/usr/bin/env bash
# One GPU session for the pooling family: unpack the bundle, prebuild the kernels the GPU tests
# and the spec workloads use (parallel processes; the programs compile every size in, so the
# workloads are prebuilt at full size), the GPU tests of the kernels and the harness, then the
# side-by-side benchmarks of the bars (tileops bench against torch eager and a fresh
# torch.compile per workload; Liger-Kernel has no pooling) and the channels-last inputs, which
# no spec workload can state (a timing of the op against torch eager and torch.compile on the
# same tensors, the outputs channels last as torch's, CUDA graphs, bytes read once and written
# once). Logs and results go to $OUT
# (or ./gpu-out). STAGES picks stages (default: prebuild tests bench channels_last; also:
# sweep, the forward program's launch plans on the bars' shapes, for choosing pool_plan);
# BENCHES the bench stage's groups (default: max2d pool1d3d adaptive grads).
# The bars (H200, bf16): max and average pooling at least torch.compile on every workload
# (2.40 TB/s on 32 x 256 x 112 x 112, k3 s2; eager 0.62) and at least 3.5 TB/s on the large
# NCHW and channels-last inputs.
STAGES=${STAGES:-prebuild tests bench channels_last}
BENCHES=${BENCHES:-max2d pool1d3d adaptive grads}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
run() {  # run LOG CMD...: the command's output filtered into $OUT/LOG, its tail and exit code
  local log=$1; shift
  "$@" 2>&1 | grep -v "TileLang" | tee "$OUT/$log" | tail -n "${TAIL:-30}"
  echo "== $log: exit ${PIPESTATUS[0]}"
}
bench() {  # bench NAME OP... [-w LABEL ...]: one table of the bars, named pooling_NAME
  local name=$1; shift
  TAIL=40 run "bench_$name.log" python3 -m tileops.ops.cli bench --name "pooling_$name" \
    --out "$OUT" --no-plot "$@"
}
for stage in $STAGES; do case $stage in
  prebuild)
    TAIL=2 run prebuild_tests.log python3 tests/kernels/test_pooling_cuda.py --prebuild --workers 15
    TAIL=3 run prebuild_ops.log python3 benchmarks/prebuild_ops.py --family pooling --workers 15 --max-elements 0 ;;
  tests)
    TAIL=25 run kernel_cuda.log python3 -m pytest -m cuda tests/kernels/test_pooling_cuda.py -q -p no:cacheprovider
    TAIL=25 run ops_cuda.log python3 -m pytest -m cuda tests/ops/harness/test_cuda.py -k "Pool" -q -p no:cacheprovider --maxfail=40 ;;
  bench)
    for group in $BENCHES; do case $group in
      max2d) bench max2d MaxPool2dFwdOp AvgPool2dFwdOp ;;
      pool1d3d) bench pool1d3d MaxPool1dFwdOp AvgPool1dFwdOp MaxPool3dFwdOp AvgPool3dFwdOp ;;
      adaptive) bench adaptive AdaptiveAvgPool2dFwdOp AdaptiveMaxPool2dFwdOp ;;
      grads) bench grads MaxPool2dBwdOp AvgPool2dBwdOp MaxPool1dBwdOp AvgPool3dBwdOp ;;
      *) echo "unknown bench group $group (groups: max2d pool1d3d adaptive grads)" ;;
    esac; done ;;
  channels_last)
    TAIL=20 run channels_last.log python3 - <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
import torch
import torch.nn.functional as F
import tileops.ops as O
from _common import graph_events

CASES = [  # (label, op class, params, shape): the bar's shape and the large non-overlapping one
    ("max k3s2", O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2}, (32, 256, 112, 112)),
    ("avg k3s2", O.AvgPool2dFwdOp, {"kernel_size": 3, "stride": 2}, (32, 256, 112, 112)),
    ("max k2s2", O.MaxPool2dFwdOp, {"kernel_size": 2, "stride": 2}, (64, 256, 112, 112)),
    ("avg k2s2", O.AvgPool2dFwdOp, {"kernel_size": 2, "stride": 2}, (64, 256, 112, 112)),
]
print(f"{'case':10} {'layout':14} {'tileops':>16} {'eager':>16} {'compile':>16}")
for label, cls, params, shape in CASES:
    fn = F.max_pool2d if cls is O.MaxPool2dFwdOp else F.avg_pool2d
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(memory_format=fmt)
        op = cls(**params)
        y = op(x)
        y = y[0] if isinstance(y, tuple) else y
        want = fn(x, **params)
        assert torch.equal(y.float().nan_to_num(), want.float().nan_to_num()) or \
            torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2), label
        gb = (x.numel() + y.numel()) * 2 / 1e9
        compiled = torch.compile(lambda t: fn(t, **params))
        compiled(x)
        cells = []
        for f in (lambda: op(x), lambda: fn(x, **params), lambda: compiled(x)):
            ms = graph_events(f, 20)
            cells.append(f"{ms * 1e3:8.1f}us {gb / ms:5.2f}TB/s")
        layout = str(fmt).split(".")[-1]
        print(f"{label:10} {layout:14} " + " ".join(f"{c:>16}" for c in cells))
EOF
    ;;
  sweep)
    TAIL=40 run sweep.log python3 - <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
import torch
import torch.nn.functional as F
import tileops.ops as O
from tileops.kernels import pooling as K
from _common import graph_events

PLANS = [(128, 1), (256, 1), (256, 2), (256, 4), (512, 4), (256, 8), (128, 8),
         # a plane a row of the grid (the planes layout; channels last runs the flat plan)
         (128, 4, True), (256, 2, True), (256, 4, True), (512, 2, True)]
CASES = [  # (label, op class, params, shape, channels_last)
    ("max k3s2", O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2}, (32, 256, 112, 112), False),
    ("max k3s2 cl", O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2}, (32, 256, 112, 112), True),
    ("avg k3s2", O.AvgPool2dFwdOp, {"kernel_size": 3, "stride": 2}, (32, 256, 112, 112), False),
    ("max k2s2", O.MaxPool2dFwdOp, {"kernel_size": 2, "stride": 2}, (64, 256, 112, 112), False),
    ("max k2s2 cl", O.MaxPool2dFwdOp, {"kernel_size": 2, "stride": 2}, (64, 256, 112, 112), True),
    ("avg k2s2 cl", O.AvgPool2dFwdOp, {"kernel_size": 2, "stride": 2}, (64, 256, 112, 112), True),
]
for label, cls, params, shape, cl in CASES:
    fn = F.max_pool2d if cls is O.MaxPool2dFwdOp else F.avg_pool2d
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if cl:
        x = x.to(memory_format=torch.channels_last)
    want = fn(x, **params)  # channels last for a channels-last x, as the op's
    layout = K.PoolLayout.CHANNELS_LAST if cl else K.PoolLayout.PLANES
    spec = cls(**params)._spec(None, x.dtype, shape, tuple(want.shape), layout, False)
    y = torch.empty_like(want)
    flat_x, flat_y = ((t.permute(0, 2, 3, 1) if cl else t).reshape(-1) for t in (x, y))
    gb = (x.numel() + y.numel()) * 2 / 1e9
    cells = [f"default {K.pool_plan(spec)}"]
    for plan in PLANS:
        prog = K.build_pool_kernel(spec, plan=plan)
        prog(flat_x, flat_y)
        ok = torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2)
        ms = graph_events(lambda: prog(flat_x, flat_y), 20)
        cells.append(f"{plan[0]}x{plan[1]}{'y' if plan[2:] else ''} {gb / ms:4.2f}"
                     f"{'' if ok else ' WRONG'}")
    print(f"{label:12} TB/s: " + " | ".join(cells))
EOF
    ;;
  *) echo "unknown stage $stage (stages: prebuild tests bench channels_last sweep)" ;;
esac; done
