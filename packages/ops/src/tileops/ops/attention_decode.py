"""Decode attention over a KV cache: one new query token a sequence against the keys and
values cached so far, contiguous or paged.

:class:`AttentionDecodeOp` is the family base; it owns the forward flow its ops share:

- layout: every tensor contiguous at a 16-byte aligned address (the kernels read K and V by
  TMA and ``q`` in 16-byte vectors, and index the lengths and the block table densely); a
  tensor that is not is copied, which for a strided view of a cache is a copy of the cache:
  keep caches contiguous;
- the call spec: :class:`~tileops.kernels.attention_decode.AttentionDecodeSpec` from the
  tensors' sizes, the cache layout of the op (:attr:`AttentionDecodeOp.layout`), the dtype and
  the resolved scale (``scale=None`` is ``1 / sqrt(D)``) and softcap; the split of the keys is
  the kernel's plan;
- the slot ``attention_decode_fwd``.

The lengths and the block table are data, not shapes: every length must be within the cache
and every page a sequence reads in the pool. The reference (the ``reference`` target) checks
both and refuses a call that breaks them, naming the sequence. The kernels check them where
they read them, without a synchronisation (a host check would stall every decode step and
could not run in a CUDA graph): a bad sequence reads nothing outside the cache and its output
is NaN, every head, while the other sequences' outputs are unaffected. To find which call and
sequence, run it on the ``reference`` target. Where the tensors hold no data (fake or meta
tensors: shape inference, tracing), there is nothing to check.

The contenders: ``torch`` is ``scaled_dot_product_attention`` on the dense (for a paged
cache, gathered) keys with a mask of each sequence's length (the math where a softcap is
given, which SDPA does not take); the peers ``sdpa-flash`` and ``sdpa-cudnn`` run SDPA with
that backend over every sequence's whole cache (no mask, which those backends do not take),
so they compute the op exactly where every length is the cache's, as in the bar workloads;
a paged cache is gathered once per cache and block table and reused, so they time the
attention on the gathered dense tensors, not the gather.
"""

from __future__ import annotations

import enum
import math
from typing import Any, ClassVar, get_args

import torch
import torch.nn.functional as F

from tileops.kernels.attention_decode import (
    AttentionDecodeDType,
    AttentionDecodeInterface,
    AttentionDecodeSpec,
    AttentionDecodeSplitKernel,
    CacheLayout,
)
from tileops.runtime import Op
from tileops.runtime.memory import has_data

from ._dtypes import NAMES, refuse_unserved

__all__ = [
    "AttentionDecodeOp",
    "GroupedQueryAttentionDecodePagedWithKVCacheFwdOp",
    "GroupedQueryAttentionDecodeWithKVCacheFwdOp",
    "MultiHeadAttentionDecodePagedWithKVCacheFwdOp",
    "MultiHeadAttentionDecodeWithKVCacheFwdOp",
]

_KERNEL_DTYPES = frozenset(get_args(AttentionDecodeDType))


class AttentionDecodeOp(Op):
    """Family base of the decode attentions (see the module docstring). A subclass sets
    :attr:`layout`; its entry's inputs are ``q, k_cache, v_cache, cache_seqlens`` and, for a
    paged cache, ``block_table``, its output ``o``."""

    layout: ClassVar[CacheLayout]
    kernel_types = {AttentionDecodeInterface: (AttentionDecodeSplitKernel,)}

    def forward(self, call, q, k_cache, v_cache, cache_seqlens, *rest) -> None:
        paged = self.layout is CacheLayout.PAGED
        block_table, o = rest if paged else (None, rest[0])
        b, h, d = q.shape
        rows, width, hk = k_cache.shape[:3]  # (B, S, H_kv) or (P, page_size, H_kv)
        mp = block_table.shape[1] if paged else 0
        dtype = q.dtype
        key = (call.device, dtype, b, h, d, rows, width, hk, mp)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "decode attention")
            entry = self.kernel_for(key, AttentionDecodeInterface, lambda: AttentionDecodeSpec(
                device=call.device, layout=self.layout, batch=b, heads=h, kv_heads=hk,
                head_dim=d, capacity=rows if paged else width,
                page_size=width if paged else 0, max_pages=mp,
                dtype=NAMES[dtype], scale=self.resolved_scale(d), softcap=self.softcap))
        tensors = [q, k_cache, v_cache, cache_seqlens, block_table]
        for i, t in enumerate(tensors):
            if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
                tensors[i] = t.contiguous() if not t.is_contiguous() else t.clone()
        entry(*tensors, o)  # o is the call's own output, allocated contiguous

    def resolved_scale(self, head_dim: int) -> float:
        """The scores' scale: the op's, or ``1 / sqrt(head_dim)`` where it is None."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    # --- the reference and the contenders --------------------------------------------------

    def reference(self, call, q, k_cache, v_cache, cache_seqlens, block_table=None):
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        k, v = self.dense(k_cache, v_cache, cache_seqlens, block_table, check=True)
        return (_attend(q.to(wide), k.to(wide), v.to(wide), cache_seqlens,
                        self.resolved_scale(q.shape[-1]), self.softcap),)

    def dense(self, k_cache, v_cache, cache_seqlens, block_table=None, *,
              check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches as dense ``(B, S, H_kv, D)`` keys and values (a paged cache's pages
        gathered in block-table order, ``S = max_pages * page_size``). With ``check`` (the
        reference), where the tensors hold data, the lengths and the pages read are checked
        first and only the pages the longest sequence reads are gathered."""
        paged = self.layout is CacheLayout.PAGED
        read = None
        if check and has_data(cache_seqlens):
            read = self._check_data(k_cache, cache_seqlens, block_table)
        if not paged:
            return k_cache, v_cache
        pool, ps = k_cache.shape[:2]
        b, mp = block_table.shape
        mp = mp if read is None else read
        # entries past a sequence's pages may hold anything: clamped, their keys masked
        pages = block_table[:, :mp].long().clamp(0, max(pool - 1, 0))
        k = k_cache[pages].reshape(b, mp * ps, *k_cache.shape[2:])
        v = v_cache[pages].reshape(b, mp * ps, *v_cache.shape[2:])
        return k, v

    def _check_data(self, k_cache, cache_seqlens, block_table) -> int | None:
        """Refuse lengths past the cache and pages outside the pool among those read; the
        most pages a sequence reads (paged), else None."""
        name = type(self).__name__
        paged = self.layout is CacheLayout.PAGED
        cap = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
        lens = cache_seqlens.tolist()
        for i, n in enumerate(lens):
            if not 0 <= n <= cap:
                held = (f"max_pages * page_size = {cap} keys" if paged else
                        f"S = {cap} keys")
                raise ValueError(f"{name}: cache_seqlens[{i}] is {n}, outside [0, {cap}] "
                                 f"(the cache holds {held} a sequence)")
        if not paged:
            return None
        pool, ps = k_cache.shape[:2]
        table = block_table.tolist()
        for i, n in enumerate(lens):
            used = -(-n // ps)
            for j in range(used):
                if not 0 <= table[i][j] < pool:
                    raise ValueError(
                        f"{name}: block_table[{i}, {j}] is {table[i][j]}, not a page of the "
                        f"pool [0, {pool}) (sequence {i} has {n} keys, in its first {used} "
                        f"pages)")
        return max((-(-n // ps) for n in lens), default=0)

    def eager(self):
        op = self

        def decode(q, k_cache, v_cache, cache_seqlens, block_table=None):
            k, v = op.dense(k_cache, v_cache, cache_seqlens, block_table)
            scale = op.resolved_scale(q.shape[-1])
            if op.softcap is not None:  # SDPA takes no softcap: the math, in q's dtype
                return _attend(q, k, v, cache_seqlens, scale, op.softcap)
            keys = torch.arange(k.shape[1], device=q.device)
            mask = (keys < cache_seqlens[:, None])[:, None, None, :]
            o = F.scaled_dot_product_attention(
                q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                scale=scale, enable_gqa=True)[:, :, 0]
            return torch.where((cache_seqlens > 0)[:, None, None], o, 0)  # an empty row is NaN

        return decode

    peers: ClassVar[dict[str, Any]] = {
        "sdpa-flash": lambda op: _sdpa_peer(op, _Backend.FLASH),
        "sdpa-cudnn": lambda op: _sdpa_peer(op, _Backend.CUDNN),
    }


class MultiHeadAttentionDecodeWithKVCacheFwdOp(AttentionDecodeOp):
    layout = CacheLayout.CONTIGUOUS


class GroupedQueryAttentionDecodeWithKVCacheFwdOp(AttentionDecodeOp):
    layout = CacheLayout.CONTIGUOUS


class MultiHeadAttentionDecodePagedWithKVCacheFwdOp(AttentionDecodeOp):
    layout = CacheLayout.PAGED


class GroupedQueryAttentionDecodePagedWithKVCacheFwdOp(AttentionDecodeOp):
    layout = CacheLayout.PAGED


# --- helpers -----------------------------------------------------------------------------------


def _attend(q, k, v, cache_seqlens, scale: float, softcap: float | None) -> torch.Tensor:
    """``o (B, H, D)`` of ``q (B, H, D)`` over the first ``cache_seqlens[b]`` keys of the dense
    ``k``, ``v`` ``(B, S, H_kv, D)``, computed in ``q``'s dtype; 0 for an empty sequence.
    Nothing past a sequence's length is read, whatever it holds (a cache made by
    ``torch.empty`` may hold NaN there), as the kernels zero-fill those keys and values; a NaN
    within the length (or in ``q``) reaches the output, as prefill attention's does."""
    b, h, d = q.shape
    s, hk = k.shape[1], k.shape[2]
    qg = q.reshape(b, hk, h // hk if hk else 1, d)  # no heads at all: an empty call
    seen = torch.arange(s, device=q.device) < cache_seqlens.to(q.device)[:, None]  # (B, S)
    k = k.masked_fill(~seen[:, :, None, None], 0)
    v = v.masked_fill(~seen[:, :, None, None], 0)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~seen[:, None, None, :], -math.inf)
    p = torch.softmax(scores, dim=-1)
    # an empty sequence (every score -inf, softmax NaN) gives 0
    p = p.masked_fill(~seen.any(dim=1)[:, None, None, None], 0.0)
    return torch.einsum("bkgs,bskd->bkgd", p, v).reshape(b, h, d)


class _Backend(enum.Enum):
    FLASH = "FLASH_ATTENTION"
    CUDNN = "CUDNN_ATTENTION"


def _sdpa_peer(op: AttentionDecodeOp, backend: _Backend) -> Any:
    """SDPA under one backend over every sequence's whole cache (see the module docstring);
    None where the op's softcap is given (SDPA takes none) or torch lacks the backend."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if op.softcap is not None or not hasattr(SDPBackend, backend.value):
        return None
    chosen = getattr(SDPBackend, backend.value)
    gathered: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def sdpa(q, k_cache, v_cache, cache_seqlens, block_table=None):
        if block_table is None:
            k, v = k_cache, v_cache
        else:  # the dense tensors, gathered once per cache and table
            key = (k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                   k_cache._version, v_cache._version, block_table._version)
            if key not in gathered:
                gathered.clear()
                gathered[key] = op.dense(k_cache, v_cache, cache_seqlens, block_table)
            k, v = gathered[key]
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(
                q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                scale=op.resolved_scale(q.shape[-1]), enable_gqa=True)[:, :, 0]

    return sdpa
