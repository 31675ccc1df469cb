"""The elementwise kernels on a GPU against torch in float64: every scalar function of
SCALAR_FNS, called through the slot as the op calls it (a spec from the tensors, the
implementation the slot selects, its entry).

What is compiled is bounded (about 150 programs, :func:`runs`): every function once in bfloat16
on the contiguous flat layout; the layouts (odd, one row, empty, row/column/0-dim broadcast,
strided rows, the general strided path) with silu, add and where; int32 on every integral
function, int64 and bool on a few; float16 and float32 on a handful; in place and misaligned.
``python3 tests/kernels/test_elementwise_cuda.py --prebuild --workers 15`` compiles exactly
those programs in spawned processes first, so the tests load them from TileLang's disk cache.

Tolerances, per output dtype (``ulp(d, r)``: the spacing of dtype ``d`` at the reference
``r``):
- exact functions (rounding, selection, comparisons, abs/neg, integer math): equal to the
  float64 reference rounded to the output dtype, NaN where it is NaN;
- the rest: ``|got - ref| <= |torch - ref| + ulp(out, ref) + floor``, where ``torch`` is
  torch's own result on the same inputs in their storage dtype on the GPU: no worse than torch
  by more than one unit in the last place of the output (for float16/bfloat16 the math runs in
  float32 and is rounded once; for float32, CUDA's libm functions are within 2 ulp, as torch's
  are). ``ulp`` takes the subnormal spacing below the dtype's smallest normal. ``floor`` is the
  float64 reference's own error where it cancels, ``16 * eps(float64) * prod(max(1, |x|))``
  over the float inputs of the element (gelu's reference is 0 below x = -8.3, the kernel's
  erfc form 1e-22): an absolute floor far below any output the tests compare otherwise;
- a reference that is not finite once rounded to the output dtype (NaN, or a value past the
  dtype's largest: a bf16 pow of 3.4e44, a float16 exp of 8e4) is compared rounded: the output
  is that inf or NaN.
"""

import math
import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tileops.kernels import elementwise as E  # noqa: E402
from tileops.runtime import select  # noqa: E402

pytestmark = pytest.mark.cuda
if __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
NAMES = {torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
         torch.int32: "int32", torch.int64: "int64", torch.float16: "float16",
         torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
KERNELS = (E.ElementwiseFlatKernel, E.ElementwiseRowsKernel, E.ElementwiseStridedKernel)
SELU = (1.6732632423543772848170429916717, 1.0507009873554804934193349852946)


def _align(t):
    """The address alignment from the view's offset (allocations are 256-byte aligned), so a
    meta tensor of the prebuild gives what the GPU tensor gives."""
    b = t.storage_offset() * t.element_size()
    return min(16, (b & -b) or 16)


def spec_of(fn, params, ins, outs, compute, device=DEV):
    return E.ElementwiseSpec(
        device=device, fn=fn, params=params, in_dtypes=tuple(NAMES[t.dtype] for t in ins),
        out_dtypes=tuple(NAMES[t.dtype] for t in outs), compute=compute,
        out_shape=tuple(outs[0].shape), in_shapes=tuple(tuple(t.shape) for t in ins),
        in_strides=tuple(t.stride() for t in ins), in_align=tuple(map(_align, ins)),
        out_strides=tuple(t.stride() for t in outs), out_align=tuple(map(_align, outs)))


def run(fn, params, ins, outs, compute):
    """Call the slot as the op does: the spec from the tensors, the selected implementation's
    entry, ``entry(*inputs, *outputs)``."""
    spec = spec_of(fn, params, ins, outs, compute)
    impl = select(E.ElementwiseInterface, KERNELS, spec)
    impl.entry_for(spec, None)(*ins, *outs)
    torch.cuda.synchronize()
    return impl


def _bwd(f):
    """The gradient of ``f`` at ``x`` times ``dy`` (float64 autograd)."""
    def g(dy, x):
        x = x.detach().requires_grad_()
        (gx,) = torch.autograd.grad(f(x), x, dy)
        return gx
    return g


def _gated_bwd(f):
    def g(dy, a, b):
        a = a.detach().requires_grad_()
        b = b.detach().requires_grad_()
        return torch.autograd.grad(f(a) * b, (a, b), dy)
    return g


#: name -> (torch function of the inputs, the constants); returns a tensor or a tuple
REF = {
    "abs": torch.abs, "neg": torch.neg, "exp": torch.exp, "expm1": torch.expm1,
    "log": torch.log, "log1p": torch.log1p, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round, "trunc": torch.trunc, "sign": torch.sign, "isnan": torch.isnan,
    "isinf": torch.isinf, "isfinite": torch.isfinite, "relu": torch.relu, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "mish": F.mish,
    "softplus": lambda x, b, t: F.softplus(x, b, t),
    "leaky_relu": lambda x, s: F.leaky_relu(x, s), "elu": lambda x, a: F.elu(x, a),
    "selu": F.selu, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
    "hardtanh": lambda x, lo, hi: F.hardtanh(x, lo, hi),
    "clamp": lambda x, lo, hi, hl, hh: torch.clamp(x, lo if hl else None, hi if hh else None),
    "add": lambda a, b, al: torch.add(a, b, alpha=al),
    "sub": lambda a, b, al: torch.sub(a, b, alpha=al), "mul": torch.mul, "div": torch.div,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"), "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "remainder": torch.remainder,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge,
    "clamp_tensor": lambda x, lo, hi, hl, hh: torch.clamp(x, lo if hl else None,
                                                          hi if hh else None),
    "where": torch.where, "masked_fill": lambda x, m, v: x.masked_fill(m, v),
    "lerp": torch.lerp, "lerp_scalar": lambda s, e, w: torch.lerp(s, e, w),
    "silu_and_mul": lambda a, b: F.silu(a) * b, "gelu_and_mul": lambda a, b: F.gelu(a) * b,
    "gelu_tanh_and_mul": lambda a, b: F.gelu(a, approximate="tanh") * b,
    "relu_bwd": lambda dy, y: torch.ops.aten.threshold_backward(dy, y, 0),
    "sigmoid_bwd": torch.ops.aten.sigmoid_backward, "tanh_bwd": torch.ops.aten.tanh_backward,
    "gelu_bwd": lambda dy, x: torch.ops.aten.gelu_backward(dy, x),
    "gelu_tanh_bwd": lambda dy, x: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"),
    "silu_bwd": torch.ops.aten.silu_backward, "mish_bwd": torch.ops.aten.mish_backward,
    "softplus_bwd": lambda dy, x, b, t: torch.ops.aten.softplus_backward(dy, x, b, t),
    "leaky_relu_bwd": lambda dy, x, s: torch.ops.aten.leaky_relu_backward(dy, x, s, False),
    "elu_bwd": lambda dy, x, a: torch.ops.aten.elu_backward(dy, a, 1, 1, False, x),
    "selu_bwd": lambda dy, x: torch.ops.aten.elu_backward(dy, SELU[0], SELU[1], 1, False, x),
    "hardswish_bwd": torch.ops.aten.hardswish_backward,
    "hardsigmoid_bwd": torch.ops.aten.hardsigmoid_backward,
    "hardtanh_bwd": lambda dy, x, lo, hi: torch.ops.aten.hardtanh_backward(dy, x, lo, hi),
    "silu_and_mul_bwd": _gated_bwd(F.silu), "gelu_and_mul_bwd": _gated_bwd(F.gelu),
    "gelu_tanh_and_mul_bwd": _gated_bwd(lambda a: F.gelu(a, approximate="tanh")),
    "div_bwd_b": lambda dy, a, b: -(dy * ((a / b) / b)),
    "pow_bwd_a": lambda dy, a, b: torch.where(b == 0, 0.0, dy * (b * a.pow(b - 1))),
    "pow_bwd_b": lambda dy, a, b: torch.where((a == 0) & (b >= 0), 0.0,
                                              dy * (a.pow(b) * a.log())),
    "remainder_bwd_b": lambda dy, a, b: -dy * torch.div(a, b, rounding_mode="floor"),
    # the unary math's gradients, of (dy, y) or (dy, x) as their ops save them
    "expm1_bwd": lambda dy, y: dy * (y + 1), "sqrt_bwd": lambda dy, y: dy / (2 * y),
    "rsqrt_bwd": lambda dy, y: -0.5 * dy * (y * y * y),
    "reciprocal_bwd": lambda dy, y: -dy * (y * y), "log1p_bwd": lambda dy, x: dy / (x + 1),
    "sin_bwd": lambda dy, x: dy * torch.cos(x), "cos_bwd": lambda dy, x: dy * -torch.sin(x),
    "erf_bwd": lambda dy, x: dy * 1.1283791670955126 * torch.exp(-(x * x)),
    "abs_bwd": lambda dy, x: dy * torch.sign(x).nan_to_num(0.0),
}
PARAMS = {"softplus": (1.5, 4.0), "leaky_relu": (0.02,), "elu": (1.3,),
          "hardtanh": (-1.0, 1.0), "clamp": (-0.5, 0.75, True, True), "add": (0.5,),
          "sub": (2,), "clamp_tensor": (True, True), "masked_fill": (-7.0,),
          "lerp_scalar": (0.3,), "softplus_bwd": (1.5, 4.0), "leaky_relu_bwd": (0.02,),
          "elu_bwd": (1.3,), "hardtanh_bwd": (-1.0, 1.0)}
#: the values where the functions have kinks, ties or special cases
SPECIAL = [0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.0, -3.0, 1.0, -1.0, 4.0 / 1.5,
           float("nan"), float("inf"), float("-inf"), 1e-30, 20.0, -20.0]
#: the functions defined for positive operands only, and which operand that is
POSITIVE = {"log": 0, "sqrt": 0, "rsqrt": 0, "pow": 0, "pow_bwd_a": 1, "pow_bwd_b": 1}


def test_reference_table_covers_the_registry():
    assert set(REF) == set(E.SCALAR_FNS)


def make_inputs(fn, shapes, dtype, gen, special=True):
    f = E.SCALAR_FNS[fn]
    ins = []
    for k, shape in enumerate(shapes):
        if k in f.keep:
            ins.append(torch.rand(shape, generator=gen, device=DEV) < 0.5)
            continue
        if dtype.is_floating_point:
            x = torch.randn(shape, generator=gen, device=DEV, dtype=torch.float32) * 3
            if POSITIVE.get(fn) == k:
                x = x.abs() + 0.01
            if fn in ("log1p",):
                x = x.abs() - 0.9
            if special and x.numel() >= len(SPECIAL) and k == (1 if "bwd" in fn else 0):
                x.view(-1)[:len(SPECIAL)] = torch.tensor(SPECIAL, device=DEV)
        else:
            lo = 0 if dtype == torch.uint8 else -50
            x = torch.randint(lo, 50, shape, generator=gen, device=DEV)
            if fn in ("div_trunc", "div_floor", "remainder") and k == 1:
                x = torch.where(x == 0, torch.ones_like(x), x)
        ins.append(x.to(dtype))
    return ins


def _ulp(dtype, ref):
    """The spacing of ``dtype`` at ``|ref|`` (its subnormal spacing below the smallest normal)."""
    fi = torch.finfo(dtype)
    mag = ref.abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def _floor(ins):
    """The float64 reference's own error where it cancels: eps(float64) times the product of
    the float inputs' magnitudes (floored at 1), 16 times over (gelu's ``1 + erf(x/sqrt(2))``
    is 0 in float64 below x = -8.3, where the kernel's erfc form gives 1e-22)."""
    scale = torch.ones((), dtype=torch.float64, device=ins[0].device)
    for t in ins:
        if t.dtype.is_floating_point:
            scale = scale * t.double().abs().nan_to_num(0.0, 0.0, 0.0).clamp_min(1.0)
    return 16 * torch.finfo(torch.float64).eps * scale


def check(fn, got, ins, params, exact):
    """Compare ``got`` (one tensor an output) with float64 torch on ``ins``."""
    ref = REF[fn](*[t.double() if t.dtype.is_floating_point else t for t in ins], *params)
    native = REF[fn](*ins, *params)
    refs = ref if isinstance(ref, tuple) else (ref,)
    natives = native if isinstance(native, tuple) else (native,)
    for g, r, n in zip(got, refs, natives, strict=True):
        if exact or not g.dtype.is_floating_point:
            want = r.to(g.dtype)
            same = (g == want) | (g.isnan() & want.isnan()) if g.dtype.is_floating_point \
                else g == want
            assert bool(same.all()), (fn, g[~same][:8], want[~same][:8])
            continue
        r = r.double()
        gd = g.double()
        # a reference that is not finite in the output dtype (a log of a negative, a value
        # that overflows it) is held to its value rounded to that dtype
        rounded = r.to(g.dtype).double()
        special = ~torch.isfinite(rounded)
        same = (gd == rounded) | (gd.isnan() & rounded.isnan())
        err = (gd - r).abs()
        tol = ((n.double() - r).abs().nan_to_num(0.0) + _ulp(g.dtype, r).nan_to_num(0.0)
               + _floor(ins))
        ok = torch.where(special, same, err <= tol)
        assert bool(ok.all()), (fn, g.dtype, gd[~ok][:8], r[~ok][:8],
                                [torch.broadcast_to(t, ok.shape)[~ok][:8] for t in ins])


def _compute(fn, dtype):
    f = E.SCALAR_FNS[fn]
    if not dtype.is_floating_point:
        return NAMES[dtype]
    if f.exact:
        return NAMES[dtype]
    return "float64" if dtype == torch.float64 else "float32"


def _out_dtypes(fn, dtype):
    f = E.SCALAR_FNS[fn]
    return (torch.bool,) * f.outputs if f.bool_out else (dtype,) * f.outputs


def _params(fn, dtype):
    params = PARAMS.get(fn, ())
    if not dtype.is_floating_point:
        params = tuple(int(p) if isinstance(p, float) else p for p in params)
    return params


#: layout -> (input shapes of an arity, output shape, view of each input or None); (why)
LAYOUTS = {
    "contiguous": (lambda n: [(64, 4096)] * n, (64, 4096), None),
    # a flat run in 16-byte vectors, its masked tail
    "odd-4097": (lambda n: [(33, 4097)] * n, (33, 4097), None),
    # whole vectors only, the last CTA part full (its vectors checked, no element left over)
    "partial-cta": (lambda n: [(40, 1000)] * n, (40, 1000), None),
    # small calls: single elements, one a thread; one masked CTA, a masked last CTA
    "three-elements": (lambda n: [(3,)] * n, (3,), None),
    "one-row": (lambda n: [(1, 4097)] * n, (1, 4097), None),
    "no-elements": (lambda n: [(0, 16)] * n, (0, 16), None),  # nothing launched
    "row-broadcast": (lambda n: [(32, 1024)] + [(1024,)] * (n - 1), (32, 1024), None),
    # rows at odd offsets: one flat run in vectors, the row read modulo its length (a vector
    # wraps past a row's end), the masked last CTA too
    "odd-row-broadcast": (lambda n: [(33, 4097)] + [(4097,)] * (n - 1), (33, 4097), None),
    "scalar": (lambda n: [(32, 1000)] + [()] * (n - 1), (32, 1000), None),  # 0-dim partner
    "column-broadcast": (lambda n: [(64, 96)] + [(64, 1)] * (n - 1), (64, 96), None),
    "strided-rows": (lambda n: [(48, 1024)] * n, (48, 512), lambda t: t[:, :512]),
    "transposed": (lambda n: [(48, 1024)] * n, (1024, 48), lambda t: t.t()),
    "every-other": (lambda n: [(48, 1024)] * n, (24, 342), lambda t: t[::2, ::3]),
    # three row groups (each row's offset divided out of its index): single elements, and
    # with a contiguous last dim 16-byte vectors
    "permuted-3d": (lambda n: [(8, 32, 48)] * n, (8, 48, 32), lambda t: t.permute(0, 2, 1)),
    "permuted-4d": (lambda n: [(4, 8, 16, 64)] * n, (4, 16, 8, 64),
                    lambda t: t.permute(0, 2, 1, 3)),
}
LAYOUT_FNS = ("silu", "add", "where")
#: (fn, dtype) beyond bf16: int32 on every integral function, int64 and bool on a few, float16
#: and float32 on a handful (the libm calls and the gelu forms)
DTYPE_CASES = (
    [(fn, torch.int32) for fn in sorted(E.SCALAR_FNS) if E.SCALAR_FNS[fn].integral]
    + [(fn, torch.int64) for fn in ("add", "maximum", "div_floor", "where")]
    + [(fn, torch.bool) for fn in ("eq", "ne", "mul")]
    + [(fn, dt) for fn in ("silu", "gelu", "gelu_tanh", "exp", "div", "gelu_and_mul_bwd")
       for dt in (torch.float16, torch.float32)]
    + [(fn, torch.float16) for fn in sorted(E.SCALAR_FNS)
       if E.SCALAR_FNS[fn].half_build is not None and E.SCALAR_FNS[fn].arity == 1
       and fn not in ("silu", "gelu", "gelu_tanh")])
#: the one-input functions with a 16-bit form, checked on every 16-bit input
HALF_UNARY = sorted(fn for fn, f in E.SCALAR_FNS.items()
                    if f.half_build is not None and f.arity == 1 and f.outputs == 1)


def tensors(fn, dtype, layout, device, gen=None):
    """A layout's inputs (random on the GPU, empty on ``meta`` for the prebuild) and outputs."""
    f = E.SCALAR_FNS[fn]
    shapes, _, view = LAYOUTS[layout]
    if device == "meta":
        ins = [torch.empty(s, device="meta", dtype=torch.bool if k in f.keep else dtype)
               for k, s in enumerate(shapes(f.arity))]
    else:
        ins = make_inputs(fn, shapes(f.arity), dtype, gen)
    if view is not None:
        ins = [view(t) for t in ins]
    out_shape = torch.broadcast_shapes(*(t.shape for t in ins))
    outs = [torch.empty(out_shape, device=ins[0].device, dtype=d) for d in _out_dtypes(fn, dtype)]
    return ins, outs


def runs():
    """Every (fn, dtype, layout) the tests below call."""
    out = [(fn, torch.bfloat16, "contiguous") for fn in sorted(E.SCALAR_FNS)]
    out += [(fn, torch.bfloat16, lay) for fn in LAYOUT_FNS for lay in LAYOUTS
            if lay != "contiguous"]
    out += [(fn, dt, "contiguous") for fn, dt in DTYPE_CASES]
    return out


def _call_and_check(fn, dtype, layout):
    f = E.SCALAR_FNS[fn]
    gen = torch.Generator(DEV).manual_seed(hash((fn, layout)) % 1000)
    params = _params(fn, dtype)
    ins, outs = tensors(fn, dtype, layout, DEV, gen)
    impl = run(fn, params, ins, outs, _compute(fn, dtype))
    if layout in ("strided-rows", "transposed", "every-other", "permuted-3d", "permuted-4d"):
        assert impl is {"strided-rows": E.ElementwiseRowsKernel}.get(
            layout, E.ElementwiseStridedKernel), layout
    if outs[0].numel():
        check(fn, outs, ins, params, f.exact)


@pytest.mark.parametrize("fn", sorted(E.SCALAR_FNS))
def test_every_function_bf16_contiguous(fn):
    _call_and_check(fn, torch.bfloat16, "contiguous")


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay != "contiguous"])
@pytest.mark.parametrize("fn", LAYOUT_FNS)
def test_layouts(fn, layout):
    _call_and_check(fn, torch.bfloat16, layout)


@pytest.mark.parametrize(("fn", "dtype"), DTYPE_CASES,
                         ids=[f"{f}-{NAMES[d]}" for f, d in DTYPE_CASES])
def test_integer_bool_and_other_float_dtypes(fn, dtype):
    _call_and_check(fn, dtype, "contiguous")


@pytest.mark.parametrize("fn", ["silu", "add"])
def test_in_place_on_a_strided_view(fn):
    """The output is the input object itself, a strided view: written where it lies."""
    f = E.SCALAR_FNS[fn]
    gen = torch.Generator(DEV).manual_seed(0)
    params = PARAMS.get(fn, ())
    dtype = torch.bfloat16
    big = make_inputs(fn, [(64, 2048)] * f.arity, dtype, gen, special=False)
    ins = [t[:, 1024:] for t in big]
    before = [t.clone() for t in ins]
    outside = big[0][:, :1024].clone()
    run(fn, params, ins, [ins[0]], _compute(fn, dtype))
    check(fn, [ins[0]], before, params, f.exact)
    assert torch.equal(big[0][:, :1024], outside)


def test_misaligned_views_read_narrower():
    """A view starting at an odd element is read in single elements, and right."""
    x = torch.randn(4097 * 8 + 1, device=DEV, dtype=torch.bfloat16)[1:].view(8, 4097)
    y = torch.empty_like(x)
    run("silu", (), [x], [y], "float32")
    check("silu", [y], [x], (), False)


def test_entries_are_shared_within_a_layout_class():
    # both past the small-call rule (fewer vectors than 132 CTAs' worth take one access a
    # thread, another plan)
    a = torch.randn(512, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(1000, 8192, device=DEV, dtype=torch.bfloat16)
    for x in (a, b):
        y = torch.empty_like(x)
        run("gelu", (), [x], [y], "float32")
        check("gelu", [y], [x], (), False)
    assert E.build_kernel.cache_info().currsize >= 1
    spec = lambda x: E.ElementwiseSpec(  # noqa: E731
        device=DEV, fn="gelu", params=(), in_dtypes=("bfloat16",), out_dtypes=("bfloat16",),
        compute="float32", out_shape=tuple(x.shape), in_shapes=(tuple(x.shape),),
        in_strides=(x.stride(),), in_align=(16,), out_strides=(x.stride(),), out_align=(16,))
    k = E.ElementwiseFlatKernel
    assert k.identity(spec(a)) == k.identity(spec(b))


@pytest.mark.parametrize("fn", ["silu_and_mul", "add"])
def test_rows_on_one_grid_dimension_match(fn):
    """The tiled kinds' program for calls of more than 65535 row blocks (the grid's y): one
    grid dimension, each CTA's column and row block divided out of its index. Forced here on
    a small call (gated halves at odd and at even offsets; a row bias)."""
    for n in (4097, 4096):
        if fn == "add":
            ins = [torch.randn(37, n, device=DEV, dtype=torch.bfloat16),
                   torch.randn(n, device=DEV, dtype=torch.bfloat16)]
        else:
            x = torch.randn(37, 2 * n, device=DEV, dtype=torch.bfloat16)
            ins = [x[:, :n], x[:, n:]]
        outs = [torch.empty(37, n, device=DEV, dtype=torch.bfloat16)]
        params = PARAMS.get(fn, ())
        s = spec_of(fn, params, ins, outs, "float32")
        p = E.plan(s, grid_y=False)
        if p.kind == "flat":  # [37, 4097] + [4097] is the modular flat run: no rows program
            continue
        assert (p.kind, p.grid_y) == ("rows", False)
        E.build_kernel(s.fn, s.params, s.in_dtypes, s.out_dtypes, s.compute, 2, p)(*ins, *outs)
        torch.cuda.synchronize()
        check(fn, outs, ins, params, E.SCALAR_FNS[fn].exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("fn", HALF_UNARY)
def test_half_forms_on_every_16_bit_input(fn, dtype):
    """Every bfloat16 and float16 bit pattern (NaNs, infinities, subnormals and -0 included),
    four times over the contiguous layout's 64 x 4096 (its program), against float64 with
    the tolerance of :func:`check`: within one unit in the last place of torch's own error;
    a -0 keeps its sign where torch's does."""
    bits = torch.arange(-(1 << 15), 1 << 15, device=DEV, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype).repeat(4).view(64, 4096)
    y = torch.empty_like(x)
    params = _params(fn, dtype)
    run(fn, params, [x], [y], "float32")
    check(fn, [y], [x], params, False)
    zero = torch.tensor([-0.0], device=DEV, dtype=dtype)
    want = REF[fn](zero, *params)
    got = torch.empty_like(zero)
    run(fn, params, [zero], [got], "float32")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (fn, got, want)


def test_large_flat_call_matches():
    """A call over more elements than one grid row of CTAs covers (2**27 bf16)."""
    x = torch.randn(1 << 14, 1 << 13, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    run("silu", (), [x], [y], "float32")
    assert torch.allclose(y.float(), F.silu(x.float()), atol=0, rtol=2 ** -7)
    assert math.isfinite(float(y.float().sum()))


# --- the prebuild ----------------------------------------------------------------------------


def _extra_specs():
    """The specs of the tests outside :func:`runs` (in place, misaligned)."""
    out = []
    for fn in ("silu", "add"):
        big = [torch.empty(64, 2048, device="meta", dtype=torch.bfloat16)
               for _ in range(E.SCALAR_FNS[fn].arity)]
        ins = [t[:, 1024:] for t in big]
        out.append(spec_of(fn, PARAMS.get(fn, ()), ins, [ins[0]], "float32", None))
    x = torch.empty(4097 * 8 + 1, device="meta", dtype=torch.bfloat16)[1:].view(8, 4097)
    out.append(spec_of("silu", (), [x], [torch.empty_like(x)], "float32", None))
    for fn in HALF_UNARY:  # a single element (-0), on both 16-bit dtypes
        for dtype in (torch.bfloat16, torch.float16):
            z = torch.empty(1, device="meta", dtype=dtype)
            out.append(spec_of(fn, _params(fn, dtype), [z], [torch.empty_like(z)], "float32",
                               None))
    return out


def program_keys():
    """The distinct programs the file compiles: build_kernel's arguments, deduplicated."""
    specs = []
    for fn, dtype, layout in runs():
        ins, outs = tensors(fn, dtype, layout, "meta")
        if outs[0].numel():
            specs.append(spec_of(fn, _params(fn, dtype), ins, outs, _compute(fn, dtype), None))
    keys = {}
    for s in specs + _extra_specs():
        p = E.plan(s)
        keys[(s.fn, s.params, s.in_dtypes, s.out_dtypes, s.compute, len(s.out_shape), p)] = None
    return list(keys)


def _build(key):
    E.build_kernel(*key)


def _describe(key) -> str:
    return f"{key[0]} {key[2]} {key[6].kind}"


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
