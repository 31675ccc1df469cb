"""The rotary position embedding layer: :class:`RotaryEmbedding`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tileops.ops import (
    RopeLlama31FwdOp,
    RopeLongRopeFwdOp,
    RopeNeoxFwdOp,
    RopeNonNeoxFwdOp,
    RopeYarnFwdOp,
)

from ._holder import HoldsOp

__all__ = ["RotaryEmbedding"]

#: Hugging Face's ``rope_scaling`` keys -> the op's params, per ``rope_type``
_SCALING = {
    "llama3": (RopeLlama31FwdOp, {"factor": "factor", "low_freq_factor": "low_freq_factor",
                                  "high_freq_factor": "high_freq_factor",
                                  "original_max_position_embeddings":
                                      "original_max_position"}),
    "yarn": (RopeYarnFwdOp, {"factor": "factor", "beta_fast": "beta_fast",
                             "beta_slow": "beta_slow", "attention_factor": "attention_factor",
                             "original_max_position_embeddings": "original_max_position"}),
    "longrope": (RopeLongRopeFwdOp, {"short_factor": "short_factor",
                                     "long_factor": "long_factor",
                                     "attention_factor": "attention_factor",
                                     "original_max_position_embeddings":
                                         "original_max_position"}),
}
#: the keys Hugging Face reads that the layer folds into the op's params itself
_FOLDED = {"yarn": ("mscale", "mscale_all_dim", "truncate"), "longrope": ("factor",)}


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale of a factor (transformers' ``get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(HoldsOp, nn.Module):
    """``forward(q, k, position_ids=None) -> (q_out, k_out)``: q and k rotated in one launch.

    The layer stands for the two halves of a Hugging Face attention block's RoPE (the rotary
    module making cos/sin and ``apply_rotary_pos_emb``): the op computes the angles itself,
    so the layer holds no tensor and its ``state_dict`` is empty, as the rotary module's is
    (its ``inv_freq`` buffer is not persistent). ``scaling`` is a model config's
    ``rope_scaling`` (``rope_type`` ``default``, ``llama3``, ``yarn`` or ``longrope`` with
    their keys; ``max_position_embeddings`` is the model's, for LongRoPE's attention factor),
    held as a read-only copy: a change in place is refused, assigning a new one rebuilds the
    op (``layer.scaling = {**layer.scaling, "factor": 4.0}``).
    ``interleaved`` pairs columns (2j, 2j + 1) as GPT-J does (Llama and most models rotate
    halves); ``layout`` is ``"bshd"`` ([B, S, H, D], as the projections produce) or
    ``"bhsd"``; ``cache_length`` > 0 reads cos/sin of the first positions from a table (not
    with LongRoPE); ``inplace`` writes q and k. ``target`` is the op's. ``position_ids`` is
    ``[B, S]``, or ``[S]`` or ``[1, S]`` for every sequence of the batch, int64 or int32."""

    def __init__(self, head_dim: int, rotary_dim: int | None = None, base: float = 10000.0, *,
                 interleaved: bool = False, layout: str = "bshd",
                 scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None,
                 cache_length: int = 0, inplace: bool = False,
                 target: str | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self.interleaved = interleaved
        self.layout = layout
        self.scaling = dict(scaling) if scaling else None
        self.max_position_embeddings = max_position_embeddings
        self.cache_length = cache_length
        self.inplace = inplace
        self.target = target
        self._build_op()

    op_attrs = ("head_dim", "rotary_dim", "base", "interleaved", "layout", "scaling",
                "max_position_embeddings", "cache_length", "inplace")

    def _build_op(self) -> Any:
        scaling = self.scaling or {}
        # transformers' older configs name it "type"
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        common = {"rotary_dim": self.rotary_dim, "base": self.base, "layout": self.layout,
                  "inplace": self.inplace}
        if rope_type == "default":
            cls = RopeNonNeoxFwdOp if self.interleaved else RopeNeoxFwdOp
            params = {**common, "cache_length": self.cache_length}
        elif rope_type in _SCALING:
            cls, keys = _SCALING[rope_type]
            folded = _FOLDED.get(rope_type, ())
            unknown = sorted(set(scaling) - set(keys) - set(folded) - {"rope_type", "type"})
            if unknown:
                raise ValueError(f"RotaryEmbedding: scaling key {unknown[0]!r} is not a key of "
                                 f"rope_type {rope_type!r} ({', '.join((*keys, *folded))})")
            params = {**common, "interleaved": self.interleaved,
                      **{keys[k]: v for k, v in scaling.items() if k in keys and v is not None}}
            if rope_type == "yarn":
                params.update(self._yarn(scaling))
            if rope_type == "longrope":
                if self.cache_length:
                    raise ValueError("RotaryEmbedding: rope_type 'longrope' computes every "
                                     "angle (its table depends on the call); cache_length "
                                     "must be 0")
                params.update(self._longrope(scaling))
            else:
                params["cache_length"] = self.cache_length
        else:
            raise ValueError(f"RotaryEmbedding: rope_type must be one of default, "
                             f"{', '.join(_SCALING)}, got {rope_type!r}")
        op = cls(**params, target=self.target)
        self.__dict__["_op"] = op
        return op

    def _original(self, scaling: dict, rope_type: str) -> int:
        """The context length before scaling: the scaling's
        ``original_max_position_embeddings``, else the model's ``max_position_embeddings``
        (as transformers reads it)."""
        original = scaling.get("original_max_position_embeddings") or \
            self.max_position_embeddings
        if original is None:
            raise ValueError(f"RotaryEmbedding: rope_type {rope_type!r} needs the context "
                             f"length before scaling: original_max_position_embeddings in "
                             f"scaling, or max_position_embeddings")
        return original

    def _yarn(self, scaling: dict) -> dict:
        """YaRN's params as transformers derives them from the config: the original length
        (above), beta_fast and beta_slow where given and nonzero, and the attention factor
        of ``mscale`` and ``mscale_all_dim`` where both are given and nonzero."""
        if scaling.get("truncate", True) is not True:
            raise ValueError("RotaryEmbedding: rope_type 'yarn' with truncate="
                             f"{scaling['truncate']!r} is not served (the op truncates the "
                             "correction range to whole dimensions, as truncate=True)")
        params: dict[str, Any] = {"original_max_position": self._original(scaling, "yarn")}
        for key in ("beta_fast", "beta_slow"):  # transformers: `or` its default
            if key in scaling and not scaling[key]:
                params[key] = 32.0 if key == "beta_fast" else 1.0
        factor, mscale, all_dim = (scaling.get(k) for k in ("factor", "mscale",
                                                             "mscale_all_dim"))
        if scaling.get("attention_factor") is None and factor is not None and mscale \
                and all_dim:
            params["attention_factor"] = _mscale(factor, mscale) / _mscale(factor, all_dim)
        return params

    def _longrope(self, scaling: dict) -> dict:
        """LongRoPE's params: the short/long switch at the original length (above); the
        attention factor given, else of ``factor`` (transformers' formula), else of
        ``max_position_embeddings / original`` (Phi-3's configs)."""
        original = self._original(scaling, "longrope")
        top = self.max_position_embeddings
        params: dict[str, Any] = {"original_max_position": original}
        factor = scaling.get("factor")
        if scaling.get("attention_factor") is None and factor is not None:
            params["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(
                1 + math.log(factor) / math.log(original))
        if scaling.get("attention_factor") is not None or "attention_factor" in params:
            top = max(original, top or original)  # read by no formula then
        if top is not None:
            params["max_position"] = top
        return params

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> tuple:
        d = q.shape[-1]
        if d != self.head_dim:
            raise ValueError(f"RotaryEmbedding: q has head_dim {d}, the layer was made for "
                             f"{self.head_dim}")
        if position_ids is None:
            return self.op(q, k)
        return self.op(q, k, self._positions(position_ids, q))

    def _positions(self, position_ids: Any, q: Any) -> Any:
        """``position_ids`` as the op takes them, ``[B, S]`` int64, from the forms Hugging
        Face's models pass: ``[S]`` or ``[1, S]`` (one row for the batch, expanded) and int32.
        Anything else goes to the op as it is, for its check to name."""
        p = position_ids
        if not (isinstance(p, torch.Tensor) and isinstance(q, torch.Tensor) and q.dim() == 4
                and p.dim() in (1, 2) and p.dtype in (torch.int32, torch.int64)):
            return p
        if p.dim() == 1:
            p = p[None]
        if p.shape[0] == 1 and q.shape[0] != 1:
            p = p.expand(q.shape[0], p.shape[1])
        return p.long()

    def extra_repr(self) -> str:
        parts = [f"head_dim={self.head_dim}"]
        if self.rotary_dim is not None:
            parts.append(f"rotary_dim={self.rotary_dim}")
        parts.append(f"base={self.base}")
        for name, default in (("interleaved", False), ("layout", "bshd"), ("scaling", None),
                              ("cache_length", 0), ("inplace", False)):
            v = getattr(self, name)
            if v != default:
                parts.append(f"{name}={v!r}")
        return ", ".join(parts) + self._target_repr()
