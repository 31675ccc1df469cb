"""Cross-entropy over class indices, forward and gradient, in TileLang.

Every program here works on the rows of a contiguous ``(M, V)`` logits tensor; ``M`` is a
launch-time size (one compiled program serves every row count), ``V``, the dtype and the
options (``ignore_index``, the label smoothing, the z-loss scale, the softcap) are compiled in.
Arithmetic is fp32 whatever the storage dtype.

Per row, with ``z`` the logits (or ``softcap * tanh(logits / softcap)``):
``lse = log(sum(exp(z)))`` by an online softmax (each thread keeps a running max and the sum of
exponentials below it, rescaled once per 16-byte vector; the threads' pairs merge by warp
shuffles and, across warps, through shared memory), and

- the loss ``lse - (1 - eps) z[t] - eps / V sum(z) + s lse^2`` (``eps`` the smoothing, ``s``
  the z-loss scale); 0 for a row whose target is ``ignore_index``, NaN for a target outside
  ``[0, V)`` (nothing outside the row is read);
- the gradient ``g ((1 + 2 s lse) softmax(z) - (1 - eps) onehot(t) - eps / V) dz/dlogits``,
  ``g`` the row's share of the loss's gradient; zero rows for ignored targets, NaN rows for
  targets outside ``[0, V)``.

Programs (all in :class:`CrossEntropyFwdKernel` and :class:`CrossEntropyBwdKernel`):

``rows`` (loss)
    One CTA a row, one pass: the row is read once. It writes each row's loss (the output for
    reduction none, a float32 scratch row of losses otherwise).
``rows`` (gradient)
    Persistent: a grid of as many CTAs as the GPU holds at once, each walking rows
    ``bx, bx + grid, ...``; two passes over a row (the log-sum-exp, then the gradient), the
    second read served by L2. Rows in flight are bounded by the grid, so their bytes
    (``grid * V * itemsize``: 132 rows of 128256 bfloat16 are 34 MB) stay within the H200's
    50 MB L2; a grid sized by occupancy alone (two CTAs an SM) would double that and send
    the second pass back to HBM.
``finish``
    One CTA: the sum of the row losses and the count of rows not ignored, giving the mean
    (``sum / count``, NaN when every row is ignored, as torch's) or the sum; in the gradient,
    the mean's per-row scale ``dloss / count``.

TileLang indexes the ``(M, V)`` buffers in int64 (the row offset ``row * V`` is widened before
the multiply), so any row count is one launch.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import functools
import math
from typing import Any, Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._tilelang import compile_program, tl

__all__ = [
    "CrossEntropyBwdInterface",
    "CrossEntropyBwdKernel",
    "CrossEntropyDType",
    "CrossEntropyFwdInterface",
    "CrossEntropyFwdKernel",
    "CrossEntropySpec",
    "Reduction",
    "build_finish_kernel",
    "build_rows_kernel",
    "rows_plan",
]

_VECTOR_BYTES = 16
_WARP = 32
#: bytes of rows the persistent gradient grid keeps in flight, at most (half the H200's L2)
_L2_ROW_BUDGET = 24 << 20
#: the SM count a program is planned for when no device says (the H100/H200's)
DEFAULT_SMS = 132
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
#: the running max's start: finite, so exp2 of a difference of two starts is 1, not NaN
_LOWEST = -3.0e38


class Reduction(enum.Enum):
    """How the row losses combine."""

    NONE = "none"
    MEAN = "mean"
    SUM = "sum"


#: the storage dtypes the kernels are written for
CrossEntropyDType = Literal["float16", "bfloat16", "float32"]
_DTYPES = frozenset(get_args(CrossEntropyDType))


class CrossEntropySpec(CallSpec, frozen=True, kw_only=True):
    """What a cross-entropy implementation is told about a call (forward or gradient): the
    exact sizes and options; the launch plan is the implementation's."""

    rows: int
    classes: int
    dtype: CrossEntropyDType  # the logits' storage dtype
    ignore_index: int
    reduction: Reduction
    label_smoothing: float
    lse_square_scale: float
    softcap: float | None

    def __post_init__(self) -> None:
        if not isinstance(self.reduction, Reduction):
            raise TypeError(f"CrossEntropySpec.reduction must be a Reduction, got "
                            f"{self.reduction!r}")
        self.check_fields(choices={"dtype": _DTYPES}, sizes=("rows", "classes"))
        if self.classes == 0:
            raise ValueError("CrossEntropySpec.classes must be > 0, got 0")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"CrossEntropySpec.label_smoothing must be in [0, 1], got "
                             f"{self.label_smoothing!r}")
        if self.softcap is not None and not self.softcap > 0.0:
            raise ValueError(f"CrossEntropySpec.softcap must be > 0 or None, got "
                             f"{self.softcap!r}")

    @property
    def options(self) -> tuple:
        """What the row programs compile in beyond ``(classes, dtype)``."""
        return (self.ignore_index, float(self.label_smoothing), float(self.lse_square_scale),
                None if self.softcap is None else float(self.softcap))


class CrossEntropyFwdInterface(KernelInterface):
    """``forward(logits, target, loss)``: ``logits`` contiguous ``(M, V)``, ``target`` ``(M,)``
    int64, ``loss`` float32, ``(M,)`` for reduction none and ``()`` otherwise."""

    slot = "cross_entropy_fwd"
    call_spec = CrossEntropySpec


class CrossEntropyBwdInterface(KernelInterface):
    """``forward(logits, target, dloss, dlogits)``: ``logits`` and ``dlogits`` contiguous
    ``(M, V)``, ``target`` ``(M,)`` int64, ``dloss`` float32 shaped as the loss."""

    slot = "cross_entropy_bwd"
    call_spec = CrossEntropySpec


# --- plans -----------------------------------------------------------------------------------


def _vec(n: int, dtype: str) -> int:
    """Widest power-of-two access (elements) that divides ``n`` and fits 16 bytes (rows start
    at ``n * itemsize`` bytes, so a wider access would be misaligned)."""
    vec = _VECTOR_BYTES // _ITEMSIZE[dtype]
    while vec > 1 and n % vec:
        vec //= 2
    return vec


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def rows_plan(classes: int, dtype: str, grad: bool, sms: int = DEFAULT_SMS
              ) -> tuple[int, int, int, int]:
    """``(threads, vec, per, ctas)`` of a row program: each thread issues ``per`` accesses of
    ``vec`` elements before it reduces them (a chunk of ``threads * vec * per`` columns a step);
    ``ctas`` is the persistent grid of the gradient (0: one CTA a row).

    The loss reads a row once: 512 threads with 4 accesses each (32 KB in flight a CTA, two
    CTAs an SM at 64 registers a thread). The gradient's grid holds one 1024-thread CTA an
    SM where a row is wide (its second pass must find the row in L2: see the module
    docstring) and more where rows are narrow, never more than 1024 threads an SM (64
    registers a thread: a CTA of the grid that could not be resident would run its rows
    after the others, doubling the time). Narrow rows take as few threads as give each
    about ``per`` accesses, at least a warp.
    """
    vec = _vec(classes, dtype)
    nv = -(-classes // vec)
    per = 2 if grad else 4
    cap = 1024 if grad else 512
    threads = min(cap, max(_WARP, _pow2_at_least(-(-nv // per))))
    if not grad:
        return threads, vec, per, 0
    row_bytes = classes * _ITEMSIZE[dtype]
    per_sm = max(1, min(1024 // threads, _L2_ROW_BUDGET // max(1, sms * row_bytes)))
    return threads, vec, per, sms * per_sm


# --- TileLang programs -----------------------------------------------------------------------


def _softcapped(T, x, softcap):
    """``z`` of a logit already in fp32: ``softcap * tanh(x / softcap)``, or ``x``."""
    if softcap is None:
        return x
    return T.tanh(x * (1.0 / softcap)) * softcap


def rows_program(classes: int, dtype: str, options: tuple, grad: bool, per_row_scale: bool,
                 threads: int, vec: int, per: int, ctas: int):
    """The row program (not compiled): the loss of each row (``grad`` false), or its gradient
    scaled by ``G[row]`` (``per_row_scale``, reduction none) or ``G[0]``."""
    _, T = tl()
    ignore_index, smoothing, zscale, softcap = options
    M = T.dynamic("M")
    V = classes
    f32 = "float32"
    chunk = threads * vec * per
    steps = -(-V // chunk)
    exact = V % chunk == 0  # no column predicate
    warps = threads // _WARP
    persistent = ctas > 0
    grid = ctas if persistent else M
    hit_w = 1.0 - smoothing  # the target's weight in the loss
    spread_w = smoothing / V  # every class's
    nan = T.cast(float("nan"), f32)

    def merged(m, s, om, os_):
        """``(max, sum)`` of two (running max, sum of exp below it) pairs."""
        nm = T.max(m, om)
        return nm, s * T.exp2((m - nm) * _LOG2E) + os_ * T.exp2((om - nm) * _LOG2E)

    @T.macro
    def body(X, Tg, G, OUT):
        with T.Kernel(grid, threads=threads) as bx:
            tx = T.get_thread_binding()
            held = T.alloc_local((per * vec,), dtype)
            zv = T.alloc_local((vec,), f32)
            acc = T.alloc_local((3,), f32)  # running max, sum of exp, sum of z
            row_t = T.alloc_local((1,), "int64")
            cm = T.alloc_local((1,), f32)  # a vector's running max
            g = T.alloc_local((1,), f32)  # the row's share of the loss's gradient
            red = T.alloc_shared((warps * 3,), f32)
            for it in T.serial(T.ceildiv(M, grid) if persistent else 1):
                row = it * grid + bx if persistent else bx
                row_t[0] = T.int64(ignore_index)
                if row < M:
                    row_t[0] = Tg[row]
                valid = row_t[0] != T.int64(ignore_index)
                in_range = (row_t[0] >= T.int64(0)) and (row_t[0] < T.int64(V))
                tcol = T.if_then_else(in_range, T.cast(row_t[0], "int32"), 0)
                acc[0] = T.cast(_LOWEST, f32)
                acc[1] = T.cast(0, f32)
                acc[2] = T.cast(0, f32)
                for step in T.serial(steps):
                    for u in T.unroll(per):
                        col = step * chunk + (u * threads + tx) * vec
                        if valid and (exact or col < V):
                            for i in T.vectorized(vec):
                                held[u * vec + i] = X[row, col + i]
                    for u in T.unroll(per):
                        col = step * chunk + (u * threads + tx) * vec
                        if valid and (exact or col < V):
                            for i in T.unroll(vec):
                                zv[i] = _softcapped(T, T.cast(held[u * vec + i], f32), softcap)
                            cm[0] = acc[0]
                            for i in T.unroll(vec):
                                cm[0] = T.max(cm[0], zv[i])
                            acc[1] = acc[1] * T.exp2((acc[0] - cm[0]) * _LOG2E)
                            for i in T.unroll(vec):
                                acc[1] += T.exp2((zv[i] - cm[0]) * _LOG2E)
                                if smoothing > 0.0:
                                    acc[2] += zv[i]
                            acc[0] = cm[0]
                # merge the threads' pairs: within the warp, then across warps
                for k in T.unroll(5):
                    om = T.shfl_xor(acc[0], 16 >> k)
                    os_ = T.shfl_xor(acc[1], 16 >> k)
                    nm, ns = merged(acc[0], acc[1], om, os_)
                    acc[0] = nm
                    acc[1] = ns
                    if smoothing > 0.0:
                        acc[2] += T.shfl_xor(acc[2], 16 >> k)
                if warps > 1:
                    if tx % _WARP == 0:
                        red[tx // _WARP] = acc[0]
                        red[warps + tx // _WARP] = acc[1]
                        red[2 * warps + tx // _WARP] = acc[2]
                    T.sync_threads()
                    acc[0] = red[0]
                    acc[1] = red[warps]
                    acc[2] = red[2 * warps]
                    for w in T.serial(1, warps):
                        nm, ns = merged(acc[0], acc[1], red[w], red[warps + w])
                        acc[0] = nm
                        acc[1] = ns
                        acc[2] += red[2 * warps + w]
                    T.sync_threads()  # red is written again by the next row
                lse = acc[0] + T.log2(acc[1]) * _LN2
                if not grad:
                    if tx == 0 and row < M:
                        zt = _softcapped(T, T.cast(X[row, tcol], f32), softcap)
                        loss = lse - hit_w * zt
                        if smoothing > 0.0:
                            loss = loss - spread_w * acc[2]
                        if zscale > 0.0:
                            loss = loss + zscale * lse * lse
                        OUT[row] = T.if_then_else(valid, T.if_then_else(in_range, loss, nan),
                                                  T.cast(0, f32))
                else:
                    g[0] = T.cast(0, f32)
                    if row < M:
                        g[0] = G[row] if per_row_scale else G[0]
                    g[0] = T.if_then_else(in_range, g[0], nan)
                    coef = g[0] * (1.0 + 2.0 * zscale * lse) if zscale > 0.0 else g[0]
                    for step in T.serial(steps):
                        for u in T.unroll(per):
                            col = step * chunk + (u * threads + tx) * vec
                            if valid and (exact or col < V):
                                for i in T.vectorized(vec):
                                    held[u * vec + i] = X[row, col + i]
                        for u in T.unroll(per):
                            col = step * chunk + (u * threads + tx) * vec
                            if row < M and (exact or col < V):
                                for i in T.unroll(vec):
                                    zv[i] = _softcapped(T, T.cast(held[u * vec + i], f32),
                                                        softcap)
                                for i in T.unroll(vec):
                                    d = coef * T.exp2((zv[i] - lse) * _LOG2E) - T.if_then_else(
                                        col + i == tcol, g[0] * hit_w, T.cast(0, f32))
                                    if smoothing > 0.0:
                                        d = d - g[0] * spread_w
                                    if softcap is not None:
                                        th = zv[i] * (1.0 / softcap)  # tanh(x / softcap)
                                        d = d * (1.0 - th * th)
                                    held[u * vec + i] = T.cast(
                                        T.if_then_else(valid, d, T.cast(0, f32)), dtype)
                                for i in T.vectorized(vec):
                                    OUT[row, col + i] = held[u * vec + i]

    xs = (M, V)
    if not grad:
        @T.prim_func
        def main(X: T.Tensor(xs, dtype), Tg: T.Tensor((M,), "int64"),
                 L: T.Tensor((M,), f32)):
            body(X, Tg, None, L)
    elif per_row_scale:
        @T.prim_func
        def main(X: T.Tensor(xs, dtype), Tg: T.Tensor((M,), "int64"),
                 G: T.Tensor((M,), f32), D: T.Tensor(xs, dtype)):
            body(X, Tg, G, D)
    else:
        @T.prim_func
        def main(X: T.Tensor(xs, dtype), Tg: T.Tensor((M,), "int64"),
                 G: T.Tensor((1,), f32), D: T.Tensor(xs, dtype)):
            body(X, Tg, G, D)
    return main


def finish_program(ignore_index: int, mean: bool, grad: bool, threads: int = 1024):
    """One CTA over the rows: ``out[0] = sum(L) / count`` (``mean``) or ``sum(L)``, ``count``
    the targets that are not ``ignore_index``; with ``grad``, ``out[0] = dloss[0] / count``."""
    _, T = tl()
    M = T.dynamic("M")
    f32 = "float32"
    warps = threads // _WARP

    @T.macro
    def body(L, Tg, DL, OUT):
        with T.Kernel(1, threads=threads) as _bx:
            tx = T.get_thread_binding()
            acc = T.alloc_local((2,), f32)  # sum of losses, count
            red = T.alloc_shared((warps * 2,), f32)
            acc[0] = T.cast(0, f32)
            acc[1] = T.cast(0, f32)
            for i in T.serial(T.ceildiv(M, threads)):
                r = i * threads + tx
                if r < M:
                    if not grad:
                        acc[0] += L[r]
                    if mean:
                        acc[1] += T.if_then_else(Tg[r] != T.int64(ignore_index),
                                                 T.cast(1, f32), T.cast(0, f32))
            for k in T.unroll(5):
                acc[0] += T.shfl_xor(acc[0], 16 >> k)
                acc[1] += T.shfl_xor(acc[1], 16 >> k)
            if tx % _WARP == 0:
                red[tx // _WARP] = acc[0]
                red[warps + tx // _WARP] = acc[1]
            T.sync_threads()
            if tx == 0:
                for w in T.serial(1, warps):
                    acc[0] += red[w]
                    acc[1] += red[warps + w]
                total = DL[0] if grad else acc[0]
                OUT[0] = total / acc[1] if mean else total

    if grad:
        @T.prim_func
        def main(Tg: T.Tensor((M,), "int64"), DL: T.Tensor((1,), f32),
                 OUT: T.Tensor((1,), f32)):
            body(None, Tg, DL, OUT)
    else:
        @T.prim_func
        def main(L: T.Tensor((M,), f32), Tg: T.Tensor((M,), "int64"),
                 OUT: T.Tensor((1,), f32)):
            body(L, Tg, None, OUT)
    return main


@functools.lru_cache(maxsize=256)
def build_rows_kernel(classes: int, dtype: str, options: tuple, grad: bool,
                      per_row_scale: bool, sms: int = DEFAULT_SMS, target: str | None = None):
    """Compile the row program (cached per configuration)."""
    threads, vec, per, ctas = rows_plan(classes, dtype, grad, sms)
    prog = rows_program(classes, dtype, options, grad, per_row_scale, threads, vec, per, ctas)
    return compile_program(prog, target)


@functools.lru_cache(maxsize=64)
def build_finish_kernel(ignore_index: int, mean: bool, grad: bool, target: str | None = None):
    """Compile the one-CTA finish program (cached per configuration)."""
    return compile_program(finish_program(ignore_index, mean, grad), target)


# --- the implementations ---------------------------------------------------------------------


def _sm_count(device: Any) -> int:
    if getattr(device, "type", None) != "cuda":
        return DEFAULT_SMS
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


class _CrossEntropyKernel(Kernel):
    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True

    @classmethod
    def identity(cls, spec: CrossEntropySpec):
        # the programs take the row count at launch; the blocks are split per call
        return (spec.classes, spec.dtype, spec.options, spec.reduction, spec.device)


class CrossEntropyFwdKernel(_CrossEntropyKernel, CrossEntropyFwdInterface):
    """The loss: the one-pass row program, then (mean, sum) the finish program over the row
    losses."""

    def __init__(self, spec: CrossEntropySpec) -> None:
        super().__init__(spec)
        self._reduction = spec.reduction
        self.rows = build_rows_kernel(spec.classes, spec.dtype, spec.options, False, False,
                                      _sm_count(spec.device))
        self.finish = None
        if spec.reduction is not Reduction.NONE:
            self.finish = build_finish_kernel(spec.ignore_index,
                                              spec.reduction is Reduction.MEAN, False)

    def __call__(self, logits, target, loss) -> None:
        rows = logits.shape[0]
        if not rows:  # nothing to launch over: torch's mean of no rows is NaN, its sum 0
            if self.finish is not None:
                loss.fill_(math.nan if self._reduction is Reduction.MEAN else 0.0)
            return
        per_row = loss if self.finish is None else loss.new_empty((rows,))
        self.rows(logits, target, per_row)
        if self.finish is not None:
            self.finish(per_row, target, loss.view(1))


class CrossEntropyBwdKernel(_CrossEntropyKernel, CrossEntropyBwdInterface):
    """The gradient: (mean) the finish program's ``dloss / count``, then the persistent
    two-pass row program."""

    def __init__(self, spec: CrossEntropySpec) -> None:
        super().__init__(spec)
        none = spec.reduction is Reduction.NONE
        self.rows = build_rows_kernel(spec.classes, spec.dtype, spec.options, True, none,
                                      _sm_count(spec.device))
        self.scale = None
        if spec.reduction is Reduction.MEAN:
            self.scale = build_finish_kernel(spec.ignore_index, True, True)
        self._none = none

    def __call__(self, logits, target, dloss, dlogits) -> None:
        rows = logits.shape[0]
        if not rows:
            return
        if self._none:
            g = dloss
        elif self.scale is not None:
            g = dloss.new_empty((1,))
            self.scale(target, dloss.view(1), g)
        else:
            g = dloss.view(1)
        self.rows(logits, target, g, dlogits)

