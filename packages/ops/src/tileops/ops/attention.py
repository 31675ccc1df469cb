"""Prefill attention: multi-head and grouped-query, FlashAttention's definition.

``o = softmax(scale * q k^T, masked) v`` per query head, the scores capped by
``softcap * tanh(s / softcap)`` first where ``softcap`` is given. Query head ``h`` reads key and
value head ``h // (H / H_kv)`` (``scaled_dot_product_attention(..., enable_gqa=True)``'s
grouping); multi-head attention is ``H_kv == H``.

The mask is bottom-right aligned, as FlashAttention's (``torch``'s ``is_causal`` is top-left
aligned, which differs only when ``S_q != S_kv``): query row ``i`` sits at key position
``i + S_kv - S_q``; ``window=(left, right)`` lets it see the keys from ``left`` before that
position to ``right`` after it (-1: unbounded on that side) and ``is_causal`` bounds the right
side at 0. A row that sees no key (a window that ends before the first key) has output 0 and
log-sum-exp -inf, as FlashAttention's; a softmax over nothing would be 0 / 0.

:class:`AttentionOp` is the family base. It owns the forward flow of its ops:

- layout: the kernels read q, k, v in the op's layout (``[B, S, H, D]`` or ``[B, H, S, D]``),
  each contiguous at a 16-byte aligned address (a tensor that is not one is copied), and write
  ``o`` in that layout and the log-sum-exp as ``[B, H, S_q]`` float32;
- the call spec: :class:`~tileops.kernels.attention.AttentionFwdSpec`, the sizes the
  signature solved, the dtype, the op's mask (the window with ``is_causal`` folded in), scale
  and softcap, and whether the log-sum-exp is written; tile sizes are the kernel's;
- the slot ``attention_fwd``.

The leaf ops are their spec entries (``specs/attention.yaml``); the reference, the eager
contender (``scaled_dot_product_attention``, its mask made explicit where torch's would differ)
and the peers (torch's cuDNN and FlashAttention backends) are declared once, here.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar, get_args

import torch
import torch.nn.functional as F

from tileops.kernels.attention import (
    AttentionDType,
    AttentionFwdInterface,
    AttentionFwdKernel,
    AttentionFwdSpec,
    AttentionLayout,
    AttentionVarlenFwdInterface,
    AttentionVarlenFwdKernel,
    AttentionVarlenFwdSpec,
)
from tileops.kernels.attention_bwd import (
    AttentionBwdInterface,
    AttentionBwdKernel,
    AttentionBwdTmaKernel,
)
from tileops.runtime import Op
from tileops.runtime.memory import has_data
from tileops.spec.primitives import per_axis

from ._dtypes import NAMES, refuse_unserved

__all__ = ["AttentionBwdOp", "AttentionOp", "GroupedQueryAttentionBwdOp",
           "GroupedQueryAttentionFwdOp", "GroupedQueryAttentionVarlenFwdOp",
           "MultiHeadAttentionBwdOp", "MultiHeadAttentionFwdOp"]

#: the dtypes the attention kernels state they serve (their call spec's)
_KERNEL_DTYPES = frozenset(get_args(AttentionDType))
#: score-matrix elements the reference holds at once (float64: 512 MiB)
_REFERENCE_CHUNK = 1 << 26


def window_bounds(is_causal: bool, window: Any) -> tuple[int, int]:
    """``(left, right)`` of the mask, -1 for an unbounded side: ``window`` (an int is both
    sides, None unbounded) with ``is_causal`` bounding the right side at 0."""
    if window is None:
        left = right = -1
    else:  # an int, or one value for both sides, as the signature's per-axis type allows
        left, right = per_axis(window, 0, 2), per_axis(window, 1, 2)
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def visible(s_q: int, s_kv: int, left: int, right: int, device: Any = None) -> torch.Tensor:
    """``[s_q, s_kv]`` bool: which keys each query row sees (bottom-right aligned)."""
    diag = torch.arange(s_q, device=device)[:, None] + (s_kv - s_q)
    j = torch.arange(s_kv, device=device)[None, :]
    seen = torch.ones(s_q, s_kv, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= j >= diag - left
    if right >= 0:
        seen &= j <= diag + right
    return seen


def _probabilities(s: torch.Tensor) -> torch.Tensor:
    """The probabilities of the scores ``s`` (-inf where a row does not see a key) as torch's
    attention gives them (its safe softmax): a row holding an inf or NaN score (an inf in q or
    k) is NaN throughout; a row whose scores are all -inf, none seen or none finite, is 0
    (FlashAttention's convention too: output 0, log-sum-exp -inf). The rows' log-sum-exp,
    subtracted where finite, had left a row with a +inf score inf."""
    return torch.where((s == -math.inf).all(-1, keepdim=True), 0.0, torch.softmax(s, dim=-1))


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                        left: int, right: int, softcap: float | None,
                        bshd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` in float64 for float64 inputs, else float32: ``o`` in the inputs' layout,
    ``lse`` as ``[B, H, S_q]``. The scores are formed a block of query rows at a time (at most
    :data:`_REFERENCE_CHUNK` of them at once), so the full-size workloads fit a GPU."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    if bshd:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = q.to(wide), k.to(wide), v.to(wide)
    b, h, s_q, _ = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    if h_kv != h:
        k = k.repeat_interleave(h // h_kv, dim=1)
        v = v.repeat_interleave(h // h_kv, dim=1)
    o = q.new_zeros(b, h, s_q, v.shape[-1])
    lse = q.new_full((b, h, s_q), -math.inf)
    seen = visible(s_q, s_kv, left, right, q.device)
    rows = max(1, _REFERENCE_CHUNK // max(1, h * s_kv))
    for bi in range(b):
        for r0 in range(0, s_q, rows):
            r1 = min(s_q, r0 + rows)
            s = torch.matmul(q[bi, :, r0:r1], k[bi].transpose(-1, -2)) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            mask = seen[r0:r1]
            s = s.masked_fill(~mask, -math.inf)
            m = torch.logsumexp(s, dim=-1)  # -inf where a row sees no key
            p = _probabilities(s)
            o[bi, :, r0:r1] = torch.matmul(p, v[bi])
            lse[bi, :, r0:r1] = m
    return (o.transpose(1, 2) if bshd else o), lse


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, scale: float,
                     left: int, right: int, softcap: float | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of packed sequences (``o`` as ``[Z_q, H, D_v]``, ``lse`` as ``[H, Z_q]``)
    in float64 for float64 inputs, else float32: the packed call as one attention whose mask
    is block-diagonal (a query row sees the keys of its own sequence its window lets it, at
    the positions within the sequence), formed a block of query rows at a time. Nothing is
    read on the host, so it runs on fake and meta tensors as on real ones; rows outside every
    sequence are 0 with log-sum-exp -inf."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    z_q, h, _ = q.shape
    z_kv, h_kv = k.shape[0], k.shape[1]
    o = q.new_zeros(z_q, h, v.shape[-1], dtype=wide)
    lse = q.new_full((h, z_q), -math.inf, dtype=wide)
    batch = cu_seqlens_q.shape[0] - 1
    if batch <= 0 or z_q == 0 or z_kv == 0:
        return o, lse
    cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()

    def place(cu, n):  # each row's sequence, its position in it, whether any sequence has it
        rows = torch.arange(n, device=q.device)
        seq = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
        inside = (rows >= cu[0]) & (rows < cu[-1])
        seq = seq.clamp(max=batch - 1)
        return seq, rows - cu[seq], inside

    seq_q, pos_q, in_q = place(cq, z_q)
    seq_k, pos_k, in_k = place(ck, z_kv)
    # a query row's diagonal key position within its sequence (bottom-right aligned)
    diag = pos_q + (ck[seq_q + 1] - ck[seq_q]) - (cq[seq_q + 1] - cq[seq_q])
    qw, kw, vw = q.to(wide), k.to(wide), v.to(wide)
    if h_kv != h:
        kw, vw = kw.repeat_interleave(h // h_kv, dim=1), vw.repeat_interleave(h // h_kv, dim=1)
    kt, vt = kw.permute(1, 2, 0), vw.transpose(0, 1)  # [H, D, Z_kv], [H, Z_kv, D_v]
    rows = max(1, _REFERENCE_CHUNK // max(1, h * z_kv))
    for r0 in range(0, z_q, rows):
        r1 = min(z_q, r0 + rows)
        seen = (seq_q[r0:r1, None] == seq_k[None, :]) & in_q[r0:r1, None] & in_k[None, :]
        d = diag[r0:r1, None]
        if left >= 0:
            seen &= pos_k[None, :] >= d - left
        if right >= 0:
            seen &= pos_k[None, :] <= d + right
        s = torch.matmul(qw[r0:r1].transpose(0, 1), kt) * scale  # [H, rows, Z_kv]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~seen, -math.inf)
        m = torch.logsumexp(s, dim=-1)
        p = _probabilities(s)
        o[r0:r1] = torch.matmul(p, vt).transpose(0, 1)
        lse[:, r0:r1] = m
    return o, lse


class AttentionOp(Op):
    """Family base of the prefill attention ops (see the module docstring). A subclass names
    the index that counts its key heads (:attr:`kv_heads_index`)."""

    kernel_types = {AttentionFwdInterface: (AttentionFwdKernel,)}
    #: the index of the key/value heads: ``H`` for multi-head attention
    kv_heads_index: ClassVar[str]

    def derive(self) -> None:
        self._read = self.index_reader("B", "S_q", "S_kv", "H", self.kv_heads_index, "D", "D_v")
        #: the mask's (left, right), -1 unbounded; is_causal folded in
        self._bounds = window_bounds(self.is_causal, self.window)

    def softmax_scale(self, d: int) -> float:
        """The scores' scale: the op's ``scale``, else ``1 / sqrt(D)``."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(d)

    def _attention_entry(self, key: tuple, interface: type) -> Any:
        """The entry of a call's ``key`` (device, dtype and the solved sizes) on the slot
        ``interface``, forward or gradient: both read the same call spec."""
        device, dtype, b, s_q, s_kv, h, h_kv, d, d_v = key
        refuse_unserved(self, dtype, _KERNEL_DTYPES, "attention")
        left, right = self._bounds
        return self.kernel_for(key, interface, lambda: AttentionFwdSpec(
            device=device, batch=b, seq_q=s_q, seq_kv=s_kv, heads=h, heads_kv=h_kv, dim=d,
            dim_v=d_v, dtype=NAMES[dtype], layout=AttentionLayout(self.layout),
            scale=self.softmax_scale(d), window_left=left, window_right=right,
            softcap=self.softcap))

    def forward(self, call, q, k, v, o, lse) -> None:
        b, s_q, s_kv, h, h_kv, d, d_v = self._read(call)
        dtype = call.d_q
        key = (call.device, dtype, b, s_q, s_kv, h, h_kv, d, d_v)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            entry = self._attention_entry(key, AttentionFwdInterface)
        if not q.is_contiguous() or q.data_ptr() % 16:
            q = _laid_out(q)
        if not k.is_contiguous() or k.data_ptr() % 16:
            k = _laid_out(k)
        if not v.is_contiguous() or v.data_ptr() % 16:
            v = _laid_out(v)
        entry(q, k, v, o, lse)

    def reference(self, call, q, k, v):
        left, right = self._bounds
        o, lse = attention_reference(q, k, v, scale=self.softmax_scale(q.shape[-1]), left=left,
                                     right=right, softcap=self.softcap,
                                     bshd=self.layout == "bshd")
        return o, lse

    def eager(self):
        """``scaled_dot_product_attention`` on ``[B, H, S, D]`` views (the key heads repeated
        for GQA); where torch's own mask would differ (a window, ``is_causal`` with ``S_q !=
        S_kv``) it gets the op's mask as a bool ``attn_mask``. A softcap, which it has no form
        for, is the same math in plain torch ops; the log-sum-exp (with ``return_lse``), which
        it does not return, is ``torch.logsumexp`` of the scores (differentiable, as the
        op's)."""
        return functools.partial(_eager_dense, options=_options(self),
                                 bshd=self.layout == "bshd", with_lse=self.return_lse)

    peers = {"sdpa-cudnn": lambda op: _sdpa_peer(op, "CUDNN_ATTENTION"),
             "sdpa-flash": lambda op: _sdpa_peer(op, "FLASH_ATTENTION")}


class MultiHeadAttentionFwdOp(AttentionOp):
    kv_heads_index = "H"


class GroupedQueryAttentionFwdOp(AttentionOp):
    kv_heads_index = "H_kv"


class AttentionBwdOp(Op):
    """Family base of the dense attention gradients (``MultiHeadAttentionBwdOp``,
    ``GroupedQueryAttentionBwdOp``): the forward's layout and call spec, the slot
    ``attention_bwd``; the reference is the gradient in closed form (it may run inside a
    compiled graph's custom op, where autograd does not record), held to torch's autograd of
    the forward by the tests."""

    kernel_types = {AttentionBwdInterface: (AttentionBwdTmaKernel, AttentionBwdKernel)}
    kv_heads_index: ClassVar[str]
    derive = AttentionOp.derive
    softmax_scale = AttentionOp.softmax_scale
    _attention_entry = AttentionOp._attention_entry

    def forward(self, call, q, k, v, o, lse, dout, dlse, dq, dk, dv) -> None:
        b, s_q, s_kv, h, h_kv, d, d_v = self._read(call)
        dtype = call.d_q
        key = (call.device, dtype, b, s_q, s_kv, h, h_kv, d, d_v)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            entry = self._attention_entry(key, AttentionBwdInterface)
        if dout is None:
            # the log-sum-exp's gradient alone, dS = P dlse: the kernel reads dout, o and v
            # only in dV = P^T dout, dP = dout v^T and rowsum(dout o), so zeros in all three
            # keep an inf of v or o out (0 * inf); dv (none: the entry's nullable) is scratch
            dout = o = torch.zeros(o.shape, dtype=o.dtype, device=o.device)
            v = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
            dv = torch.empty_like(v)
        dout, q, k, v, o = (t if t.is_contiguous() and not t.data_ptr() % 16 else _laid_out(t)
                            for t in (dout, q, k, v, o))
        if lse is not None and not lse.is_contiguous():
            lse = lse.contiguous()
        entry(dout, q, k, v, o, lse, dlse, dq, dk, dv)

    def reference(self, call, q, k, v, o, lse, dout, dlse):
        left, right = self._bounds
        return attention_grads(dout, q, k, v, dlse=dlse, scale=self.softmax_scale(q.shape[-1]),
                               left=left, right=right, softcap=self.softcap,
                               bshd=self.layout == "bshd")

    def eager(self):
        """torch's autograd of the forward's eager contender: the forward recomputed, then
        its backward (torch has no gradient of attention that takes a saved log-sum-exp but
        inside its autograd), so it times a forward more than the op does."""
        forward = functools.partial(_eager_dense, options=_options(self),
                                    bshd=self.layout == "bshd")

        def attention_backward(q, k, v, o, lse, dout=None, dlse=None):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out, out_lse = forward(*leaves)
                outs, grads = [], []
                if dout is not None:
                    outs.append(out)
                    grads.append(dout)
                if dlse is not None:
                    outs.append(out_lse)
                    grads.append(dlse.to(out_lse.dtype))
                if not outs:  # no upstream gradient: none flows
                    return torch.zeros_like(q), torch.zeros_like(k), None
                # the log-sum-exp alone does not depend on v: its gradient is None
                return torch.autograd.grad(outs, leaves, grads, allow_unused=True)

        return attention_backward


class MultiHeadAttentionBwdOp(AttentionBwdOp):
    kv_heads_index = "H"


class GroupedQueryAttentionBwdOp(AttentionBwdOp):
    kv_heads_index = "H_kv"


def attention_grads(dout: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, *, dlse: torch.Tensor | None, scale: float, left: int,
                    right: int, softcap: float | None,
                    bshd: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv)`` in float64 for float64 inputs, else float32, in the inputs' layout:
    with ``P`` the probabilities of the capped, masked scores, ``dV = P^T dout``,
    ``dS = P (dout v^T - rowsum(P dout v^T) + dlse)`` (the log-sum-exp's gradient is ``P``),
    times ``1 - tanh^2`` under a softcap, ``dq = scale dS k``, ``dk = scale dS^T q``; ``dk``
    and ``dv`` summed over each key head's group. Without ``dout`` (the output's result
    unused) ``dS = P dlse``, nothing multiplies ``v`` (an inf there stays out, as in torch),
    and ``dv`` is None. The probabilities are recomputed (the forward's log-sum-exp and output
    are not read), a block of query rows at a time."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    if bshd:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        dout = None if dout is None else dout.transpose(1, 2)
    q, k, v = q.to(wide), k.to(wide), v.to(wide)
    dout = None if dout is None else dout.to(wide)
    b, h, s_q, _ = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    # the query heads of a key head: 0 where there are no query heads (the keys' gradients
    # are then zeros), 1 where there are no heads at all (an empty multi-head call)
    g = h // h_kv if h_kv else 1
    kf = k.repeat_interleave(g, dim=1) if g != 1 else k
    vf = v.repeat_interleave(g, dim=1) if g != 1 else v
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(kf)
    dv = None if dout is None else torch.zeros_like(vf)
    seen = visible(s_q, s_kv, left, right, q.device)
    rows = max(1, _REFERENCE_CHUNK // max(1, h * s_kv))
    for bi in range(b):
        for r0 in range(0, s_q, rows):
            r1 = min(s_q, r0 + rows)
            qc, mask = q[bi, :, r0:r1], seen[r0:r1]
            s = torch.matmul(qc, kf[bi].transpose(-1, -2)) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~mask, -math.inf)
            p = _probabilities(s)
            dl = None if dlse is None else dlse[bi, :, r0:r1, None].to(wide)
            if dout is None:  # the log-sum-exp's gradient alone
                ds = p * dl if dl is not None else torch.zeros_like(p)
            else:
                doc = dout[bi, :, r0:r1]
                dv[bi] += torch.matmul(p.transpose(-1, -2), doc)
                dp = torch.matmul(doc, vf[bi].transpose(-1, -2))
                delta = (p * dp).sum(-1, keepdim=True)
                if dl is not None:
                    delta = delta - dl
                ds = p * (dp - delta)
            if softcap is not None:
                ds = ds * (1 - torch.where(mask, s, 0.0).div(softcap).square())
            dq[bi, :, r0:r1] = scale * torch.matmul(ds, kf[bi])
            dk[bi] += scale * torch.matmul(ds.transpose(-1, -2), qc)
    if g != 1:
        # every size named: a -1 is ambiguous where another is 0 (an empty batch or keys)
        dk = dk.view(b, h_kv, g, s_kv, dk.shape[-1]).sum(2)
        if dv is not None:
            dv = dv.view(b, h_kv, g, s_kv, dv.shape[-1]).sum(2)
    if bshd:
        dq, dk = dq.transpose(1, 2), dk.transpose(1, 2)
        dv = None if dv is None else dv.transpose(1, 2)
    return dq, dk, dv


class GroupedQueryAttentionVarlenFwdOp(Op):
    """Grouped-query attention over packed sequences (``specs/attention.yaml``): the dense
    ops' definition per sequence. The slot ``attention_varlen_fwd`` reads the packed tensors
    and the offsets where they are (contiguous, 16-byte aligned; a tensor that is not is
    copied); the reference is one block-diagonal attention over the packed rows; the eager
    contender walks the sequences (reading the offsets on the host)."""

    kernel_types = {AttentionVarlenFwdInterface: (AttentionVarlenFwdKernel,)}
    softmax_scale = AttentionOp.softmax_scale

    def derive(self) -> None:
        self._read = self.index_reader("Z_q", "Z_kv", "B", "H", "H_kv", "D", "D_v")
        self._bounds = window_bounds(self.is_causal, self.window)

    def forward(self, call, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse) -> None:
        z_q, z_kv, b, h, h_kv, d, d_v = self._read(call)
        dtype = call.d_q
        key = (call.device, dtype, z_q, z_kv, b, h, h_kv, d, d_v)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "attention")
            left, right = self._bounds
            entry = self.kernel_for(key, AttentionVarlenFwdInterface, lambda: AttentionVarlenFwdSpec(
                device=call.device, total_q=z_q, total_kv=z_kv, batch=b, heads=h,
                heads_kv=h_kv, dim=d, dim_v=d_v, dtype=NAMES[dtype],
                scale=self.softmax_scale(d), window_left=left, window_right=right,
                softcap=self.softcap))
        q, k, v, cu_seqlens_q, cu_seqlens_k = (
            t if t.is_contiguous() and not t.data_ptr() % 16 else _laid_out(t)
            for t in (q, k, v, cu_seqlens_q, cu_seqlens_k))
        entry(q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse)

    def reference(self, call, q, k, v, cu_seqlens_q, cu_seqlens_k):
        # where the offsets hold data the reference reads them on the host and refuses any that
        # do not rise from 0 to the packed length (the slot reads them on the device only)
        for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
                                ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
            if has_data(cu):
                self._refuse_bad_offsets(name, cu.tolist(), total)
        left, right = self._bounds
        o, lse = varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                  scale=self.softmax_scale(q.shape[-1]), left=left,
                                  right=right, softcap=self.softcap)
        return o, lse

    def roofline_of_inputs(self, call, inputs):
        """The forward's flops counted a sequence at a time from the offsets, each as the dense
        op counts one sequence (``4 H q k D``, with ``D_v`` for the second product, halved
        under is_causal where ``q == k``), where the spec's formula, which sees the totals
        only, counts every sequence at the mean length: a floor for mixed lengths. The bytes
        stay the formula's. None where the offsets hold no data (meta tensors)."""
        cu_q, cu_k = inputs[3], inputs[4]
        if not (has_data(cu_q) and has_data(cu_k)):
            return None
        _, _, _, h, _, d, d_v = self._read(call)
        cq, ck = cu_q.tolist(), cu_k.tolist()
        flops = 0
        for b in range(len(cq) - 1):
            lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            flops += 2 * h * lq * lk * (d + d_v) // (2 if self.is_causal and lq == lk else 1)
        return flops, call.roofline()[1]

    def _refuse_bad_offsets(self, name: str, cu: list[int], total: int) -> None:
        """Refuse, naming the op, the offsets and the first bad entry, offsets that do not
        start at 0, fall, or end anywhere but the packed length ``total`` (the rows a sequence
        would read past the tensor, or rows no sequence holds)."""
        head = f"{type(self).__name__}: {name}"
        if cu[0] != 0:
            raise ValueError(f"{head}[0] is {cu[0]}: the offsets start at 0")
        for i in range(1, len(cu)):
            if cu[i] < cu[i - 1]:
                raise ValueError(f"{head}[{i}] is {cu[i]}, below {name}[{i - 1}] = "
                                 f"{cu[i - 1]}: the offsets never fall (sequence {i - 1} would "
                                 f"have {cu[i] - cu[i - 1]} rows)")
        if cu[-1] != total:
            raise ValueError(f"{head}[{len(cu) - 1}] is {cu[-1]}: the offsets end at the "
                             f"packed length, {total} rows")

    def eager(self):
        """The dense eager contender a sequence at a time (torch has no packed attention but
        its nested tensors), the outputs written into packed tensors."""
        options = _options(self)

        with_lse = self.return_lse

        def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k):
            o = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
            lse = q.new_full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
            for (q0, q1), (k0, k1) in _sequences(cu_seqlens_q, cu_seqlens_k):
                ob, lb = _eager_dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                      options=options, bshd=True)
                o[q0:q1], lse[:, q0:q1] = ob[0], lb[0]
            return (o, lse) if with_lse else o

        return varlen_attention


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """``((q0, q1), (k0, k1))`` of each sequence with query rows, from the offsets (read on
    the host)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b]:
            yield (cq[b], cq[b + 1]), (ck[b], ck[b + 1])


def _laid_out(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address (TileLang vectorizes on that)."""
    return t.contiguous() if not t.is_contiguous() else t.clone()


def _options(op: Any) -> tuple:
    """``(scale_of, left, right, softcap, is_causal, windowed)`` of an op: what its
    contenders compute with."""
    left, right = op._bounds
    return op.softmax_scale, left, right, op.softcap, op.is_causal, op.window is not None


def _eager_dense(q, k, v, *, options: tuple, bshd: bool, with_lse: bool = True):
    """The eager contender of one dense call (see :meth:`AttentionOp.eager`): ``(o, lse)``,
    or ``o`` alone without ``with_lse`` (then torch's attention alone where it has the
    mask's form)."""
    scale_of, left, right, softcap, is_causal, windowed = options
    scale = scale_of(q.shape[-1])
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v)) if bshd else (q, k, v)
    s_q, s_kv = qh.shape[2], kh.shape[2]
    if kh.shape[1] != qh.shape[1]:
        g = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2))
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    seen = visible(s_q, s_kv, left, right, q.device)
    s = s.masked_fill(~seen, -math.inf)
    # torch's softmax of a row that sees no key is NaN: such calls take the math for o too
    unseen = s_kv == 0 or (right >= 0 and s_kv - s_q + right < 0)
    lse = torch.logsumexp(s, dim=-1) if with_lse or softcap is not None or unseen else None
    if softcap is not None or unseen:
        p = _probabilities(s)
        o = torch.matmul(p.to(vh.dtype), vh)
    else:
        mask, causal = None, is_causal
        if windowed or (is_causal and s_q != s_kv):
            mask, causal = seen, False
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal,
                                           scale=scale)
    o = o.transpose(1, 2) if bshd else o
    return (o, lse) if with_lse else o


def _sdpa_peer(op: AttentionOp, backend: str) -> Any:
    """``scaled_dot_product_attention`` under one of torch's backends, or None where it has no
    form for the op (a window, a softcap, a returned log-sum-exp); a bottom-right causal call
    with ``S_q != S_kv`` or a configuration the backend refuses raises when called."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if op.window is not None or op.softcap is not None or op.return_lse:
        return None
    chosen = getattr(SDPBackend, backend)
    bshd, causal, scale_of = op.layout == "bshd", op.is_causal, op.softmax_scale

    def sdpa(q, k, v):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v)) if bshd else (q, k, v)
        if causal and qh.shape[2] != kh.shape[2]:
            raise NotImplementedError("torch's is_causal is top-left aligned where S_q != S_kv")
        with sdpa_kernel(chosen):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal,
                                                 scale=scale_of(q.shape[-1]),
                                                 enable_gqa=kh.shape[1] != qh.shape[1])
        return out.transpose(1, 2) if bshd else out

    return sdpa
