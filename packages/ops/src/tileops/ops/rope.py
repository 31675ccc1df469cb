"""Rotary position embedding: the neox and interleaved (GPT-J) rotations, the scaled
frequency schedules of Llama 3.1, YaRN and LongRoPE, and their gradients.

:class:`RopeOp` is the family base of the forward ops and of their gradients (a gradient is
the same rotation transposed: :attr:`RopeOp.inverse`). It owns the flow they share:

- the call spec :class:`~tileops.kernels.rope.RopeSpec` from the solved indices, the style
  (a class's own, or the ``interleaved`` param of the scaled ops), where ``inv_freq`` comes
  from (:meth:`RopeOp.freq_source`) and the attention factor (:meth:`RopeOp.attention_scale`);
- the frequencies in float64 (:meth:`RopeOp.inv_freq`, a leaf's schedule) and the float64
  ``aux`` tensor the kernel reads them from, with the cos/sin table of ``cache_length``
  positions when one is asked for: built once per (device, rotary_dim, table choice) and held
  (the cos/sin values are kept in float64 whatever the call's dtype, so a cached position
  rotates exactly as a computed one; their bytes come from L2);
- layout: q, k and position_ids as contiguous tensors at 16-byte aligned addresses, copies
  where they are not (written back into q and k for an in-place call).

The declared equivalents (the float64 reference, the torch eager function in the form of
transformers' ``apply_rotary_pos_emb`` and the Liger-Kernel peer) are stated once here, on
the base, from the same hooks.

LongRoPE's ``short_factor`` and ``long_factor`` are construction tensors: stored at
construction (float64, the dtype they keep: rounded to a bfloat16 call's dtype, a factor's
0.2% error would move the angle at position 10^4 by radians), moved to the call's device and
written back by the runtime (step 3 of a call), kept across a binding reset, and handed to
the gradient op.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, get_args

import torch

from tileops.kernels.rope import (
    FreqSource,
    RopeDType,
    RopeInterface,
    RopeKernel,
    RopeLayout,
    RopeSpec,
    RopeStyle,
)
from tileops.runtime import Op
from tileops.runtime.memory import keepable

from ._dtypes import NAMES, refuse_unserved

__all__ = [
    "RopeLlama31BwdOp",
    "RopeLlama31FwdOp",
    "RopeLongRopeBwdOp",
    "RopeLongRopeFwdOp",
    "RopeNeoxBwdOp",
    "RopeNeoxFwdOp",
    "RopeNonNeoxBwdOp",
    "RopeNonNeoxFwdOp",
    "RopeOp",
    "RopeYarnBwdOp",
    "RopeYarnFwdOp",
]

_KERNEL_DTYPES = frozenset(get_args(RopeDType))
_LAYOUTS = {"bshd": RopeLayout.BSHD, "bhsd": RopeLayout.BHSD}


class RopeOp(Op):
    """Family base of the RoPE ops and their gradients (see the module docstring). A leaf
    sets :attr:`style` (or takes the ``interleaved`` param), :attr:`inverse` for a gradient,
    and overrides :meth:`inv_freq` / :meth:`attention_scale` for a scaled schedule."""

    kernel_types = {RopeInterface: (RopeKernel,)}
    #: the pairing, where the entry has no ``interleaved`` param
    style: ClassVar[RopeStyle] = RopeStyle.NEOX
    #: the gradient: the rotation transposed (sin negated)
    inverse: ClassVar[bool] = False

    def derive(self) -> None:
        self._read = self.index_reader("B", "S", "H", "HK", "D")
        if hasattr(self, "interleaved"):
            self._style = RopeStyle.INTERLEAVED if self.interleaved else RopeStyle.NEOX
        else:
            self._style = type(self).style
        self._layout = _LAYOUTS[self.layout]
        self._inplace = bool(getattr(self, "inplace", False))
        self._cache = int(getattr(self, "cache_length", 0))
        #: (device, rotary_dim, long) -> the float64 aux tensor (see aux_layout)
        self._aux: dict[tuple, torch.Tensor | None] = {}
        #: (device, rotary_dim, long) -> inv_freq in float64, for the reference and contenders
        self._tables: dict[tuple, torch.Tensor] = {}

    # --- what a leaf states ----------------------------------------------------------------------

    def inv_freq(self, rotary_dim: int, long: bool) -> torch.Tensor:
        """The ``rotary_dim / 2`` frequencies in float64, on the CPU or where the op's
        construction tensors are (``long``: LongRoPE's long factors; the others have one
        schedule)."""
        return _base_inv_freq(self.base, rotary_dim)

    def attention_scale(self) -> float:
        """The factor cos and sin are scaled by."""
        return 1.0

    def freq_source(self, has_pos: bool) -> FreqSource:
        """Where the kernel reads ``inv_freq`` from: the base schedule is computed in it."""
        return FreqSource.BASE

    def long_for(self, max_position: int) -> bool:
        """Whether a call whose largest position is ``max_position`` takes the long table."""
        return False

    def inv_freq_of(self, positions: torch.Tensor, rd: int) -> torch.Tensor:
        """The float64 frequencies a call at ``positions`` rotates by, on their device, for
        the reference and the contenders: a schedule with two tables picks one by the largest
        position with tensor ops (no host sync, so it also runs on fake tensors and under
        torch.compile); the kernels read that position on the device."""
        short = self._table(positions.device, rd, False)
        if type(self).long_for is RopeOp.long_for or not positions.numel():
            return short
        top = positions.max().to(torch.float64)
        return torch.where(top + 1 > self.original_max_position,
                           self._table(positions.device, rd, True), short)

    def _table(self, device: Any, rd: int, long: bool) -> torch.Tensor:
        t = self._tables.get((device, rd, long))
        if t is None:
            t = self.inv_freq(rd, long).to(device)
            if keepable(t):  # not a fake or meta table, nor one a graph capture fills later
                self._tables[(device, rd, long)] = t
        return t

    # --- the call ---------------------------------------------------------------------------------

    def forward(self, call, q, k, pos, q_out, k_out) -> None:
        b, s, h, hk, d = self._read(call)
        rd = d if self.rotary_dim is None else self.rotary_dim
        dtype = q.dtype
        has_pos = pos is not None
        freq = self.freq_source(has_pos)
        # a table chosen on the host: without positions, the largest is S - 1
        long = freq is FreqSource.TABLE and self.long_for(s - 1)
        key = (call.device, dtype, h, hk, d, has_pos, long)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "RoPE")
            entry = self.kernel_for(key, RopeInterface, lambda: self._spec(
                call.device, dtype, h, hk, d, rd, has_pos, freq))
        aux_key = (call.device, rd, long)
        aux = self._aux.get(aux_key, False)
        if aux is False:
            aux = self._build_aux(call.device, rd, long, freq)
        if has_pos and not pos.is_contiguous():
            pos = pos.contiguous()
        lq, lk = _laid(q), _laid(k)
        # maxpos None: a SWITCH kernel finds the largest position on the device itself
        if self._inplace:
            entry(lq, lk, pos, None, aux, lq, lk)
            if lq is not q:
                q.copy_(lq)
            if lk is not k:
                k.copy_(lk)
        else:
            entry(lq, lk, pos, None, aux, q_out, k_out)

    def _spec(self, device, dtype, h, hk, d, rd, has_pos, freq) -> RopeSpec:
        if rd % 2 or not 0 < rd <= d:
            raise ValueError(f"{type(self).__name__}: rotary_dim must be even and at most "
                             f"head_dim = {d}, got {rd}")
        return RopeSpec(
            device=device, style=self._style, layout=self._layout, heads_q=h, heads_k=hk,
            head_dim=d, rotary_dim=rd, dtype=NAMES[dtype],
            pos_dtype="int64" if has_pos else None, freq=freq,
            base=float(getattr(self, "base", 10000.0)), mscale=self.attention_scale(),
            cache_length=self._cache,
            switch_at=self.original_max_position if freq is FreqSource.SWITCH else 0,
            inverse=self.inverse, inplace=self._inplace)

    def _build_aux(self, device, rd: int, long: bool, freq: FreqSource) -> torch.Tensor | None:
        """The float64 aux tensor of :func:`~tileops.kernels.rope.aux_layout`: the inv_freq
        tables the source reads, then the cos/sin table of ``cache_length`` positions."""
        parts = []
        if freq is FreqSource.TABLE:
            parts.append(self.inv_freq(rd, long))
        elif freq is FreqSource.SWITCH:
            parts += [self.inv_freq(rd, False), self.inv_freq(rd, True)]
        if self._cache:
            cos, sin = self.cos_sin(torch.arange(self._cache, dtype=torch.float64),
                                    self.inv_freq(rd, long))
            parts += [cos.reshape(-1), sin.reshape(-1)]
        aux = None
        if parts:
            aux = torch.cat([p.cpu() for p in parts]).to(device)
        if aux is None or keepable(aux):  # not fake or meta, nor filled by a graph replay
            with self._lock:
                self._aux[(device, rd, long)] = aux
        return aux

    def cos_sin(self, positions: torch.Tensor, inv: torch.Tensor) -> tuple:
        """``cos, sin`` (float64, ``[*positions.shape, rd / 2]``, scaled by the attention
        factor) of the float64 ``positions`` and frequencies ``inv``."""
        ang = positions[..., None] * inv.to(positions.device)
        m = self.attention_scale()
        return torch.cos(ang) * m, torch.sin(ang) * m

    # --- the declared equivalents ---------------------------------------------------------------

    def reference(self, call, q, k, position_ids):
        bhsd = self._layout is RopeLayout.BHSD
        b, s, d = q.shape[0], q.shape[2 if bhsd else 1], q.shape[-1]
        rd = d if self.rotary_dim is None else self.rotary_dim
        if position_ids is None:
            pos = torch.arange(s, dtype=torch.float64, device=q.device).expand(b, s)
        else:
            pos = position_ids.to(torch.float64)
        cos, sin = self.cos_sin(pos, self.inv_freq_of(pos, rd))
        if self.inverse:
            sin = -sin
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        return tuple(_rotate(x.to(torch.float64), cos, sin, rd, self._style, bhsd).to(wide)
                     for x in (q, k))

    def eager(self):
        """transformers' form: cos/sin in float32 from float32 frequencies and positions (in
        float64 for float64 tensors), rounded to the tensors' dtype, then
        ``x * cos + rotate_half(x) * sin``."""
        op = self
        bhsd = self._layout is RopeLayout.BHSD
        style, inverse, inplace = self._style, self.inverse, self._inplace

        def rope(q, k, position_ids=None):
            b, s, d = q.shape[0], q.shape[2 if bhsd else 1], q.shape[-1]
            rd = d if op.rotary_dim is None else op.rotary_dim
            pos = (torch.arange(s, device=q.device)[None].expand(b, s)
                   if position_ids is None else position_ids)
            # float32 as transformers computes them; float64 for float64 tensors
            wide = torch.float64 if q.dtype == torch.float64 else torch.float32
            freqs = pos[..., None].to(wide) * op.inv_freq_of(pos, rd).to(wide)
            m = op.attention_scale()
            cos, sin = (freqs.cos() * m).to(q.dtype), (freqs.sin() * m).to(q.dtype)
            if inverse:
                sin = -sin
            outs = tuple(_rotate(x, cos, sin, rd, style, bhsd) for x in (q, k))
            if inplace:
                q.copy_(outs[0])
                k.copy_(outs[1])
                return q, k
            return outs

        return rope

    peers = {"liger": lambda op: _liger_rope(op)}


def _laid(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address: itself, or a copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int,
            style: RopeStyle, bhsd: bool) -> torch.Tensor:
    """``x`` with its first ``rd`` columns rotated by ``cos``/``sin`` (``[B, S, rd / 2]``),
    in ``x``'s dtype, the rest passed through."""
    cos = cos[:, None] if bhsd else cos[:, :, None]
    sin = sin[:, None] if bhsd else sin[:, :, None]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot, rest = x[..., :rd], x[..., rd:]
    if style is RopeStyle.NEOX:
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def _base_inv_freq(base: float, rd: int) -> torch.Tensor:
    return base ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)


# --- the plain rotations ---------------------------------------------------------------------------


class RopeNeoxFwdOp(RopeOp):
    style = RopeStyle.NEOX


class RopeNonNeoxFwdOp(RopeOp):
    style = RopeStyle.INTERLEAVED


class RopeNeoxBwdOp(RopeOp):
    style = RopeStyle.NEOX
    inverse = True


class RopeNonNeoxBwdOp(RopeOp):
    style = RopeStyle.INTERLEAVED
    inverse = True


# --- Llama 3.1 -------------------------------------------------------------------------------------


class _Llama31(RopeOp):
    """Llama 3.1's schedule (transformers' ``rope_type: llama3``)."""

    def freq_source(self, has_pos: bool) -> FreqSource:
        return FreqSource.TABLE

    def inv_freq(self, rotary_dim: int, long: bool) -> torch.Tensor:
        inv = _base_inv_freq(self.base, rotary_dim)
        orig, lo, hi = self.original_max_position, self.low_freq_factor, self.high_freq_factor
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / lo, orig / hi
        scaled = torch.where(wavelen > low_wl, inv / self.factor, inv)
        smooth = (orig / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, blended, scaled)


class RopeLlama31FwdOp(_Llama31):
    pass


class RopeLlama31BwdOp(_Llama31):
    inverse = True


# --- YaRN ------------------------------------------------------------------------------------------


class _Yarn(RopeOp):
    """YaRN's schedule and attention factor (transformers' ``rope_type: yarn``, with its
    truncated correction range)."""

    def freq_source(self, has_pos: bool) -> FreqSource:
        return FreqSource.TABLE

    def attention_scale(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def inv_freq(self, rotary_dim: int, long: bool) -> torch.Tensor:
        base, orig = self.base, self.original_max_position
        pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            # log(orig / (2 pi rotations)) as a difference of logs: the quotient under- or
            # overflows for rotations far from orig (a log of 0, an int of inf)
            return (rotary_dim * (math.log(orig) - math.log(2 * math.pi) - math.log(rotations))
                    / (2 * math.log(base)))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low))
        extra = 1 - ramp.clamp(0, 1)
        return interpolated * (1 - extra) + extrapolated * extra


class RopeYarnFwdOp(_Yarn):
    pass


class RopeYarnBwdOp(_Yarn):
    inverse = True


# --- LongRoPE --------------------------------------------------------------------------------------


class _LongRope(RopeOp):
    """LongRoPE (Phi-3): per-frequency rescale factors, short or long by the call's largest
    position (see the module docstring for the construction tensors). With position_ids the
    kernel finds their largest value on the device (see ``tileops.kernels.rope``), so the
    choice costs no host sync and the call stays graph-capturable."""

    construction_tensors = {"short_factor": None, "long_factor": None}

    def __init__(self, *, short_factor: Any = None, long_factor: Any = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.short_factor = _factors(self, "short_factor", short_factor)
        self.long_factor = _factors(self, "long_factor", long_factor)
        params, *rest = self._init_args
        # pickling and deep copies rebuild the op with its factors
        self._init_args = ({**params, "short_factor": self.short_factor,
                            "long_factor": self.long_factor}, *rest)

    def freq_source(self, has_pos: bool) -> FreqSource:
        return FreqSource.SWITCH if has_pos else FreqSource.TABLE

    def long_for(self, max_position: int) -> bool:
        return max_position + 1 > self.original_max_position

    def attention_scale(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        scale = self.max_position / self.original_max_position
        if scale <= 1:
            return 1.0
        return math.sqrt(1 + math.log(scale) / math.log(self.original_max_position))

    def inv_freq(self, rotary_dim: int, long: bool) -> torch.Tensor:
        name = "long_factor" if long else "short_factor"
        f = getattr(self, name)
        half = rotary_dim // 2
        if f is None:
            f = torch.ones(half, dtype=torch.float64)
        elif f.numel() != half:
            raise ValueError(f"{type(self).__name__}: {name} must hold rotary_dim / 2 = {half} "
                             f"factors, got {f.numel()}")
        pos_freqs = self.base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64)
                                  / rotary_dim)
        # on the factors' device (the call's, after step 3: meta tensors give meta tables)
        return 1.0 / (f.detach().to(torch.float64) * pos_freqs.to(f.device))


def _factors(op: Op, name: str, value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    # a sequence of numbers is read in float64 (as_tensor would round it to float32 first)
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.float64)
    if t.dim() != 1 or not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{type(op).__name__}: {name} must be a 1-D sequence of numbers, got "
                         f"a tensor of shape {tuple(t.shape)} and dtype {t.dtype}")
    t = t.detach().to(torch.float64)
    if not bool((t > 0).all()):
        raise ValueError(f"{type(op).__name__}: {name} must be positive, got "
                         f"{t.min().item()} in it")
    return t


class RopeLongRopeFwdOp(_LongRope):
    def _backward_op(self, needs: tuple[bool, ...]) -> Op:
        # the gradient rotates by the same factors: they are the forward's construction
        # tensors, not params, so they are handed over here
        op = super()._backward_op(needs)
        op.short_factor, op.long_factor = self.short_factor, self.long_factor
        return op


class RopeLongRopeBwdOp(_LongRope):
    inverse = True


# --- Liger-Kernel peer (present when liger_kernel is installed) -----------------------------------


def _liger_rope(op: RopeOp) -> Any:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None
    if op._style is not RopeStyle.NEOX or op._inplace or op.inverse:
        return None  # Liger rotates halves, into new tensors
    bhsd = op._layout is RopeLayout.BHSD

    def liger_rope(q, k, position_ids=None):
        b, s, d = q.shape[0], q.shape[2 if bhsd else 1], q.shape[-1]
        if op.rotary_dim not in (None, d):
            raise NotImplementedError("Liger's RoPE rotates the whole head")
        pos = (torch.arange(s, device=q.device)[None].expand(b, s)
               if position_ids is None else position_ids)
        freqs = pos[..., None].float() * op.inv_freq_of(pos, d).float()
        emb = torch.cat((freqs, freqs), dim=-1)
        m = op.attention_scale()
        cos, sin = (emb.cos() * m).to(q.dtype), (emb.sin() * m).to(q.dtype)
        if bhsd:
            return LigerRopeFunction.apply(q, k, cos, sin)
        qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return qo.transpose(1, 2), ko.transpose(1, 2)

    return liger_rope
