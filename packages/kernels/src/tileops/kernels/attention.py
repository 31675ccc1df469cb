"""Prefill attention forward in TileLang: FlashAttention's online softmax over key tiles.

One CTA computes one tile of ``block_m`` query rows of one query head of one batch entry: it
holds the rows' queries in shared memory and walks the key tiles the mask lets the tile see
(``T.Pipelined`` over ``block_n`` keys a step, the next tile's keys and values copied while the
current one computes), keeping in registers the rows' running maximum, their sum of
exponentials and the unnormalized output. The pattern is TileLang's
``examples/flash_attention/example_gqa_fwd_bshd.py`` (128 x 128 tiles, two stages, 256 threads
for head dims up to 128), with what the ops need beyond it:

- the mask is bottom-right aligned (row ``i`` at key position ``i + S_kv - S_q``) and bounded
  on either side by the window (``is_causal`` is a right bound of 0): the key-tile loop starts
  and stops at the first and last tile any row of the CTA sees, and the scores outside a row's
  window or past ``S_kv`` are set to -inf after the product (not added before it: a
  selection, so no key tile's contents, in bounds or not, can reach a masked score);
- the running maximum used in the exponent is 0 while a row has seen no key (FlashAttention's
  ``Check_inf``), so a row that sees no key accumulates nothing, is written 0 and its
  log-sum-exp -inf, instead of 0 / 0;
- the scores' scale is folded into the base-2 exponent (one FFMA an element); with a softcap
  the scores are replaced by ``softcap * log2(e) * tanh(scale * s / softcap)`` first, and the
  exponent's factor is 1;
- the log-sum-exp (natural log) of each row is written to a ``[B, H, S_q]`` float32 tensor;
- grouped-query heads: query head ``h`` reads key/value head ``h // (H / H_kv)``;
- either layout, ``[B, S, H, D]`` or ``[B, H, S, D]``, read and written in place;
- causal CTAs are launched longest first (the query tiles in reverse), so the short diagonal
  tiles fill the tail of the grid.

``B``, ``S_q`` and ``S_kv`` are launch-time sizes: one program serves every batch and
sequence length of a head configuration and the op's options (it is compiled with or without
the mask, which a key length off the tile needs even without a window). Query rows past
``S_q`` and key rows past ``S_kv`` in the last tiles are TileLang's bounds-checked copies:
loads outside the tensor read zeros and stores outside it are dropped.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import functools
import math
import struct
from typing import Any, Literal, NamedTuple, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._tilelang import compile_program, tl

__all__ = [
    "AttentionDType",
    "AttentionFwdInterface",
    "AttentionFwdKernel",
    "AttentionFwdSpec",
    "AttentionLayout",
    "AttentionPlan",
    "HEAD_DIMS",
    "attention_plan",
    "build_attention_fwd",
    "attention_fwd_program",
    "first_key_tile",
    "key_tiles_end",
    "needs_mask",
    "program_key",
]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

#: the storage dtypes the attention kernels are written for
AttentionDType = Literal["float16", "bfloat16"]
_DTYPES = frozenset(get_args(AttentionDType))
#: the (D, D_v) pairs the kernels serve (each one's program is compiled by the tests)
HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})


class AttentionLayout(enum.Enum):
    """The axis order of q, k, v and o."""

    BSHD = "bshd"  # [B, S, H, D], FlashAttention's
    BHSD = "bhsd"  # [B, H, S, D], scaled_dot_product_attention's


class AttentionFwdSpec(CallSpec, frozen=True, kw_only=True):
    """The facts of one attention call: exact sizes, the dtype, the layout and the op's mask,
    scale and softcap (``window_left`` / ``window_right``: keys seen before / after a row's
    diagonal position, -1 unbounded, ``is_causal`` already folded in as a right bound of 0)."""

    batch: int
    seq_q: int
    seq_kv: int
    heads: int
    heads_kv: int
    dim: int
    dim_v: int
    dtype: AttentionDType
    layout: AttentionLayout
    scale: float
    window_left: int
    window_right: int
    softcap: float | None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, AttentionLayout):
            raise TypeError(f"AttentionFwdSpec.layout must be an AttentionLayout, got "
                            f"{self.layout!r}")
        self.check_fields(choices={"dtype": _DTYPES},
                          sizes=("batch", "seq_q", "seq_kv", "heads", "heads_kv", "dim",
                                 "dim_v"))
        if self.heads_kv == 0 or self.heads % self.heads_kv:
            raise ValueError(f"AttentionFwdSpec: {self.heads} query heads do not form groups "
                             f"of {self.heads_kv} key heads")
        if not self.scale > 0.0:
            raise ValueError(f"AttentionFwdSpec.scale must be > 0, got {self.scale!r}")
        if self.window_left < -1 or self.window_right < -1:
            raise ValueError(f"AttentionFwdSpec: window bounds are >= -1, got "
                             f"({self.window_left}, {self.window_right})")
        if self.softcap is not None and not self.softcap > 0.0:
            raise ValueError(f"AttentionFwdSpec.softcap must be > 0, got {self.softcap!r}")


class AttentionFwdInterface(KernelInterface):
    """One slot: ``forward(q, k, v, o, lse)``, q/k/v/o contiguous in the spec's layout, ``lse``
    a ``[B, H, S_q]`` float32 tensor or None (not asked for)."""

    slot = "attention_fwd"
    call_spec = AttentionFwdSpec


class AttentionPlan(NamedTuple):
    """How a program is launched: ``block_m`` query rows and ``block_n`` keys a step,
    ``stages`` of key/value copies in flight, ``threads`` a CTA, and whether the output goes
    through shared memory (a 16-byte-vector store; left out where it would not fit)."""

    block_m: int
    block_n: int
    stages: int
    threads: int
    staged_output: bool


def attention_plan(dim: int, dim_v: int) -> AttentionPlan:
    """The launch plan of a head-dim pair. Up to 128: the example's 128 x 128 tiles, two
    stages, 256 threads (Q 32 KiB, K and V 64 KiB each staged twice, O 32 KiB of shared
    memory). Wider heads take 64 keys a step: D = 256 holds Q (64 KiB) and two stages of K and
    V (128 KiB) and writes O from registers (another 64 KiB would pass the 227 KiB an H200 CTA
    may use); 192 / 128 fits in 160 KiB with O staged."""
    if max(dim, dim_v) <= 128:
        return AttentionPlan(block_m=128, block_n=128, stages=2, threads=256,
                             staged_output=True)
    return AttentionPlan(block_m=128, block_n=64, stages=2, threads=256,
                         staged_output=dim_v <= 128)


def _f32(x: float) -> float:
    """``x`` rounded to float32: the program's constants are float32 literals, and one that
    is not exactly representable would be rounded by nvcc with a warning per use."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _bounds(seq_q: int, seq_kv: int, left: int, right: int) -> tuple[int, int]:
    """The window's sides, an unbounded one (-1) as a bound no key reaches: one comparison
    form for every mask."""
    reach = seq_q + seq_kv + 1
    return (left if left >= 0 else reach), (right if right >= 0 else reach)


def first_key_tile(r0: Any, seq_q: int, seq_kv: int, left: int, bn: int, mx: Any = max) -> Any:
    """The first key tile a query tile starting at row ``r0`` sees: its first row's leftmost
    key. ``mx`` is ``max`` for ints, ``T.max`` in the program (the same formula for both)."""
    lb, _ = _bounds(seq_q, seq_kv, left, -1)
    return mx(0, r0 + (seq_kv - seq_q) - lb) // bn


def key_tiles_end(r0: Any, seq_q: int, seq_kv: int, left: int, right: int, bm: int, bn: int,
                  mx: Any = max, mn: Any = min) -> Any:
    """One past the last key tile a query tile of ``bm`` rows from ``r0`` sees (its last
    row's rightmost key, within ``S_kv``); never before :func:`first_key_tile`, so a tile
    that sees no key runs no step."""
    _, rb = _bounds(seq_q, seq_kv, left, right)
    hi = mx(0, mn(seq_kv, r0 + bm + (seq_kv - seq_q) + rb))
    return mx(first_key_tile(r0, seq_q, seq_kv, left, bn, mx), (hi + bn - 1) // bn)


def attention_fwd_program(layout: str, heads: int, heads_kv: int, dim: int, dim_v: int,
                          dtype: str, scale: float, left: int, right: int,
                          softcap: float | None, masked: bool, plan: AttentionPlan):
    """The prim_func of a head configuration and the op's options (see the module
    docstring); ``B``, ``S_q`` and ``S_kv`` are launch-time sizes. ``masked``: whether any
    score can be masked (a window, or a key length off the tile), which
    :func:`needs_mask` decides from a call."""
    tilelang, T = tl()
    bm, bn, threads = plan.block_m, plan.block_n, plan.threads
    accum = "float32"
    groups = heads // heads_kv
    batch, seq_q, seq_kv = T.dynamic("B"), T.dynamic("S_q"), T.dynamic("S_kv")
    offset = seq_kv - seq_q  # a row's diagonal key position is its index + offset
    bshd = layout == "bshd"
    q_shape = [batch, seq_q, heads, dim] if bshd else [batch, heads, seq_q, dim]
    k_shape = [batch, seq_kv, heads_kv, dim] if bshd else [batch, heads_kv, seq_kv, dim]
    v_shape = [batch, seq_kv, heads_kv, dim_v] if bshd else [batch, heads_kv, seq_kv, dim_v]
    o_shape = [batch, seq_q, heads, dim_v] if bshd else [batch, heads, seq_q, dim_v]
    m_tiles = T.ceildiv(seq_q, bm)
    causal_like = right >= 0  # later query tiles see more keys: launch them first
    lb, rb = _bounds(seq_q, seq_kv, left, right)
    capped = softcap is not None
    # the factor of the raw scores in the base-2 exponent (1 once the softcap replaced them)
    sm = _f32(1.0 if capped else scale * _LOG2E)
    cap_l2 = _f32((softcap or 1.0) * _LOG2E)
    cap_in = _f32(scale / (softcap or 1.0))
    ln2 = _f32(_LN2)
    neg_inf = -math.inf

    @T.macro
    def store_staged(acc_o, Out, r0, by, bz):
        O_shared = T.alloc_shared([bm, dim_v], dtype)
        T.copy(acc_o, O_shared)
        if bshd:
            T.copy(O_shared, Out[bz, r0:r0 + bm, by, :])
        else:
            T.copy(O_shared, Out[bz, by, r0:r0 + bm, :])

    @T.macro
    def store_direct(acc_o, Out, r0, by, bz):
        if bshd:
            T.copy(acc_o, Out[bz, r0:r0 + bm, by, :])
        else:
            T.copy(acc_o, Out[bz, by, r0:r0 + bm, :])

    @T.prim_func
    def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(k_shape, dtype),
             V: T.Tensor(v_shape, dtype), Out: T.Tensor(o_shape, dtype),
             LSE: T.Tensor([batch, heads, seq_q], accum)):
        with T.Kernel(m_tiles, heads, batch, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([bm, dim], dtype)
            K_shared = T.alloc_shared([bn, dim], dtype)
            V_shared = T.alloc_shared([bn, dim_v], dtype)
            acc_s = T.alloc_fragment([bm, bn], accum)
            acc_s_cast = T.alloc_fragment([bm, bn], dtype)
            acc_o = T.alloc_fragment([bm, dim_v], accum)
            scores_max = T.alloc_fragment([bm], accum)
            scores_max_prev = T.alloc_fragment([bm], accum)
            m_safe = T.alloc_fragment([bm], accum)
            scores_scale = T.alloc_fragment([bm], accum)
            scores_sum = T.alloc_fragment([bm], accum)
            logsum = T.alloc_fragment([bm], accum)

            tile = (m_tiles - 1 - bx) if causal_like else bx
            r0 = tile * bm
            hk = by // groups
            if bshd:
                T.copy(Q[bz, r0:r0 + bm, by, :], Q_shared)
            else:
                T.copy(Q[bz, by, r0:r0 + bm, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(m_safe, 0)
            T.fill(scores_max, neg_inf)

            # the key tiles some row of this CTA sees
            start = first_key_tile(r0, seq_q, seq_kv, left, bn, T.max)
            end = key_tiles_end(r0, seq_q, seq_kv, left, right, bm, bn, T.max, T.min)

            for kt in T.Pipelined(start, end, num_stages=plan.stages):
                if bshd:
                    T.copy(K[bz, kt * bn:(kt + 1) * bn, hk, :], K_shared)
                else:
                    T.copy(K[bz, hk, kt * bn:(kt + 1) * bn, :], K_shared)
                T.clear(acc_s)
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True,
                       policy=T.GemmWarpPolicy.FullRow)
                if capped:
                    for i, j in T.Parallel(bm, bn):
                        acc_s[i, j] = cap_l2 * T.tanh(acc_s[i, j] * cap_in)
                if masked:
                    for i, j in T.Parallel(bm, bn):
                        key = kt * bn + j
                        diag = r0 + i + offset
                        acc_s[i, j] = T.if_then_else(
                            key < seq_kv and key >= diag - lb and key <= diag + rb,
                            acc_s[i, j], neg_inf)
                if bshd:
                    T.copy(V[bz, kt * bn:(kt + 1) * bn, hk, :], V_shared)
                else:
                    T.copy(V[bz, hk, kt * bn:(kt + 1) * bn, :], V_shared)
                T.copy(scores_max, scores_max_prev)
                T.reduce_max(acc_s, scores_max, dim=1, clear=False)
                for i in T.Parallel(bm):
                    scores_max[i] = T.max(scores_max[i], scores_max_prev[i])
                for i in T.Parallel(bm):
                    # 0 while the row has seen no key: exp2(-inf - 0) = 0, never -inf + inf
                    m_safe[i] = T.if_then_else(scores_max[i] == neg_inf, 0.0,
                                               scores_max[i] * sm)
                    scores_scale[i] = T.exp2(scores_max_prev[i] * sm - m_safe[i])
                for i, j in T.Parallel(bm, bn):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * sm - m_safe[i])
                T.reduce_sum(acc_s, scores_sum, dim=1)
                for i in T.Parallel(bm):
                    logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]
                T.copy(acc_s, acc_s_cast)
                for i, j in T.Parallel(bm, dim_v):
                    acc_o[i, j] *= scores_scale[i]
                T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

            for i, j in T.Parallel(bm, dim_v):
                acc_o[i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0.0)
            for i in T.Parallel(bm):
                if r0 + i < seq_q:
                    LSE[bz, by, r0 + i] = T.if_then_else(
                        logsum[i] > 0, (T.log2(logsum[i]) + m_safe[i]) * ln2, neg_inf)
            if plan.staged_output:
                store_staged(acc_o, Out, r0, by, bz)
            else:
                store_direct(acc_o, Out, r0, by, bz)

    return main


def needs_mask(spec: AttentionFwdSpec, plan: AttentionPlan) -> bool:
    """Whether a call's scores can be masked: a window (``is_causal`` is one), or a key
    length that is not a multiple of the key tile (the last tile's keys past ``S_kv``)."""
    return spec.window_left >= 0 or spec.window_right >= 0 or spec.seq_kv % plan.block_n != 0


def program_key(spec: AttentionFwdSpec) -> tuple:
    """What the compiled program of ``spec`` depends on (the sizes are launch-time)."""
    plan = attention_plan(spec.dim, spec.dim_v)
    return (spec.layout.value, spec.heads, spec.heads_kv, spec.dim, spec.dim_v, spec.dtype,
            spec.scale, spec.window_left, spec.window_right, spec.softcap,
            needs_mask(spec, plan))


@functools.lru_cache(maxsize=128)
def build_attention_fwd(key: tuple, target: str | None = None,
                        plan: AttentionPlan | None = None):
    """Compile the program of a :func:`program_key` (cached per key). ``plan`` overrides
    :func:`attention_plan`, for tuning."""
    layout, heads, heads_kv, dim, dim_v, dtype, scale, left, right, softcap, masked = key
    plan = plan or attention_plan(dim, dim_v)
    prog = attention_fwd_program(layout, heads, heads_kv, dim, dim_v, dtype, scale, left,
                                 right, softcap, masked, plan)
    return compile_program(prog, target)


class AttentionFwdKernel(Kernel, AttentionFwdInterface):
    """The one forward implementation: the head-dim pairs of :data:`HEAD_DIMS`."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})

    @classmethod
    def region_refusal(cls, spec: AttentionFwdSpec) -> str | None:
        if (spec.dim, spec.dim_v) not in HEAD_DIMS:
            pairs = ", ".join(f"{d}/{dv}" for d, dv in sorted(HEAD_DIMS))
            return (f"head dims D = {spec.dim}, D_v = {spec.dim_v} are none of the served "
                    f"D/D_v pairs {pairs}")
        return None

    @classmethod
    def identity(cls, spec: AttentionFwdSpec):
        return (spec.device, program_key(spec))

    def __init__(self, spec: AttentionFwdSpec) -> None:
        super().__init__(spec)
        self.program = build_attention_fwd(program_key(spec))
        self._seq_axis = 1 if spec.layout is AttentionLayout.BSHD else 2
        #: the log-sum-exp of calls that do not ask for it (never read): grown as needed
        self._scratch = None

    def __call__(self, q, k, v, o, lse) -> None:
        if not q.numel():
            return  # no query row
        if not k.numel():  # no key: every row sees none
            o.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
            return
        if lse is None:
            # the program always writes the log-sum-exp (a B x H x S_q float32 store beside
            # the products); a call that does not ask for it writes a kept scratch
            b, h, s_q = q.shape[0], o.shape[3 - self._seq_axis], q.shape[self._seq_axis]
            n = b * h * s_q
            if self._scratch is None or self._scratch.numel() < n:
                import torch

                self._scratch = torch.empty(n, dtype=torch.float32, device=q.device)
            lse = self._scratch[:n].view(b, h, s_q)
        self.program(q, k, v, o, lse)
