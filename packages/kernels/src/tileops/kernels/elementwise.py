"""Elementwise ops in TileLang: one generator for unary math, activations, binary ops with
broadcasting, gated activations and the activations' gradients.

A call is a scalar function (:data:`SCALAR_FNS`: the math of one element, as TileLang
expressions) applied over the elements of ``out_shape``, reading each input at its own strides
(broadcast dims read with stride 0) and writing each output at its own. The op states the call
in an :class:`ElementwiseSpec`; this module owns everything about the layout:

- **collapse** (:func:`collapse`): dims of extent 1 drop out, and adjacent dims merge where
  every operand is contiguous across them (``stride[d] == stride[d + 1] * size[d + 1]``, a
  broadcast dim being stride 0), so a contiguous ``[B, S, H]`` call is one flat run and a
  ``[M, N] + [N]`` bias call is ``M`` rows of ``N``;
- **layout class** (:func:`plan`): ``flat`` (at most one dim left and every operand unit-stride
  or a single broadcast element), ``rows`` (two dims, unit or zero inner stride: a row
  broadcast, a column broadcast, strided rows such as a gated op's halves ``x[..., :N]``) and
  ``strided`` (anything else up to :data:`MAX_DIMS` dims);
- **vector width**: 16-byte accesses for the widest operand, narrowed until every operand's
  data pointer alignment (``in_align``/``out_align``), the row length and every row stride
  allow it (strided rows of ``N = 4097`` get single elements, a flat run of 4097 x 8192 keeps
  16 bytes and a masked tail, and ``[M, 4097] + [4097]`` is that flat run with the bias read
  at the index modulo its row, :func:`_modular`); a flat call small enough to be one element
  a thread in one wave of CTAs reads single elements (a small call's time is the code a
  thread runs).

One program serves every size of a layout class: extents and strides are launch-time
(``T.dynamic``, bound by the FFI from the tensors themselves, so an entry launches the op's
tensors as they are, without views but a bool tensor's uint8 view). Blocks that lie wholly
inside the iteration space run unmasked with every load of a thread issued before its first
store (``per`` accesses of ``vec`` elements in flight; :func:`_default_launch` has the
measured defaults); only the blocks at the edges check bounds (a flat run's last block its
whole vectors, then its last elements one a thread; the tiled kinds' edge blocks each
access). The tiled kinds' row blocks sit on the grid's y where they fit in it, so a CTA finds
its blocks without a division. Arithmetic runs in the spec's ``compute`` dtype (float32 for
float16/bfloat16 storage), exact functions in the storage dtype itself.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES

from ._store import stored
from ._tilelang import compile_program, tl
from ._tilelang import pow2_at_least as _pow2_at_least

__all__ = [
    "DTYPES_SERVED",
    "MAX_DIMS",
    "SCALAR_FNS",
    "ElementwiseFlatKernel",
    "ElementwiseInterface",
    "ElementwiseRowsKernel",
    "ElementwiseSpec",
    "ElementwiseStridedKernel",
    "Plan",
    "ScalarFn",
    "build_program",
    "collapse",
    "plan",
]

#: storage dtypes the elementwise kernels read and write
DTYPES_SERVED = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                           "bfloat16", "float32", "float64"})
_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
_HALF = frozenset({"float16", "bfloat16"})
#: collapsed dims the strided kernel indexes; a call with more is the op's to copy
MAX_DIMS = 8
_VECTOR_BYTES = 16
_INT32_MAX = (1 << 31) - 1


# --- the scalar functions ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScalarFn:
    """The math of one element.

    ``build(xs, ps, dt)`` returns the outputs' TileLang expressions from the inputs ``xs`` (cast
    to the compute dtype ``dt``, except the inputs in ``keep``, which arrive in their storage
    dtype: a condition or a mask) and the constants ``ps`` (in ``params`` order). ``exact``: the
    result is exact in the storage dtype (abs, comparisons, rounding, selection), so the op may
    compute in it; otherwise it computes in float32 or float64. ``integral``: integer and bool
    compute dtypes are served (the rest need a floating one). ``bool_out``: the outputs are
    bool (comparisons, ``isnan``)."""

    name: str
    arity: int
    outputs: int
    params: tuple[str, ...]
    exact: bool
    integral: bool
    build: Callable[..., tuple]
    keep: tuple[int, ...] = ()
    bool_out: bool = False
    #: the builder used where every output is float16/bfloat16 and the math runs in float32
    #: (the result keeps 8 or 11 bits, so a cheaper float32 form within a few ulp serves),
    #: or None for ``build`` everywhere
    half_build: Callable[..., tuple] | None = None
    #: ``(threads, accesses a thread)`` of a flat one-input call where this function's sweep
    #: preferred another launch than the flat default (see :func:`_default_launch`), or None
    flat_launch: tuple[int, int] | None = None
    #: ``(threads, accesses a thread, CTAs an SM)`` of a rows call whose inputs are all read
    #: along the row (a gated op's halves) where this function's sweep preferred another than
    #: the rows default; the register cap (``Plan.resident``) lets the 16-bit form serve more
    #: than one access a thread
    rows_launch: tuple[int, int, int] | None = None
    #: the 16-bit form calls :data:`HALF_PRELUDE`'s helpers (its programs carry the prelude)
    prelude: bool = False


def _T():
    return tl()[1]


def _c(v, dt):
    """The constant ``v`` in dtype ``dt`` (a float64 constant keeps float64's precision)."""
    from tilelang import tvm

    return tvm.tirx.const(v, dt)


def _w(x):
    """``x`` widened to float32 where it is a 16-bit float (exact): comparisons and selections
    on half types go through float32."""
    return _T().cast(x, "float32") if str(x.dtype) in _HALF else x


def _sel(c, a, b):
    return _T().if_then_else(c, a, b)


def _isnan(x):
    """CUDA's ``isnan`` as an opaque call. ``x != x`` is folded to False by TVM's simplifier
    (it takes floats to be reflexive), and ``T.isnan`` is lowered back to ``x != x`` by TVM's
    CUDA intrinsic rule, which leaves it to nvcc; the libdevice call is kept by every pass. A
    float16/bfloat16 ``x`` is widened to float32 first (exact)."""
    y = _w(x)
    return _T().call_pure_extern("bool", "isnan", y)


def _max_nan(a, b):
    """torch.maximum: NaN if either is NaN (then ``a + b``, a NaN): one test of both operands
    and one select, where a select a NaN operand would nest the next test in both arms, and a
    caller that feeds the result to another one copied it into each (clamp with tensor bounds:
    696 SASS instructions a program against add's 176)."""
    if str(a.dtype) not in _FLOATS:
        return _T().max(a, b)
    return _sel(_either_nan(a, b), a + b, _T().max(a, b))


def _min_nan(a, b):
    """torch.minimum: as :func:`_max_nan`."""
    if str(a.dtype) not in _FLOATS:
        return _T().min(a, b)
    return _sel(_either_nan(a, b), a + b, _T().min(a, b))


def _either_nan(a, b):
    from tilelang import tvm

    return tvm.tirx.Or(_isnan(a), _isnan(b))


def _std_max(a, b):
    """``std::max(a, b)`` (``a < b ? b : a``: a NaN ``a`` is kept), as torch's activations."""
    return _sel(a < b, b, a)


def _std_min(a, b):
    return _sel(b < a, b, a)


def _expm1(x):
    T = _T()
    return T.call_pure_extern(str(x.dtype), "expm1f" if str(x.dtype) == "float32" else "expm1",
                              x)


def _sigmoid(x):
    one = _c(1.0, x.dtype)
    return one / (one + _T().exp(-x))


def _gelu(x):
    dt = x.dtype
    return x * _c(0.5, dt) * (_c(1.0, dt) + _T().erf(x * _c(math.sqrt(0.5), dt)))


#: erfc(z) / 2 = t * exp2(Q(t) - z^2 log2(e)), t = 1 / (1 + z / 2), z >= 0, Q's coefficients
#: from t^0 up: a degree-5 fit on t in [1/6, 1] (z up to 10, where the result is 2^-148),
#: near-minimax by reweighted Chebyshev least squares against float64's erfc, then rounded to
#: float32. Q's own error is below 1.1e-5 (7.6e-6 of the result); Q is smooth in t (it tends
#: to -log2(4 sqrt(pi)) as z grows), and past z = 10 it stays in [-2.83, -2.56], so the result
#: only underflows further. Numerical Recipes' ``erfcc`` has the same form with a degree-9 fit
#: (1.2e-7): bf16's and float16's ulps (3.9e-3 and 4.9e-4 of the value) need far less, and
#: gelu's kernel is bound by this math, not by its bytes.
HALF_ERFC_COEFFS = (-2.8272335529327393, 1.4686834812164307, 0.36708229780197144,
                    0.6845520734786987, -1.023148775100708, 0.33007553219795227)


_LOG2E = 1.4426950408889634


def _exp2(x):
    """``exp2f`` of a float32 ``x``: one ``ex2.approx`` (subnormal results kept)."""
    return _T().call_pure_extern("float32", "exp2f", x)


#: device functions the 16-bit forms call by name, put at the top of the CUDA source of a
#: program that runs a 16-bit form (``T.import_source``; a fixed text, nothing of a call's in
#: it): ``ex2.approx.ftz`` alone is one MUFU.EX2, where ``exp2f`` adds three instructions an
#: element to keep subnormal results (``ftz``: a result below 2^-126 is 0); ``rcp.approx``
#: and ``sqrt.approx`` (subnormals kept: ptxas scales around the MUFU, four to six
#: instructions) where the IEEE division and ``sqrtf`` take a branch an element to a slow
#: path. Not ``volatile``: nvcc schedules and merges them as its own arithmetic
HALF_PRELUDE = """
__device__ __forceinline__ float tileops_ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float tileops_rcp(float x) {
  float y;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float tileops_sqrt(float x) {
  float y;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


def _exp2_ftz(x):
    """``2^x`` of a float32 ``x`` as one ``ex2.approx.ftz`` (:data:`HALF_PRELUDE`): within 2
    ulp, a result below float32's smallest normal flushed to 0. For the forms that only add
    the result to 1 (tanh's ``1 +- e``, erf's ``1 - t P(t) e``), where a subnormal is lost
    anyway; the 16-bit forms only (their programs carry the prelude)."""
    return _T().call_pure_extern("float32", "tileops_ex2_ftz", x)


def _exp32(x):
    """``exp`` of a float32 ``x`` for the 16-bit outputs' forms: ``exp2f(x * log2(e))``, one
    ``ex2.approx`` (subnormal results kept) where libdevice's ``expf`` spends a dozen
    instructions on a correctly split argument. Rounding the product costs a relative error of
    ``|x| * 2^-24`` (5.1e-6 at x = -85, near float32's smallest normal result), far inside
    bf16's and float16's ulp (3.9e-3 and 4.9e-4), and these forms' math, not the bytes, bounds
    their kernels."""
    return _exp2(x * _c(_LOG2E, "float32"))


def _let(value, body):
    """``body(v)`` with ``v`` bound to ``value`` once (a float32 local in the CUDA source): an
    expression used more than once is otherwise printed, and computed, at each use, and
    ``_rcp``'s ``asm volatile`` is never merged by nvcc."""
    from tilelang import tvm

    v = tvm.tirx.Var("v", value.dtype)
    return tvm.tirx.Let(v, value, body(v))


def _rcp(x):
    """``1 / x`` of a float32 ``x`` as one ``rcp.approx.ftz`` (TileLang's ``fast_rcp``): within
    1 float32 ulp for ``x`` in [2^-126, 2^126], 0 past it (a subnormal result flushed), inf at
    0. ``__fdividef(1, x)`` is the same MUFU.RCP behind five more instructions that rescale
    subnormals, which no caller's range reaches, and these forms are bound by their
    instructions, not their bytes."""
    return _T().fast_rcp(x)


def _half_erfc32(x):
    """``erfc(|x| / sqrt(2)) / 2`` of a float32 ``x`` (``HALF_ERFC_COEFFS``): the normal
    distribution's mass beyond ``|x|``, relative accuracy everywhere; 0 at infinity, NaN for
    NaN. The constants absorb the ``1 / sqrt(2)``, ``log2(e)`` and the half."""
    T = _T()
    f32 = "float32"

    def of(t):
        acc = _c(HALF_ERFC_COEFFS[-1], f32)
        for c in reversed(HALF_ERFC_COEFFS[:-1]):
            acc = acc * t + _c(c, f32)
        return t * _exp2((x * x) * _c(-0.5 * _LOG2E, f32) + acc)

    return _let(_rcp(T.abs(x) * _c(0.5 * math.sqrt(0.5), f32) + _c(1.0, f32)), of)


def _phi32(x):
    """The normal CDF of a float32 ``x`` from one erfc of ``|x| / sqrt(2)``: relative accuracy
    in both tails, where ``(1 + erf(x / sqrt(2))) / 2`` cancels (at x = -5 float32's erf
    leaves 20% of the result wrong; torch computes so and misses bf16's 2 ulp)."""
    # bound before the select: TileLang lowers a select to if/else, with each arm's
    # expression printed inside it
    return _let(_half_erfc32(x),
                lambda half: _sel(x < _c(0.0, "float32"), half, _c(1.0, "float32") - half))


def _gelu_half(x):
    return x * _phi32(x)


def _gelu_grad_half(x):
    """``Phi(x) + x phi(x)``, which cancels to 0 at x = -0.75: there the degree-5 fit's 7.6e-6
    of Phi (0.23) would be most of the result and miss float16's ulp, so Phi comes from
    libdevice's ``erfcf`` (a few float32 ulp, relative in the left tail as ``_phi32``)."""
    f32 = "float32"
    phi = _c(0.5, f32) * _T().call_pure_extern(f32, "erfcf", x * _c(-math.sqrt(0.5), f32))
    pdf = _exp2((x * x) * _c(-0.5 * _LOG2E, f32)) * _c(1.0 / math.sqrt(2.0 * math.pi), f32)
    return phi + x * pdf


_K_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5  # sqrt(2 / pi)
_K_KAPPA = 0.044715


def _gelu_tanh(x):
    """torch's form in torch's order (``x_cube = x * x * x``, ``0.5 * x * (1 + tanh(inner))``),
    so float32 rounds as torch does."""
    dt = x.dtype
    x_cube = x * x * x
    inner = _c(_K_BETA, dt) * (x + _c(_K_KAPPA, dt) * x_cube)
    return _c(0.5, dt) * x * (_c(1.0, dt) + _T().tanh(inner))


def _tanh_terms32(u, body):
    """``body(1 + tanh(u), 1 - tanh(u)^2)`` of a float32 ``u`` without cancellation: ``1 +
    tanh(u) = 2 sigmoid(2u)`` and ``sech(u)^2 = 4 sigmoid(2u) (1 - sigmoid(2u))``, both terms
    from :func:`_sigmoid_terms32` (``e = exp(-2|u|)``, no overflow). From float32's ``tanhf``
    both lose every bit once ``tanh(u)`` rounds to -1 or 1 (|u| > 8.3), which a gradient
    scaled by ``dy * b`` shows past bf16's ulps."""
    f32 = "float32"
    return _let(_c(2.0, f32) * u, lambda v: _sigmoid_terms32(v, lambda s, c: body(
        _c(2.0, f32) * s, _c(4.0, f32) * s * c)))


def _gelu_tanh_half(x):
    """``0.5 x (1 + tanh(u)) = x / (1 + exp(-2u))``, u = sqrt(2 / pi) (x + 0.044715 x^3), from
    ``e = exp(-2|u|)`` (u has x's sign): ``x r`` for x >= 0 and ``x e r`` below, ``r = 1 / (1 +
    e)`` in [1/2, 1] (the fast reciprocal's range), so the left tail keeps its relative
    accuracy until ``e`` leaves the normal floats (x = -10.0). The exponent ``|x| (a + b x^2)`` folds
    ``-2 log2(e) sqrt(2 / pi)`` into two constants: about a dozen float32 instructions an
    element, where tanhf's form took twice that and bounded the kernel."""
    T = _T()
    f32 = "float32"
    a = -2.0 * _LOG2E * _K_BETA
    return _let(_exp2(T.abs(x) * ((x * x) * _c(a * _K_KAPPA, f32) + _c(a, f32))),
                lambda e: x * _rcp(_c(1.0, f32) + e) * _sel(x < _c(0.0, f32), e, _c(1.0, f32)))


def _gelu_tanh_grad_half(x):
    x_sq = x * x
    inner = _c(_K_BETA, "float32") * (x + _c(_K_KAPPA, "float32") * (x_sq * x))
    inner_d = _c(_K_BETA, "float32") * (_c(1.0, "float32") + _c(3.0 * _K_KAPPA, "float32") * x_sq)
    return _tanh_terms32(inner, lambda one_plus, sech2: (
        _c(0.5, "float32") * one_plus + _c(0.5, "float32") * x * sech2 * inner_d))


def _silu(x):
    return x / (_c(1.0, x.dtype) + _T().exp(-x))


def _sigmoid_terms32(x, body):
    """``body(sigmoid(x), 1 - sigmoid(x))`` of a float32 ``x``, both without cancellation:
    with ``e = exp(-|x|)`` (in (0, 1]) and ``r = 1 / (1 + e)`` (1 + e in [1, 2], the fast
    reciprocal's range), ``sigmoid(x)`` is ``e r`` for x < 0 and ``r`` otherwise, and ``1 -
    sigmoid(x)`` the other one. Relative accuracy while ``e`` is a normal float32 (x > -87.3),
    then ``exp2f``'s subnormals; NaN stays NaN, -inf gives (0, 1)."""
    f32 = "float32"
    neg = x < _c(0.0, f32)
    return _let(_exp32(-_T().abs(x)), lambda e: _let(
        _rcp(_c(1.0, f32) + e), lambda r: body(r * _sel(neg, e, _c(1.0, f32)),
                                              r * _sel(neg, _c(1.0, f32), e))))


def _silu_half(x):
    """``x sigmoid(x)`` for a 16-bit output (``_sigmoid_terms32``): one exp2 and one fast
    reciprocal where torch's ``x / (1 + exp(-x))`` takes libdevice's ``expf`` and an IEEE
    division, two dozen instructions that bound a small call's chain."""
    return _sigmoid_terms32(x, lambda s, c: x * s)


def _silu_grad_half(x):
    """``s (1 + x (1 - s))``, s = sigmoid(x), with ``1 - s`` from ``_sigmoid_terms32`` (no
    cancellation as s nears 1); +-inf give NaN as torch's (inf * 0)."""
    return _sigmoid_terms32(x, lambda s, c: s * (_c(1.0, "float32") + x * c))


def _mish_half(x):
    """mish of a float32 ``x`` for a 16-bit output, from one ``exp`` and one fast reciprocal:
    ``tanh(softplus(x)) = n / (n + 2)`` with ``n = e (e + 2)``, ``e = exp(min(x, 20))``, a
    ratio of positive terms (no cancellation; ``exp`` keeps subnormals, so the far left tail is
    ``x * e`` as it should be). ``n + 2`` is in ``[2, 2.4e17]``, where the fast reciprocal is
    within 2 float32 ulp; from x = 20 on ``n / (n + 2)`` is 1 within those 2 ulp (``1 - 8.5e-18``
    exactly), so the result is ``x`` to 2.4e-7, which a 16-bit output rounds back to ``x``.
    NaN stays NaN (``fminf`` gives 20, ``x`` carries the NaN), -inf gives NaN as torch's
    ``-inf * 0``. No select: torch's ``x * tanh(log1p(exp(x)))`` is three transcendental calls,
    and this math, not the bytes, bounded mish."""
    f32 = "float32"
    return _let(_exp32(_T().min(x, _c(20.0, f32))), lambda e: _let(
        e * (e + _c(2.0, f32)), lambda n: x * (n * _rcp(n + _c(2.0, f32)))))


#: below this ``e``, ``log1p(e)`` and ``expm1(-e)`` take their Taylor series (four terms:
#: relative error below ``e^4 / 5``, 2.1e-7); from it on, the approximate log and exp2 (absolute
#: errors near 2^-22 on results of at least 0.03, so 1e-5 relative at worst)
_SERIES_BELOW = 2.0 ** -5


def _log1p_series(x):
    """``log1p``'s Taylor series of a float32 ``x`` to four terms (below
    :data:`_SERIES_BELOW` in magnitude: relative error below ``x^4 / 5``)."""
    f32 = "float32"
    return x * (_c(1.0, f32) - x * (_c(0.5, f32) - x * (_c(1.0 / 3.0, f32)
                                                       - x * _c(0.25, f32))))


def _log1p_half(x):
    """``log1p`` of a float32 ``x`` for the 16-bit outputs' forms: the series below
    :data:`_SERIES_BELOW` in magnitude, else ``__logf(1 + x)`` (the rounding of ``1 + x``
    and lg2.approx's absolute 2^-22 against a result of at least 0.03 in magnitude). -1 gives
    -inf, below it NaN, NaN stays NaN."""
    f32 = "float32"
    return _sel(_T().abs(x) < _c(_SERIES_BELOW, f32), _log1p_series(x),
                _T().call_pure_extern(f32, "__logf", _c(1.0, f32) + x))


def _softplus(x, beta, threshold):
    """torch's softplus: ``x`` where ``beta x > threshold``, else ``log1p(exp(beta x)) / beta``.
    ``beta == 0`` is written out as torch's arithmetic has it (a constant division by zero
    does not build, and the simplifier would take ``x * 0`` for 0): for a finite ``x``,
    ``x`` where ``0 > threshold``, else ``log(2) / 0 = inf``; NaN for the rest (``inf * 0``)."""
    dt = x.dtype
    if beta == 0:
        return _sel(_T().isfinite(x), x if threshold < 0 else _c(math.inf, dt),
                    _c(math.nan, dt))
    return _sel(x * _c(beta, dt) > _c(threshold, dt), x,
                _T().log1p(_T().exp(x * _c(beta, dt))) / _c(beta, dt))


def _softplus_half(x, beta, threshold):
    """torch's softplus of a float32 ``x`` for a 16-bit output: ``x`` where ``beta x`` passes
    ``threshold``, else ``(max(t, 0) + log1p(exp(-|t|))) / beta`` with ``t = beta x`` (the same
    value as ``log1p(exp(t)) / beta``, from one exp2 of a non-positive argument and
    :func:`_log1p_half` of the result, in ``(0, 1]``). Relative error 7.7e-6 at worst in a numpy emulation of the float32
    steps (at the exp's underflow, from rounding ``t log2(e)``), plus the approximate log's
    5.4e-6 where it serves; torch's ``log1pf(expf(t))`` took some 60 instructions and bound the
    kernel (2.94 TB/s on the H200 against a 4.3 TB/s copy). NaN stays NaN; -inf gives 0, +inf
    itself."""
    f32 = "float32"
    if beta == 0.0:  # torch's division by zero, as torch's form has it
        return _softplus(x, beta, threshold)
    t = x * _c(beta, f32) if beta != 1.0 else x
    scaled = (lambda v: v * _c(1.0 / beta, f32)) if beta != 1.0 else (lambda v: v)
    return _let(t, lambda u: _sel(
        u > _c(threshold, f32), x,
        scaled(_T().max(u, _c(0.0, f32)) + _log1p_half(_exp32(-_T().abs(u))))))


def _expm1_half(x):
    """``expm1`` of a float32 ``x`` for the 16-bit outputs' forms: the series below
    :data:`_SERIES_BELOW` in magnitude, else ``exp32(x) - 1`` (``exp2``'s absolute error near
    2^-22 against a result of at least 0.03 in magnitude on the negative side, 7.7e-6 relative;
    the relative error of ``exp2`` itself on the positive one). A numpy emulation of the
    float32 steps with an exact exp2 is within 1e-6 on [-100, 0]. libdevice's ``expm1f`` is
    three dozen instructions."""
    f32 = "float32"
    series = x * (_c(1.0, f32) + x * (_c(0.5, f32) + x * (_c(1.0 / 6.0, f32)
                                                         + x * _c(1.0 / 24.0, f32))))
    return _sel(_T().abs(x) < _c(_SERIES_BELOW, f32), series, _exp32(x) - _c(1.0, f32))


def _elu_half(x, alpha, scale):
    """torch's elu (and selu) of a float32 ``x`` for a 16-bit output: ``scale x`` where
    ``x > 0``, else ``alpha scale expm1(x)`` by :func:`_expm1_half`."""
    f32 = "float32"
    return _let(x, lambda v: _sel(v <= _c(0.0, f32), _expm1_half(v) * _c(alpha * scale, f32),
                                  v * _c(scale, f32)))


#: below this ``|x|``, tanh's 16-bit form takes ``x (1 - x^2 / 3)`` (relative error below
#: ``2 x^4 / 15``, 1.3e-7); from it on ``(1 - e) / (1 + e)``, ``e = exp(-2|x|)``, whose ``1 - e``
#: carries exp2's relative 2^-22 of ``e`` as ``2^-22 / (2|x|)`` of the result, 3.8e-6 there
_TANH_SERIES_BELOW = 2.0 ** -5


def _tanh_half(x):
    """tanh of a float32 ``x`` for a 16-bit output: ``sign(x) (1 - e) r``, ``e = exp(-2|x|)``
    (in (0, 1]) and ``r = 1 / (1 + e)`` (the fast reciprocal's range), the series below
    :data:`_TANH_SERIES_BELOW`. One exp2 and one reciprocal, where libdevice's ``tanhf`` took
    some 20 instructions an element and held the kernel under the copy's bandwidth. Both arms
    are computed and one selected (the reciprocal is an ``asm volatile``: in an arm of its own
    it would be a branch an element). +-inf give +-1, NaN stays NaN, -0 stays -0."""
    T = _T()
    f32 = "float32"
    e = _exp2_ftz(T.abs(x) * _c(-2.0 * _LOG2E, f32))
    return _let(e, lambda e: _let(
        T.copysign((_c(1.0, f32) - e) * _rcp(_c(1.0, f32) + e), x),
        lambda far: _sel(T.abs(x) < _c(_TANH_SERIES_BELOW, f32),
                         x * (_c(1.0, f32) - (x * x) * _c(1.0 / 3.0, f32)), far)))


#: Abramowitz and Stegun 7.1.26: ``erf(x) = 1 - t P(t) exp(-x^2)``, ``t = 1 / (1 + p x)``,
#: x >= 0, absolute error below 1.5e-7 (``p`` first, then P's coefficients from t^0 up)
ERF_AS_P = 0.3275911
ERF_AS_COEFFS = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
#: below this ``|x|``, erf's 16-bit form takes its series (three terms: relative error below
#: ``x^6 / 42``, 9e-8); from it on the absolute 1.5e-7 (and float32's) is 3e-6 of the result
_ERF_SERIES_BELOW = 0.125


def _erf_half(x):
    """erf of a float32 ``x`` for a 16-bit output: ``sign(x) (1 - t P(t) exp(-x^2))``
    (:data:`ERF_AS_COEFFS`; one fast reciprocal, one exp2) from :data:`_ERF_SERIES_BELOW` on,
    ``2 / sqrt(pi) x (1 - x^2 / 3 + x^4 / 10)`` below, where the absolute error would be
    relative to a small result; both computed, one selected (as :func:`_tanh_half`).
    libdevice's ``erff`` took some 27 instructions an element (3.5 TB/s on the H200). +-inf
    give +-1, NaN stays NaN, -0 stays -0."""
    T = _T()
    f32 = "float32"

    def tail(x2, t):
        acc = _c(ERF_AS_COEFFS[-1], f32)
        for c in reversed(ERF_AS_COEFFS[:-1]):
            acc = acc * t + _c(c, f32)
        return T.copysign(_c(1.0, f32) - acc * t * _exp2_ftz(x2 * _c(-_LOG2E, f32)), x)

    return _let(x * x, lambda x2: _let(
        _rcp(T.abs(x) * _c(ERF_AS_P, f32) + _c(1.0, f32)), lambda t: _let(
            tail(x2, t), lambda far: _sel(
                T.abs(x) < _c(_ERF_SERIES_BELOW, f32),
                x * (_c(2.0 / math.sqrt(math.pi), f32)
                     + x2 * (_c(-2.0 / (3.0 * math.sqrt(math.pi)), f32)
                             + x2 * _c(1.0 / (5.0 * math.sqrt(math.pi)), f32))),
                far))))


def _log_half(x):
    """log of a float32 ``x`` for a 16-bit output: ``__logf`` (lg2.approx, an absolute
    2^-21.4 on [0.5, 2], relative 2^-22 past it), and near 1, where that absolute error would
    be relative to a small result, ``log1p``'s series of ``x - 1`` (exact: Sterbenz) below
    :data:`_SERIES_BELOW` (relative error below 2.1e-7). libdevice's ``logf`` took some 30
    instructions an element (3.3 TB/s on the H200). 0 gives -inf, a negative NaN, NaN and inf
    themselves."""
    f32 = "float32"
    return _let(x - _c(1.0, f32), lambda d: _let(
        _T().call_pure_extern(f32, "__logf", x), lambda far: _sel(
            _T().abs(d) < _c(_SERIES_BELOW, f32), _log1p_series(d), far)))


#: sin and cos's 16-bit forms: ``sin(r) = r (1 + r^2 (S1 + r^2 S2))`` and ``cos(r) = 1 + r^2
#: (C1 + r^2 (C2 + r^2 C3))`` on |r| <= pi / 4, fits of relative error 1.9e-6 and 3.9e-8
#: (reweighted least squares on Chebyshev nodes, the constant term held at 1, then rounded to
#: float32)
SIN_COEFFS = (-0.16663377, 0.00816294)
COS_COEFFS = (-0.49999884, 0.04165573, -0.00135912)
#: pi / 2 in two float32 parts (Cody and Waite): each ``k * part`` of the reduction is exact
#: inside an fma, so ``r = x - k pi / 2`` is off by at most ``k`` times the third part
#: (1.7e-15): over every bfloat16 and float16 input below :data:`_TRIG_FAST_BELOW`, at most
#: 3.2e-7 of ``r`` (float16 54304; bfloat16 8.2e-9), though ``r`` comes as close to 0 as
#: 1.5e-5 (float16 177.5). CUDA's ``sinf`` takes a third part for float32's precision
PIO2_PARTS = (1.5707963705062866, -4.371138828673793e-08)
_TRIG_FAST_BELOW = 105615.0
#: 1.5 * 2^23: ``x * 2 / pi + this`` rounds ``x * 2 / pi`` to an integer ``k`` whose low bits
#: are the float's own
_ROUND_MAGIC = 12582912.0


def _sincos_half(x, cos: bool):
    """sin (or cos) of a float32 ``x`` for a 16-bit output: ``k = rint(2 x / pi)``, ``r = x - k
    pi / 2`` (:data:`PIO2_PARTS`), then the quadrant ``k mod 4`` picks ``+-sin(r)`` or
    ``+-cos(r)`` (:data:`SIN_COEFFS`, :data:`COS_COEFFS`); past :data:`_TRIG_FAST_BELOW`
    libdevice's ``sinf``/``cosf`` (its Payne-Hanek reduction), in a branch no activation
    takes. Where sin or cos is small away from 0 (x near a multiple of pi), ``r`` is small
    and the result keeps its relative accuracy. libdevice's own took some 25 instructions an
    element (3.9 TB/s on the H200). +-inf and NaN give NaN; sin keeps -0."""
    T = _T()
    f32 = "float32"
    # on |x| (an operand modifier): sin(x) = sign(x) sin(|x|), cos(x) = cos(|x|), and sin's
    # sign goes in with the quadrant's (the reduction of -0 would give +0)
    j = T.abs(x) * _c(2.0 / math.pi, f32) + _c(_ROUND_MAGIC, f32)

    def reduced(jv):
        k = jv - _c(_ROUND_MAGIC, f32)
        r = T.abs(x) - k * _c(PIO2_PARTS[0], f32)
        r = r - k * _c(PIO2_PARTS[1], f32)
        q = T.reinterpret(jv, "int32") + (1 if cos else 0)  # cos(x) = sin(x + pi / 2)
        sign = T.shift_left(T.bitwise_and(q, 2), 30)
        if not cos:
            sign = T.bitwise_xor(sign, T.bitwise_and(T.reinterpret(x, "int32"),
                                                     _c(-(1 << 31), "int32")))

        def of(rv):
            r2 = rv * rv
            sin_r = rv * (_c(1.0, f32) + r2 * (_c(SIN_COEFFS[0], f32)
                                               + r2 * _c(SIN_COEFFS[1], f32)))
            cos_r = _c(1.0, f32) + r2 * (_c(COS_COEFFS[0], f32) + r2 * (
                _c(COS_COEFFS[1], f32) + r2 * _c(COS_COEFFS[2], f32)))
            # both bound, one selected, the sign flipped by the quadrant's bit 1 moved to the
            # sign bit: no branch (a select between expressions is printed as if/else)
            return _let(sin_r, lambda sv: _let(cos_r, lambda cv: _let(
                _sel(T.bitwise_and(q, 1) != 0, cv, sv), lambda v: T.reinterpret(
                    T.bitwise_xor(T.reinterpret(v, "int32"), sign), f32))))

        return _let(r, of)

    name = "cosf" if cos else "sinf"
    # the fast form bound first: only the far arm (libdevice's) is a branch
    return _let(_let(j, reduced), lambda near: _sel(
        T.abs(x) < _c(_TRIG_FAST_BELOW, f32), near, T.call_pure_extern(f32, name, x)))


def _hard_gate(x):
    """``min(max(x + 3, 0), 6)`` with ``std::max``/``std::min``'s NaN rule, as torch's
    hardswish and hardsigmoid."""
    return _std_min(_std_max(x + _c(3.0, x.dtype), _c(0.0, x.dtype)), _c(6.0, x.dtype))


def _gelu_grad(x):
    """d gelu(x) / dx (torch's GeluBackward, approximate='none')."""
    dt = x.dtype
    T = _T()
    cdf = _c(0.5, dt) * (_c(1.0, dt) + T.erf(x * _c(math.sqrt(0.5), dt)))
    pdf = T.exp(_c(-0.5, dt) * x * x) * _c((2.0 / math.sqrt(math.pi)) * math.sqrt(0.5) * 0.5, dt)
    return cdf + x * pdf


def _gelu_tanh_grad(x):
    dt = x.dtype
    T = _T()
    x_sq = x * x
    x_cube = x_sq * x
    inner = _c(_K_BETA, dt) * (x + _c(_K_KAPPA, dt) * x_cube)
    th = T.tanh(inner)
    left = _c(0.5, dt) * x
    right = _c(1.0, dt) + th
    left_d = _c(0.5, dt) * right
    inner_d = _c(_K_BETA, dt) * (_c(1.0, dt) + _c(3.0 * _K_KAPPA, dt) * x_sq)
    right_d = left * (_c(1.0, dt) - th * th) * inner_d  # torch's order
    return left_d + right_d


def _silu_grad(x):
    s = _sigmoid(x)
    one = _c(1.0, x.dtype)
    return s * (one + x * (one - s))


_GATES = {"silu": (_silu, _silu_grad), "gelu": (_gelu, _gelu_grad),
          "gelu_tanh": (_gelu_tanh, _gelu_tanh_grad)}
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _elu(x, alpha, scale):
    dt = x.dtype
    return _sel(x <= _c(0.0, dt), _expm1(x) * _c(alpha * scale, dt), x * _c(scale, dt))


def _floor_div(a, b):
    """torch's floor division of floats (``div_floor_floating``): from fmod, so the quotient is
    exact where a / b rounds across an integer."""
    T = _T()
    dt = a.dtype
    z = _c(0.0, dt)

    # each intermediate bound once: a select is printed as if/else, and one read in several
    # arms of the next was copied into each (12146 characters of TIR for bf16, 24 selects)
    def from_mod(mod):
        return _let(_sel((mod != z) & ((b < z) != (mod < z)), (a - mod) / b - _c(1.0, dt),
                         (a - mod) / b), from_div)

    def from_div(div):
        return _let(T.floor(div), lambda fl: _sel(
            b == z, a / b, _sel(div != z, _sel(div - fl > _c(0.5, dt), fl + _c(1.0, dt), fl),
                                T.copysign(z, a / b))))

    return _let(T.fmod(a, b), from_mod)


def _remainder(a, b):
    """torch.remainder: the result takes the divisor's sign."""
    T = _T()
    if str(a.dtype) not in _FLOATS:
        return T.floormod(a, b)
    z = _c(0.0, a.dtype)
    # fmod bound once: libdevice's fmodf is a loop of some hundred instructions, and a select
    # is printed as if/else with each read of it copied into its arms (1766 SASS instructions
    # an unmasked body of eight bf16 elements)
    return _let(T.fmod(a, b), lambda mod: _sel((mod != z) & ((b < z) != (mod < z)), mod + b,
                                                 mod))


def _lerp(s, e, w):
    dt = s.dtype
    return _sel(_T().abs(w) < _c(0.5, dt), s + w * (e - s), e - (e - s) * (_c(1.0, dt) - w))


def _clamp(x, lo, hi, has_lo, has_hi):
    """torch.clamp with scalar bounds: NaN stays NaN, ``min > max`` gives ``max``."""
    y = _w(x)
    dt = y.dtype
    if has_lo:
        lo_c = _c(lo, dt)
        y = _sel(y < lo_c, lo_c, y)
    if has_hi:
        hi_c = _c(hi, dt)
        y = _sel(y > hi_c, hi_c, y)
    return y


def _cmp(op):
    return lambda xs, ps, dt: (op(_w(xs[0]), _w(xs[1])),)


def _round(x):
    T = _T()
    return T.nearbyint(_w(x)) if str(x.dtype) in _FLOATS else x  # rint: half to even


def _rounding(fn):
    return lambda xs, ps, dt: ((fn(_T())(_w(xs[0])) if dt in _FLOATS else xs[0]),)


def _fns() -> dict[str, ScalarFn]:
    """The registry (built once: each builder is a plain function of TileLang expressions)."""
    fns: list[ScalarFn] = []

    def add(name, arity, build, *, params=(), exact=False, integral=False, outputs=1,
            keep=(), bool_out=False, half_build=None, flat_launch=None, rows_launch=None,
            prelude=False):
        fns.append(ScalarFn(name, arity, outputs, tuple(params), exact, integral, build,
                            keep, bool_out, half_build, flat_launch, rows_launch, prelude))

    def unary(name, f, **kw):
        add(name, 1, lambda xs, ps, dt: (f(xs[0]),), **kw)

    T = _T
    # --- unary math
    # the flat launches past L2 (:func:`_default_launch`): one access a thread unless the
    # function declares two, where its 16-bit form's math wants the second access in flight
    # (bf16 32768 x 8192 on the H200, 2026-12-04, TB/s, 128/2 against 128/1: expm1 4.224 /
    # 4.103, log1p 4.236 / 4.117, tanh 4.253 / 3.983, sin 4.229 / 3.821, cos 4.268 / 3.895,
    # elu 4.253 / 3.972, selu 4.241 / 3.919, softplus 4.248 / 3.915; the cheap functions the
    # other way: neg 4.241 / 4.258, sign 4.235 / 4.259, clamp 4.238 / 4.271, sqrt 4.229 / 4.266,
    # log's form 4.226 / 4.237)
    unary("abs", lambda x: T().abs(_w(x)) if str(x.dtype) != "bool" else x, exact=True,
          integral=True)
    unary("neg", lambda x: -_w(x), exact=True, integral=True)
    unary("exp", lambda x: T().exp(x))
    unary("expm1", _expm1, half_build=lambda xs, ps, dt: (_let(xs[0], _expm1_half),),
          flat_launch=(128, 2))
    unary("log", lambda x: T().log(x), half_build=lambda xs, ps, dt: (_let(xs[0], _log_half),))
    unary("log1p", lambda x: T().log1p(x), half_build=lambda xs, ps, dt: (
        _let(xs[0], _log1p_half),), flat_launch=(128, 2))
    # the 16-bit forms of the roots and the reciprocal: the approximate instructions (within
    # a float32 ulp or two, subnormals kept: :data:`HALF_PRELUDE`; libdevice's ``rsqrtf``),
    # where the float32 forms take torch's IEEE sqrt and division and their slow paths
    unary("sqrt", lambda x: T().sqrt(x), prelude=True, half_build=lambda xs, ps, dt: (
        T().call_pure_extern("float32", "tileops_sqrt", xs[0]),))
    unary("rsqrt", lambda x: _c(1.0, x.dtype) / T().sqrt(x), half_build=lambda xs, ps, dt: (
        T().call_pure_extern("float32", "rsqrtf", xs[0]),))
    unary("reciprocal", lambda x: _c(1.0, x.dtype) / x, prelude=True,
          half_build=lambda xs, ps, dt: (
              T().call_pure_extern("float32", "tileops_rcp", xs[0]),))
    unary("sin", lambda x: T().sin(x), half_build=lambda xs, ps, dt: (
        _let(xs[0], lambda x: _sincos_half(x, False)),), flat_launch=(128, 2))
    unary("cos", lambda x: T().cos(x), half_build=lambda xs, ps, dt: (
        _let(xs[0], lambda x: _sincos_half(x, True)),), flat_launch=(128, 2))
    unary("tanh", lambda x: T().tanh(x), half_build=lambda xs, ps, dt: (_let(xs[0], _tanh_half),),
          prelude=True, flat_launch=(128, 2))
    unary("sigmoid", _sigmoid, half_build=lambda xs, ps, dt: (
        _sigmoid_terms32(xs[0], lambda s, c: s),))
    # the 16-bit forms' flat launches (the same sweep): erf 64/4 4.245, 64/2 4.176, 128/2
    # 4.159 (eager 3.327, compile 3.102); tanh 128/2 4.282, sin 128/2 4.247, cos 128/2 4.269,
    # log 128/1 4.258 and 128/2 4.247 (eager 3.352, compile 3.394)
    unary("erf", lambda x: T().erf(x), half_build=lambda xs, ps, dt: (_let(xs[0], _erf_half),),
          prelude=True, flat_launch=(64, 4))
    add("floor", 1, _rounding(lambda t: t.floor), exact=True, integral=True)
    add("ceil", 1, _rounding(lambda t: t.ceil), exact=True, integral=True)
    add("round", 1, lambda xs, ps, dt: (_round(xs[0]),), exact=True, integral=True)
    add("trunc", 1, _rounding(lambda t: t.trunc), exact=True, integral=True)
    unary("sign", lambda x: (T().cast(_w(x) > _c(0, _w(x).dtype), x.dtype)
                             - T().cast(_w(x) < _c(0, _w(x).dtype), x.dtype)),
          exact=True, integral=True)
    for name, f, other in (("isnan", _isnan, False), ("isinf", lambda x: T().isinf(x), False),
                           ("isfinite", lambda x: T().isfinite(x), True)):
        add(name, 1, _float_test(f, other), exact=True, integral=True, bool_out=True)
    # --- activations (the flat launches: the bf16 sweep on the H200, 32768 x 8192, TB/s,
    # 2026-12-04, benchmarks/results/sweep_elementwise-cuda0.txt and sweep_elementwise_b-
    # cuda0.txt). relu 128/1 4.250, 256/1 4.269 (eager 4.281, compile 4.262); the half forms,
    # bound by their math, from the second run (one rcp.approx, silu's half form): gelu 64/4
    # 4.225, 64/2 4.185, 128/8 4.118; gelu_tanh 128/2 4.248, 64/2 4.246, 128/4 3.983; silu
    # 128/1 and 64/2 4.258, 64/4 4.152 (compile 4.152); mish 128/1 4.255, 64/2 4.242, 64/4
    # 4.144
    unary("relu", lambda x: _sel(_w(x) < _c(0, _w(x).dtype), _c(0, _w(x).dtype), _w(x)),
          exact=True, integral=True)
    unary("gelu", _gelu, half_build=lambda xs, ps, dt: (_gelu_half(xs[0]),),
          flat_launch=(64, 4))
    unary("gelu_tanh", _gelu_tanh, half_build=lambda xs, ps, dt: (_gelu_tanh_half(xs[0]),),
          flat_launch=(64, 2))
    unary("silu", _silu, half_build=lambda xs, ps, dt: (_silu_half(xs[0]),),
          flat_launch=(64, 2))
    unary("mish", lambda x: x * T().tanh(T().log1p(T().exp(x))),
          half_build=lambda xs, ps, dt: (_mish_half(xs[0]),), flat_launch=(64, 2))
    add("softplus", 1, lambda xs, ps, dt: (_softplus(xs[0], ps[0], ps[1]),),
        params=("beta", "threshold"), flat_launch=(128, 2),
        half_build=lambda xs, ps, dt: (_softplus_half(xs[0], float(ps[0]), float(ps[1])),))
    add("leaky_relu", 1, lambda xs, ps, dt: (_sel(
        xs[0] > _c(0.0, dt), xs[0], xs[0] * _c(ps[0], dt)),), params=("negative_slope",))
    add("elu", 1, lambda xs, ps, dt: (_elu(xs[0], ps[0], 1.0),), params=("alpha",),
        half_build=lambda xs, ps, dt: (_elu_half(xs[0], float(ps[0]), 1.0),),
        flat_launch=(128, 2))
    unary("selu", lambda x: _elu(x, _SELU_ALPHA, _SELU_SCALE), flat_launch=(128, 2),
          half_build=lambda xs, ps, dt: (_elu_half(xs[0], _SELU_ALPHA, _SELU_SCALE),))
    # torch's division by 6; the 16-bit forms multiply by float32's 1/6 (within 2 float32 ulp
    # of the quotient, one 16-bit rounding): the IEEE division was most of their instructions.
    # hardswish scales the gate first, so x * 6 never overflows (bf16 x past 5.7e37: x itself,
    # as torch's CUDA kernel gives). The default launch (bf16 32768 x 8192 on the H200,
    # 2026-12-04: hardswish 128/1 4.271 TB/s, eager 4.274; hardsigmoid 128/1 4.277, eager
    # 4.275)
    unary("hardswish", lambda x: x * _hard_gate(x) / _c(6.0, x.dtype),
          half_build=lambda xs, ps, dt: (xs[0] * (_hard_gate(xs[0]) * _c(1.0 / 6.0, dt)),))
    unary("hardsigmoid", lambda x: _hard_gate(x) / _c(6.0, x.dtype),
          half_build=lambda xs, ps, dt: (_hard_gate(xs[0]) * _c(1.0 / 6.0, dt),))
    # integers too: the constants truncated toward zero, as torch's hardtanh of an integer
    add("hardtanh", 1, lambda xs, ps, dt: (_clamp(xs[0], ps[0], ps[1], True, True),),
        params=("min_val", "max_val"), exact=True, integral=True)
    add("clamp", 1, lambda xs, ps, dt: (_clamp(xs[0], *ps),),
        params=("min", "max", "has_min", "has_max"), exact=True, integral=True)
    # --- binary
    add("add", 2, lambda xs, ps, dt: (xs[0] + xs[1] if ps[0] == 1
                                      else xs[0] + _c(ps[0], dt) * xs[1],),
        params=("alpha",), integral=True)
    add("sub", 2, lambda xs, ps, dt: (xs[0] - xs[1] if ps[0] == 1
                                      else xs[0] - _c(ps[0], dt) * xs[1],),
        params=("alpha",), integral=True)
    add("mul", 2, lambda xs, ps, dt: (xs[0] * xs[1],), integral=True)
    add("div", 2, lambda xs, ps, dt: (xs[0] / xs[1],))
    add("div_trunc", 2, lambda xs, ps, dt: (
        T().trunc(xs[0] / xs[1]) if dt in _FLOATS else T().truncdiv(xs[0], xs[1]),),
        integral=True)
    add("div_floor", 2, lambda xs, ps, dt: (
        _floor_div(xs[0], xs[1]) if dt in _FLOATS else T().floordiv(xs[0], xs[1]),),
        integral=True)
    add("pow", 2, lambda xs, ps, dt: (T().pow(xs[0], xs[1]),))
    add("maximum", 2, lambda xs, ps, dt: (_max_nan(_w(xs[0]), _w(xs[1])),), exact=True,
        integral=True)
    add("minimum", 2, lambda xs, ps, dt: (_min_nan(_w(xs[0]), _w(xs[1])),), exact=True,
        integral=True)
    add("remainder", 2, lambda xs, ps, dt: (_remainder(xs[0], xs[1]),), integral=True)
    for name, op in (("eq", lambda a, b: a == b), ("ne", lambda a, b: a != b),
                     ("lt", lambda a, b: a < b), ("le", lambda a, b: a <= b),
                     ("gt", lambda a, b: a > b), ("ge", lambda a, b: a >= b)):
        add(name, 2, _cmp(op), exact=True, integral=True, bool_out=True)
    add("clamp_tensor", 3, lambda xs, ps, dt: (_clamp_tensor(xs, *ps),),
        params=("has_lo", "has_hi"), exact=True, integral=True)
    add("where", 3, lambda xs, ps, dt: (_sel(xs[0], _w(xs[1]), _w(xs[2])),), keep=(0,),
        exact=True, integral=True)
    add("masked_fill", 2, lambda xs, ps, dt: (
        _sel(xs[1], _c(ps[0], _w(xs[0]).dtype), _w(xs[0])),), params=("value",), keep=(1,),
        exact=True, integral=True)
    add("lerp", 3, lambda xs, ps, dt: (_lerp(*xs),))
    add("lerp_scalar", 2, lambda xs, ps, dt: (_lerp(xs[0], xs[1], _c(ps[0], dt)),),
        params=("weight",))
    # --- gated: a = gate, b = up
    half_gates = {"silu": (_silu_half, _silu_grad_half), "gelu": (_gelu_half, _gelu_grad_half),
                  "gelu_tanh": (_gelu_tanh_half, _gelu_tanh_grad_half)}
    for g, (f, df) in _GATES.items():
        hf, hdf = half_gates.get(g, (None, None))
        # gelu's 16-bit form is the heaviest: two accesses a thread under a cap of 64
        # registers (gelu_and_mul over 16384 x 28672: 128/2 capped 4.391 TB/s, 128/1 4.142,
        # torch.compile 3.747; H200, 2026-12-04)
        add(f"{g}_and_mul", 2, _gated(f), half_build=hf and _gated(hf),
            rows_launch=(128, 2, 8) if g == "gelu" else None)
        add(f"{g}_and_mul_bwd", 3, _gated_bwd(f, df), outputs=2,
            half_build=hf and _gated_bwd(hf, hdf))
    # --- gradients: (dy, y) from the output, (dy, x) from the input
    z = lambda dt: _c(0.0, dt)  # noqa: E731
    one = lambda dt: _c(1.0, dt)  # noqa: E731
    add("relu_bwd", 2, lambda xs, ps, dt: (_sel(xs[1] <= z(dt), z(dt), xs[0]),))
    add("sigmoid_bwd", 2, lambda xs, ps, dt: (xs[0] * (one(dt) - xs[1]) * xs[1],))
    add("tanh_bwd", 2, lambda xs, ps, dt: (xs[0] * (one(dt) - xs[1] * xs[1]),))
    # the unary math's gradients, torch's formulas: (dy, y) where the forward saves its
    # output (exp's is mul, log's div, neg's neg: the family's own functions)
    add("expm1_bwd", 2, lambda xs, ps, dt: (xs[0] * (xs[1] + one(dt)),))
    add("sqrt_bwd", 2, lambda xs, ps, dt: (xs[0] / (xs[1] * _c(2.0, dt)),))
    add("rsqrt_bwd", 2, lambda xs, ps, dt: (
        _c(-0.5, dt) * xs[0] * (xs[1] * xs[1] * xs[1]),))
    add("reciprocal_bwd", 2, lambda xs, ps, dt: (-xs[0] * (xs[1] * xs[1]),))
    add("log1p_bwd", 2, lambda xs, ps, dt: (xs[0] / (xs[1] + one(dt)),))
    add("sin_bwd", 2, lambda xs, ps, dt: (xs[0] * T().cos(xs[1]),))
    add("cos_bwd", 2, lambda xs, ps, dt: (xs[0] * -T().sin(xs[1]),))
    add("erf_bwd", 2, lambda xs, ps, dt: (
        xs[0] * _c(1.1283791670955126, dt) * T().exp(-(xs[1] * xs[1])),))
    # torch's dy * sgn(x): zero at 0 and at NaN
    add("abs_bwd", 2, lambda xs, ps, dt: (_sel(xs[1] > z(dt), xs[0], _sel(
        xs[1] < z(dt), -xs[0], z(dt))),))
    for g, (_, df) in _GATES.items():
        hdf = half_gates.get(g, (None, None))[1]
        add(f"{g}_bwd", 2, _grad_times(df), half_build=hdf and _grad_times(hdf))
    add("mish_bwd", 2, lambda xs, ps, dt: (_mish_bwd(xs[0], xs[1]),))
    add("softplus_bwd", 2, lambda xs, ps, dt: (_softplus_bwd(xs[0], xs[1], *ps),),
        params=("beta", "threshold"))
    add("leaky_relu_bwd", 2, lambda xs, ps, dt: (
        _sel(xs[1] > z(dt), xs[0], xs[0] * _c(ps[0], dt)),), params=("negative_slope",))
    add("elu_bwd", 2, lambda xs, ps, dt: (_sel(
        xs[1] <= z(dt), xs[0] * _c(ps[0], dt) * T().exp(xs[1]), xs[0]),), params=("alpha",))
    add("selu_bwd", 2, lambda xs, ps, dt: (_sel(
        xs[1] <= z(dt), xs[0] * _c(_SELU_ALPHA * _SELU_SCALE, dt) * T().exp(xs[1]),
        xs[0] * _c(_SELU_SCALE, dt)),))
    # torch's boundaries (since its hardswish gradient follows the documented formula): zero
    # at x <= -3, dy at x >= 3 (x = +-3 are common in bfloat16)
    add("hardswish_bwd", 2, lambda xs, ps, dt: (_sel(
        xs[1] <= _c(-3.0, dt), z(dt), _sel(xs[1] < _c(3.0, dt),
                                           xs[0] * (xs[1] / _c(3.0, dt) + _c(0.5, dt)),
                                           xs[0])),))
    add("hardsigmoid_bwd", 2, lambda xs, ps, dt: (_sel(
        (xs[1] > _c(-3.0, dt)) & (xs[1] < _c(3.0, dt)), xs[0] * _c(1.0 / 6.0, dt), z(dt)),))
    add("hardtanh_bwd", 2, lambda xs, ps, dt: (_sel(
        (xs[1] <= _c(ps[0], dt)) | (xs[1] >= _c(ps[1], dt)), z(dt), xs[0]),),
        params=("min_val", "max_val"))
    # -(dy * ((a / b) / b)) as torch computes it: b * b underflows (b = 1e-30 in float32)
    # where dividing twice does not
    add("div_bwd_b", 3, lambda xs, ps, dt: (-(xs[0] * ((xs[1] / xs[2]) / xs[2])),))
    # torch's pow gradients: (dout, a, b) -> dout * b * a^(b - 1), zero where b == 0;
    # dout * a^b * log(a), zero where a == 0 and b >= 0
    add("pow_bwd_a", 3, lambda xs, ps, dt: (_sel(
        xs[2] == z(dt), z(dt), xs[0] * (xs[2] * T().pow(xs[1], xs[2] - one(dt)))),))
    add("pow_bwd_b", 3, lambda xs, ps, dt: (_sel(
        (xs[1] == z(dt)) & (xs[2] >= z(dt)), z(dt),
        xs[0] * (T().pow(xs[1], xs[2]) * T().log(xs[1]))),))
    # torch's remainder gradient of the divisor: -dout * floor(a / b)
    add("remainder_bwd_b", 3, lambda xs, ps, dt: (-xs[0] * _floor_div(xs[1], xs[2]),))
    return {f.name: f for f in fns}


def _float_test(f, other):
    """``f`` of a floating input; an integer or bool input is never NaN or infinite."""
    return lambda xs, ps, dt: (f(_w(xs[0])) if dt in _FLOATS else _c(other, "bool"),)


def _gated(f):
    """``f(a) * b`` (a the gate, b the up projection)."""
    return lambda xs, ps, dt: (f(xs[0]) * xs[1],)


def _gated_bwd(f, df):
    """``(dy, a, b) -> (dy * b * f'(a), dy * f(a))``."""
    return lambda xs, ps, dt: (xs[0] * xs[2] * df(xs[1]), xs[0] * f(xs[1]))


def _grad_times(df):
    """``(dy, x) -> dy * f'(x)``."""
    return lambda xs, ps, dt: (xs[0] * df(xs[1]),)


def _clamp_tensor(xs, has_lo, has_hi):
    """torch.clamp with tensor bounds: ``minimum(maximum(x, lo), hi)``, NaN from any."""
    y = _w(xs[0])
    if has_lo and has_hi:  # the lower clamp bound once: the upper one reads it three times
        return _let(_max_nan(y, _w(xs[1])), lambda v: _min_nan(v, _w(xs[2])))
    if has_lo:
        y = _max_nan(y, _w(xs[1]))
    if has_hi:
        y = _min_nan(y, _w(xs[2]))
    return y


def _mish_bwd(dy, x):
    T = _T()
    one = _c(1.0, x.dtype)
    # tanh(softplus(x)) bound once: read three times, it was computed three times
    return _let(T.tanh(T.log1p(T.exp(x))),
                lambda ts: dy * (ts + x * _sigmoid(x) * (one - ts * ts)))


def _softplus_bwd(dy, x, beta, threshold):
    dt = x.dtype
    zz = _T().exp(x * _c(beta, dt))
    return _sel(x * _c(beta, dt) > _c(threshold, dt), dy, dy * zz / (zz + _c(1.0, dt)))


#: name -> :class:`ScalarFn`
SCALAR_FNS: dict[str, ScalarFn] = _fns()


# --- the call spec -------------------------------------------------------------------------------


def _is_const(v) -> bool:
    return isinstance(v, (bool, int, float))


class ElementwiseSpec(CallSpec, frozen=True, kw_only=True):
    """What an elementwise implementation is told about a call: the function and its
    constants, every operand's dtype, shape (inputs broadcast to ``out_shape``), element
    strides and data-pointer alignment (the largest power of two dividing the address, capped
    at 16 bytes), and the dtype the math runs in (the op's choice)."""

    fn: str
    params: tuple = ()
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    compute: str
    out_shape: tuple[int, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    in_strides: tuple[tuple[int, ...], ...]
    in_align: tuple[int, ...]
    out_strides: tuple[tuple[int, ...], ...]
    out_align: tuple[int, ...]

    def __post_init__(self) -> None:
        name = type(self).__name__
        f = SCALAR_FNS.get(self.fn)
        if f is None:
            raise ValueError(f"{name}.fn must name a scalar function of SCALAR_FNS, got "
                             f"{self.fn!r}")
        if len(self.params) != len(f.params) or not all(map(_is_const, self.params)):
            want = ", ".join(f.params) or "none"
            raise ValueError(f"{name}.params: {self.fn} takes {len(f.params)} constants "
                             f"({want}) as bools, ints or floats, got {self.params!r}")
        counts = (("in_dtypes", f.arity), ("in_shapes", f.arity), ("in_strides", f.arity),
                  ("in_align", f.arity), ("out_dtypes", f.outputs),
                  ("out_strides", f.outputs), ("out_align", f.outputs))
        for field, n in counts:
            got = len(getattr(self, field))
            if got != n:
                what = "inputs" if field.startswith("in_") else "outputs"
                raise ValueError(f"{name}.{field}: {self.fn} has {n} {what}, got {got} "
                                 f"entries")
        allowed = ", ".join(sorted(DTYPES_SERVED))
        for field in ("in_dtypes", "out_dtypes"):
            for i, dt in enumerate(getattr(self, field)):
                if dt not in DTYPES_SERVED:
                    raise ValueError(f"{name}.{field}[{i}] must be one of {allowed}, got "
                                     f"{dt!r}")
        self.check_fields(choices={"compute": DTYPES_SERVED})
        if not f.integral and self.compute not in _FLOATS:
            raise ValueError(f"{name}.compute: {self.fn} computes in a floating dtype, got "
                             f"{self.compute}")
        if not f.exact and self.compute in _HALF:
            raise ValueError(f"{name}.compute: {self.fn} is not exact in {self.compute}; "
                             f"compute it in float32")
        _check_shape(name, "out_shape", self.out_shape)
        rank = len(self.out_shape)
        for i, shape in enumerate(self.in_shapes):
            _check_shape(name, f"in_shapes[{i}]", shape)
            if len(shape) > rank or any(s not in (1, o) for s, o in
                                        zip(reversed(shape), reversed(self.out_shape), strict=False)):
                raise ValueError(f"{name}.in_shapes[{i}]: {list(shape)} does not broadcast "
                                 f"to out_shape {list(self.out_shape)}")
        ranks = [(f"in_strides[{i}]", s, len(self.in_shapes[i]))
                 for i, s in enumerate(self.in_strides)]
        ranks += [(f"out_strides[{i}]", s, rank) for i, s in enumerate(self.out_strides)]
        for field, strides, r in ranks:
            if len(strides) != r or not all(isinstance(s, int) and not isinstance(s, bool)
                                            and s >= 0 for s in strides):
                raise ValueError(f"{name}.{field} must be {r} element strides (ints >= 0), "
                                 f"got {strides!r}")
        for field in ("in_align", "out_align"):
            for i, a in enumerate(getattr(self, field)):
                if a not in (1, 2, 4, 8, 16):
                    raise ValueError(f"{name}.{field}[{i}] must be 1, 2, 4, 8 or 16 (bytes), "
                                     f"got {a!r}")

    @property
    def scalar_fn(self) -> ScalarFn:
        return SCALAR_FNS[self.fn]


def _check_shape(name: str, field: str, shape) -> None:
    if not isinstance(shape, tuple) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"{name}.{field} must be a tuple of sizes (ints >= 0), got {shape!r}")


class ElementwiseInterface(KernelInterface):
    """One slot: ``forward(*inputs, *outputs)`` with the tensors as the op has them: inputs
    broadcastable to ``out_shape`` at any strides (0-dim included), outputs of ``out_shape``
    (fresh tensors in torch's layout for the inputs, or for an in-place call the input object
    itself, possibly a strided view; an output that partly overlaps an input is the op's to
    refuse)."""

    slot = "elementwise"
    call_spec = ElementwiseSpec


# --- collapse and plan ---------------------------------------------------------------------------


def collapse(shape, strides):
    """The fewest dims that address every operand: ``(groups, merged)`` where ``groups`` are
    the surviving dims of ``shape`` (outer to inner) as tuples of the original dims each
    merges, and ``merged[k][g]`` is operand ``k``'s stride across group ``g`` (the stride of
    its innermost dim). ``strides[k]`` are aligned to ``shape`` with 0 for broadcast dims;
    ``strides[0]`` is the (first) output's. Dims of extent 1 drop out; the rest are visited in
    the output's memory order (its strides from largest to smallest; a contiguous output keeps
    the logical order), and adjacent dims merge where every operand is contiguous across them:
    an output in its input's permuted layout (torch's for a transposed or ``[B, S, H, D]`` as
    ``[B, H, S, D]`` input) is one flat run over both storages, as torch's TensorIterator
    reorders its dims before it coalesces them."""
    dims = [d for d, n in enumerate(shape) if n != 1]
    dims.sort(key=lambda d: -strides[0][d])  # stable: equal strides keep the logical order
    groups: list[list[int]] = []
    for d in dims:
        n = shape[d]
        if groups and all(st[groups[-1][-1]] == st[d] * n for st in strides):
            groups[-1].append(d)
        else:
            groups.append([d])
    merged = tuple(tuple(st[g[-1]] for g in groups) for st in strides)
    return tuple(tuple(g) for g in groups), merged


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a call is launched; with the dtypes and the function, what its program depends on.

    ``kind``: ``empty`` (no elements), ``flat``, ``rows`` or ``strided`` (module docstring).
    ``groups``: the collapsed dims as the output dims each merges. ``codes[k][g]``: operand
    ``k``'s stride across group ``g`` (outputs first, then inputs) as the program reads it: 0
    (broadcast), 1 (unit) or 2 (the launch-time stride of its dim). Inputs' ``ones[k]``: which
    of its own dims have extent 1 (declared so; the rest take the output's extents). A thread
    makes ``per`` accesses of ``vec`` elements; ``tcols`` of a CTA's ``threads`` span a row's
    vectors (tiled kinds: all of them for rows of ``threads`` vectors or more, else the power
    of two that covers the row, so narrow rows stack in a CTA; one program a width class). ``wide``: 64-bit extents and strides (an operand spans 2**31
    elements or more). ``row``: for a flat plan whose inputs of code 3 are a row broadcast
    over contiguous operands (``[M, 4097] + [4097]``), the output dims of that row: such an
    input is read at the flat index modulo the row's length (:func:`_modular`). ``half``: the
    function's 16-bit form serves the call where it has one and the outputs are 16-bit
    (:class:`ScalarFn`). ``resident``: the CTAs an SM the program is compiled to hold at once
    (``__launch_bounds__``' second argument: a register cap of 65536 / (``threads`` x
    ``resident``) a thread), 0 for no cap. ``grid_y``: the tiled kinds' row blocks on the
    grid's y and column blocks on its x (where the row blocks fit in y's 65535), else one grid
    dimension whose index the program divides into the two."""

    kind: str
    groups: tuple[tuple[int, ...], ...]
    codes: tuple[tuple[int, ...], ...]
    ones: tuple[tuple[bool, ...], ...]
    vec: int
    threads: int
    per: int
    tcols: int
    wide: bool
    row: tuple[int, ...] = ()
    half: bool = True
    resident: int = 0
    grid_y: bool = False


def _default_launch(kind: str, in_codes, fn: str = "") -> tuple[int, int, int]:
    """``(threads, per, resident)`` by layout class and what is read, from the sweep on the H200
    (benchmarks/sweep_elementwise.py, bf16, TB/s counting every byte read and written once;
    the device copy runs at about 4.3):

    - flat, one input: 128 threads, one access a thread, the cheap functions' best (2026-12-04,
      32768 x 8192: neg 128/1 4.258, 256/1 4.265, 128/2 4.241, eager 4.270; clamp 128/1
      4.271, 128/2 4.238, eager 4.282; sqrt 128/1 4.266, 128/2 4.229; 16384 x 4097:
      reciprocal 128/1 4.123, 256/1 4.147, 128/2 4.122, compile 4.107). A function whose
      16-bit form has math to hide declares its ``flat_launch`` (:class:`ScalarFn`): tanh's
      128/2 4.253 against 128/1 3.983. A call whose traffic fits in L2 takes two accesses
      a thread (:func:`plan`).
    - flat, two or more inputs (a 0-dim scalar included): 128/1. add with a 0-dim scalar:
      128/1 4.242, 256/1 4.240, 128/2 4.209, 256/4 4.084 (compile 4.246).
    - rows with a broadcast input (a row bias, a column): 256/2. add with a [8192] bias:
      256/2 4.247, 128/2 4.247, 512/2 4.213, 128/1 4.208, 256/4 3.935 (compile 4.247).
    - rows whose inputs are all read along the row (a gated op's strided halves): 128/1, with
      the function's 16-bit form (:func:`plan`). silu_and_mul over 16384 x 28672 (2026-12-04,
      row blocks on the grid's y): 128/1 with the half form 4.386, 128/4 4.376, 256/4 4.175
      (72 registers; 4.370 capped at four CTAs an SM), 128/1 with the float32 form 4.133
      (compile 4.372). A function that declares its ``rows_launch`` takes that.
    - strided: 128/4. silu over a [16, 2048, 32, 128] view read as [B, H, S, D] into a
      contiguous output (16-byte accesses along D; 2026-12-04, tree 3d914bd,
      ``sweep_elementwise_f``): 128/4 3.561, 256/4 3.420, 256/2 3.329, 128/2 3.168, 128/1
      2.676 (torch.compile 4.108, which writes the output in the view's own layout); over a
      transposed [64, 1024, 1024] (single elements): 256/4 0.956, 128/2 0.956, 128/4 0.945."""
    f = SCALAR_FNS.get(fn)
    if kind == "flat":
        if len(in_codes) == 1 and f is not None and f.flat_launch:
            return (*f.flat_launch, 0)
        return 128, 1, 0
    if kind == "rows":
        if any(0 in c for c in in_codes):
            return 256, 2, 0
        return f.rows_launch if f is not None and f.rows_launch else (128, 1, 0)
    return 128, 4, 0


#: the grid's y extent at most (CUDA's limit)
_GRID_Y_MAX = 65535
#: a flat or rows call of fewer vectors than this many CTAs of its default launch (the H200's
#: SMs) takes one access a thread (:func:`plan`)
_SMALL_CTAS = 132
#: the threads a CTA of such a small call
_SMALL_THREADS = 128
#: the H200's L2 (50 MiB); a flat call whose traffic fits in it takes two accesses a thread
#: where its default takes one (:func:`plan`)
_L2_BYTES = 50 << 20


def _traffic(spec: ElementwiseSpec) -> int:
    """The bytes a call moves at least: every output written, every input read once at its own
    size (a broadcast input once)."""
    out = math.prod(spec.out_shape) * sum(DTYPES[d] for d in spec.out_dtypes)
    return out + sum(math.prod(s) * DTYPES[d]
                     for s, d in zip(spec.in_shapes, spec.in_dtypes, strict=True))


def plan(spec: ElementwiseSpec, threads: int | None = None, per: int | None = None,
         half: bool | None = None, resident: int | None = None, vec: int | None = None,
         grid_y: bool | None = None) -> Plan:
    """The launch plan of ``spec`` (``threads``/``per``/``half``/``resident`` override the
    defaults, and ``vec`` narrows the access width, for the sweep)."""
    shape = spec.out_shape
    rank = len(shape)
    aligned = []
    for strides in spec.out_strides:
        aligned.append(tuple(0 if n == 1 else s for n, s in zip(shape, strides, strict=True)))
    for ishape, istrides in zip(spec.in_shapes, spec.in_strides, strict=True):
        pad = rank - len(ishape)
        aligned.append((0,) * pad + tuple(0 if n == 1 else s
                                          for n, s in zip(ishape, istrides, strict=True)))
    ones = tuple(tuple(n == 1 for n in s) for s in spec.in_shapes)
    dtypes = (*spec.out_dtypes, *spec.in_dtypes)
    aligns = (*spec.out_align, *spec.in_align)
    items = [DTYPES[d] for d in dtypes]
    numel = math.prod(shape)
    spans = [sum((n - 1) * s for n, s in zip(shape, st, strict=True)) + 1 for st in aligned]
    wide = max([numel, *spans]) > _INT32_MAX
    if numel == 0:
        return Plan("empty", (), (), ones, 1, 1, 1, 1, wide)
    groups, merged = collapse(shape, aligned)
    codes = tuple(tuple(0 if s == 0 else 1 if s == 1 else 2 for s in st) for st in merged)
    inner_unit = all(c[-1] in (0, 1) for c in codes) if groups else True
    if len(groups) <= 1 and inner_unit:
        kind = "flat"
    elif len(groups) == 2 and inner_unit:
        kind = "rows"
    else:
        kind = "strided"
    # the width comes from the operands read along the vector (inner stride 1): a broadcast
    # one (a 0-dim float32 scalar beside bf16 tensors) is read once and does not narrow it
    along = [items[k] for k, c in enumerate(codes) if c and c[-1] == 1]
    narrow = vec
    vec = _VECTOR_BYTES // max(along or items)
    if not inner_unit:
        vec = 1
    if narrow is not None:
        vec = min(vec, narrow)
    ncols = math.prod(shape[d] for d in groups[-1]) if groups else 1

    def fits(v: int) -> bool:
        for k, c in enumerate(codes):
            if c and c[-1] == 1 and aligns[k] < v * items[k]:
                return False
            if kind != "flat" and any(cd == 2 and s % v for cd, s in zip(c, merged[k], strict=True)):
                return False
            # an operand read in vectors with a unit stride across rows (an overlapping view:
            # rows one element apart) starts rows off the vector
            if kind != "flat" and v > 1 and c and c[-1] == 1 and 1 in c[:-1]:
                return False
        return kind == "flat" or ncols % v == 0

    full = vec
    while vec > 1 and not fits(vec):
        vec //= 2
    small = numel <= _SMALL_THREADS * _SMALL_CTAS
    single = kind == "flat" and narrow is None and small
    if single:
        # so few elements that one a thread is still one wave of CTAs: the program reads and
        # writes single elements, a fraction of the code, and a small call's time is mostly
        # the code a thread fetches (silu over 3 elements: 1.10 us against 1.32 with 16-byte
        # accesses, torch.compile 1.10; gelu over 1 x 4096 1.17 against 1.18, compile 1.16;
        # SwiGLU over 1 x 14336 1.21 against 1.23, compile 1.26; H200, 2026-12-04)
        vec = 1
    if kind == "rows" and vec < full and not small:
        # (not for a small call: as a flat run it would read single elements anyway, and the
        # rows kind at one access a thread reads the row without an index modulo its length)
        modular = _modular(spec, shape, groups, merged, codes, items, aligns, full, wide,
                           threads, per)
        if modular is not None:
            return modular
    d_threads, d_per, d_resident = _default_launch(kind, codes[len(spec.out_dtypes):], spec.fn)
    if single or (kind != "strided"
                  and -(-numel // vec) < d_per * (threads or d_threads) * _SMALL_CTAS):
        # too few vectors for one CTA an SM at the default: the call's time is one thread's
        # chain of loads and math (mish over one row of 4096, four accesses a thread: 3.5 us
        # on the H200 against torch.compile's 1.4; silu_and_mul over 5 rows of 2 x 4097, its
        # halves at odd offsets read element by element, 256/4 4.2 us, 256/1 2.0), so each
        # thread takes one access, 128 threads a CTA (best or tied in every small shape of the
        # sweep: gelu 1 x 4096 1.5 us, 64/1 1.6; SwiGLU 1 x 14336 1.5, 64/1 1.6; those 5 odd
        # rows 1.8, 256/1 2.0; mish 1 x 4096 1.4 at 64, 128 and 256)
        d_threads, d_per, d_resident = _SMALL_THREADS, 1, 0
    elif kind == "flat" and d_per == 1 and _traffic(spec) <= _L2_BYTES:
        # a call served from L2 (an activation its producer just wrote, or a repeated call)
        # moves its bytes faster than HBM, and one access a thread leaves too few in flight
        # (bf16 2048 x 4096, 34 MB moved, on the H200, 2026-12-04, us: exp 128/1 6.70, 128/2
        # 6.24, 64/4 6.00, eager 6.69; hardswish 6.94, 6.15, 6.04, compile 6.41; neg 6.40,
        # 5.88, 6.27, eager 6.46; add of two such inputs 12.40, 12.38, compile 12.08)
        d_per = 2
    explicit = threads is not None or per is not None
    threads = threads or d_threads
    per = per or d_per
    # the default's register cap goes with the default launch only
    resident = (0 if explicit else d_resident) if resident is None else resident
    tcols = min(threads, _pow2_at_least(max(1, ncols // vec))) if kind != "flat" else threads
    # the half forms serve the flat kind and one access a thread by default: straight-line
    # math over every element a thread holds, nvcc keeps them all live, and the rows program
    # holds two inputs' halves (silu_and_mul 16384 x 28672 at 256/4: 125 registers against the
    # float32 form's 54, two CTAs an SM instead of four, 3.25 TB/s against 4.35 on the H200;
    # at 128/1 37 registers, 4.386 against the float32 form's 4.133, 2026-12-04); a register
    # cap keeps them to their share of the SM
    if half is None:
        half = kind == "flat" or per == 1 or resident > 0
    half = half and _has_half(spec)
    # the tiled kinds put their row blocks on the grid's y where they fit in it
    fits_y = kind != "flat" and -(-(numel // ncols) // (threads // tcols * per)) <= _GRID_Y_MAX
    grid_y = fits_y if grid_y is None else grid_y and fits_y
    return Plan(kind, groups, codes, ones, vec, threads, per, tcols, wide, (), half, resident,
                grid_y)


def _has_half(spec: ElementwiseSpec) -> bool:
    """Whether the call's function has a 16-bit form that serves it (16-bit outputs, float32
    math)."""
    return (SCALAR_FNS[spec.fn].half_build is not None and spec.compute == "float32"
            and set(spec.out_dtypes) <= _HALF)


def _modular(spec: ElementwiseSpec, shape, groups, merged, codes, items, aligns,
             full: int, wide: bool, threads: int | None = None,
             per: int | None = None) -> Plan | None:
    """The flat plan of a rows call whose row length keeps the rows plan from wide accesses
    (``[M, 4097] + [4097]``: rows start at odd offsets, so the rows plan reads single
    elements), when every operand is contiguous over both groups or a row broadcast (or a
    single element): the contiguous ones are one flat run read in vectors, a row broadcast is
    read element by element at the flat index modulo the row's length (from L1: the row is
    small and shared by every CTA). None when the call is not of that form or gains nothing
    (the flat run's alignment allows no wider access)."""
    ncols = math.prod(shape[d] for d in groups[-1])
    n_out = len(spec.out_dtypes)
    flat_codes = []
    for k, c in enumerate(codes):
        if c == (2, 1) and merged[k][0] == ncols:
            flat_codes.append((1,))
        elif c == (0, 1) and k >= n_out:
            flat_codes.append((3,))
        elif c == (0, 0) and k >= n_out:
            flat_codes.append((0,))
        else:
            return None
    if (3,) not in flat_codes:
        return None
    vec = _VECTOR_BYTES // max(items[k] for k, c in enumerate(flat_codes) if c == (1,))
    vec = min(vec, full)
    while vec > 1 and any(c == (1,) and aligns[k] < vec * items[k]
                          for k, c in enumerate(flat_codes)):
        vec //= 2
    if vec == 1 or ncols < vec:
        return None
    d_threads, d_per, _ = _default_launch("flat", flat_codes[n_out:], spec.fn)
    threads, per = threads or d_threads, per or d_per  # the sweep's overrides
    ones = tuple(tuple(n == 1 for n in s) for s in spec.in_shapes)
    dims = tuple(d for g in groups for d in g)
    return Plan("flat", (dims,), tuple(flat_codes), ones, vec, threads, per, threads, wide,
                groups[-1], _has_half(spec))


# --- the TileLang programs -----------------------------------------------------------------------

#: the generated index arithmetic is correct by construction (full blocks lie inside the
#: iteration space, edge blocks check each access), and TileLang's own bounds checks would
#: stop the vectorization of strided rows
_PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


def _with_params(body, ins: list, outs: list):
    """The prim_func over exactly the call's tensors, inputs then outputs (every tensor
    argument costs the launch host time, so there are no placeholders)."""
    _, T = tl()
    shape = (len(ins), len(outs))
    if shape == (1, 1):
        a, y = *ins, *outs

        @T.prim_func
        def main(A: a, Y: y):
            T.annotate_pass_configs(_PASS_CONFIGS)
            body((A,), (Y,))
    elif shape == (1, 2):
        a, y, z = *ins, *outs

        @T.prim_func
        def main(A: a, Y: y, Z: z):
            T.annotate_pass_configs(_PASS_CONFIGS)
            body((A,), (Y, Z))
    elif shape == (2, 1):
        a, b, y = *ins, *outs

        @T.prim_func
        def main(A: a, B: b, Y: y):
            T.annotate_pass_configs(_PASS_CONFIGS)
            body((A, B), (Y,))
    elif shape == (2, 2):
        a, b, y, z = *ins, *outs

        @T.prim_func
        def main(A: a, B: b, Y: y, Z: z):
            T.annotate_pass_configs(_PASS_CONFIGS)
            body((A, B), (Y, Z))
    elif shape == (3, 1):
        a, b, c, y = *ins, *outs

        @T.prim_func
        def main(A: a, B: b, C: c, Y: y):
            T.annotate_pass_configs(_PASS_CONFIGS)
            body((A, B, C), (Y,))
    elif shape == (3, 2):
        a, b, c, y, z = *ins, *outs

        @T.prim_func
        def main(A: a, B: b, C: c, Y: y, Z: z):
            T.annotate_pass_configs(_PASS_CONFIGS)
            body((A, B, C), (Y, Z))
    elif shape == (4, 1):
        a, b, c, d, y = *ins, *outs

        @T.prim_func
        def main(A: a, B: b, C: c, D: d, Y: y):
            T.annotate_pass_configs(_PASS_CONFIGS)
            body((A, B, C, D), (Y,))
    else:
        a, b, c, d, y, z = *ins, *outs

        @T.prim_func
        def main(A: a, B: b, C: c, D: d, Y: y, Z: z):
            T.annotate_pass_configs(_PASS_CONFIGS)
            body((A, B, C, D), (Y, Z))
    return main


def _storage(dtype: str) -> str:
    """The dtype a tensor is declared in: bool as uint8 (one byte, 0 or 1, as torch stores it),
    since TileLang cannot vectorize bool; the entry passes a bool tensor as its uint8 view."""
    return "uint8" if dtype == "bool" else dtype


def build_program(fn: str, params: tuple, in_dtypes: tuple, out_dtypes: tuple, compute: str,
                  out_rank: int, p: Plan):
    """The TileLang prim_func of a call class (not compiled): every tensor declared at its own
    rank with launch-time extents (an input's extent-1 dims as 1) and strides, read and written
    through a flat alias of its data at the offsets ``p`` lays out. Bool tensors are declared
    uint8 (:func:`_storage`): read as a nonzero test, written as 0 or 1."""
    _, T = tl()
    f = SCALAR_FNS[fn]
    prelude = False
    if p.half and f.half_build is not None and compute == "float32" and set(out_dtypes) <= _HALF:
        f = dataclasses.replace(f, build=f.half_build)
        prelude = f.prelude
    idt = "int64" if p.wide else "int32"
    dims = [T.dynamic(f"n{d}", idt) for d in range(out_rank)]

    def declare(tag: str, rank: int, ones, dtype: str):
        strides = tuple(T.dynamic(f"s{tag}_{j}", idt) for j in range(rank))
        if rank == 0:
            return T.Tensor((), dtype), strides
        shape = tuple(1 if one else dims[out_rank - rank + j] for j, one in enumerate(ones))
        return T.StridedTensor(shape, strides, dtype), strides

    n_out = len(out_dtypes)
    decl_out = [declare(f"y{o}", out_rank, (False,) * out_rank, _storage(dt))
                for o, dt in enumerate(out_dtypes)]
    decl_in = [declare(f"x{k}", len(ones), ones, _storage(dt))
               for k, (ones, dt) in enumerate(zip(p.ones, in_dtypes, strict=True))]
    ranks = [out_rank] * n_out + [len(o) for o in p.ones]
    svars = [s for _, s in decl_out] + [s for _, s in decl_in]

    def stride(k: int, g: int):
        """Operand ``k``'s stride across group ``g`` (a multiple of ``vec`` where it is read in
        vectors: written so, the vectorizer can prove the accesses aligned)."""
        code = p.codes[k][g]
        if code < 2:
            return code
        s = svars[k][p.groups[g][-1] - (out_rank - ranks[k])]
        return T.truncdiv(s, p.vec) * p.vec if p.vec > 1 else s

    extents = [math.prod(dims[d] for d in g) if g else 1 for g in p.groups]
    if p.kind == "flat":
        ncols = math.prod(dims[d] for d in p.row) if p.row else 1
        body = _flat_body(T, f, params, in_dtypes, out_dtypes, compute, p, extents, ncols, idt,
                          prelude)
    else:
        body = _tiled_body(T, f, params, in_dtypes, out_dtypes, compute, p, extents, stride,
                           idt, prelude)
    return _with_params(body, [b for b, _ in decl_in], [b for b, _ in decl_out])


def _values(T, f, xs, in_dtypes, compute):
    """The inputs as the scalar function takes them: a bool input (held as uint8) as the test
    ``x != 0``, then cast to the compute dtype but ``keep``. An integer or a float64 reaches
    a 16-bit compute dtype (a comparison's) through float32, which CUDA's half and bfloat16
    types convert from."""
    xs = [T.cast(x, "bool") if dt == "bool" else x for x, dt in zip(xs, in_dtypes, strict=True)]
    return [x if k in f.keep else
            T.cast(T.cast(x, "float32"), compute) if compute in _HALF and dt not in _HALF
            and dt != "float32" else T.cast(x, compute)
            for k, (x, dt) in enumerate(zip(xs, in_dtypes, strict=True))]


def _stored(T, value, dtype: str):
    """An output value in its storage dtype: a bool one as 0 or 1 in uint8 (any nonzero value
    is true, as torch's conversion to bool)."""
    if dtype == "bool":
        return T.cast(T.cast(value, "bool"), "uint8")
    return T.cast(value, dtype)


def _flat_body(T, f, params, in_dtypes, out_dtypes, compute, p, extents, ncols, idt,
               prelude=False):
    """One run of ``n`` elements; inputs unit-stride, a single element, or (code 3) a row of
    ``ncols`` broadcast over the run, read at the index modulo ``ncols`` (``prelude``: the
    function calls :data:`HALF_PRELUDE`'s helpers). A CTA covers
    ``threads * per`` vectors; the CTAs wholly inside run unmasked, the last checks each
    vector and takes the run's last elements (fewer than a vector) one a thread."""
    vec, per, threads = p.vec, p.per, p.threads
    n_out, n_in = len(out_dtypes), len(in_dtypes)
    chunk = threads * per  # vectors a CTA
    runs = tuple(k for k in range(n_in) if p.codes[n_out + k] and p.codes[n_out + k][-1] == 1)
    mods = tuple(k for k in range(n_in) if p.codes[n_out + k] == (3,))
    single = tuple(k for k in range(n_in) if k not in runs and k not in mods)
    outs_i = tuple(range(n_out))
    n = extents[0] if extents else 1
    nvec = T.truncdiv(n, vec)  # whole vectors of the run (an expression, not a bound name)

    @T.macro
    def load(fin, held, base, v):
        """Vector ``v`` of the thread's inputs into its slots of ``held``."""
        for k in runs:
            for i in T.vectorized(vec):
                held[k][v * vec + i] = fin[k][(base + v * threads) * vec + i]
        if mods:
            # a vector wraps past the row's end at most once (ncols >= vec). The start and each
            # element's column bound in the plan's index type: written into each access, the
            # modulo and the wrap's compares were promoted with the address to 64 bits (a
            # 64-bit division and eight 64-bit compare-and-selects a vector of eight:
            # [16384, 4097] + [4097] ran at 0.93 of torch.compile)
            start = T.alloc_var(idt, init=T.truncmod((base + v * threads) * vec, ncols))
            at = T.alloc_local((vec,), idt)  # each element's column, wrapped, bound as well
            for i in T.unroll(vec):
                at[i] = T.if_then_else(start + i >= ncols, start + i - ncols, start + i)
            for k in mods:
                for i in T.unroll(vec):
                    held[k][v * vec + i] = fin[k][at[i]]

    @T.macro
    def math_of(held, res, j):
        got = f.build(_values(T, f, [held[k][0] if k in single else held[k][j]
                                     for k in range(n_in)], in_dtypes, compute),
                      params, compute)
        for o in outs_i:
            res[o][j] = _stored(T, got[o], out_dtypes[o])

    @T.macro
    def store(fout, res, base, v):
        for o in outs_i:
            for i in T.vectorized(vec):
                fout[o][(base + v * threads) * vec + i] = res[o][v * vec + i]

    @T.macro
    def element(fin, fout, held, e):
        """Element ``e`` alone (read and written by itself)."""
        got = f.build(_values(T, f, [
            held[k][0] if k in single else
            fin[k][T.truncmod(e, ncols)] if k in mods else fin[k][e]
            for k in range(n_in)], in_dtypes, compute), params, compute)
        for o in outs_i:
            fout[o][e] = _stored(T, got[o], out_dtypes[o])

    @T.macro
    def body(ins, outs):
        fin = [T.Tensor((1,), b.dtype, data=b.data) for b in ins]
        fout = [T.Tensor((1,), b.dtype, data=b.data) for b in outs]
        with T.Kernel(T.cast(T.ceildiv(n, chunk * vec), "int32"), threads=threads) as bx:
            if prelude:
                T.import_source(HALF_PRELUDE)
            if p.resident:
                T.annotate_min_blocks_per_sm(p.resident)
            tx = T.get_thread_binding()
            b = T.cast(bx, idt)
            base = b * chunk + tx
            held = [T.alloc_local((per * vec,), _storage(dt)) for dt in in_dtypes]
            res = [T.alloc_local((per * vec,), _storage(dt)) for dt in out_dtypes]
            for k in single:
                held[k][0] = fin[k][0]
            if (b + 1) * chunk <= nvec:
                # every access in flight before the math, every store after it
                for v in T.unroll(per):
                    load(fin, held, base, v)
                for j in T.unroll(per * vec):
                    math_of(held, res, j)
                for v in T.unroll(per):
                    store(fout, res, base, v)
            elif vec == 1:
                for v in T.unroll(per):
                    if base + v * threads < n:
                        element(fin, fout, held, base + v * threads)
            else:
                # the last CTA: its whole vectors as the others do, one at a time, then the
                # run's last elements (fewer than a vector) one a thread. Each thread runs
                # the code of ``per`` vectors and one element, where a check of each of its
                # elements ran ``per * vec`` copies of the math whether the element was there
                # or not (the latency of a small call: SwiGLU over 5 x 4097)
                for v in T.unroll(per):
                    if base + v * threads < nvec:
                        load(fin, held, base, v)
                        for i in T.unroll(vec):
                            math_of(held, res, v * vec + i)
                        store(fout, res, base, v)
                if nvec * vec + tx < n and T.truncdiv(nvec, chunk) == b:
                    element(fin, fout, held, nvec * vec + tx)

    return body


def _tiled_body(T, f, params, in_dtypes, out_dtypes, compute, p, extents, stride, idt,
                prelude=False):
    """Rows of the innermost group by the outer groups (one outer group: ``rows``; any number:
    ``strided``, each row's offset decomposed from its index). A CTA is ``threads / tcols``
    rows of ``tcols`` vectors, each thread making ``per`` accesses down the rows; CTAs wholly
    inside run unmasked, the edge ones check each access."""
    vec, per, threads, tcols = p.vec, p.per, p.threads, p.tcols
    trows = threads // tcols
    n_out, n_in = len(out_dtypes), len(in_dtypes)
    ops = n_out + n_in
    inner = len(p.groups) - 1
    outer = tuple(range(inner))
    ncols = extents[-1]
    nrows = math.prod(extents[:-1]) if inner else 1
    ncv = T.truncdiv(ncols, vec)
    ncb = T.ceildiv(ncv, tcols)
    rows_cta = trows * per
    nrb = T.ceildiv(nrows, rows_cta)
    # per operand: reads its vector (1), one element a row (0, broadcast along the row)
    col_code = tuple(p.codes[k][inner] for k in range(ops))
    vector_in = tuple(k for k in range(n_in) if col_code[n_out + k] != 0)
    row_in = tuple(k for k in range(n_in) if col_code[n_out + k] == 0)
    outs_i = tuple(range(n_out))

    def row_offsets(r):
        """Each operand's offset of row ``r``."""
        if inner == 1:
            return [r * stride(k, 0) for k in range(ops)]
        offs = [0] * ops
        rem = r
        for g in reversed(outer):
            coord = T.truncmod(rem, extents[g]) if g else rem
            rem = T.truncdiv(rem, extents[g])
            offs = [o + coord * stride(k, g) for k, o in enumerate(offs)]
        return offs

    def col(k: int, c):
        return c * stride(k, inner) if col_code[k] == 2 else c

    def in_vectors(k: int) -> bool:
        """Whether operand ``k``'s row offsets are whole vectors (kept divided by ``vec``, so
        the vectorizer sees them aligned): read or written along the row in vectors."""
        return vec > 1 and col_code[k] != 0

    def offsets(at, v):
        """The strided kind's row offsets of access ``v``, from what ``tile`` keeps."""
        return [at[v * ops + k] * vec if in_vectors(k) else at[v * ops + k]
                for k in range(ops)]

    @T.macro
    def tile(fin, fout, cb, rb, tx, guard):
        held = [T.alloc_local((per * vec,), _storage(dt)) for dt in in_dtypes]
        res = [T.alloc_local((per * vec,), _storage(dt)) for dt in out_dtypes]
        c = (cb * tcols + tx % tcols) * vec
        if inner > 1:
            # the strided kind's row offsets, in vectors, once for the loads and the stores:
            # written into each index, their divisions by the runtime extents ran in 64 bits
            # at every access (a transposed silu: 1208 SASS instructions for 4 elements a
            # thread)
            at = T.alloc_local((per * ops,), idt)
            for v in T.unroll(per):
                for k, o in enumerate(row_offsets(rb * rows_cta + v * trows + tx // tcols)):
                    at[v * ops + k] = T.truncdiv(o, vec) if in_vectors(k) else o

        for v in T.unroll(per):
            r = rb * rows_cta + v * trows + tx // tcols
            offs = offsets(at, v) if inner > 1 else row_offsets(r)
            ok = T.cast(c, idt) < ncols and r < nrows if guard else True
            if ok:
                for k in vector_in:
                    for i in T.vectorized(vec):
                        held[k][v * vec + i] = fin[k][offs[n_out + k] + col(n_out + k, c) + i]
                for k in row_in:
                    for i in T.unroll(vec):
                        held[k][v * vec + i] = fin[k][offs[n_out + k]]
        for j in T.unroll(per * vec):
            got = f.build(_values(T, f, [held[k][j] for k in range(n_in)], in_dtypes, compute),
                          params, compute)
            for o in outs_i:
                res[o][j] = _stored(T, got[o], out_dtypes[o])
        for v in T.unroll(per):
            r = rb * rows_cta + v * trows + tx // tcols
            offs = offsets(at, v) if inner > 1 else row_offsets(r)
            ok = T.cast(c, idt) < ncols and r < nrows if guard else True
            if ok:
                for o in outs_i:
                    for i in T.vectorized(vec):
                        fout[o][offs[o] + col(o, c) + i] = res[o][v * vec + i]

    @T.macro
    def block(fin, fout, cb, rb):
        """The CTA of column block ``cb`` and row block ``rb``: unmasked wholly inside."""
        if p.resident:
            T.annotate_min_blocks_per_sm(p.resident)
        tx = T.get_thread_binding()
        if (cb + 1) * tcols <= ncv and (rb + 1) * rows_cta <= nrows:
            tile(fin, fout, cb, rb, tx, False)
        else:
            tile(fin, fout, cb, rb, tx, True)

    @T.macro
    def body(ins, outs):
        fin = [T.Tensor((1,), b.dtype, data=b.data) for b in ins]
        fout = [T.Tensor((1,), b.dtype, data=b.data) for b in outs]
        if p.grid_y:
            # column blocks on the grid's x, row blocks on its y: no division
            with T.Kernel(T.cast(ncb, "int32"), T.cast(nrb, "int32"), threads=threads) as (
                    bx, by):
                if prelude:
                    T.import_source(HALF_PRELUDE)
                block(fin, fout, T.cast(bx, idt), T.cast(by, idt))
        else:
            with T.Kernel(T.cast(ncb * nrb, "int32"), threads=threads) as bx:
                if prelude:
                    T.import_source(HALF_PRELUDE)
                b = T.cast(bx, idt)
                # bound once: written into each index, the division by the runtime ``ncb``
                # was repeated in 64 bits at every access (nvcc's software division, hundreds
                # of instructions: the latency of a small call)
                cb = T.alloc_var(idt, init=T.truncmod(b, ncb))
                rb = T.alloc_var(idt, init=T.truncdiv(b, ncb))
                block(fin, fout, cb, rb)

    return body


@stored(maxsize=512)
def build_kernel(fn: str, params: tuple, in_dtypes: tuple, out_dtypes: tuple, compute: str,
                 out_rank: int, p: Plan, target: str | None = None):
    """Compile the program of a call class (cached per class and target)."""
    prog = build_program(fn, params, in_dtypes, out_dtypes, compute, out_rank, p)
    return compile_program(prog, target)


# --- the implementations -------------------------------------------------------------------------


class _ElementwiseKernel(Kernel, ElementwiseInterface):
    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    kinds: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def region_refusal(cls, spec: ElementwiseSpec) -> str | None:
        kind = plan(spec).kind
        if kind not in cls.kinds:
            return f"serves {' or '.join(sorted(cls.kinds))} layouts, not {kind}"
        return None

    @classmethod
    def identity(cls, spec: ElementwiseSpec):
        # the program depends on the sizes and strides only through the plan they give
        return (spec.fn, spec.params, spec.in_dtypes, spec.out_dtypes, spec.compute,
                len(spec.out_shape), plan(spec), spec.device)

    @classmethod
    def entry_for(cls, spec: ElementwiseSpec, op):
        """The kernel itself; where an operand is bool, a call that passes each bool tensor as
        its uint8 view (a view, no copy: what the program declares), so calls without one pay
        nothing for it."""
        kernel = cls(spec)
        bools = frozenset(i for i, dt in enumerate((*spec.in_dtypes, *spec.out_dtypes))
                          if dt == "bool")
        if not bools or kernel.program is None:
            return kernel
        import torch

        program, u8 = kernel.program, torch.uint8

        def entry(*tensors) -> None:
            program(*[t.view(u8) if i in bools else t for i, t in enumerate(tensors)])

        return entry

    def __init__(self, spec: ElementwiseSpec) -> None:
        super().__init__(spec)
        p = plan(spec)
        self.plan = p
        self.program = None if p.kind == "empty" else build_kernel(
            spec.fn, spec.params, spec.in_dtypes, spec.out_dtypes, spec.compute,
            len(spec.out_shape), p)

    def __call__(self, *tensors) -> None:
        if self.program is not None:
            self.program(*tensors)


class ElementwiseFlatKernel(_ElementwiseKernel):
    """Every operand one contiguous run (or a single element, or nothing at all): 16-byte
    accesses from the base pointers, a masked last CTA."""

    kinds = frozenset({"flat", "empty"})


class ElementwiseRowsKernel(_ElementwiseKernel):
    """Two collapsed dims with unit or zero inner strides: a row or column broadcast, strided
    rows (in-place on a view, a gated op's halves)."""

    kinds = frozenset({"rows"})


class ElementwiseStridedKernel(_ElementwiseKernel):
    """Any layout of up to :data:`MAX_DIMS` collapsed dims; vectors along the rows where every
    operand's inner stride is 0 or 1, single elements otherwise."""

    general = True
    kinds = frozenset({"flat", "rows", "strided", "empty"})

    @classmethod
    def region_refusal(cls, spec: ElementwiseSpec) -> str | None:
        groups = plan(spec).groups
        if len(groups) > MAX_DIMS:
            return (f"indexes up to {MAX_DIMS} collapsed dims, the call has {len(groups)} "
                    f"(copy an operand contiguous)")
        return None
