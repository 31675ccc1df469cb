"""The attention layers: :class:`ScaledDotProductAttention`, FlashAttention's attention as a
parameter-free ``torch.nn`` module over :class:`~tileops.ops.GroupedQueryAttentionFwdOp`, and
:class:`Attention`, the grouped-query attention block of a decoder layer around it (the q, k, v
and o projections on TileOPs' GEMM, a rotary position embedding, the attention)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tileops.ops import GroupedQueryAttentionFwdOp

from ._holder import HoldsOp, PassesTarget
from .linear import Linear
from .rotary import RotaryEmbedding

__all__ = ["Attention", "ScaledDotProductAttention"]


class ScaledDotProductAttention(HoldsOp, nn.Module):
    """``o = softmax(scale * q k^T, masked) v`` over ``[B, S, H, D]`` tensors (``layout=
    'bhsd'``: ``[B, H, S, D]``, ``scaled_dot_product_attention``'s), the key and value heads
    shared by groups of query heads as ``enable_gqa`` shares them, trained through the op's
    gradients. The mask is FlashAttention's, bottom-right aligned (``is_causal`` with fewer
    queries than keys lets the last query see every key, where torch's ``is_causal`` lets the
    first see only the first), bounded by ``window=(left, right)`` (-1: unbounded) and the
    scores capped by ``softcap``; a query that sees no key is 0. It has no parameters (the
    projections around it are the model's), so its ``state_dict`` is empty; ``forward``
    returns ``o`` (the op's result without ``return_lse``)."""

    op_class = GroupedQueryAttentionFwdOp
    op_attrs = ("is_causal", "scale", "window", "softcap", "layout")

    def __init__(self, *, is_causal: bool = False, scale: float | None = None,
                 window: Any = None, softcap: float | None = None, layout: str = "bshd",
                 target: str | None = None) -> None:
        super().__init__()
        self.is_causal, self.scale, self.window = is_causal, scale, window
        self.softcap, self.layout, self.target = softcap, layout, target
        self._build_op()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.op(q, k, v)

    def extra_repr(self) -> str:
        text = f"is_causal={self.is_causal}, layout={self.layout!r}"
        for name in ("scale", "window", "softcap"):
            if getattr(self, name) is not None:
                text += f", {name}={getattr(self, name)!r}"
        return text + self._target_repr()


def _positive(layer: str, argument: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{layer}: argument {argument} must be a positive int, seen {value!r}")
    return value


def heads_of(layer: str, hidden: int, num_heads: int, num_kv_heads: int | None,
             head_dim: int | None, hidden_name: str = "hidden") -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of an attention block of ``hidden`` features and
    ``num_heads`` query heads: ``num_kv_heads`` defaults to ``num_heads`` (multi-head) and must
    divide it (each key/value head serves a group of query heads); ``head_dim`` defaults to
    ``hidden / num_heads``. Refuses what is not a positive int, naming ``layer`` and the
    argument (``hidden_name`` is the layer's name for ``hidden``)."""
    _positive(layer, hidden_name, hidden)
    _positive(layer, "num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else _positive(layer, "num_kv_heads",
                                                                    num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"{layer}: argument num_heads is {num_heads}, not a multiple of "
                         f"num_kv_heads {num_kv_heads}; expected each key/value head to "
                         f"serve the same number of query heads")
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(f"{layer}: argument {hidden_name} is {hidden}, not divisible by "
                             f"num_heads {num_heads}; give head_dim")
        head_dim = hidden // num_heads
    return num_kv_heads, _positive(layer, "head_dim", head_dim)


def projections_of(layer: str, q: Any, k: Any, v: Any, o: Any, num_heads: int,
                   num_kv_heads: int | None, what: str = "") -> tuple[int, int, int, bool]:
    """``(hidden, num_kv_heads, head_dim, bias)`` of an attention block whose projections are
    the ``torch.nn.Linear`` layers ``q``, ``k``, ``v`` (``hidden -> heads * head_dim``, the
    features head-major as Hugging Face's models lay them out) and ``o`` (``num_heads *
    head_dim -> hidden``); ``bias`` is whether q, k and v have one (all or none). Refuses
    layers that are not ``torch.nn.Linear`` (``what`` is said of them) or do not fit together,
    naming ``layer`` (``Class.method``) and the argument."""
    for argument, linear in (("q", q), ("k", k), ("v", v), ("o", o)):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{layer}: argument {argument} must be a torch.nn.Linear{what}, "
                            f"seen {type(linear).__name__}")
    _positive(layer, "num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else _positive(layer, "num_kv_heads",
                                                                    num_kv_heads)
    hidden = q.in_features
    if q.out_features % num_heads:
        raise ValueError(f"{layer}: argument q has {q.out_features} output features, not a "
                         f"multiple of num_heads {num_heads}")
    head_dim = q.out_features // num_heads
    for argument, linear, shape in (
            ("k", k, (num_kv_heads * head_dim, hidden)),
            ("v", v, (num_kv_heads * head_dim, hidden)),
            ("o", o, (hidden, num_heads * head_dim))):
        if (linear.out_features, linear.in_features) != shape:
            raise ValueError(f"{layer}: argument {argument} does not match q ({hidden} -> "
                             f"{num_heads} heads of {head_dim}); expected {shape[1]} -> "
                             f"{shape[0]}, seen {linear.in_features} -> {linear.out_features}")
    biases = {linear.bias is not None for linear in (q, k, v)}
    if len(biases) != 1:
        raise ValueError(f"{layer}: q, k and v must all have a bias or all have none; seen q "
                         f"{q.bias is not None}, k {k.bias is not None}, v {v.bias is not None}")
    heads_of(layer, hidden, num_heads, num_kv_heads, head_dim)
    return hidden, num_kv_heads, head_dim, biases.pop()


class Attention(PassesTarget, nn.Module):
    """The grouped-query attention block of a decoder layer (Llama's, Mistral's, Qwen2's):
    ``o_proj(attention(rotary(q_proj(x), k_proj(x)), v_proj(x)))`` over ``x`` of ``[B, S,
    hidden_size]``, returning ``[B, S, hidden_size]``.

    - The projections are :class:`~tileops.nn.Linear` (TileOPs' GEMM): ``q_proj`` to
      ``num_heads * head_dim`` features, ``k_proj`` and ``v_proj`` to ``num_kv_heads *
      head_dim`` (head-major: feature ``h * head_dim + j`` is head ``h``'s ``j``), ``o_proj``
      back to ``hidden_size``. ``bias`` puts a bias on q, k and v (Qwen2's), ``o_bias`` on o
      (Llama's ``attention_bias`` sets both). The submodules' names are Hugging Face's, so a
      ``LlamaAttention``'s ``state_dict`` loads as is (:meth:`from_linears` takes its layers).
    - ``rotary`` is the position hook, called as ``rotary(q, k, position_ids) -> (q, k)`` on
      the ``[B, S, heads, head_dim]`` projections before attention. ``True`` (the default)
      builds a :class:`~tileops.nn.RotaryEmbedding` of ``rope_theta``, ``rope_scaling`` (a
      config's ``rope_scaling``: llama3, yarn, longrope) and ``max_position_embeddings``,
      rotating halves as Llama does; a module (or any callable) of that form is used as given,
      for another rotation or a normalization of q and k before it; ``None`` or ``False``
      rotates nothing, and a call then refuses ``position_ids``. ``position_ids`` (``[B, S]``
      or ``[S]``) defaults to ``0 .. S - 1``.
    - The attention is :class:`ScaledDotProductAttention` (the ``attention`` submodule) over
      :class:`~tileops.ops.GroupedQueryAttentionFwdOp`: causal by default with FlashAttention's
      bottom-right mask, bounded by ``window=(left, right)``, capped by ``softcap``, scaled by
      ``scale`` (default ``head_dim ** -0.5``). Query head ``h`` reads key/value head ``h //
      (num_heads / num_kv_heads)``.

    Every part trains through its op's gradient. ``target`` is every op's (the ``reference``
    target serves float64 on the CPU). A call refuses an ``x`` that is not ``[B, S,
    hidden_size]``, naming the block and the argument; the ops refuse the rest (dtypes,
    devices) by their own names."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, bias: bool = False, o_bias: bool = False,
                 is_causal: bool = True, scale: float | None = None, window: Any = None,
                 softcap: float | None = None, rotary: Any = True, rope_theta: float = 10000.0,
                 rope_scaling: dict[str, Any] | None = None,
                 max_position_embeddings: int | None = None, device: Any = None,
                 dtype: Any = None, target: str | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        num_kv_heads, head_dim = heads_of(name, hidden_size, num_heads, num_kv_heads, head_dim,
                                          "hidden_size")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        kw = {"device": device, "dtype": dtype, "target": target}
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias, **kw)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias, **kw)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias, **kw)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, o_bias, **kw)
        if rotary is True:
            rotary = RotaryEmbedding(head_dim, base=rope_theta, scaling=rope_scaling,
                                     max_position_embeddings=max_position_embeddings,
                                     target=target)
        elif rotary is False:
            rotary = None
        elif rotary is not None and not callable(rotary):
            raise TypeError(f"{name}: argument rotary must be True, False, None or a callable "
                            f"rotary(q, k, position_ids) -> (q, k), seen "
                            f"{type(rotary).__name__}")
        self.rotary = rotary
        self.attention = ScaledDotProductAttention(is_causal=is_causal, scale=scale,
                                                   window=window, softcap=softcap,
                                                   target=target)
        self.target = target
        self._parts_done()

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear,
                     num_heads: int, num_kv_heads: int | None = None,
                     **kwargs: Any) -> Attention:
        """A block holding copies of the weights (and biases) of the projections ``q``, ``k``,
        ``v`` and ``o`` of an attention block of ``num_heads`` query and ``num_kv_heads``
        key/value heads (a Hugging Face ``LlamaAttention``'s ``q_proj`` ... ``o_proj``), on
        their device and dtype; ``kwargs`` are the constructor's (``rope_theta``, ``window``,
        ``target``, ...)."""
        name = f"{cls.__name__}.from_linears"
        hidden, num_kv_heads, head_dim, bias = projections_of(name, q, k, v, o, num_heads,
                                                              num_kv_heads)
        for key in ("bias", "o_bias", "head_dim", "device", "dtype"):
            if key in kwargs:
                raise TypeError(f"{name}: argument {key} is read from the projections; it "
                                f"cannot be given")
        w = q.weight
        block = cls(hidden, num_heads, num_kv_heads, head_dim, bias=bias,
                    o_bias=o.bias is not None, device=w.device, dtype=w.dtype, **kwargs)
        with torch.no_grad():
            for mine, theirs in ((block.q_proj, q), (block.k_proj, k), (block.v_proj, v),
                                 (block.o_proj, o)):
                mine.load_state_dict(theirs.state_dict())
        return block

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            seen = (f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
                    else type(x).__name__)
            raise ValueError(f"{type(self).__name__}: argument x must be a [B, S, "
                             f"hidden_size] tensor with hidden_size {self.hidden_size}; seen "
                             f"{seen}")
        b, s, d = x.shape[0], x.shape[1], self.head_dim
        q = self.q_proj(x).view(b, s, self.num_heads, d)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, d)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, d)
        if self.rotary is not None:
            q, k = self.rotary(q, k, position_ids)
        elif position_ids is not None:
            raise ValueError(f"{type(self).__name__}: argument position_ids is given, but the "
                             f"block has no rotary embedding (rotary=None) to use it")
        o = self.attention(q, k, v)
        return self.o_proj(o.reshape(b, s, self.num_heads * d))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}")
