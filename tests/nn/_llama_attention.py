"""Hugging Face's ``LlamaAttention`` forward written out in plain torch, the reference of the
attention blocks' tests (tileops.nn.Attention, TensorParallelAttention): the projections,
``rotate_half`` RoPE from ``inv_freq = theta ** (-2i / D)``, causal
``scaled_dot_product_attention`` with ``enable_gqa``, ``o_proj``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama_attention(x, q, k, v, o, heads, kv_heads, positions, theta, *, rope=True):
    """The block's output for ``x`` of ``[B, S, hidden]`` through the ``torch.nn.Linear``
    projections ``q``, ``k``, ``v``, ``o``, in the modules' dtype; ``positions`` ``[B, S]``
    (unused without ``rope``)."""
    b, s, _ = x.shape
    d = q.out_features // heads
    qs = q(x).view(b, s, heads, d).transpose(1, 2)
    ks = k(x).view(b, s, kv_heads, d).transpose(1, 2)
    vs = v(x).view(b, s, kv_heads, d).transpose(1, 2)
    if rope:
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = positions.double()[..., None] * inv_freq  # [B, S, D/2]
        emb = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, S, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        qs = qs * cos + rotate_half(qs) * sin
        ks = ks * cos + rotate_half(ks) * sin
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    return o(out.transpose(1, 2).reshape(b, s, heads * d))
