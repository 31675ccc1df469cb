"""Max, average and adaptive pooling and their gradients, in TileLang.

Every op of the family pools over up to three spatial axes; a 1-D or 2-D call is a 3-D one
whose leading spatial axes have length 1 (a window of 1, a stride of 1, no padding), so one
program generator serves all of them. Sizes, windows and strides are compiled in, the batch
included: the divisions of a flat index into coordinates are then multiplications by
constants in int32, and a window's taps unroll. (With the batch a launch-time size, TileLang
indexes the flat tensors in int64 and guards every load against their length; a new batch
size costs one compile.)

Forward (:func:`pool_program`): one thread per output element, ``per`` elements a thread
(consecutive blocks of ``threads`` outputs, so every store and the loads of neighbouring
windows are coalesced across a warp; overlapping windows are served by L1/L2, the input is read
from HBM about once; in a large call whose windows overlap along W, two neighbouring outputs a
thread, sharing their columns' loads: :func:`forward_run`). Every tap's load is issued
unconditionally, from its position clamped
into the input, and a tap outside the input reads as -inf (max) or 0 (sum) by masking the
loaded value's bits: a window's loads are in flight together (a load behind its tap's bounds
check waited for the one before it: the padded and small calls were bound by that chain).
The window is scanned in torch's order (depth, then rows, then columns), in float32:

- max: the running maximum starts at -inf at the window's first tap that is not in the
  leading padding (:func:`first_tap`), and a tap replaces it when it is greater or NaN
  (torch's CUDA and CPU kernels: a window of -inf gives its first position, a NaN wins over
  any number and the last NaN's position is kept, a dilated window wholly in the padding
  gives -inf at that first position); the index is the flat position in the input plane
  (``(d * H + h) * W + w``), written as int64 when asked for; without indices, the running
  maximum is ``fmaxf`` and a flag records a NaN (:func:`_scanner`);
- average: the sum divided by ``divisor_override``, else by the window's size clipped to the
  padded input (``count_include_pad``) or to the input itself, as torch's ``avg_pool*d`` (a
  divisor every window shares is a constant, and the division by it a multiplication and a
  correction: :func:`_over`);
- adaptive: output ``i`` of an axis of ``In`` to ``Out`` pools ``[floor(i * In / Out),
  ceil((i + 1) * In / Out))``; the taps run to the longest such window, masked past the end.

Layouts: the input is read in place, and the output (and indices) written, either as planes
(``N, C, D, H, W``: torch's contiguous form) or channels last (``N, D, H, W, C``: torch's
``channels_last`` / ``channels_last_3d``, whose pooled output torch gives in the same format).
The thread index runs over the output in its memory order, so a warp's stores are contiguous,
and its loads too where they run along the channels.

Gradients (:func:`pool_bwd_program`): one thread per input element gathers from the windows
that hold it (:func:`window_of`: of a fixed window without dilation, the ``ceil(k / s)``
windows that start in ``(i + p - k, i + p]``; of a dilated one, for each tap ``t`` the window
``o`` with ``o * s - p + t * d == i``; of adaptive ones, the run of windows whose range holds
``i``), so no atomics are needed and the result is deterministic: average pooling adds ``dy /
divisor`` of each such window; max pooling adds ``dy`` of each window whose maximum is this
element, read from the forward's indices or, without them, found again by the forward's scan
(the same macros, :func:`_scanner`, every load unconditional). A large max gradient without
indices runs the forward with indices first, then the gather from them
(:class:`PoolBwdKernel`): a window's maximum is then found once, not once for each element
the window holds. Where W's stride divides W
and each window's gradient is a load (average pooling, max pooling with indices), a thread
takes a run of the stride's elements along W (:func:`gradient_run`), loading each window
near the run once for all its elements (the bar's average gradient: 51 SASS instructions an
element, from 104). (A dilated
window wholly in the padding has no element: torch gives it -inf at its first tap's position
and adds its gradient there, outside the window; the gather drops it.)

The index arithmetic is written once, in :func:`tap_position`, :func:`tap_range`,
:func:`first_tap`, :func:`divisor` and :func:`window_of`, functions of plain integer operations that the programs apply to TIR
expressions and :func:`emulate` (the CPU mirror of the programs' algorithm, which the tests
hold to torch over the input space) to torch tensors.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import math
from typing import Any, Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, isinf, isnan, tl

__all__ = [
    "PoolBwdInterface",
    "PoolBwdKernel",
    "PoolDType",
    "PoolFwdInterface",
    "PoolKernel",
    "PoolKind",
    "PoolLayout",
    "PoolSpec",
    "adaptive_taps",
    "forward_run",
    "gradient_run",
    "build_pool_kernel",
    "divisor",
    "emulate",
    "emulate_bwd",
    "first_tap",
    "gather_taps",
    "gradient_programs",
    "pool_bwd_program",
    "pool_plan",
    "pool_program",
    "tap_position",
    "tap_range",
    "two_pass",
    "window_of",
    "with_indices",
]

PoolDType = Literal["float16", "bfloat16", "float32"]
_DTYPES = frozenset(get_args(PoolDType))
_THREADS = 256
#: flat indices are int32: every tensor of a call holds fewer elements
_MAX_ELEMENTS = 2**31 - 1
#: windows of at most this many taps are unrolled; longer ones loop
_UNROLL_TAPS = 64
#: the grid's y extent at most (CUDA's limit)
_GRID_Y_MAX = 65535
#: a max gradient without indices over this many input elements or more runs the forward
#: with indices first (:func:`two_pass`): a wave of the H200, 132 SMs of 2048 threads
_TWO_PASS_INPUTS = 132 * 2048


class PoolKind(enum.Enum):
    MAX = "max"
    AVG = "avg"


class PoolLayout(enum.Enum):
    """How the input's elements are ordered in memory."""

    PLANES = "planes"  # N, C, D, H, W (contiguous)
    CHANNELS_LAST = "channels_last"  # N, D, H, W, C


class PoolSpec(CallSpec, frozen=True, kw_only=True):
    """A pooling call, forward or gradient, as three spatial axes (a 1-D or 2-D call has
    leading axes of length 1, window 1, stride 1). ``size_in``/``size_out`` are
    ``(D, H, W)``; ``kernel``, ``stride``, ``padding``, ``dilation`` per axis (ignored when
    ``adaptive``); ``divisor`` 0 means none (``divisor_override``); ``indices``: the forward
    writes them, or the gradient reads them (max only)."""

    kind: PoolKind
    adaptive: bool
    layout: PoolLayout
    batch: int
    channels: int
    size_in: tuple[int, int, int]
    size_out: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int]
    dilation: tuple[int, int, int]
    count_include_pad: bool
    divisor: int
    indices: bool
    dtype: PoolDType

    def __post_init__(self) -> None:
        for f, enum_type in (("kind", PoolKind), ("layout", PoolLayout)):
            if not isinstance(getattr(self, f), enum_type):
                raise TypeError(f"PoolSpec.{f} must be a {enum_type.__name__}, "
                                f"got {getattr(self, f)!r}")
        self.check_fields(choices={"dtype": _DTYPES}, sizes=("batch", "channels"),
                          flags=("adaptive", "count_include_pad", "indices"))
        for f in ("size_in", "size_out", "kernel", "stride", "padding", "dilation"):
            v = getattr(self, f)
            if len(v) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                                  for x in v):
                raise ValueError(f"PoolSpec.{f} must be three sizes (D, H, W), got {v!r}")
        if not self.adaptive and min(*self.kernel, *self.stride, *self.dilation) < 1:
            raise ValueError(f"PoolSpec: kernel, stride and dilation must be positive, got "
                             f"{self.kernel}, {self.stride}, {self.dilation}")
        if self.indices and self.kind is not PoolKind.MAX:
            raise ValueError("PoolSpec.indices: only max pooling has indices")
        if self.kind is PoolKind.AVG and self.dilation != (1, 1, 1):
            raise ValueError(f"PoolSpec.dilation: average pooling has none, got "
                             f"{self.dilation}")


class PoolFwdInterface(KernelInterface):
    """``forward(x, y, indices)``: ``x``, ``y`` and ``indices`` (int64, like ``y``, or None)
    in the spec's layout."""

    slot = "pool_fwd"
    call_spec = PoolSpec


class PoolBwdInterface(KernelInterface):
    """``forward(dy, x, indices, dx)``: every tensor contiguous in the planes order; ``x`` the
    forward's input (read to find the maxima again when ``indices`` is None; not read by
    average pooling), ``dx`` written whole."""

    slot = "pool_bwd"
    call_spec = PoolSpec


# --- the index arithmetic (shared by the programs and emulate) -----------------------------------


def adaptive_taps(n_in: int, n_out: int) -> int:
    """The longest adaptive window of an axis of ``n_in`` pooled to ``n_out``."""
    return max(-(-(o + 1) * n_in // n_out) - o * n_in // n_out for o in range(n_out))


def taps(spec: PoolSpec) -> tuple[int, int, int]:
    """Taps a window scans per axis."""
    if spec.adaptive:
        return tuple(adaptive_taps(i, o) for i, o in zip(spec.size_in, spec.size_out,
                                                          strict=True))
    return spec.kernel


def tap_position(spec: PoolSpec, axis: int, o: Any, t: Any) -> Any:
    """The input position of tap ``t`` of output ``o`` along ``axis`` (maybe outside the
    input: :func:`tap_range` says where it is valid)."""
    if spec.adaptive:
        return o * spec.size_in[axis] // spec.size_out[axis] + t
    return o * spec.stride[axis] - spec.padding[axis] + t * spec.dilation[axis]


def tap_range(spec: PoolSpec, axis: int, o: Any, mn: Any, mx: Any) -> tuple[Any, Any]:
    """``(lo, hi)``: the taps of output ``o`` along ``axis`` read the input where
    ``lo <= position < hi`` (``mn``/``mx``: the min and max of the values' kind)."""
    n = spec.size_in[axis]
    if spec.adaptive:
        no = spec.size_out[axis]
        return o * n // no, ((o + 1) * n + no - 1) // no
    return 0, n


def gather_taps(spec: PoolSpec) -> tuple[int, int, int]:
    """How many windows the gradient's gather tries per axis for an input element: the most
    adaptive windows one element is in; of fixed windows without dilation ``ceil(k / s)``,
    the most that overlap (3 x 3 windows at a stride of 2: 4 windows tried, not 9); of
    dilated ones one per tap."""
    if spec.adaptive:
        return tuple(adaptive_taps(o, i) for i, o in zip(spec.size_in, spec.size_out,
                                                          strict=True))
    return tuple(-(-k // s) if d == 1 else k
                 for k, s, d in zip(spec.kernel, spec.stride, spec.dilation, strict=True))


def window_of(spec: PoolSpec, axis: int, i: Any, t: Any) -> tuple[Any, tuple]:
    """``(o, conditions)``: the ``t``-th window along ``axis`` that may hold input position
    ``i``, and what must hold for it to. A fixed window's tap ``t`` reads ``o * s - p + t *
    dil``, so ``o = (i + p - t * dil) / s`` where that divides and lies in ``[0, Out)``; the
    adaptive windows holding ``i`` are ``floor(i * Out / In)`` up to ``ceil((i + 1) * Out /
    In)``, exclusive. Without dilation, the ``t``-th is counted back from the last window
    that starts at or before ``i`` (:func:`gather_taps`)."""
    if spec.adaptive:
        n_in, n_out = spec.size_in[axis], spec.size_out[axis]
        o = i * n_out // n_in + t
        return o, (o < ((i + 1) * n_out + n_in - 1) // n_in, True, True)
    s, p, k = spec.stride[axis], spec.padding[axis], spec.kernel[axis]
    if spec.dilation[axis] == 1:
        # the windows holding i start in (i + p - k, i + p] (padded coordinates): the last is
        # (i + p) // s, and the t-th before it holds i while it starts past i + p - k
        o = (i + p) // s - t
        return o, (o >= 0, i + p - o * s < k, o < spec.size_out[axis])
    num = i + p - t * spec.dilation[axis]
    return num // s, (num >= 0, num % s == 0, num // s < spec.size_out[axis])


def first_tap(spec: PoolSpec, axis: int, o: Any, mn: Any, mx: Any) -> Any:
    """The position of output ``o``'s first tap along ``axis`` that is not left of the input
    (torch's ``while (start < 0) start += dilation``): where max pooling's index starts."""
    if spec.adaptive:
        return tap_position(spec, axis, o, 0)
    s, p, d = spec.stride[axis], spec.padding[axis], spec.dilation[axis]
    return o * s - p + (mx(p - o * s, 0) + d - 1) // d * d


def divisor(spec: PoolSpec, o: tuple[Any, Any, Any], mn: Any, mx: Any) -> Any:
    """What the sum of average pooling's window at output ``o`` (``(d, h, w)``) is divided by:
    torch's ``avg_pool*d`` and ``adaptive_avg_pool*d``."""
    if spec.divisor:
        return spec.divisor
    size = 1
    for a in range(3):
        n = spec.size_in[a]
        if spec.adaptive:
            lo, hi = tap_range(spec, a, o[a], mn, mx)
            size = size * (hi - lo)
            continue
        s, p, k = spec.stride[a], spec.padding[a], spec.kernel[a]
        last = (spec.size_out[a] - 1) * s - p + k  # where the last window ends
        if (last <= n + p) if spec.count_include_pad else (p == 0 and last <= n):
            size = size * k  # no window clipped: a constant the programs fold
            continue
        start = o[a] * s - p
        end = mn(start + k, n + p)
        if not spec.count_include_pad:
            start, end = mx(start, 0), mn(end, n)
        size = size * (end - start)
    return size


def pool_plan(spec: PoolSpec) -> tuple[int, int]:
    """``(threads, per)``: threads a CTA (a multiple of 32 dividing 1024), output (or, for the
    gradient, input) elements a thread. Four elements a thread from a million outputs on
    (fewer CTAs, the index arithmetic of a thread's elements shares its constants), one
    below."""
    return _THREADS, 4 if _outputs(spec) >= 1 << 20 else 1


def _outputs(spec: PoolSpec) -> int:
    return spec.batch * spec.channels * math.prod(spec.size_out)


def _inputs(spec: PoolSpec) -> int:
    return spec.batch * spec.channels * math.prod(spec.size_in)


# --- the programs ----------------------------------------------------------------------------------


#: the bits of float32 -inf, as an int32: what a max pool's tap outside the input reads
_FILL_BITS = -(1 << 23)
#: the bits of float32's quiet NaN: a max pool's window that held a NaN, without indices
_NAN_BITS = 0x7FC00000


def _masked(T, value, cond, fill_bits: int):
    """``value`` (float32) where ``cond`` holds, else the float32 of ``fill_bits``: by masking
    the value's bits, not by a select, so nvcc cannot sink the load of ``value`` into a branch
    (and a NaN or inf loaded where ``cond`` is false is not seen)."""
    keep = T.if_then_else(cond, T.int32(-1), T.int32(0))
    return T.reinterpret((T.reinterpret(value, "int32") & keep) | (T.int32(fill_bits) & ~keep),
                         "float32")


def _clamp(T, i, n: int):
    """``i`` clamped into ``[0, n)``."""
    return T.max(T.min(i, n - 1), 0)


def _over(T, x, d):
    """``x / d`` in float32 (``d`` an average pool's divisor). A constant ``d`` (every window
    the same size: :func:`divisor`) is folded: a power of two into a multiplication, another
    into a multiplication by its float32 reciprocal ``r`` and one correction, ``q + fmaf(-q,
    d, x) * r`` with ``q = x * r`` (three instructions against IEEE division's eight and its
    slow-path branch). That is the quotient IEEE division gives wherever the quotient is a
    normal float32: checked against ``x / d`` for x from 2^-102 to 2^127, every seventh
    float32 for each divisor 1 to 30 and every 1009th for 31 to 4096; where the quotient is
    subnormal it may be one unit in the last place away; an infinite sum gives the product
    (the correction would be inf - inf). A divisor that varies over the windows divides."""
    if not isinstance(d, int):
        return x / T.cast(d, "float32")
    if d & (d - 1) == 0:
        return x * T.float32(1.0 / d)
    r = T.float32(1.0 / d)
    q = x * r
    fixed = T.call_pure_extern("float32", "fmaf",
                               T.call_pure_extern("float32", "fmaf", -q, T.float32(d), x), r, q)
    # an infinite sum's correction is inf - inf: the quotient is the product itself
    return T.if_then_else(isinf(T, q), q, fixed)


def _scanner(T, spec: PoolSpec, index_of, tap_loop, argmax: bool = True):
    """``(start, scan, value)``: the macros of a window's scan, shared by the forward and the
    max gradient's scan found again. ``start(od, oh, ow, acc, arg)`` sets a window's running
    value (-inf and its first tap's position for max, 0 for a sum); ``scan(X, n, c, od, oh,
    ow, acc, arg, val)`` runs the taps of window (od, oh, ow) of plane (n, c) over it, reading
    X at ``index_of(n, c, at)`` for the tap's flat position ``at`` in the plane;
    ``value(acc, arg)`` is the window's maximum or sum, in float32.

    Max pooling without ``argmax`` keeps no position: the running maximum is ``fmaxf`` (one
    instruction a tap, where the position's rule takes a compare for greater, one for NaN and
    a select) and ``arg`` says whether a NaN was seen (one compare a tap, folded into the
    flag), so a window with a NaN gives NaN, as torch's."""
    f32 = "float32"
    Di, Hi, Wi = spec.size_in
    kd, kh, kw = taps(spec)
    is_max = spec.kind is PoolKind.MAX
    # the axes whose taps outside the input are masked: all but, for a max without indices,
    # an undilated axis of fixed windows that each hold a tap inside the input, where a tap's
    # position clamped into the input is another tap of its own window (a duplicate changes
    # no maximum, nor whether a NaN was seen)
    masked = tuple(not (is_max and not argmax and not spec.adaptive and spec.dilation[a] == 1
                        and spec.kernel[a] - 1 - spec.padding[a] >= 0
                        and (spec.size_out[a] - 1) * spec.stride[a] - spec.padding[a]
                        <= spec.size_in[a] - 1)
                   for a in range(3))

    @T.macro
    def start(od, oh, ow, acc, arg):
        """A window's running value: -inf at its first tap (max), or 0 (sum)."""
        if is_max and argmax:
            arg[0] = (first_tap(spec, 0, od, T.min, T.max) * Hi
                      + first_tap(spec, 1, oh, T.min, T.max)) * Wi + first_tap(
                          spec, 2, ow, T.min, T.max)
            acc[0] = -T.infinity(f32)
        elif is_max:
            arg[0] = 0  # no NaN seen
            acc[0] = -T.infinity(f32)
        else:
            acc[0] = T.float32(0)

    def value(acc, arg):
        if is_max and not argmax:
            return T.if_then_else(arg[0] != 0, T.reinterpret(T.int32(_NAN_BITS), f32), acc[0])
        return acc[0]

    @T.macro
    def scan(X, n, c, od, oh, ow, acc, arg, val):
        """The window of output (od, oh, ow) of plane (n, c): max (acc, arg) or sum (acc)."""
        lo_d, hi_d = tap_range(spec, 0, od, T.min, T.max)
        lo_h, hi_h = tap_range(spec, 1, oh, T.min, T.max)
        lo_w, hi_w = tap_range(spec, 2, ow, T.min, T.max)
        for td in tap_loop(kd):
            for th in tap_loop(kh):
                for tw in tap_loop(kw):
                    d = tap_position(spec, 0, od, td)
                    h = tap_position(spec, 1, oh, th)
                    w = tap_position(spec, 2, ow, tw)
                    inside = ((not masked[0] or (d >= lo_d and d < hi_d))
                              and (not masked[1] or (h >= lo_h and h < hi_h))
                              and (not masked[2] or (w >= lo_w and w < hi_w)))
                    spot = (d * Hi + h) * Wi + w
                    # every tap's load unconditional, from the position clamped into the
                    # input where the tap is outside it (read as -inf or 0, which never wins a
                    # max nor adds to a sum): the window's loads are all in flight at once,
                    # where a load behind its tap's branch waited for the one before it (and
                    # the clamp keeps the load's index provably in bounds, which a select of
                    # it would not: TileLang would guard the load with a branch again)
                    at = (_clamp(T, d, Di) * Hi + _clamp(T, h, Hi)) * Wi + _clamp(T, w, Wi)
                    raw = X[index_of(n, c, at)]
                    # the tap's value a local (read three times, an expression would be
                    # printed, and its select branched on, at each read): the value's bits
                    # masked, not selected, so nvcc cannot sink the load into a branch of the
                    # select (over 25 taps it did, and the loads ran one after another again)
                    val[0] = _masked(T, T.cast(raw, f32), inside, _FILL_BITS if is_max else 0)
                    if is_max and argmax:
                        if val[0] > acc[0] or isnan(T, val[0]):
                            acc[0] = val[0]
                            arg[0] = spot
                    elif is_max:
                        acc[0] = T.max(acc[0], val[0])
                        arg[0] = arg[0] | T.cast(isnan(T, val[0]), "int32")
                    else:
                        acc[0] = acc[0] + val[0]

    return start, scan, value


def pool_program(spec: PoolSpec, plan: tuple | None = None):
    """The forward prim_func of ``spec`` (not compiled), under ``plan`` (``(threads, per)``;
    None: :func:`pool_plan`'s, what the ops run; others are for the GPU script's sweep).
    ``(threads, per, True)``: in the planes layout, a plane a row of the grid (its y, where
    the planes fit in it), so a thread divides its index into the plane's positions only
    (the flat index's division into (n, c, d, h, w) is a fifth of the bar shape's 78 SASS
    instructions a max output, and those 24.8M outputs' instructions take some 58 us to issue
    on the H200 at full rate, of the 95 us measured)."""
    _, T = tl()
    f32, i32 = "float32", "int32"
    dtype = spec.dtype
    Di, Hi, Wi = spec.size_in
    Do, Ho, Wo = spec.size_out
    C = spec.channels
    n_out, n_in = _outputs(spec), _inputs(spec)
    kd, kh, kw = taps(spec)
    threads, per, *rest = plan or pool_plan(spec)
    block = threads * per
    grid = max(1, -(-n_out // block))
    is_max = spec.kind is PoolKind.MAX
    channels_last = spec.layout is PoolLayout.CHANNELS_LAST
    tap_loop = T.unroll if kd * kh * kw <= _UNROLL_TAPS else T.serial
    planes, positions = spec.batch * C, Do * Ho * Wo
    by_plane = bool(rest and rest[0]) and not channels_last and 0 < planes <= _GRID_Y_MAX

    def index_of(n, c, at):
        """The flat index of position ``at`` of plane (n, c) in X."""
        if channels_last:
            return ((n * Di * Hi * Wi) + at) * C + c
        return (n * C + c) * (Di * Hi * Wi) + at

    start, scan, value = _scanner(T, spec, index_of, tap_loop, argmax=spec.indices)

    def result(acc, arg, od, oh, ow):
        """The output value of a scanned window, in the output dtype."""
        if is_max:
            return T.cast(value(acc, arg), dtype)
        return T.cast(_over(T, acc[0], divisor(spec, (od, oh, ow), T.min, T.max)), dtype)

    @T.macro
    def window(X, Y, IDX, t, n, c, od, oh, ow, acc, arg, val):
        """Output ``t`` (flat, in the output's order) at (n, c, od, oh, ow)."""
        start(od, oh, ow, acc, arg)
        scan(X, n, c, od, oh, ow, acc, arg, val)
        Y[t] = result(acc, arg, od, oh, ow)
        if spec.indices:
            IDX[t] = T.cast(arg[0], "int64")

    @T.macro
    def body_by_plane(X, Y, IDX):
        with T.Kernel(-(-positions // block), planes, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            acc = T.alloc_local((1,), f32)
            arg = T.alloc_local((1,), i32)
            val = T.alloc_local((1,), f32)
            for e in T.unroll(per):
                q = bx * block + e * threads + tx  # a position in plane by
                if q < positions:
                    window(X, Y, IDX, by * positions + q, by // C, by % C, q // (Wo * Ho),
                           q // Wo % Ho, q % Wo, acc, arg, val)

    @T.macro
    def body(X, Y, IDX):
        with T.Kernel(grid, threads=threads) as bx:
            tx = T.get_thread_binding()
            acc = T.alloc_local((1,), f32)
            arg = T.alloc_local((1,), i32)
            val = T.alloc_local((1,), f32)
            for e in T.unroll(per):
                t = bx * block + e * threads + tx
                if t < n_out:
                    if channels_last:  # t runs over (n, od, oh, ow, c), the output's order
                        c = t % C
                        ow = t // C % Wo
                        oh = t // (C * Wo) % Ho
                        od = t // (C * Wo * Ho) % Do
                        n = t // (C * Wo * Ho * Do)
                    else:  # t runs over (n, c, od, oh, ow)
                        ow = t % Wo
                        oh = t // Wo % Ho
                        od = t // (Wo * Ho) % Do
                        c = t // (Wo * Ho * Do) % C
                        n = t // (Wo * Ho * Do * C)
                    window(X, Y, IDX, t, n, c, od, oh, ow, acc, arg, val)

    fwd = forward_run(spec) if not by_plane else 1

    @T.macro
    def body_runs(X, Y, IDX):
        with T.Kernel(max(1, -(-(n_out // fwd) // block)), threads=threads) as bx:
            tx = T.get_thread_binding()
            acc = T.alloc_local((1,), f32)
            arg = T.alloc_local((1,), i32)
            val = T.alloc_local((1,), f32)
            for e in T.unroll(per):
                u = bx * block + e * threads + tx  # the run; its first output t
                if u < n_out // fwd:
                    t = u * fwd
                    ow = u % (Wo // fwd) * fwd
                    oh = t // Wo % Ho
                    od = t // (Wo * Ho) % Do
                    c = t // (Wo * Ho * Do) % C
                    n = t // (Wo * Ho * Do * C)
                    for r in T.unroll(fwd):
                        window(X, Y, IDX, t + r, n, c, od, oh, ow + r, acc, arg, val)

    run = body_by_plane if by_plane else body_runs if fwd > 1 else body
    if spec.indices:
        @T.prim_func
        def main(X: T.Tensor((n_in,), dtype), Y: T.Tensor((n_out,), dtype),
                 IDX: T.Tensor((n_out,), "int64")):
            run(X, Y, IDX)
    else:
        @T.prim_func
        def main(X: T.Tensor((n_in,), dtype), Y: T.Tensor((n_out,), dtype)):
            run(X, Y, None)
    return main


#: outputs from which a forward thread takes two neighbouring windows (:func:`forward_run`):
#: calls large enough to be bound by the instructions they issue, not by one thread's chain
_FORWARD_RUN_FROM = 1 << 20


def forward_run(spec: PoolSpec) -> int:
    """Consecutive outputs along W a forward thread takes: 2 in the planes layout where W's
    fixed windows overlap without dilation (a stride below the window), the output's W is
    even and the call has :data:`_FORWARD_RUN_FROM` outputs or more, so two neighbouring
    windows share their columns' loads and the coordinates (the stem's max: 94 SASS
    instructions an output to 71, its average 104 to 75); else 1."""
    k, s, d = spec.kernel[2], spec.stride[2], spec.dilation[2]
    if (spec.adaptive or spec.layout is not PoolLayout.PLANES or d != 1 or s >= k
            or spec.size_out[2] % 2 or _outputs(spec) < _FORWARD_RUN_FROM):
        return 1
    return 2


def gradient_run(spec: PoolSpec) -> int:
    """Consecutive input elements along W a gradient thread takes: W's stride, for fixed
    windows without dilation along W whose stride is at least 2 and divides W, where each
    window's gradient is a load (average pooling, or max pooling with its indices); else 1.
    A run starts at a multiple of the stride, so which of its elements each nearby window
    holds is the same for every run (a constant pattern): the run loads each window once
    (3 x 3 windows at a stride of 2: a run of 2 loads 4 windows along H and W where its
    elements loaded 8) and shares its coordinates."""
    s, d = spec.stride[2], spec.dilation[2]
    if spec.adaptive or d != 1 or s < 2 or spec.size_in[2] % s:
        return 1
    if spec.kind is PoolKind.MAX and not spec.indices:
        return 1
    return s


def _run_windows(spec: PoolSpec, run: int) -> list[tuple[int, tuple[int, ...]]]:
    """``[(delta, elements)]``: the windows along W a run of ``run`` elements starting at
    ``j * run`` may be in (window ``j + delta``), each with the run's elements it holds (a
    window holds element ``r`` when ``0 <= r + p - delta * s < k``; the bounds of W are the
    program's)."""
    k, s, p = spec.kernel[2], spec.stride[2], spec.padding[2]
    out: dict[int, list[int]] = {}
    for r in range(run):
        for t in range(-(-k // s)):
            delta = (r + p) // s - t
            if 0 <= r + p - delta * s < k:
                out.setdefault(delta, []).append(r)
    return sorted((dl, tuple(rs)) for dl, rs in out.items())


def pool_bwd_program(spec: PoolSpec, plan: tuple[int, int] | None = None):
    """The gradient prim_func of ``spec`` (planes layout; not compiled), under ``plan`` as
    :func:`pool_program`'s (its elements counted in runs, :func:`gradient_run`)."""
    run = gradient_run(spec)
    if run > 1:
        return _pool_bwd_run_program(spec, run, plan)
    _, T = tl()
    f32, i32 = "float32", "int32"
    dtype = spec.dtype
    Di, Hi, Wi = spec.size_in
    Do, Ho, Wo = spec.size_out
    n_out, n_in = _outputs(spec), _inputs(spec)
    kd, kh, kw = taps(spec)
    gd, gh, gw = gather_taps(spec)
    threads, per = plan or pool_plan(spec)
    block = threads * per
    grid = max(1, -(-n_in // block))
    is_max = spec.kind is PoolKind.MAX
    plane_in, plane_out = Di * Hi * Wi, Do * Ho * Wo
    gather = T.unroll if gd * gh * gw <= _UNROLL_TAPS else T.serial
    # the scan found again runs inside the gather: unrolled where both together stay small
    # (a 3-D window of 27 taps would unroll 729 copies of it)
    loop = T.unroll if kd * kh * kw * gd * gh * gw <= 4 * _UNROLL_TAPS else T.serial
    # the forward's scan over plane p (its n; c is 0)
    start, scan, _ = _scanner(T, spec, lambda n, c, at: n * plane_in + at, loop)

    @T.macro
    def body(DY, X, IDX, DX):
        with T.Kernel(grid, threads=threads) as bx:
            tx = T.get_thread_binding()
            acc = T.alloc_local((1,), f32)
            m = T.alloc_local((1,), f32)
            arg = T.alloc_local((1,), i32)
            val = T.alloc_local((1,), f32)
            for e in T.unroll(per):
                t = bx * block + e * threads + tx
                if t < n_in:
                    iw = t % Wi
                    ih = t // Wi % Hi
                    i_d = t // (Wi * Hi) % Di
                    p = t // plane_in
                    spot = t % plane_in
                    acc[0] = T.float32(0)
                    # the windows holding (i_d, ih, iw), by window_of
                    for jd in gather(gd):
                        for jh in gather(gh):
                            for jw in gather(gw):
                                od, (d0, d1, d2) = window_of(spec, 0, i_d, jd)
                                oh, (h0, h1, h2) = window_of(spec, 1, ih, jh)
                                ow, (w0, w1, w2) = window_of(spec, 2, iw, jw)
                                holds = (d0 and d1 and d2 and h0 and h1 and h2 and w0 and w1
                                         and w2)
                                # average pooling and max pooling with indices: every
                                # window's loads unconditional, from the window clamped into
                                # the output, masked where it does not hold the element (as
                                # the forward's taps)
                                cd, ch, cw = _clamp(T, od, Do), _clamp(T, oh, Ho), _clamp(
                                    T, ow, Wo)
                                oc = p * plane_out + (cd * Ho + ch) * Wo + cw
                                if not is_max:
                                    acc[0] = acc[0] + _masked(T, _over(
                                        T, T.cast(DY[oc], f32),
                                        divisor(spec, (cd, ch, cw), T.min, T.max)), holds, 0)
                                elif spec.indices:  # an index's low word (a position
                                    # in a plane of fewer than 2^31: the int64's value): a
                                    # 4-byte load and one compare (bar shape 543 to 442 SASS
                                    # instructions a thread)
                                    acc[0] = acc[0] + _masked(
                                        T, T.cast(DY[oc], f32),
                                        T.And(holds, T.cast(IDX[oc], "int32") == spot), 0)
                                else:  # the window's maximum found again, by the
                                    # forward's scan of the window clamped into the output
                                    # (every load unconditional here too; the window's dy
                                    # masked where it does not hold the element)
                                    start(cd, ch, cw, m, arg)
                                    scan(X, p, 0, cd, ch, cw, m, arg, val)
                                    acc[0] = acc[0] + _masked(
                                        T, T.cast(DY[oc], f32), T.And(holds, arg[0] == spot), 0)
                    DX[t] = T.cast(acc[0], dtype)

    if is_max and spec.indices:
        @T.prim_func
        def main(DY: T.Tensor((n_out,), dtype), X: T.Tensor((n_in,), dtype),
                 IDX: T.Tensor((n_out,), "int64"), DX: T.Tensor((n_in,), dtype)):
            body(DY, X, IDX, DX)
    else:
        @T.prim_func
        def main(DY: T.Tensor((n_out,), dtype), X: T.Tensor((n_in,), dtype),
                 DX: T.Tensor((n_in,), dtype)):
            body(DY, X, None, DX)
    return main


def _pool_bwd_run_program(spec: PoolSpec, run: int, plan: tuple[int, int] | None):
    """The gradient with a thread a run of ``run`` elements along W (:func:`gradient_run`):
    the gather of :func:`pool_bwd_program` over D and H, and along W each window of
    :func:`_run_windows` loaded once and added to the run's elements it holds."""
    _, T = tl()
    f32 = "float32"
    dtype = spec.dtype
    Di, Hi, Wi = spec.size_in
    Do, Ho, Wo = spec.size_out
    n_out, n_in = _outputs(spec), _inputs(spec)
    gd, gh, _ = gather_taps(spec)
    threads, per = plan or pool_plan(spec)
    block = threads * per
    n_runs = n_in // run
    grid = max(1, -(-n_runs // block))
    is_max = spec.kind is PoolKind.MAX
    plane_in, plane_out = Di * Hi * Wi, Do * Ho * Wo
    windows = _run_windows(spec, run)
    gather = T.unroll if gd * gh * len(windows) <= _UNROLL_TAPS else T.serial

    @T.macro
    def body(DY, IDX, DX):
        with T.Kernel(grid, threads=threads) as bx:
            tx = T.get_thread_binding()
            acc = T.alloc_local((run,), f32)
            for e in T.unroll(per):
                u = bx * block + e * threads + tx  # the run
                if u < n_runs:
                    t = u * run  # its first element
                    j = u % (Wi // run)  # its first column over the stride
                    ih = t // Wi % Hi
                    i_d = t // (Wi * Hi) % Di
                    p = t // plane_in
                    spot = t % plane_in
                    for r in T.unroll(run):
                        acc[r] = T.float32(0)
                    for jd in gather(gd):
                        for jh in gather(gh):
                            od, (d0, d1, d2) = window_of(spec, 0, i_d, jd)
                            oh, (h0, h1, h2) = window_of(spec, 1, ih, jh)
                            for delta, held in windows:
                                ow = j + delta
                                holds = (d0 and d1 and d2 and h0 and h1 and h2
                                         and ow >= 0 and ow < Wo)
                                cd, ch, cw = _clamp(T, od, Do), _clamp(T, oh, Ho), _clamp(
                                    T, ow, Wo)
                                oc = p * plane_out + (cd * Ho + ch) * Wo + cw
                                if not is_max:
                                    v = _masked(T, _over(
                                        T, T.cast(DY[oc], f32),
                                        divisor(spec, (cd, ch, cw), T.min, T.max)), holds, 0)
                                    for r in held:
                                        acc[r] = acc[r] + v
                                else:  # the window's maximum: the run's element it names
                                    at = T.cast(IDX[oc], "int32") - spot
                                    g = T.cast(DY[oc], f32)
                                    for r in held:
                                        acc[r] = acc[r] + _masked(T, g, T.And(holds, at == r),
                                                                  0)
                    for r in T.unroll(run):
                        DX[t + r] = T.cast(acc[r], dtype)

    if is_max:
        @T.prim_func
        def main(DY: T.Tensor((n_out,), dtype), X: T.Tensor((n_in,), dtype),
                 IDX: T.Tensor((n_out,), "int64"), DX: T.Tensor((n_in,), dtype)):
            body(DY, IDX, DX)
    else:
        @T.prim_func
        def main(DY: T.Tensor((n_out,), dtype), X: T.Tensor((n_in,), dtype),
                 DX: T.Tensor((n_in,), dtype)):
            body(DY, None, DX)
    return main


# --- building and running -------------------------------------------------------------------------

_SPEC_FIELDS = ("kind", "adaptive", "layout", "batch", "channels", "size_in", "size_out",
                "kernel", "stride", "padding", "dilation", "count_include_pad", "divisor",
                "indices", "dtype")


def _identity(spec: PoolSpec) -> tuple:
    """Every field but the device."""
    return tuple(getattr(spec, f) for f in _SPEC_FIELDS)


@stored(maxsize=256)
def _build(identity: tuple, backward: bool, target: str | None, plan: tuple[int, int] | None):
    spec = PoolSpec(device=None, **dict(zip(_SPEC_FIELDS, identity, strict=True)))
    program = pool_bwd_program(spec, plan) if backward else pool_program(spec, plan)
    return compile_program(program, target)


def build_pool_kernel(spec: PoolSpec, target: str | None = None, backward: bool = False,
                      plan: tuple[int, int] | None = None):
    """Compile the forward (or gradient) program of ``spec`` (cached per configuration),
    under ``plan`` (None: :func:`pool_plan`'s)."""
    return _build(_identity(spec), backward, target, plan)


def two_pass(spec: PoolSpec) -> bool:
    """Whether the gradient of ``spec`` runs the forward with indices first, then the gather
    from them: max pooling without indices over a call of more than a wave of threads
    (:data:`_TWO_PASS_INPUTS`). Finding a window's maximum again inside the gather scans each
    window once for every element it holds (3 x 3 windows at a stride of 2: 4 windows of 9
    taps an element, 36 loads, against the forward's 9 an output and the gather's 4 indices
    an element); below a wave, a call's time is one thread's chain, and a second launch costs
    more than the scans."""
    return (spec.kind is PoolKind.MAX and not spec.indices
            and _inputs(spec) >= _TWO_PASS_INPUTS)


def gradient_programs(spec: PoolSpec) -> list[tuple[PoolSpec, bool]]:
    """``(spec, backward)`` of each program :class:`PoolBwdKernel` builds for ``spec`` (what
    a prebuild compiles)."""
    if two_pass(spec):
        return [(with_indices(spec), False), (with_indices(spec), True)]
    return [(spec, True)]


def with_indices(spec: PoolSpec) -> PoolSpec:
    """``spec`` with the forward's indices."""
    fields = dict(zip(_SPEC_FIELDS, _identity(spec), strict=True))
    return PoolSpec(device=spec.device, **{**fields, "indices": True})


def _size_refusal(spec: PoolSpec) -> str | None:
    n = max(_inputs(spec), _outputs(spec))
    if n > _MAX_ELEMENTS:
        return (f"indexes its tensors with int32: at most {_MAX_ELEMENTS} elements, got a "
                f"tensor of {n}")
    return None


class _PoolKernel(Kernel):
    """The pooling kernels: each is its slot's one implementation, for sm_80 to sm_90, of
    tensors that int32 indexes (:func:`_size_refusal`), built per spec but its device."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True

    @classmethod
    def region_refusal(cls, spec: PoolSpec) -> str | None:
        return _size_refusal(spec)

    @classmethod
    def identity(cls, spec: PoolSpec):
        return (*_identity(spec), spec.device)


class PoolKernel(_PoolKernel, PoolFwdInterface):
    """The forward: every pooling of the family, in either layout."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.program = build_pool_kernel(spec)
        self._indices = spec.indices
        self._channels_last = spec.layout is PoolLayout.CHANNELS_LAST

    def __call__(self, x, y, indices) -> None:
        """The programs take flat views: channels-last tensors as the contiguous ``(N,
        *spatial, C)`` their strides are."""
        if y.numel() == 0:
            return
        if self._channels_last:
            last = (0, *range(2, x.dim()), 1)
            x, y = x.permute(last), y.permute(last)
            indices = None if indices is None else indices.permute(last)
        if self._indices:
            self.program(x.view(-1), y.view(-1), indices.view(-1))
        else:
            self.program(x.view(-1), y.view(-1))


class PoolBwdKernel(_PoolKernel, PoolBwdInterface):
    """The gradient of max, average and adaptive pooling (planes layout)."""

    @classmethod
    def region_refusal(cls, spec: PoolSpec) -> str | None:
        if spec.layout is not PoolLayout.PLANES:
            return "reads its tensors in the planes layout (contiguous N, C, D, H, W)"
        return super().region_refusal(spec)

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        # with two passes, the forward with indices (its output unused), then the gather
        *first, (spec, _) = gradient_programs(spec)
        self._forward = build_pool_kernel(first[0][0]) if first else None
        self.program = build_pool_kernel(spec, backward=True)
        self._indices = spec.indices

    def __call__(self, dy, x, indices, dx) -> None:
        if dx.numel() == 0:
            return
        if self._forward is not None:
            import torch

            y = dy.new_empty((dy.numel(),))
            indices = dy.new_empty((dy.numel(),), dtype=torch.int64)
            self._forward(x.view(-1), y, indices)
        if self._indices:
            self.program(dy.view(-1), x.view(-1), indices.view(-1), dx.view(-1))
        else:
            self.program(dy.view(-1), x.view(-1), dx.view(-1))


# --- the CPU mirror of the programs ---------------------------------------------------------------


def _tensor_minmax(torch):
    """``min``/``max`` of tensors and ints, for the shared index arithmetic."""
    def mn(a, b):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))

    def mx(a, b):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))

    return mn, mx


def _window_taps(spec: PoolSpec, torch):
    """Per tap, in scan order: ``(spot, valid)`` over every output ``(Do, Ho, Wo)``, where
    ``spot`` is the tap's flat position in its plane (clamped where invalid)."""
    outs = [torch.arange(n) for n in spec.size_out]
    grid = torch.meshgrid(*outs, indexing="ij")
    kd, kh, kw = taps(spec)
    ranges = [tap_range(spec, a, grid[a], *_tensor_minmax(torch)) for a in range(3)]
    _, Hi, Wi = spec.size_in
    for td in range(kd):
        for th in range(kh):
            for tw in range(kw):
                pos = [tap_position(spec, a, grid[a], t) for a, t in enumerate((td, th, tw))]
                valid = torch.ones_like(grid[0], dtype=torch.bool)
                for a in range(3):
                    lo, hi = ranges[a]
                    valid &= (pos[a] >= lo) & (pos[a] < hi)
                spot = (pos[0] * Hi + pos[1]) * Wi + pos[2]
                yield torch.where(valid, spot, 0), valid


def emulate(spec: PoolSpec, x):
    """What :func:`pool_program` computes, on CPU in float32 (float64 for a float64 ``x``),
    by the same index arithmetic and scan rule: ``x`` is ``(N, C, D, H, W)`` (either memory
    layout: the values, not the strides, are read); returns ``(y, indices)``, indices None for
    average pooling."""
    import torch

    wide = x.double() if x.dtype == torch.float64 else x.float()
    planes = wide.reshape(spec.batch * spec.channels, -1)
    shape = (planes.shape[0], *spec.size_out)
    if spec.kind is PoolKind.MAX:
        grid = torch.meshgrid(*[torch.arange(n) for n in spec.size_out], indexing="ij")
        first = [first_tap(spec, a, grid[a], *_tensor_minmax(torch)) for a in range(3)]
        _, Hi, Wi = spec.size_in
        acc = torch.full(shape, -math.inf, dtype=wide.dtype)
        arg = ((first[0] * Hi + first[1]) * Wi + first[2]).expand(shape)
        for spot, valid in _window_taps(spec, torch):
            v = planes[:, spot.flatten()].reshape(shape)
            take = valid & ((v > acc) | v.isnan())
            acc = torch.where(take, v, acc)
            arg = torch.where(take, spot.expand(shape), arg)
        out_shape = (spec.batch, spec.channels, *spec.size_out)
        return acc.reshape(out_shape), arg.reshape(out_shape)
    acc = torch.zeros(shape, dtype=wide.dtype)
    for spot, valid in _window_taps(spec, torch):
        acc += torch.where(valid, planes[:, spot.flatten()].reshape(shape), 0)
    grid = torch.meshgrid(*[torch.arange(n) for n in spec.size_out], indexing="ij")
    div = divisor(spec, grid, *_tensor_minmax(torch))
    y = acc / torch.as_tensor(div, dtype=wide.dtype)
    return y.reshape(spec.batch, spec.channels, *spec.size_out), None


def emulate_bwd(spec: PoolSpec, dy, x, indices=None):
    """What :func:`pool_bwd_program` computes, on CPU: for every input element, the gather over
    the windows holding it by the program's arithmetic (:func:`window_of`), with the maxima
    from ``indices`` or found again by :func:`emulate`'s scan."""
    import torch

    wide = dy.double() if dy.dtype == torch.float64 else dy.float()
    P = spec.batch * spec.channels
    g = wide.reshape(P, -1)
    if spec.kind is PoolKind.MAX:
        arg = (indices if indices is not None else emulate(spec, x)[1]).reshape(P, -1)
    else:
        grid = torch.meshgrid(*[torch.arange(n) for n in spec.size_out], indexing="ij")
        div = torch.as_tensor(divisor(spec, grid, *_tensor_minmax(torch)),
                              dtype=wide.dtype)
        g = g / div.reshape(1, -1)
    ins = torch.meshgrid(*[torch.arange(n) for n in spec.size_in], indexing="ij")
    Di, Hi, Wi = spec.size_in
    Do, Ho, Wo = spec.size_out
    spot = ((ins[0] * Hi + ins[1]) * Wi + ins[2]).flatten()
    dx = torch.zeros(P, Di * Hi * Wi, dtype=wide.dtype)
    gd, gh, gw = gather_taps(spec)
    for t in [(a, b, c) for a in range(gd) for b in range(gh) for c in range(gw)]:
        ok = torch.ones_like(ins[0], dtype=torch.bool)
        win = []
        for a in range(3):
            o_a, conds = window_of(spec, a, ins[a], t[a])
            for c in conds:
                ok = ok & c
            win.append(o_a)
        o = ((win[0] * Ho + win[1]) * Wo + win[2]).flatten()
        o = torch.where(ok.flatten(), o, 0)
        take = ok.flatten().expand(P, -1)
        if spec.kind is PoolKind.MAX:
            take = take & (arg[:, o] == spot)
        dx += torch.where(take, g[:, o], 0)
    return dx.reshape(spec.batch, spec.channels, *spec.size_in)
