"""Rotary position embedding (RoPE) applied to q and k in one launch, in TileLang.

One CTA a token ``(b, s)``: it computes the token's ``cos``/``sin`` once per frequency a
thread owns (registers) and walks every head of q and then k with them, so the angles cost
nothing per head and q and k are each read and written once (the bandwidth floor). ``B`` and
``S`` are launch-time sizes (one program serves every batch and sequence length); the head
counts, ``head_dim``, ``rotary_dim``, the layout, the style, the dtype and the frequency
source are compiled in.

Thread mapping. Elements move in vectors of ``vec`` (16 bytes where the sizes allow). In the
neox style (rotate halves) a thread owns the vector at column ``c`` of the first half and the
vector at ``c + rotary_dim / 2``: ``vec`` frequencies. In the interleaved style (GPT-J) a
thread owns one vector of ``vec / 2`` adjacent pairs. ``tph`` threads cover a head's rotated
columns; ``groups = threads / tph`` heads are in flight at once, and every thread issues all
the loads of its heads before any store (``in_flight`` vectors), so an in-place call (the
outputs are the inputs) is safe and the loads overlap. Columns past ``rotary_dim`` are copied
through by the same threads (left alone in place).

Angles. ``angle = position * inv_freq`` is formed in float64 and reduced to ``[-pi, pi]``
before the float32 ``cos``/``sin``: float32's product alone is off by ``position * 6e-8``
radians (6e-3 at position 10^5), which a float64 reference shows at long positions.
``inv_freq`` is either computed in the kernel from ``base`` (``FreqSource.BASE``) or read from
a float64 table the op builds (``TABLE``: the scaled variants; ``SWITCH``: two tables, the
second used when the call's largest position + 1 exceeds ``switch_at``, found on the device
so no host sync is needed: every CTA scans the positions itself when there are at most
:data:`SCAN_POSITIONS` of them (a decode batch: no second launch), else it reads a
one-element tensor the kernel object fills with ``amax`` first). With a cos/sin cache
(``cache_length > 0``) the values of positions ``0 <= p < cache_length`` are read from it and
others computed. The attention factor ``mscale`` scales cos and sin. The backward is the
transposed rotation: the same kernel with ``sin`` negated (``inverse``).
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import math
from typing import Any, Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl

__all__ = [
    "FreqSource",
    "RopeDType",
    "RopeInterface",
    "RopeKernel",
    "RopeLayout",
    "RopeSpec",
    "RopeStyle",
    "SCAN_POSITIONS",
    "aux_layout",
    "build_rope_kernel",
    "rope_plan",
    "rope_program",
]

_VECTOR_BYTES = 16
_THREADS = 128
#: vectors one thread keeps in flight (issued before the first store)
_MAX_IN_FLIGHT = 16
#: the most positions a ``SWITCH`` program's CTAs scan for their largest value themselves; past
#: it one ``amax`` launch first is cheaper than every CTA's scan (H200, LongRoPE decode steps of
#: Llama-3 8B's heads, benchmarks/results/rope_switch-cuda0.txt: at 512 tokens the scan 6.4 us
#: against torch.compile's 7.9; at 1024 it 11.9 and one token more through amax 9.9)
SCAN_POSITIONS = 512


class RopeStyle(enum.Enum):
    """Which columns form a rotated pair."""

    NEOX = "neox"  # (j, j + rotary_dim / 2): rotate halves
    INTERLEAVED = "interleaved"  # (2j, 2j + 1): GPT-J


class RopeLayout(enum.Enum):
    """The axis order of q and k."""

    BSHD = "bshd"
    BHSD = "bhsd"


class FreqSource(enum.Enum):
    """Where ``inv_freq`` comes from."""

    BASE = "base"  # base ** (-2j / rotary_dim), in the kernel
    TABLE = "table"  # aux[j]
    SWITCH = "switch"  # aux[j], or aux[half + j] when max(position) + 1 > switch_at


RopeDType = Literal["float16", "bfloat16", "float32"]
PosDType = Literal["int32", "int64"]
_DTYPES = frozenset(get_args(RopeDType))
_POS_DTYPES = frozenset(get_args(PosDType))


class RopeSpec(CallSpec, frozen=True, kw_only=True):
    """The facts of a RoPE call but its batch and sequence lengths, which every program takes
    at launch. ``pos_dtype`` None: positions are ``0..S-1``."""

    style: RopeStyle
    layout: RopeLayout
    heads_q: int
    heads_k: int
    head_dim: int
    rotary_dim: int
    dtype: RopeDType
    pos_dtype: PosDType | None
    freq: FreqSource
    base: float
    mscale: float
    cache_length: int
    switch_at: int
    inverse: bool
    inplace: bool

    def __post_init__(self) -> None:
        for f, enum_type in (("style", RopeStyle), ("layout", RopeLayout),
                             ("freq", FreqSource)):
            if not isinstance(getattr(self, f), enum_type):
                raise TypeError(f"RopeSpec.{f} must be a {enum_type.__name__}, "
                                f"got {getattr(self, f)!r}")
        self.check_fields(choices={"dtype": _DTYPES}, flags=("inverse", "inplace"),
                          sizes=("heads_q", "heads_k", "head_dim",
                                 "rotary_dim", "cache_length", "switch_at"))
        if self.pos_dtype is not None and self.pos_dtype not in _POS_DTYPES:
            raise ValueError(f"RopeSpec.pos_dtype must be one of int32, int64 or None, "
                             f"got {self.pos_dtype!r}")
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"RopeSpec.rotary_dim must be even and in (0, head_dim = "
                             f"{self.head_dim}], got {self.rotary_dim}")
        if self.freq is FreqSource.SWITCH and self.pos_dtype is None:
            raise ValueError("RopeSpec: FreqSource.SWITCH reads the largest position of "
                             "position_ids; without them the op chooses the table")


class RopeInterface(KernelInterface):
    """One slot: rotate q and k.

    ``forward(q, k, pos, maxpos, aux, q_out, k_out)``: ``q``/``k`` contiguous in the spec's
    layout; ``pos`` the ``(B, S)`` positions (int32/int64) or None; ``maxpos`` None (the
    kernel finds the largest position itself) or, ``SWITCH`` only, a one-element tensor of
    ``pos``'s dtype holding it (read only past :data:`SCAN_POSITIONS` positions: below, the
    program scans them); ``aux`` the float64 table of :func:`aux_layout` or None;
    ``q_out``/``k_out`` like q and k (None, or q and k themselves, in place).
    """

    slot = "rope"
    call_spec = RopeSpec


def aux_layout(spec: RopeSpec) -> tuple[int, int, int]:
    """``(tables, cos_at, length)`` of the float64 ``aux`` tensor the op hands the kernel:
    ``tables`` inv_freq tables of ``rotary_dim / 2`` (0, 1 or 2), then, with a cache,
    ``cache_length x rotary_dim / 2`` cosines from ``cos_at`` and as many sines after them
    (``mscale`` folded in). ``length`` 0: no aux tensor."""
    half = spec.rotary_dim // 2
    tables = {FreqSource.BASE: 0, FreqSource.TABLE: 1, FreqSource.SWITCH: 2}[spec.freq]
    cos_at = tables * half
    return tables, cos_at, cos_at + 2 * spec.cache_length * half


def _pow2_divisor(n: int, cap: int) -> int:
    v = cap
    while v > 1 and n % v:
        v //= 2
    return v


def rope_plan(style: RopeStyle, head_dim: int, rotary_dim: int, dtype: str,
              heads: int) -> tuple[int, int, int, int]:
    """``(vec, tph, groups, passes)``: elements a vector, threads a head, heads in flight,
    passes over the ``heads`` (q's then k's) of a token.

    ``vec`` divides ``head_dim`` (each head row starts at a multiple of it) and the rotated
    span a thread steps over (``rotary_dim / 2`` in the neox style, ``rotary_dim`` in the
    interleaved one, whose vectors hold whole pairs, so at least 2 there). A CTA has about
    128 threads: fewer would leave a decode batch's 64 CTAs too few warps to cover latency,
    more gives the loop over a token's 40 heads (32 + 8) fewer passes to overlap.
    """
    cap = _VECTOR_BYTES // _ITEMSIZE[dtype]
    span = rotary_dim // 2 if style is RopeStyle.NEOX else rotary_dim
    vec = _pow2_divisor(math.gcd(head_dim, span), cap)
    if style is RopeStyle.INTERLEAVED:
        vec = max(vec, 2)
    tph = span // vec
    groups = max(1, min(_THREADS // tph, heads))
    passes = -(-heads // groups)
    return vec, tph, groups, passes


def rope_program(spec: RopeSpec):
    """The TileLang prim_func of ``spec`` (not compiled)."""
    _, T = tl()
    neox = spec.style is RopeStyle.NEOX
    hq, hk, d, rd = spec.heads_q, spec.heads_k, spec.head_dim, spec.rotary_dim
    half = rd // 2
    dtype = spec.dtype
    vec, tph, groups, passes = rope_plan(spec.style, d, rd, dtype, hq + hk)
    threads = tph * groups
    npair = vec if neox else vec // 2  # frequencies a thread owns
    # vectors of one head past rotary_dim, spread over the head's tph threads
    pass_vecs = (d - rd) // vec
    pass_per = -(-pass_vecs // tph)
    units = 2 if neox else 1  # rotated vectors a thread holds per head
    # passes of one round: their loads are all issued before the round's first store
    per_round = max(1, min(passes, _MAX_IN_FLIGHT // (units + pass_per)))
    scan_per = -(-SCAN_POSITIONS // (tph * groups))  # positions a thread tests in a scan
    rounds = -(-passes // per_round)
    f32, f64 = "float32", "float64"
    tables, cos_at, aux_len = aux_layout(spec)
    L = spec.cache_length
    sin_at = cos_at + L * half
    log_step = -2.0 * math.log(spec.base) / rd if spec.freq is FreqSource.BASE else 0.0
    step = math.exp(log_step)
    two_pi = 2.0 * math.pi
    has_pos = spec.pos_dtype is not None
    pdt = spec.pos_dtype or "int32"
    bhsd = spec.layout is RopeLayout.BHSD
    B = T.dynamic("B")
    S = T.dynamic("S")
    sq = (B, hq, S, d) if bhsd else (B, S, hq, d)
    sk = (B, hk, S, d) if bhsd else (B, S, hk, d)
    spos = (B, S) if has_pos else (1,)
    smax = (1,)
    saux = (aux_len if aux_len else 1,)
    sign = -1.0 if spec.inverse else 1.0

    def at(X, b, s, h, c):
        return X[b, h, s, c] if bhsd else X[b, s, h, c]

    @T.macro
    def put(X, b, s, h, c, v):
        if bhsd:
            X[b, h, s, c] = v
        else:
            X[b, s, h, c] = v

    @T.macro
    def angle(cs, sn, i, j, fr, pos, sel, AUX):
        if spec.freq is FreqSource.BASE:
            ang = pos[0] * fr[0]
            fr[0] = fr[0] * step
        else:
            ang = pos[0] * AUX[sel[0] * half + j]
        red = T.cast(ang - T.floor(ang * (1.0 / two_pi) + 0.5) * two_pi, f32)
        cs[i] = T.cos(red) * spec.mscale
        sn[i] = T.sin(red) * (spec.mscale * sign)

    @T.macro
    def angles(cs, sn, t, tx, POS, MAXP, AUX, bb, bs):
        pos = T.alloc_local((1,), f64)
        sel = T.alloc_local((1,), "int32")
        fr = T.alloc_local((1,), f64)
        if has_pos:
            pos[0] = T.cast(POS[bb, bs], f64)
        else:
            pos[0] = T.cast(bs, f64)
        sel[0] = 0
        # the outer tests are Python's, at parse time; the inner ones the kernel's
        if spec.freq is FreqSource.SWITCH:
            if B * S <= SCAN_POSITIONS:
                # the CTA's own scan: a thread tests its strided positions, all loads in
                # flight together, and one barrier ORs the threads' answers (the branch is
                # the same for every thread)
                for i in T.unroll(scan_per):
                    if i * threads + tx < B * S:  # noqa: SIM102
                        if POS[(i * threads + tx) // S, (i * threads + tx) % S] + 1 > \
                                spec.switch_at:
                            sel[0] = 1
                if T.call_extern("int32", "__syncthreads_or", sel[0]) != 0:
                    sel[0] = 1
            elif MAXP[0] + 1 > spec.switch_at:
                sel[0] = 1
        if spec.freq is FreqSource.BASE:
            # inv_freq_j = step ** j: one exp a thread, then a product per frequency
            fr[0] = T.exp(T.cast(t * npair, f64) * log_step)
        for i in T.unroll(npair):
            if L:
                if pos[0] >= 0 and pos[0] < L:
                    p = T.cast(pos[0], "int32")
                    cs[i] = T.cast(AUX[cos_at + p * half + t * npair + i], f32)
                    sn[i] = T.cast(AUX[sin_at + p * half + t * npair + i], f32) * sign
                    if spec.freq is FreqSource.BASE:
                        fr[0] = fr[0] * step
                else:
                    angle(cs, sn, i, t * npair + i, fr, pos, sel, AUX)
            else:
                angle(cs, sn, i, t * npair + i, fr, pos, sel, AUX)

    @T.macro
    def body(Q, K, POS, MAXP, AUX, QO, KO):
        with T.Kernel(S, B, threads=threads) as (bs, bb):
            tx = T.get_thread_binding()
            g = tx // tph
            t = tx % tph
            cs = T.alloc_local((npair,), f32)
            sn = T.alloc_local((npair,), f32)
            held = T.alloc_local((per_round * units * vec,), dtype)
            kept = T.alloc_local((per_round * pass_per * vec if pass_vecs else 1,), dtype)
            for r in T.serial(rounds):
                # every load of the round's heads first (see the module docstring)
                for p in T.unroll(per_round):
                    h = (r * per_round + p) * groups + g
                    for u in T.unroll(units):
                        col = t * vec + u * half
                        if h < hq:
                            for i in T.vectorized(vec):
                                held[(p * units + u) * vec + i] = at(Q, bb, bs, h, col + i)
                        elif h < hq + hk:
                            for i in T.vectorized(vec):
                                held[(p * units + u) * vec + i] = at(K, bb, bs, h - hq,
                                                                     col + i)
                    if pass_vecs and not spec.inplace:
                        for e in T.unroll(pass_per):
                            col = rd + (e * tph + t) * vec
                            if col < d:
                                if h < hq:
                                    for i in T.vectorized(vec):
                                        kept[(p * pass_per + e) * vec + i] = at(
                                            Q, bb, bs, h, col + i)
                                elif h < hq + hk:
                                    for i in T.vectorized(vec):
                                        kept[(p * pass_per + e) * vec + i] = at(
                                            K, bb, bs, h - hq, col + i)
                if r == 0:  # after the first loads, so they are in flight meanwhile
                    angles(cs, sn, t, tx, POS, MAXP, AUX, bb, bs)
                for p in T.unroll(per_round):
                    h = (r * per_round + p) * groups + g
                    o = p * units * vec
                    if neox:
                        for i in T.unroll(vec):
                            x1 = T.cast(held[o + i], f32)
                            x2 = T.cast(held[o + vec + i], f32)
                            held[o + i] = T.cast(x1 * cs[i] - x2 * sn[i], dtype)
                            held[o + vec + i] = T.cast(x2 * cs[i] + x1 * sn[i], dtype)
                    else:
                        for i in T.unroll(npair):
                            x1 = T.cast(held[o + 2 * i], f32)
                            x2 = T.cast(held[o + 2 * i + 1], f32)
                            held[o + 2 * i] = T.cast(x1 * cs[i] - x2 * sn[i], dtype)
                            held[o + 2 * i + 1] = T.cast(x2 * cs[i] + x1 * sn[i], dtype)
                    for u in T.unroll(units):
                        col = t * vec + u * half
                        if h < hq:
                            for i in T.vectorized(vec):
                                put(QO, bb, bs, h, col + i, held[(p * units + u) * vec + i])
                        elif h < hq + hk:
                            for i in T.vectorized(vec):
                                put(KO, bb, bs, h - hq, col + i,
                                    held[(p * units + u) * vec + i])
                    if pass_vecs and not spec.inplace:
                        for e in T.unroll(pass_per):
                            col = rd + (e * tph + t) * vec
                            if col < d:
                                if h < hq:
                                    for i in T.vectorized(vec):
                                        put(QO, bb, bs, h, col + i,
                                            kept[(p * pass_per + e) * vec + i])
                                elif h < hq + hk:
                                    for i in T.vectorized(vec):
                                        put(KO, bb, bs, h - hq, col + i,
                                            kept[(p * pass_per + e) * vec + i])

    if spec.inplace:
        @T.prim_func
        def main(Q: T.Tensor(sq, dtype), K: T.Tensor(sk, dtype), POS: T.Tensor(spos, pdt),
                 MAXP: T.Tensor(smax, pdt), AUX: T.Tensor(saux, f64)):
            body(Q, K, POS, MAXP, AUX, Q, K)
    else:
        @T.prim_func
        def main(Q: T.Tensor(sq, dtype), K: T.Tensor(sk, dtype), POS: T.Tensor(spos, pdt),
                 MAXP: T.Tensor(smax, pdt), AUX: T.Tensor(saux, f64),
                 QO: T.Tensor(sq, dtype), KO: T.Tensor(sk, dtype)):
            body(Q, K, POS, MAXP, AUX, QO, KO)
    return main


def _identity(spec: RopeSpec) -> tuple:
    """Every field but the device."""
    return (spec.style, spec.layout, spec.heads_q, spec.heads_k, spec.head_dim,
            spec.rotary_dim, spec.dtype, spec.pos_dtype, spec.freq, spec.base, spec.mscale,
            spec.cache_length, spec.switch_at, spec.inverse, spec.inplace)


@stored(maxsize=256)
def _build(identity: tuple, target: str | None):
    spec = RopeSpec(device=None, **dict(zip(_SPEC_FIELDS, identity, strict=True)))
    return compile_program(rope_program(spec), target)


_SPEC_FIELDS = ("style", "layout", "heads_q", "heads_k", "head_dim", "rotary_dim", "dtype",
                "pos_dtype", "freq", "base", "mscale", "cache_length", "switch_at", "inverse",
                "inplace")


def build_rope_kernel(spec: RopeSpec, target: str | None = None):
    """Compile the program of ``spec`` (cached per configuration)."""
    return _build(_identity(spec), target)


class RopeKernel(Kernel, RopeInterface):
    """The one implementation: every size, both layouts and styles."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True

    @classmethod
    def identity(cls, spec: RopeSpec):
        return (*_identity(spec), spec.device)

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__(spec)
        self.program = build_rope_kernel(spec)
        self._inplace = spec.inplace
        self._switch = spec.freq is FreqSource.SWITCH
        self._placeholders: dict[Any, tuple] = {}

    def __call__(self, q, k, pos, maxpos, aux, q_out, k_out) -> None:
        if q.numel() == 0 and k.numel() == 0:  # no token (or no head) to rotate
            return
        if pos is None or maxpos is None or aux is None:
            holder = self._placeholders.get(q.device)
            if holder is None:
                import torch

                holder = self._placeholders[q.device] = (
                    torch.zeros(1, dtype=torch.int32, device=q.device),
                    torch.zeros(1, dtype=torch.float64, device=q.device),
                    torch.zeros(1, dtype=torch.int64, device=q.device))
            if pos is None:
                pos = maxpos = holder[0]
            elif maxpos is None:
                if self._switch and pos.numel() > SCAN_POSITIONS:
                    maxpos = pos.amax().reshape(1)  # too many for every CTA to scan
                else:  # not read, or scanned by the program
                    maxpos = holder[2 if pos.dtype == holder[2].dtype else 0]
            aux = holder[1] if aux is None else aux
        if self._inplace:
            self.program(q, k, pos, maxpos, aux)
        else:
            self.program(q, k, pos, maxpos, aux, q_out, k_out)
