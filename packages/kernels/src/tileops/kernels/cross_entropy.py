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
    second read served by L2 where it can be. The grid is as many CTAs as are resident (two
    512-thread CTAs an SM), even where its rows in flight outgrow the L2 (264 rows of 128256
    bfloat16 are 68 MB against the H200's 50 MB): on the H200 that ran faster than a grid
    held within the L2 (8192 x 128256: 1.49 ms against 1.53 for one 1024-thread CTA an SM
    and 1.82 for three quarters of that), the latency hidden outweighing the second pass's
    misses. The second pass walks the row from its end: with the L2's least-recently-used
    eviction an element's reuse distance is then twice its distance from the row's end (the
    bytes all the grid reads and writes in between), not the whole row for every element, so
    where the rows in flight and the gradient written meanwhile outgrow the L2 the row's tail
    still hits.
``rows`` (gradient and loss)
    The gradient's program, scaled by one value, that also writes each row's loss between its
    passes: the forward of a training step with a mean or sum loss (the gradient kept for a
    unit upstream gradient, ``1 / count`` for the mean), so the step reads each row once from
    HBM and once from L2 and writes the gradient once.
``scale``
    Persistent: the kept gradient times the upstream gradient, in place; every CTA returns at
    once when the upstream gradient is exactly 1, as ``loss.backward()``'s is (it is a device
    tensor: the host cannot tell without a sync).
``finish``
    One CTA: the sum of the row losses and the count of rows not ignored, giving the mean
    (``sum / count``, NaN when every row is ignored, as torch's) or the sum; in the gradient,
    the mean's per-row scale ``dloss / count``.

TileLang indexes the ``(M, V)`` buffers in int64 (the row offset ``row * V`` is widened before
the multiply), so any row count is one launch.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import math
from typing import Any, Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl
from ._tilelang import pow2_at_least as _pow2_at_least
from ._tilelang import widest_vec as _vec

__all__ = [
    "CrossEntropyBwdInterface",
    "CrossEntropyBwdKernel",
    "CrossEntropyClusterBwdKernel",
    "CrossEntropyClusterFwdKernel",
    "CrossEntropyDType",
    "CrossEntropyFwdInterface",
    "CrossEntropyFwdKernel",
    "CrossEntropySpec",
    "Reduction",
    "build_cluster_rows_kernel",
    "build_finish_kernel",
    "build_rows_kernel",
    "build_scale_kernel",
    "cluster_plan",
    "rows_plan",
    "staged_chunks",
    "scale_plan",
]

_VECTOR_BYTES = 16
_WARP = 32
#: bytes of rows a grid of one CTA an SM may hold in flight for the second pass to find them in
#: L2 (half the H200's): the rows past it are those the cluster programs serve
_L2_ROW_BUDGET = 24 << 20
#: steps of ``threads * vec * per`` columns a gradient CTA takes over a row, at least
_GRAD_STEPS = 4
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
    #: the forward also writes the gradient for a unit upstream gradient (a kept gradient:
    #: reduction mean or sum), and scales it by the upstream gradient later
    kept: bool = False

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
        if self.kept and self.reduction is Reduction.NONE:
            raise ValueError("CrossEntropySpec.kept needs reduction mean or sum (a 0-dim "
                             "loss), got reduction none")
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
    int64, ``loss`` float32, ``(M,)`` for reduction none and ``()`` otherwise.

    With the spec's ``kept``: ``forward(logits, target, loss, dlogits)`` also writes into
    ``dlogits`` (contiguous ``(M, V)``, possibly ``logits`` itself) the gradient for a unit
    upstream gradient, and ``scale(dlogits, dloss)`` multiplies it by ``dloss`` (a float32
    0-dim tensor on the device)."""

    slot = "cross_entropy_fwd"
    call_spec = CrossEntropySpec


class CrossEntropyBwdInterface(KernelInterface):
    """``forward(logits, target, dloss, dlogits)``: ``logits`` and ``dlogits`` contiguous
    ``(M, V)``, ``target`` ``(M,)`` int64, ``dloss`` float32 shaped as the loss."""

    slot = "cross_entropy_bwd"
    call_spec = CrossEntropySpec


# --- plans -----------------------------------------------------------------------------------


def rows_plan(classes: int, dtype: str, grad: bool, sms: int = DEFAULT_SMS
              ) -> tuple[int, int, int, int]:
    """``(threads, vec, per, ctas)`` of a row program: each thread issues ``per`` accesses of
    ``vec`` elements before it reduces them (a chunk of ``threads * vec * per`` columns a step);
    ``ctas`` is the persistent grid of the gradient (0: one CTA a row).

    The loss reads a row once: 512 threads with 4 accesses each (32 KB in flight a CTA, two
    CTAs an SM at 64 registers a thread). The gradient's program takes the same CTA, and its
    persistent grid is every CTA the GPU holds at once, never more than 1024 threads an SM
    (64 registers a thread: a CTA of the grid that could not be resident would run its rows
    after the others, doubling the time); see the module docstring for why the grid is not
    held within the L2. The loss's CTA covers a narrow row in one step: as few threads as
    give each about ``per`` accesses, at least a warp. The gradient's takes as few as walk a
    row in about ``_GRAD_STEPS`` steps (at least a warp), so that more rows are in flight:
    16384 x 32000 bfloat16 ran in 0.70 ms with 256 threads (four CTAs an SM) against 0.77
    with 512, while 128256 and 256000 classes keep 512 (within 2% of the best plan there).
    """
    vec = _vec(classes, dtype)
    nv = -(-classes // vec)
    per = 4
    if not grad:
        return min(512, max(_WARP, _pow2_at_least(-(-nv // per)))), vec, per, 0
    threads = min(512, max(_WARP, _pow2_at_least(-(-nv // (per * _GRAD_STEPS)))))
    return threads, vec, per, sms * (1024 // threads)


#: the L2 of the GPUs the plans were measured on (H100 and H200: 50 MB)
_L2_BYTES = 50 << 20
#: the shared memory an SM gives a gradient program's staged chunks (of its 227 KiB)
_STAGE_BYTES_PER_SM = 192 << 10


def staged_chunks(classes: int, dtype: str, threads: int, vec: int, per: int, ctas: int,
                  sms: int = DEFAULT_SMS) -> int:
    """How many of a row's first chunks a persistent gradient program keeps in shared memory
    for its second pass (``rows_program``'s ``staged``): where the rows in flight (one a CTA)
    outgrow the L2, the second pass would read those chunks from HBM again, so as many as
    :data:`_STAGE_BYTES_PER_SM` holds for the SM's resident CTAs, at most the row's; 0 where
    the L2 serves the second pass. On the H200 at 8192 x 128256 bfloat16 (264 rows of 256 KB in
    flight against a 50 MB L2) three staged chunks of two 512-thread CTAs an SM ran the kept
    gradient in 1.40 ms against 1.49 without (benchmarks/results/gpu_session_2026-12-02b.md)."""
    item = _ITEMSIZE[dtype]
    if ctas <= 0 or ctas * classes * item <= _L2_BYTES:
        return 0
    chunk = threads * vec * per
    per_sm = max(1, -(-ctas // sms))
    return min(-(-classes // chunk), _STAGE_BYTES_PER_SM // (per_sm * chunk * item))


# --- TileLang programs -----------------------------------------------------------------------


def _softcapped(T, x, softcap):
    """``z`` of a logit already in fp32: ``softcap * tanh(x / softcap)``, or ``x``."""
    if softcap is None:
        return x
    return T.tanh(x * (1.0 / softcap)) * softcap


def _row_math(T, options: tuple, V: int):
    """What every row program computes the same way from a row's reductions:
    ``row_loss(zt, m, rel, zsum, valid, in_range)`` (the loss from the target's ``z``, the
    row's maximum ``m``, the log-sum-exp above it ``rel`` and the sum of ``z``),
    ``merged(m, s, om, os_)`` (the ``(max, sum)`` of two (running max, sum of exp below it)
    pairs) and ``grad_of(z, col, tcol, g, coef, valid)``
    (the gradient of the logit at ``col`` whose ``z`` is ``z``, for the row's share ``g``
    of the loss's gradient and ``coef = g (1 + 2 s lse)``; 0 for an ignored row; with
    ``target=False`` that of a logit known not to be the target's, the same value)."""
    ignore_index, smoothing, zscale, softcap = options
    f32 = "float32"
    hit_w = 1.0 - smoothing  # the target's weight in the loss
    spread_w = smoothing / V  # every class's
    nan = T.cast(float("nan"), f32)

    def row_loss(zt, m, rel, zsum, valid, in_range):
        # lse - (1 - eps) zt - eps / V sum(z), with lse = m + rel, summed as rel plus each
        # weight times its distance from m ((1 - eps) + V eps / V is 1): the maximum and a
        # logit near it subtract exactly, where m + rel first rounds to the maximum's ulp (1e-3
        # of a loss beside logits of 1e4)
        loss = rel + hit_w * (m - zt)
        if smoothing > 0.0:
            loss = loss + spread_w * (V * m - zsum)
        if zscale > 0.0:
            lse = m + rel
            loss = loss + zscale * lse * lse
        return T.if_then_else(valid, T.if_then_else(in_range, loss, nan), T.cast(0, f32))

    def merged(m, s, om, os_):
        nm = T.max(m, om)
        return nm, s * T.exp2((m - nm) * _LOG2E) + os_ * T.exp2((om - nm) * _LOG2E)

    def grad_of(z, lse, col, tcol, g, coef, valid, target=True):
        # target False: a logit known not to be the target's (x - 0 is x: the same value)
        d = coef * T.exp2((z - lse) * _LOG2E)
        if target:
            d = d - T.if_then_else(col == tcol, g * hit_w, T.cast(0, f32))
        if smoothing > 0.0:
            d = d - g * spread_w
        if softcap is not None:
            th = z * (1.0 / softcap)  # tanh(x / softcap)
            d = d * (1.0 - th * th)
        return T.if_then_else(valid, d, T.cast(0, f32))

    return row_loss, merged, grad_of, nan


def _row_macros(T, options: tuple, V: int, dtype: str, threads: int, vec: int, per: int,
                exact: bool):
    """The statements both gradient programs (and the loss) run on a thread's ``per``
    accesses of ``vec`` classes from column ``base`` (``base + (u * threads + tx) * vec``):
    ``load`` them (a row not ignored), ``accumulate`` them into the thread's running (max,
    sum of exp, sum of z), ``cta_merge`` the threads' triples (warp shuffles, then the warps'
    through ``red``: every thread ends with the CTA's), and ``store_grad`` their gradient
    into ``D`` (a row below ``M``: the cluster program's rows always are). ``exact``: no
    column predicate."""
    _, smoothing, _, softcap = options
    f32 = "float32"
    warps = threads // _WARP
    _, merged, grad_of, _ = _row_math(T, options, V)

    @T.macro
    def load(X, held, row, base, tx, valid):
        for u in T.unroll(per):
            col = base + (u * threads + tx) * vec
            if valid and (exact or col < V):
                for i in T.vectorized(vec):
                    held[u * vec + i] = X[row, col + i]

    @T.macro
    def accumulate(held, zv, cm, acc, base, tx, valid):
        for u in T.unroll(per):
            col = base + (u * threads + tx) * vec
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

    @T.macro
    def cta_merge(acc, red, tx):
        # within the warp, then across warps
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

    @T.macro
    def store_grad(D, held, zv, row, base, tx, lse, tcol, g, coef, valid, M):
        for u in T.unroll(per):
            col = base + (u * threads + tx) * vec
            if row < M and (exact or col < V):
                for i in T.unroll(vec):
                    zv[i] = _softcapped(T, T.cast(held[u * vec + i], f32), softcap)
                # every logit as not the target's, then, where the target is among the
                # access's, its own again: the comparison with the target's column was
                # three instructions an element of the SASS (sm_90a), one an access now
                for i in T.unroll(vec):
                    held[u * vec + i] = T.cast(grad_of(
                        zv[i], lse, col + i, tcol, g[0], coef, valid, False), dtype)
                if T.cast(tcol - col, "uint32") < T.uint32(vec):
                    for i in T.unroll(vec):
                        if col + i == tcol:
                            held[u * vec + i] = T.cast(grad_of(
                                zv[i], lse, col + i, tcol, g[0], coef, valid), dtype)
                for i in T.vectorized(vec):
                    D[row, col + i] = held[u * vec + i]

    return load, accumulate, cta_merge, store_grad


def _row_prim_func(T, body, M, V: int, dtype: str, grad: bool, per_row_scale: bool,
                   with_loss: bool):
    """The prim_func of a row program's ``body(X, Tg, G, D, L)`` over the tensors its kind
    takes: the loss ``(X, Tg, L)``; the gradient scaled by one value ``(X, Tg, G, D)`` or
    per row ``(X, Tg, G[M], D)``; with its loss ``(X, Tg, G, L, D)``."""
    f32 = "float32"
    xs = (M, V)
    if not grad:
        @T.prim_func
        def main(X: T.Tensor(xs, dtype), Tg: T.Tensor((M,), "int64"),
                 L: T.Tensor((M,), f32)):
            body(X, Tg, None, L, None)
    elif with_loss:
        @T.prim_func
        def main(X: T.Tensor(xs, dtype), Tg: T.Tensor((M,), "int64"),
                 G: T.Tensor((1,), f32), L: T.Tensor((M,), f32), D: T.Tensor(xs, dtype)):
            body(X, Tg, G, D, L)
    elif per_row_scale:
        @T.prim_func
        def main(X: T.Tensor(xs, dtype), Tg: T.Tensor((M,), "int64"),
                 G: T.Tensor((M,), f32), D: T.Tensor(xs, dtype)):
            body(X, Tg, G, D, None)
    else:
        @T.prim_func
        def main(X: T.Tensor(xs, dtype), Tg: T.Tensor((M,), "int64"),
                 G: T.Tensor((1,), f32), D: T.Tensor(xs, dtype)):
            body(X, Tg, G, D, None)
    return main


def rows_program(classes: int, dtype: str, options: tuple, grad: bool, per_row_scale: bool,
                 threads: int, vec: int, per: int, ctas: int, with_loss: bool = False,
                 staged: int = 0):
    """The row program (not compiled): the loss of each row (``grad`` false), or its gradient
    scaled by ``G[row]`` (``per_row_scale``, reduction none) or ``G[0]``; ``with_loss`` (a
    gradient scaled by ``G[0]``) also writes each row's loss into ``L``, between the passes.

    ``staged`` (a gradient program's; :func:`staged_chunks` gives the plans'): the row's first
    ``staged`` chunks are also kept in shared memory by the first pass, and the second pass
    reads them from there, not from L2 or HBM; its last chunks, the freshest in L2, are read
    again as before. Each thread reads back only the words it wrote (shared column = row
    column), so no barrier guards them.

    With ``with_loss`` thread 0 reads the target's logit at the start of the row, before the
    merge's barriers (or, for a single warp, its shuffles), so no thread of the second pass
    has written the gradient over it yet where ``D`` is ``X``."""
    if with_loss and (not grad or per_row_scale):
        raise ValueError("rows_program: with_loss is the gradient scaled by G[0] (grad, not "
                         f"per_row_scale), got grad={grad!r}, per_row_scale={per_row_scale!r}")
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
    if staged and not (grad and 0 < staged <= steps):
        raise ValueError(f"rows_program: staged is a gradient program's count of a row's "
                         f"{steps} chunks, got staged={staged!r} with grad={grad!r}")
    grid = ctas if persistent else M
    row_loss, _, _, nan = _row_math(T, options, V)
    load, accumulate, cta_merge, store_grad = _row_macros(T, options, V, dtype, threads, vec,
                                                          per, exact)

    @T.macro
    def stash(held, S, base, tx, valid, back):
        """A thread's accesses into (``back``: out of) the staged chunks' shared copy."""
        for u in T.unroll(per):
            col = base + (u * threads + tx) * vec
            if valid and (exact or col < V):
                for i in T.vectorized(vec):
                    if back:
                        held[u * vec + i] = S[col + i]
                    else:
                        S[col + i] = held[u * vec + i]

    @T.macro
    def body(X, Tg, G, OUT, L):
        with T.Kernel(grid, threads=threads) as bx:
            tx = T.get_thread_binding()
            if staged:
                kept = T.alloc_shared((staged * chunk,), dtype)
            held = T.alloc_local((per * vec,), dtype)
            zv = T.alloc_local((vec,), f32)
            acc = T.alloc_local((3,), f32)  # running max, sum of exp, sum of z
            row_t = T.alloc_local((1,), "int64")
            cm = T.alloc_local((1,), f32)  # a vector's running max
            g = T.alloc_local((1,), f32)  # the row's share of the loss's gradient
            xt = T.alloc_local((1,), f32)  # with_loss: the target's logit
            red = T.alloc_shared((warps * 3,), f32)
            for it in T.serial(T.ceildiv(M, grid) if persistent else 1):
                row = it * grid + bx if persistent else bx
                row_t[0] = T.int64(ignore_index)
                if row < M:
                    row_t[0] = Tg[row]
                valid = row_t[0] != T.int64(ignore_index)
                in_range = (row_t[0] >= T.int64(0)) and (row_t[0] < T.int64(V))
                tcol = T.if_then_else(in_range, T.cast(row_t[0], "int32"), 0)
                if with_loss:
                    xt[0] = T.cast(0, f32)
                    if tx == 0 and row < M:
                        xt[0] = T.cast(X[row, tcol], f32)
                acc[0] = T.cast(_LOWEST, f32)
                acc[1] = T.cast(0, f32)
                acc[2] = T.cast(0, f32)
                for step in T.serial(steps):
                    load(X, held, row, step * chunk, tx, valid)
                    if staged:  # noqa: SIM102 - the program's choice, then the step's
                        if step < staged:
                            stash(held, kept, step * chunk, tx, valid, False)
                    accumulate(held, zv, cm, acc, step * chunk, tx, valid)
                cta_merge(acc, red, tx)
                if warps > 1:
                    T.sync_threads()  # red is written again by the next row
                rel = T.log2(acc[1]) * _LN2
                lse = acc[0] + rel
                if not grad:
                    if tx == 0 and row < M:
                        zt = _softcapped(T, T.cast(X[row, tcol], f32), softcap)
                        OUT[row] = row_loss(zt, acc[0], rel, acc[2], valid, in_range)
                else:
                    if with_loss and tx == 0 and row < M:
                        L[row] = row_loss(_softcapped(T, xt[0], softcap), acc[0], rel, acc[2],
                                          valid, in_range)
                    g[0] = T.cast(0, f32)
                    if row < M:
                        g[0] = G[row] if per_row_scale else G[0]
                    g[0] = T.if_then_else(in_range, g[0], nan)
                    coef = g[0] * (1.0 + 2.0 * zscale * lse) if zscale > 0.0 else g[0]
                    # the second pass walks the row backwards: its first reads are the first
                    # pass's last, the freshest in L2 (see the module docstring)
                    for back in T.serial(steps):
                        step = steps - 1 - back
                        if staged:
                            if step < staged:
                                stash(held, kept, step * chunk, tx, valid, True)
                            else:
                                load(X, held, row, step * chunk, tx, valid)
                        else:
                            load(X, held, row, step * chunk, tx, valid)
                        store_grad(OUT, held, zv, row, step * chunk, tx, lse, tcol, g, coef,
                                   valid, M)

    return _row_prim_func(T, body, M, V, dtype, grad, per_row_scale, with_loss)


#: the most CTAs a row is split over (a portable cluster on sm_90) and the fewest classes a
#: CTA of a split row takes
_MAX_CLUSTER = 8
_MIN_CLUSTER_SHARE = 4096
#: bytes of its share of a row one thread of a cluster program holds in registers
_CLUSTER_HELD_BYTES = 64
#: consecutive rows a cluster of the cluster program takes, each row's read issued before the
#: previous one is merged and written (a cluster of 8 CTAs of 8192 rows x 128256 classes: 512
#: clusters, some 16 at a time on 132 SMs, so the last wave idles at most 1/32 of the time)
_CLUSTER_ROWS = 16


def cluster_plan(classes: int, dtype: str, held: int = _CLUSTER_HELD_BYTES
                 ) -> tuple[int, int, int, int] | None:
    """``(cluster, threads, vec, per)`` of the cluster gradient program, or None where a row
    is narrow enough for the persistent two-pass program's rows to stay in L2: a row split
    over ``cluster`` CTAs (a power of two up to 8, each taking at least
    ``_MIN_CLUSTER_SHARE`` classes), each thread holding ``per`` accesses of ``vec`` classes
    (at most ``held`` bytes, up to 1024 threads). 128256 bfloat16 classes: 8 CTAs of 512
    threads holding 4 x 8 (``held`` 128: 256 threads holding 8 x 8, two CTAs an SM)."""
    row_bytes = classes * _ITEMSIZE[dtype]
    if row_bytes * DEFAULT_SMS <= _L2_ROW_BUDGET:
        return None  # a grid of rows fits the L2: the two-pass program reads HBM once
    cluster = 1
    while cluster * 2 <= _MAX_CLUSTER and classes // (cluster * 2) >= _MIN_CLUSTER_SHARE:
        cluster *= 2
    vec = _vec(classes, dtype)
    accesses = -(-classes // vec)  # a row's
    share = -(-accesses // cluster)  # a CTA's
    threads = min(1024, max(_WARP, _pow2_at_least(-(-share * vec * _ITEMSIZE[dtype]
                                                   // held))))
    per = -(-share // threads)
    if cluster == 1 or per * vec * _ITEMSIZE[dtype] > held:
        return None
    return cluster, threads, vec, per


def cluster_rows_program(classes: int, dtype: str, options: tuple, per_row_scale: bool,
                         cluster: int, threads: int, vec: int, per: int,
                         with_loss: bool = False, rows: int = 1, async_push: bool = False):
    """The gradient program with each row held on chip (not compiled; sm_90): a row split
    over the ``cluster`` CTAs of a thread-block cluster, CTA ``r`` holding its share of the
    row (columns ``r * share`` on) in registers from one read; the CTAs' (max, sum of exp, sum
    of z) triples pushed into every CTA of the cluster over distributed shared memory and
    merged there in rank order (all of a row's CTAs get the same log-sum-exp); the gradient
    written from the registers. One read of the logits from HBM and one write of the
    gradient: no second pass to miss L2 (the two-pass program's limit for rows of 128256
    classes). The scale and ``with_loss`` as :func:`rows_program`'s (``L[row]`` written by
    CTA 0 of the row, from the target's logit it reads before the cluster's barrier after the
    row's push, so no CTA has written the gradient over it yet where ``D`` is ``X``).

    A cluster takes ``rows`` consecutive rows: once the row's triples are merged it issues the
    next row's loads into a second set of registers, then writes this row's gradient, so the
    next row's read and this row's stores are in flight together (one row a cluster, loaded,
    synchronised and stored in series, nothing overlapping: 2.04 ms for 8192 x 128256 on the
    H200 against the two-pass program's 1.53). The loads go after the cluster's barrier: its
    arrive releases the CTA's writes (the pushed triples), a fence that waits for the
    thread's memory operations in flight (``MEMBAR.ALL.GPU``). The pushed triples alternate between
    two slots by the row's parity: a CTA may push the next row's triple while another still
    reads this row's, and none can push the one after before every CTA has passed the next
    row's barrier.

    ``async_push``: no cluster barrier a row, so no fence. Thread 0 of each CTA copies its
    triple (padded to 16 bytes) into every CTA's slot with an asynchronous bulk copy that
    arrives on the receiver's mbarrier of the row's parity (``T.copy_cluster`` with a remote
    barrier: an ``mbarrier.arrive.expect_tx`` and a ``cp.async.bulk`` into the peer's shared
    memory), and each CTA waits on its own mbarrier. The next row's read is then issued
    before this row's sum (nothing waits for it until the row after), in flight through the
    exchange and the stores. A CTA pushes row ``j + 2`` into a slot (and from a source) of
    row ``j``'s parity only after every CTA pushed row ``j + 1`` to it, which each did after
    its wait for row ``j``: every copy of row ``j`` had landed, and been read. One cluster
    barrier at the end keeps a CTA's shared memory until the last copies out of it are
    done."""
    _, T = tl()
    ignore_index, smoothing, zscale, softcap = options
    M = T.dynamic("M")
    V = classes
    f32 = "float32"
    share = threads * per * vec  # columns a CTA covers
    exact = cluster * share == V
    warps = threads // _WARP
    row_loss, merged, _, nan = _row_math(T, options, V)
    load, accumulate, cta_merge, store_grad = _row_macros(T, options, V, dtype, threads, vec,
                                                          per, exact)
    # one shared array, its parts disjoint (the storage planner would otherwise overlap
    # them, unaware that the other CTAs push into the cluster's part): the warps' triples,
    # this CTA's triple, the cluster's triples (two slots of them); the asynchronous push's
    # parts 16-byte units (a bulk copy's size and alignment), its own triple two of them
    width = 4 if async_push else 3
    mine = -(-3 * warps // 4) * 4 if async_push else 3 * warps
    parts = mine + (2 * width if async_push else width)

    @T.macro
    def body(X, Tg, G, D, L):
        with T.Kernel(T.ceildiv(M, rows) * cluster, threads=threads,
                      cluster_dims=(cluster, 1, 1)) as bx:
            tx = T.get_thread_binding()
            rank = bx % cluster
            first = bx // cluster * rows
            base = rank * share
            held = T.alloc_local((per * vec,), dtype)
            ahead = T.alloc_local((per * vec,), dtype)  # the next row's share, in flight
            zv = T.alloc_local((vec,), f32)
            acc = T.alloc_local((3,), f32)  # running max, sum of exp, sum of z
            cm = T.alloc_local((1,), f32)
            g = T.alloc_local((1,), f32)
            xt = T.alloc_local((1,), f32)
            scratch = T.alloc_shared((parts + 2 * width * cluster,), f32)
            if async_push:
                # a row parity's mbarrier: one arrival of each CTA's copy a phase (TileLang
                # initialises them, then fences the init and syncs the cluster: every CTA is
                # running before any pushes into another's memory)
                bars = T.alloc_cluster_barrier([cluster, cluster])
            load(X, held, first, base, tx, Tg[first] != T.int64(ignore_index))
            if not async_push:
                # every CTA of the cluster is running before any pushes into another's memory
                T.cluster_sync()
            for j in T.serial(rows):
                row = first + j
                if row < M:  # the cluster's rows: every CTA of it takes the same branch
                    nxt = row + 1
                    if async_push and j + 1 < rows and nxt < M:
                        load(X, ahead, nxt, base, tx, Tg[nxt] != T.int64(ignore_index))
                    target = Tg[row]
                    valid = target != T.int64(ignore_index)
                    in_range = (target >= T.int64(0)) and (target < T.int64(V))
                    tcol = T.if_then_else(in_range, T.cast(target, "int32"), 0)
                    xt[0] = T.cast(0, f32)
                    if with_loss:  # noqa: SIM102 - the program's choice, then the thread's
                        if tx == 0 and rank == 0:
                            xt[0] = T.cast(X[row, tcol], f32)
                    acc[0] = T.cast(_LOWEST, f32)
                    acc[1] = T.cast(0, f32)
                    acc[2] = T.cast(0, f32)
                    accumulate(held, zv, cm, acc, base, tx, valid)
                    cta_merge(acc, scratch, tx)  # the warps' triples: the array's first part
                    # the cluster's triples, merged in rank order on every CTA of the row
                    own = mine + width * (j % 2) if async_push else mine
                    if tx == 0:
                        scratch[own] = acc[0]
                        scratch[own + 1] = acc[1]
                        scratch[own + 2] = acc[2]
                    T.sync_threads()
                    at = parts + width * cluster * (j % 2)
                    slot = at + width * rank
                    for d in T.unroll(cluster):
                        if async_push:
                            T.copy_cluster(scratch[own:own + 4], scratch[slot:slot + 4],
                                           dst_block=d, remote_barrier=bars[j % 2])
                        else:
                            T.copy_cluster(scratch[own:own + 3], scratch[slot:slot + 3],
                                           dst_block=d)
                    if async_push:
                        T.mbarrier_wait_parity(bars[j % 2], j // 2 % 2)
                    else:
                        T.cluster_sync()
                    acc[0] = scratch[at]
                    acc[1] = scratch[at + 1]
                    acc[2] = scratch[at + 2]
                    for c in T.serial(1, cluster):
                        nm, ns = merged(acc[0], acc[1], scratch[at + width * c],
                                        scratch[at + width * c + 1])
                        acc[0] = nm
                        acc[1] = ns
                        acc[2] += scratch[at + width * c + 2]
                    rel = T.log2(acc[1]) * _LN2
                    lse = acc[0] + rel
                    if with_loss:  # noqa: SIM102 - the program's choice, then the thread's
                        if tx == 0 and rank == 0:
                            L[row] = row_loss(_softcapped(T, xt[0], softcap), acc[0], rel,
                                              acc[2], valid, in_range)
                    g[0] = G[row] if per_row_scale else G[0]
                    g[0] = T.if_then_else(in_range, g[0], nan)
                    coef = g[0] * (1.0 + 2.0 * zscale * lse) if zscale > 0.0 else g[0]
                    # the next row's read, issued past the barrier (whose release fence waits
                    # for this thread's memory operations in flight) and before this row's
                    # stores, so the two overlap
                    if not async_push and j + 1 < rows and nxt < M:
                        load(X, ahead, nxt, base, tx, Tg[nxt] != T.int64(ignore_index))
                    store_grad(D, held, zv, row, base, tx, lse, tcol, g, coef, valid, M)
                    for i in T.unroll(per * vec):
                        held[i] = ahead[i]
            if async_push:
                T.cluster_sync()  # the last copies out of this CTA's memory have landed

    return _row_prim_func(T, body, M, V, dtype, True, per_row_scale, with_loss)


def scale_program(classes: int, dtype: str, threads: int, vec: int, ctas: int):
    """``D *= S[0]`` over contiguous ``(M, V)`` rows, returning at once where ``S[0]`` is
    exactly 1 (the scale of a kept gradient by the loss's upstream gradient: ``loss.backward()``
    passes 1, and reading and writing ``D`` for it would cost as much as the gradient did)."""
    _, T = tl()
    M = T.dynamic("M")
    V = classes
    f32 = "float32"
    chunk = threads * vec
    steps = -(-V // chunk)
    exact = V % chunk == 0

    @T.prim_func
    def main(D: T.Tensor((M, V), dtype), S: T.Tensor((1,), f32)):
        with T.Kernel(ctas, threads=threads) as bx:
            tx = T.get_thread_binding()
            held = T.alloc_local((vec,), dtype)
            s = T.alloc_local((1,), f32)
            s[0] = S[0]
            if s[0] != T.cast(1.0, f32):  # NaN is not 1: it is multiplied in
                for it in T.serial(T.ceildiv(M, ctas)):
                    row = it * ctas + bx
                    for step in T.serial(steps):
                        col = step * chunk + tx * vec
                        if row < M and (exact or col < V):
                            for i in T.vectorized(vec):
                                held[i] = D[row, col + i]
                            for i in T.unroll(vec):
                                held[i] = T.cast(T.cast(held[i], f32) * s[0], dtype)
                            for i in T.vectorized(vec):
                                D[row, col + i] = held[i]

    return main


def scale_plan(classes: int, dtype: str, sms: int = DEFAULT_SMS) -> tuple[int, int, int]:
    """``(threads, vec, ctas)`` of the scale program: as few threads as cover a row's accesses
    once, at least a warp and at most 512; a grid of 2048 threads an SM, each CTA walking rows
    ``bx, bx + ctas, ...`` (a grid the size of the rows would launch 8192 CTAs only to exit
    when the scale is 1)."""
    vec = _vec(classes, dtype)
    threads = min(512, max(_WARP, _pow2_at_least(-(-classes // vec))))
    return threads, vec, sms * (2048 // threads)


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


@stored(maxsize=256)
def build_rows_kernel(classes: int, dtype: str, options: tuple, grad: bool,
                      per_row_scale: bool, sms: int = DEFAULT_SMS, target: str | None = None,
                      with_loss: bool = False):
    """Compile the row program (cached per configuration)."""
    threads, vec, per, ctas = rows_plan(classes, dtype, grad, sms)
    staged = staged_chunks(classes, dtype, threads, vec, per, ctas, sms) if grad else 0
    prog = rows_program(classes, dtype, options, grad, per_row_scale, threads, vec, per, ctas,
                        with_loss, staged)
    return compile_program(prog, target)


@stored(maxsize=64)
def build_cluster_rows_kernel(classes: int, dtype: str, options: tuple, per_row_scale: bool,
                              target: str | None = None, with_loss: bool = False,
                              rows: int = _CLUSTER_ROWS, held: int = _CLUSTER_HELD_BYTES,
                              async_push: bool = False):
    """Compile the cluster gradient program of :func:`cluster_plan` (cached), ``rows``
    consecutive rows a cluster, at most ``held`` bytes of a row a thread, the triples
    exchanged by asynchronous copies where ``async_push``."""
    for name, value in (("rows", rows), ("held", held)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: the cluster program takes a positive int, not {value!r}")
    plan = cluster_plan(classes, dtype, held)
    if plan is None:
        raise ValueError(f"rows of {classes} {dtype} classes take the two-pass program (a "
                         f"grid of them fits the L2), not the cluster one")
    return compile_program(cluster_rows_program(classes, dtype, options, per_row_scale, *plan,
                                                with_loss=with_loss, rows=rows,
                                                async_push=async_push),
                           target)


@stored(maxsize=64)
def build_scale_kernel(classes: int, dtype: str, sms: int = DEFAULT_SMS,
                       target: str | None = None):
    """Compile the scale program (cached per configuration)."""
    return compile_program(scale_program(classes, dtype, *scale_plan(classes, dtype, sms)),
                           target)


@stored(maxsize=64)
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
        return (spec.classes, spec.dtype, spec.options, spec.reduction, spec.kept, spec.device)

    @staticmethod
    def _gradient_rows(spec: CrossEntropySpec, sms: int, per_row_scale: bool,
                       with_loss: bool = False):
        """The gradient's row program: the persistent two-pass one."""
        return build_rows_kernel(spec.classes, spec.dtype, spec.options, True, per_row_scale,
                                 sms, with_loss=with_loss)


class _ClusterRows:
    """The cluster gradient program (:func:`cluster_rows_program`, sm_90) in place of the
    two-pass one, for rows too wide for a grid of them to stay in L2 (:func:`cluster_plan`).
    Preferred over the general kernel of its slot where its region holds; installed through
    ``kernel_map`` until the GPU's sweep (``benchmarks/gpu_cross_entropy.sh``, stage
    ``cluster``) has timed it against the two-pass program."""

    supported_archs = frozenset({(9, 0)})
    general = False

    @classmethod
    def region_refusal(cls, spec: CrossEntropySpec) -> str | None:
        if cluster_plan(spec.classes, spec.dtype) is None:
            return (f"rows of {spec.classes} {spec.dtype} classes: a grid of them stays in L2 "
                    f"(the two-pass program reads each from HBM once), or a CTA's share "
                    f"exceeds {_CLUSTER_HELD_BYTES} bytes a thread")
        return None

    @staticmethod
    def _gradient_rows(spec: CrossEntropySpec, sms: int, per_row_scale: bool,
                       with_loss: bool = False):
        return build_cluster_rows_kernel(spec.classes, spec.dtype, spec.options,
                                         per_row_scale, with_loss=with_loss)


class CrossEntropyFwdKernel(_CrossEntropyKernel, CrossEntropyFwdInterface):
    """The loss: the one-pass row program, then (mean, sum) the finish program over the row
    losses.

    Kept (the spec's ``kept``): the loss and the gradient for a unit upstream gradient in one
    launch of the persistent two-pass gradient program that also writes each row's loss (the
    row read once from HBM and once from L2, the gradient written once), its scale ``1 /
    count`` for the mean first computed on the device by the finish program's gradient form
    (``dloss = 1``: no host sync), then the loss's finish; :meth:`scale` is the scale
    program."""

    def __init__(self, spec: CrossEntropySpec) -> None:
        super().__init__(spec)
        self._reduction = spec.reduction
        mean = spec.reduction is Reduction.MEAN
        sms = _sm_count(spec.device)
        self.finish = None
        if spec.reduction is not Reduction.NONE:
            self.finish = build_finish_kernel(spec.ignore_index, mean, False)
        self.count = self.scaler = self._unit = None
        if not spec.kept:
            self.rows = build_rows_kernel(spec.classes, spec.dtype, spec.options, False, False,
                                          sms)
            return
        self.rows = self._gradient_rows(spec, sms, False, with_loss=True)
        self.scaler = build_scale_kernel(spec.classes, spec.dtype, sms)
        if mean:
            self.count = build_finish_kernel(spec.ignore_index, True, True)
        import torch

        #: the unit upstream gradient the kept gradient is computed for (made once here, not
        #: per call: a call may be under CUDA graph capture)
        self._unit = torch.ones(1, dtype=torch.float32, device=spec.device)

    def __call__(self, logits, target, loss, dlogits=None) -> None:
        rows = logits.shape[0]
        if not rows:  # nothing to launch over: torch's mean of no rows is NaN, its sum 0
            if self.finish is not None:
                loss.fill_(math.nan if self._reduction is Reduction.MEAN else 0.0)
            return
        per_row = loss if self.finish is None else loss.new_empty((rows,))
        if self._unit is None:
            self.rows(logits, target, per_row)
        else:
            g = self._unit
            if self.count is not None:  # the mean's 1 / count of the rows not ignored
                g = loss.new_empty((1,))
                self.count(target, self._unit, g)
            self.rows(logits, target, g, per_row, dlogits)
        if self.finish is not None:
            self.finish(per_row, target, loss.view(1))

    def scale(self, dlogits, dloss) -> None:
        """``dlogits *= dloss`` on the device, nothing written where ``dloss`` is 1."""
        if dlogits.shape[0]:
            self.scaler(dlogits, dloss.reshape(1))


class CrossEntropyBwdKernel(_CrossEntropyKernel, CrossEntropyBwdInterface):
    """The gradient: (mean) the finish program's ``dloss / count``, then the persistent
    two-pass row program."""

    def __init__(self, spec: CrossEntropySpec) -> None:
        super().__init__(spec)
        none = spec.reduction is Reduction.NONE
        self.rows = self._gradient_rows(spec, _sm_count(spec.device), none)
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


class CrossEntropyClusterFwdKernel(_ClusterRows, CrossEntropyFwdKernel):
    """:class:`CrossEntropyFwdKernel` with the kept gradient from the cluster program (the
    loss alone reads each row once already: a forward without a kept gradient is refused to
    it)."""

    preferred_over = (CrossEntropyFwdKernel,)

    @classmethod
    def region_refusal(cls, spec: CrossEntropySpec) -> str | None:
        if not spec.kept:
            return "no kept gradient: the one-pass loss program reads each row once already"
        return super().region_refusal(spec)


class CrossEntropyClusterBwdKernel(_ClusterRows, CrossEntropyBwdKernel):
    """:class:`CrossEntropyBwdKernel` with the cluster program."""

    preferred_over = (CrossEntropyBwdKernel,)

