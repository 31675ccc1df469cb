"""The pooling kernels on a GPU, through the public ops, with fresh random inputs: max pooling
(values and indices) identical to torch's on the device, ties and NaNs included; average and
adaptive pooling against the float64 reference; channels-last inputs read in place; odd sizes,
per-axis windows, dilation, ceil_mode, unbatched inputs; and the gradients (max pooling's with
the forward's indices and without) against torch's autograd in float64.

``python3 tests/kernels/test_pooling_cuda.py --prebuild --workers 15`` compiles exactly the
programs these tests use, in spawned processes, so the tests load them from the disk cache.

Tolerance: average pooling sums in float32 and rounds once to the output dtype, so it is held
to two units in the last place of that dtype relative to the reference (float32: 1e-5); max
pooling selects an input element, so it is exact.
"""

import math
import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda
if __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import tileops.ops as O  # noqa: E402
from tileops.kernels import pooling as K  # noqa: E402

TOL = {torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11, torch.float32: 1e-5}
BF, HF, FP = torch.bfloat16, torch.float16, torch.float32
CL = {4: torch.channels_last, 5: torch.channels_last_3d}

#: (id, op class, params, input shape, dtype, channels_last)
FORWARD = [
    ("max2d-bar", O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2}, (32, 256, 112, 112), BF,
     False),
    ("max2d-bar-cl", O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2}, (32, 256, 112, 112),
     BF, True),
    ("max2d-stem-indices", O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1,
                                              "return_indices": True}, (4, 64, 112, 112), BF,
     False),
    ("max2d-odd-ceil-dilated", O.MaxPool2dFwdOp,
     {"kernel_size": (3, 2), "stride": (2, 1), "padding": 1, "dilation": (2, 1),
      "ceil_mode": True, "return_indices": True}, (3, 5, 37, 41), FP, False),
    ("max2d-unbatched-fp16", O.MaxPool2dFwdOp, {"kernel_size": 2, "return_indices": True},
     (16, 33, 33), HF, False),
    ("max1d-odd", O.MaxPool1dFwdOp, {"kernel_size": 4, "stride": 3, "padding": 2,
                                     "ceil_mode": True, "return_indices": True},
     (8, 64, 4097), BF, False),
    ("max3d-clip-cl", O.MaxPool3dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1,
                                         "return_indices": True}, (2, 64, 16, 56, 56), BF,
     True),
    ("avg2d-bar", O.AvgPool2dFwdOp, {"kernel_size": 3, "stride": 2}, (32, 256, 112, 112), BF,
     False),
    ("avg2d-large-cl", O.AvgPool2dFwdOp, {"kernel_size": 2}, (64, 256, 112, 112), BF, True),
    ("avg2d-exclude-pad", O.AvgPool2dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1,
                                             "ceil_mode": True, "count_include_pad": False},
     (3, 5, 37, 41), BF, False),
    ("avg2d-divisor", O.AvgPool2dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1,
                                         "divisor_override": 4}, (4, 32, 64, 64), FP, False),
    ("avg1d-exclude-pad", O.AvgPool1dFwdOp, {"kernel_size": 4, "stride": 3, "padding": 2,
                                             "ceil_mode": True, "count_include_pad": False},
     (8, 64, 1001), HF, False),
    ("avg3d-odd-cl", O.AvgPool3dFwdOp, {"kernel_size": (2, 3, 3), "stride": (1, 2, 2),
                                        "ceil_mode": True}, (2, 3, 7, 9, 11), BF, True),
    ("adaptive-avg-head", O.AdaptiveAvgPool2dFwdOp, {"output_size": 1}, (32, 2048, 7, 7), BF,
     False),
    ("adaptive-avg-odd-cl", O.AdaptiveAvgPool2dFwdOp, {"output_size": (5, 7)},
     (3, 5, 37, 41), FP, True),
    ("adaptive-max-odd", O.AdaptiveMaxPool2dFwdOp, {"output_size": (5, 7),
                                                    "return_indices": True},
     (3, 5, 37, 41), BF, False),
    ("adaptive-max-looped", O.AdaptiveMaxPool2dFwdOp, {"output_size": (4, 5),
                                                       "return_indices": True},
     (3, 5, 37, 41), BF, True),  # 10 x 9 taps: the window loops (not unrolled)
    ("adaptive-max-upsample", O.AdaptiveMaxPool2dFwdOp, {"output_size": 8,
                                                         "return_indices": True},
     (2, 4, 5, 5), FP, False),
]

#: (id, forward op class, params, input shape, dtype, return_indices)
GRADIENTS = [
    ("max2d-stem", O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1},
     (4, 64, 112, 112), BF, False),
    ("max2d-stem-indices", O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1},
     (4, 64, 112, 112), BF, True),
    ("max2d-odd-dilated", O.MaxPool2dFwdOp, {"kernel_size": (3, 2), "stride": (2, 1),
                                             "padding": 1, "dilation": (2, 1),
                                             "ceil_mode": True}, (3, 5, 37, 41), FP, True),
    ("max1d-odd", O.MaxPool1dFwdOp, {"kernel_size": 4, "stride": 3, "padding": 2,
                                     "ceil_mode": True}, (8, 64, 4097), BF, False),
    ("max3d-odd", O.MaxPool3dFwdOp, {"kernel_size": (2, 3, 3), "stride": (1, 2, 2),
                                     "ceil_mode": True}, (2, 3, 7, 9, 11), FP, False),
    ("avg2d-exclude-pad", O.AvgPool2dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1,
                                             "ceil_mode": True, "count_include_pad": False},
     (3, 5, 37, 41), BF, False),
    ("avg2d-divisor", O.AvgPool2dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1,
                                         "divisor_override": 4}, (4, 32, 64, 64), FP, False),
    ("avg1d", O.AvgPool1dFwdOp, {"kernel_size": 3, "stride": 2}, (8, 256, 4096), BF, False),
    ("avg3d", O.AvgPool3dFwdOp, {"kernel_size": 3, "stride": 2, "padding": 1},
     (2, 16, 8, 28, 28), HF, False),
    ("adaptive-avg-head", O.AdaptiveAvgPool2dFwdOp, {"output_size": 1}, (32, 2048, 7, 7), BF,
     False),
    ("adaptive-avg-upsample", O.AdaptiveAvgPool2dFwdOp, {"output_size": 8}, (2, 4, 5, 5), FP,
     False),
    ("adaptive-max-odd", O.AdaptiveMaxPool2dFwdOp, {"output_size": (5, 7)}, (3, 5, 37, 41),
     BF, False),
    ("adaptive-max-odd-indices", O.AdaptiveMaxPool2dFwdOp, {"output_size": (5, 7)},
     (3, 5, 37, 41), FP, True),
]

_TORCH = {O.MaxPool1dFwdOp: F.max_pool1d, O.MaxPool2dFwdOp: F.max_pool2d,
          O.MaxPool3dFwdOp: F.max_pool3d, O.AvgPool1dFwdOp: F.avg_pool1d,
          O.AvgPool2dFwdOp: F.avg_pool2d, O.AvgPool3dFwdOp: F.avg_pool3d,
          O.AdaptiveAvgPool2dFwdOp: F.adaptive_avg_pool2d,
          O.AdaptiveMaxPool2dFwdOp: F.adaptive_max_pool2d}


def _inputs(shape, dtype, channels_last, ties: bool) -> torch.Tensor:
    """Fresh random values on the GPU: normal, or small integers (many ties in a window) with
    about one NaN in 64; channels last where asked."""
    if ties:
        x = torch.randint(-4, 5, shape, device="cuda").to(dtype)
        x[torch.rand(shape, device="cuda") < 1 / 64] = math.nan
    else:
        x = torch.randn(shape, device="cuda", dtype=dtype)
    return x.to(memory_format=CL[len(shape)]) if channels_last else x


def _is_max(cls) -> bool:
    return cls in (O.MaxPool1dFwdOp, O.MaxPool2dFwdOp, O.MaxPool3dFwdOp,
                   O.AdaptiveMaxPool2dFwdOp)


@pytest.mark.parametrize("case", FORWARD, ids=[c[0] for c in FORWARD])
def test_forward(case):
    _, cls, params, shape, dtype, channels_last = case
    op = cls(**params)
    if _is_max(cls):
        for ties in (False, True):
            x = _inputs(shape, dtype, channels_last, ties)
            # the output alone without return_indices, as torch's
            y, idx = op(x) if params.get("return_indices") else (op(x), None)
            want = _TORCH[cls](x, **{**params, "return_indices": True})
            torch.testing.assert_close(y, want[0], rtol=0, atol=0, equal_nan=True)
            if params.get("return_indices"):
                assert torch.equal(idx, want[1])
            else:
                assert idx is None
    else:
        x = _inputs(shape, dtype, channels_last, False)
        y = op(x)
        (ref,) = op.fp64_reference(x)
        torch.testing.assert_close(y.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])
    assert op.serving_target == "tileops"


@pytest.mark.parametrize("case", GRADIENTS, ids=[c[0] for c in GRADIENTS])
def test_gradient(case):
    _, cls, params, shape, dtype, indices = case
    if _is_max(cls):
        params = {**params, "return_indices": indices}
    op = cls(**params)
    x = _inputs(shape, dtype, False, _is_max(cls)).nan_to_num_(0.0).requires_grad_()
    out = op(x)
    y = out[0] if _is_max(cls) and indices else out  # (output, indices) with return_indices
    dy = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    torch_params = {k: v for k, v in params.items() if k != "return_indices"}
    (want,) = torch.autograd.grad(_TORCH[cls](x64, **torch_params), x64, dy.double())
    # a float32 sum over the windows holding an element, rounded once
    torch.testing.assert_close(got.double(), want, rtol=2 * TOL[dtype], atol=2 * TOL[dtype])


def test_channels_last_reads_in_place():
    """The same values in either memory format give the same outputs, in the input's format
    as torch's, and the channels-last input is not copied (the kernel reads its strides)."""
    x = torch.randn(4, 64, 56, 56, device="cuda", dtype=BF)
    op = O.MaxPool2dFwdOp(kernel_size=3, stride=2, padding=1, return_indices=True)
    y, idx = op(x)
    cl = x.to(memory_format=torch.channels_last)
    y2, idx2 = op(cl)
    assert torch.equal(y, y2) and torch.equal(idx, idx2)
    want, want_idx = F.max_pool2d(cl, 3, 2, 1, return_indices=True)  # torch's, channels last
    assert y2.stride() == want.stride() and idx2.stride() == want_idx.stride()
    specs = [e.spec for e in op.built_entries[K.PoolFwdInterface].values()]
    assert {s.layout for s in specs} == {K.PoolLayout.PLANES, K.PoolLayout.CHANNELS_LAST}


# --- the prebuild ----------------------------------------------------------------------------


def _meta_out(cls, params, x):
    out = _TORCH[cls](x, **{k: v for k, v in params.items() if k != "return_indices"})
    return out[0] if isinstance(out, tuple) else out


def program_keys():
    """``(spec, backward)`` of every program the tests above build (meta tensors: no GPU)."""
    keys = {}
    for _, cls, params, shape, dtype, channels_last in FORWARD:
        op = cls(**params)
        x = torch.empty(shape, dtype=dtype, device="meta")
        y = _meta_out(cls, params, x)
        cl = channels_last and op.keeps_channels_last  # else the op reads a contiguous copy
        layout = K.PoolLayout.CHANNELS_LAST if cl else K.PoolLayout.PLANES
        has_idx = bool(params.get("return_indices"))
        keys[(op._spec(None, dtype, shape, tuple(y.shape), layout, has_idx), False)] = None
    for _, cls, params, shape, dtype, indices in GRADIENTS:
        x = torch.empty(shape, dtype=dtype, device="meta")
        y = _meta_out(cls, params, x)
        fwd = cls(**({**params, "return_indices": indices} if _is_max(cls) else params))
        keys[(fwd._spec(None, dtype, shape, tuple(y.shape), K.PoolLayout.PLANES, indices),
              False)] = None
        bwd = fwd._backward_op(())
        spec = bwd._spec(None, dtype, shape, tuple(y.shape), K.PoolLayout.PLANES, indices)
        for key in K.gradient_programs(spec):
            keys[key] = None
    shape = (4, 64, 56, 56)
    op = O.MaxPool2dFwdOp(kernel_size=3, stride=2, padding=1, return_indices=True)
    for layout in K.PoolLayout:
        keys[(op._spec(None, BF, shape, (4, 64, 28, 28), layout, True), False)] = None
    return list(keys)


def _build(key):
    spec, backward = key
    K.build_pool_kernel(spec, backward=backward)


def _describe(key) -> str:
    s, backward = key
    return (f"{'bwd' if backward else 'fwd'} {s.kind.value}{' adaptive' if s.adaptive else ''} "
            f"{s.layout.value} {s.batch}x{s.channels}x{s.size_in} -> {s.size_out} {s.dtype}")


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
