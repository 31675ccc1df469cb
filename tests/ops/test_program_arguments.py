"""The arguments the ops hand their TileLang programs, checked on the CPU against what each
program declares: the in-tree path of every op family runs here with each compiled program
replaced by a checker of its prim_func's parameters (rank, static sizes, symbolic sizes bound
the same across parameters, dtype, compact strides), which is what the program's host code
refuses on a GPU. The calls are the layouts a caller may hand over beyond the specs'
workloads: a reduced axis that is not the last, several normalized axes, transposed and
sliced views, broadcasting, in-place views. The kernels' arithmetic is not run (the GPU
tests hold it to float64)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tilelang")

import tileops.kernels as K  # noqa: E402
import tileops.ops as o  # noqa: E402
from tileops.kernels import _tilelang  # noqa: E402
from tileops.runtime import Kernel  # noqa: E402
from tileops.runtime import kernel as runtime_kernel  # noqa: E402

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
           torch.float64: "float64", torch.int32: "int32", torch.int64: "int64",
           torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}


class ArgumentMismatch(AssertionError):
    pass


class CheckedProgram:
    """Stands in for a compiled program: checks a call's arguments against ``func``'s
    parameters and runs nothing."""

    def __init__(self, func) -> None:
        self.params = [func.buffer_map.get(p) for p in func.params]

    def __call__(self, *args) -> None:
        if len(args) != len(self.params):
            raise ArgumentMismatch(f"{len(args)} arguments for {len(self.params)} parameters")
        sizes: dict[str, int] = {}
        for buf, a in zip(self.params, args, strict=True):
            if buf is None:  # a scalar parameter
                continue
            if not isinstance(a, torch.Tensor):
                raise ArgumentMismatch(f"{buf.name}: a {type(a).__name__}, not a tensor")
            declared = list(buf.shape)
            if a.dim() != len(declared):
                raise ArgumentMismatch(f"{buf.name}: rank {a.dim()} {tuple(a.shape)}, declared "
                                       f"{declared}")
            if _DTYPES.get(a.dtype, str(a.dtype)) != str(buf.dtype):
                raise ArgumentMismatch(f"{buf.name}: {a.dtype}, declared {buf.dtype}")
            for i, (d, size) in enumerate(zip(declared, a.shape, strict=True)):
                if hasattr(d, "value"):  # a static size
                    if int(d.value) != size:
                        raise ArgumentMismatch(f"{buf.name}.shape[{i}] is {size} "
                                               f"{tuple(a.shape)}, declared {int(d.value)}")
                elif hasattr(d, "name") and sizes.setdefault(d.name, size) != size:
                    raise ArgumentMismatch(f"{buf.name}.shape[{i}] is {size}, but {d.name} is "
                                           f"{sizes[d.name]} by an earlier parameter")
            if not buf.strides and a.numel() > 1 and not a.is_contiguous():
                raise ArgumentMismatch(f"{buf.name}: strides {a.stride()} of {tuple(a.shape)} "
                                       f"are not compact")


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _clear_builder_caches() -> None:
    for info in pkgutil.iter_modules(K.__path__):
        mod = importlib.import_module(f"tileops.kernels.{info.name}")
        for value in vars(mod).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


@pytest.fixture
def checked(monkeypatch):
    """The in-tree kernels serve the CPU as an sm_90 device would be served, their programs
    the checker; every builder cache is cleared after, so no checker outlives the test."""
    def compile_program(prog, target=None):
        return CheckedProgram(prog)

    monkeypatch.setattr(_tilelang, "compile_program", compile_program)
    hopper = lambda device: (9, 0)  # noqa: E731
    monkeypatch.setattr(runtime_kernel, "device_arch", hopper)
    for info in pkgutil.iter_modules(K.__path__):
        mod = importlib.import_module(f"tileops.kernels.{info.name}")
        if hasattr(mod, "compile_program"):
            monkeypatch.setattr(mod, "compile_program", compile_program)
        if hasattr(mod, "device_arch"):
            monkeypatch.setattr(mod, "device_arch", hopper)
    for cls in set(_subclasses(Kernel)):
        if "cuda" in cls.__dict__.get("devices", ()):
            monkeypatch.setattr(cls, "devices", (*cls.devices, "cpu"))
    _clear_builder_caches()
    yield
    _clear_builder_caches()


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(shape).to(dtype)


def _labels(n):
    return torch.randint(0, 10, (n,))


CALLS = {
    # softmax along any axis, of views
    "softmax-1d": lambda: o.SoftmaxFwdOp(dim=0)(_t(7)),
    "softmax-dim0": lambda: o.SoftmaxFwdOp(dim=0)(_t(3, 5)),
    "softmax-middle": lambda: o.SoftmaxFwdOp(dim=1)(_t(2, 3, 8)),
    "softmax-rank4": lambda: o.SoftmaxFwdOp(dim=2)(_t(2, 3, 4, 8)),
    "softmax-transposed": lambda: o.SoftmaxFwdOp(dim=-1)(_t(8, 6).T),
    "softmax-sliced": lambda: o.SoftmaxFwdOp(dim=-1)(_t(4, 16)[:, 3:11]),
    "log-softmax-middle": lambda: o.LogSoftmaxFwdOp(dim=1)(_t(2, 3, 8)),
    "logsumexp-two-axes": lambda: o.LogSumExpFwdOp(dim=(0, 2))(_t(2, 3, 8)),
    # row norms: one axis or several, x of any rank, views
    "rms-1d": lambda: o.RMSNormFwdOp(normalized_shape=(8,))(_t(8), _t(8)),
    "rms-two-axes-rank2": lambda: o.RMSNormFwdOp(normalized_shape=(3, 8))(_t(3, 8)),
    "rms-two-axes-rank2-weight": lambda: o.RMSNormFwdOp(normalized_shape=(3, 8))(_t(3, 8),
                                                                                 _t(3, 8)),
    "rms-two-axes-rank3": lambda: o.RMSNormFwdOp(normalized_shape=(3, 8))(_t(2, 3, 8)),
    "rms-rank3": lambda: o.RMSNormFwdOp(normalized_shape=(8,))(_t(2, 1, 8), _t(8)),
    "rms-transposed": lambda: o.RMSNormFwdOp(normalized_shape=(8,))(_t(8, 4).T, _t(8)),
    "layer-two-axes-rank2": lambda: o.LayerNormFwdOp(normalized_shape=(3, 8))(
        _t(3, 8), _t(3, 8), _t(3, 8)),
    "fused-add-rank3": lambda: o.FusedAddRMSNormFwdOp()(_t(2, 3, 8), _t(2, 3, 8), _t(8)),
    # top-k and scans along any axis
    "topk-1d": lambda: o.TopkFwdOp(k=5, dim=0)(_t(50)),
    "topk-dim0": lambda: o.TopkFwdOp(k=3, dim=0)(_t(4, 50)),
    "topk-all": lambda: o.TopkFwdOp(k=64)(_t(3, 64)),
    "cumsum-dim0": lambda: o.CumsumFwdOp(dim=0)(_t(4, 50)),
    "cumsum-middle": lambda: o.CumsumFwdOp(dim=1)(_t(3, 4, 50)),
    "cumsum-transposed": lambda: o.CumsumFwdOp(dim=-1)(_t(9, 6).T),
    # reductions over any axes
    "sum-dim0": lambda: o.SumFwdOp(dim=0)(_t(3, 5)),
    "sum-two-axes": lambda: o.SumFwdOp(dim=(0, 2))(_t(2, 3, 8)),
    "sum-all": lambda: o.SumFwdOp(dim=None)(_t(2, 3, 8)),
    "amax-transposed": lambda: o.AmaxFwdOp(dim=-1)(_t(8, 6).T),
    "mean-middle": lambda: o.MeanFwdOp(dim=1)(_t(2, 3, 8)),
    "argmax-dim0": lambda: o.ArgmaxFwdOp(dim=0)(_t(3, 5)),
    # cross-entropy: reductions, smoothing, a transposed view
    "ce": lambda: o.CrossEntropyFwdOp()(_t(4, 10), _labels(4)),
    "ce-none": lambda: o.CrossEntropyFwdOp(reduction="none")(_t(4, 10), _labels(4)),
    "ce-smoothing": lambda: o.CrossEntropyFwdOp(label_smoothing=0.1)(_t(4, 10), _labels(4)),
    "ce-transposed": lambda: o.CrossEntropyFwdOp()(_t(10, 4).T, _labels(4)),
    # GEMM of views
    "gemm": lambda: o.GemmFwdOp()(_t(5, 7), _t(7, 3)),
    "gemm-transposed-views": lambda: o.GemmFwdOp()(_t(7, 5).T, _t(3, 7).T),
    "gemm-trans-b": lambda: o.GemmFwdOp(trans_b=True)(_t(5, 8), _t(3, 8)),
    # elementwise: broadcasting, 0-dim, views, in place, gated halves
    "add-broadcast": lambda: o.AddFwdOp()(_t(3, 1, 8), _t(5, 1)),
    "add-0dim": lambda: o.AddFwdOp()(_t(3, 8), _t()),
    "mul-transposed": lambda: o.MulFwdOp()(_t(8, 3).T, _t(3, 8)),
    # numbers rounded to the tensor's dtype (pow's, a rounding division's numerator)
    "pow-number": lambda: o.PowFwdOp()(_t(3, 8, dtype=torch.float16), 1e-8),
    "div-floor-number": lambda: o.DivFwdOp(rounding_mode="floor")(70000.0, _t(3, 8)),
    "relu-inplace-strided": lambda: o.ReluFwdOp(inplace=True)(_t(4, 8)[:, ::2]),
    "silu-and-mul-1d": lambda: o.SiluAndMulFwdOp()(_t(16)),
    "silu-and-mul-rank3": lambda: o.SiluAndMulFwdOp()(_t(2, 1, 16)),
    "where-broadcast": lambda: o.WhereFwdOp()(torch.rand(3, 8) > 0.5, _t(3, 8), _t(8)),
    "clamp-tensor-bounds": lambda: o.ClampFwdOp()(_t(3, 8), _t(8), _t(3, 1)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_the_programs_get_the_arguments_they_declare(checked, name):
    CALLS[name]()


def test_the_checker_refuses_what_a_program_would(checked):
    """The checker is the programs' host check: an x of rank 2 normalized over both its axes
    handed over as it is (two rows of 8, where the program declares rows of 24) is refused."""
    op = o.RMSNormFwdOp(normalized_shape=(3, 8))
    op(_t(2, 3, 8))  # builds the program for rows of 24
    entry = next(iter(op._entries_by_call.values()))
    with pytest.raises(ArgumentMismatch, match=r"shape\[1\] is 8 \(3, 8\), declared 24"):
        entry(_t(3, 8), None, None, None, _t(3, 8), None)


def test_a_call_no_kernel_serves_is_refused_by_the_op_naming_the_reference_target(checked):
    from tileops.runtime import NoKernelError

    q = k = _t(1, 7, 2, 64)
    with pytest.raises(NoKernelError) as info:
        o.MultiHeadAttentionFwdOp()(q, k, _t(1, 7, 2, 128))  # D 64, D_v 128: no kernel's pair
    msg = str(info.value)
    assert msg.startswith("MultiHeadAttentionFwdOp: attention_fwd: no implementation serves")
    assert "D = 64, D_v = 128 are none of the served D/D_v pairs" in msg
    assert msg.endswith("MultiHeadAttentionFwdOp runs it on the reference target: construct the "
                        "op with target='reference'")
    ref = o.MultiHeadAttentionFwdOp(target="reference")(q, k, _t(1, 7, 2, 128))
    assert ref.shape == (1, 7, 2, 128)
