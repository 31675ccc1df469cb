"""The modules a patched Hugging Face model holds in place of its own, with the constructors of
the classes they replace (so a class-level patch makes the modeling module build them) and a
:meth:`sharing` constructor for an instance patch (the new module holds the old one's
parameters, the same ``Parameter`` objects: nothing is copied, an optimizer built before the
patch still steps them, and the ``state_dict`` keys are unchanged).

No module here imports ``transformers``: they read a model config by attribute.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tileops.nn as tnn

__all__ = ["TileOpsRMSNorm", "TileOpsRotaryEmbedding", "TileOpsSwiGLUMLP", "rotary_dispatch"]

#: the ``rope_scaling`` types :class:`tileops.nn.RotaryEmbedding` computes
ROPE_TYPES = ("default", "llama3", "yarn", "longrope")


class TileOpsRMSNorm(tnn.RMSNorm):
    """``LlamaRMSNorm(hidden_size, eps=1e-6)`` (and Qwen2's, Qwen3's, Mistral's: the same
    class under four names) as a :class:`tileops.nn.RMSNorm`.

    Hugging Face's norm casts the normalized rows to the input dtype before multiplying by the
    weight (two roundings in bfloat16); the op multiplies in float32 and rounds once, so a
    bfloat16 output may differ by one unit in the last place. ``variance_epsilon`` is the
    Hugging Face name of ``eps``."""

    def __init__(self, hidden_size: Any, eps: float = 1e-6, *, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    @classmethod
    def sharing(cls, norm: nn.Module) -> TileOpsRMSNorm:
        """The layer holding ``norm.weight`` itself, with ``norm.variance_epsilon``."""
        weight = norm.weight
        new = cls(tuple(weight.shape), eps=norm.variance_epsilon, device="meta",
                  dtype=weight.dtype)
        new.weight = weight
        return new


class TileOpsSwiGLUMLP(tnn.SwiGLUMLP):
    """``LlamaMLP(config)`` (Qwen2's, Qwen3's, Mistral's) as a :class:`tileops.nn.SwiGLUMLP`:
    the same ``gate_proj``, ``up_proj`` and ``down_proj`` (``config.mlp_bias`` where the
    config has one), the SiLU and the product in one op. A config whose ``hidden_act`` is not
    SiLU is refused: the fused op computes ``silu(gate) * up`` only."""

    def __init__(self, config: Any, *, device: Any = None, dtype: Any = None) -> None:
        act = getattr(config, "hidden_act", None)
        if act not in ("silu", "swish"):
            raise ValueError(f"TileOpsSwiGLUMLP: config.hidden_act must be 'silu' (the fused "
                             f"op computes silu(gate) * up), seen {act!r}; patch with "
                             f"swiglu=False")
        super().__init__(config.hidden_size, config.intermediate_size,
                         bool(getattr(config, "mlp_bias", False)), device=device, dtype=dtype)
        self.config = config

    @classmethod
    def sharing(cls, mlp: nn.Module, config: Any) -> TileOpsSwiGLUMLP:
        """The MLP holding ``mlp``'s projections' parameters themselves."""
        weight = mlp.gate_proj.weight
        new = cls(config, device="meta", dtype=weight.dtype)
        for name in ("gate_proj", "up_proj", "down_proj"):
            old, mine = getattr(mlp, name), getattr(new, name)
            if old.weight.shape != mine.weight.shape or (old.bias is None) != (mine.bias is None):
                raise ValueError(
                    f"TileOpsSwiGLUMLP.sharing: mlp.{name} is {old.in_features} -> "
                    f"{old.out_features} (bias {old.bias is not None}), the config makes "
                    f"{mine.in_features} -> {mine.out_features} (bias {mine.bias is not None})")
            mine.weight = old.weight
            mine.bias = old.bias
        return new


def _longrope_scaling(config: Any, scaling: dict, top: int | None) -> dict:
    """A LongRoPE ``rope_scaling`` as transformers reads it, in the keys of
    :class:`tileops.nn.RotaryEmbedding`: the original length is the config's
    ``original_max_position_embeddings`` attribute (Phi-3's), the factor then
    ``max_position_embeddings`` over it; without that attribute the original length is
    ``max_position_embeddings`` and the factor the scaling's (transformers reads no
    ``original_max_position_embeddings`` key of the scaling)."""
    scaling = dict(scaling)
    original = getattr(config, "original_max_position_embeddings", None)
    if original:
        scaling["original_max_position_embeddings"] = original
        if top is not None:
            scaling["factor"] = top / original
    elif top is not None:
        scaling["original_max_position_embeddings"] = top
    return scaling


class TileOpsRotaryEmbedding(nn.Module):
    """``LlamaRotaryEmbedding(config)`` as a :class:`tileops.nn.RotaryEmbedding`.

    Hugging Face splits RoPE in two: the model's rotary module turns ``position_ids`` into
    ``(cos, sin)``, handed to every attention block, whose ``apply_rotary_pos_emb(q, k, cos,
    sin)`` rotates. The RoPE op computes its angles from the positions in the kernel, so this
    module returns ``(positions, self)`` in the ``(cos, sin)`` slot instead (the positions as
    int64 ``[B, S]``), and the modeling module's ``apply_rotary_pos_emb``, replaced by
    :func:`rotary_dispatch`, hands q, k and the positions to :meth:`rotate`. No cos/sin tensor
    is made, and the op reads q and k once. The module holds no tensor, as Hugging Face's
    holds only a non-persistent ``inv_freq``: the ``state_dict`` is the same.

    The config's RoPE is read as Hugging Face reads it: ``rope_theta``, ``head_dim`` (else
    ``hidden_size / num_attention_heads``), ``rope_scaling`` (``rope_type`` ``default``,
    ``llama3``, ``yarn`` or ``longrope``; another is refused) and
    ``max_position_embeddings``. The angles are formed in float32 or wider in the kernel
    (Hugging Face rounds cos and sin to the model's dtype first). The frequencies come from
    the config, as Hugging Face's rotary module holds them in a model made with
    ``from_pretrained(dtype=...)`` or ``from_config(config, dtype=...)``; a model cast with
    ``model.to(torch.bfloat16)`` has that module's ``inv_freq`` buffer rounded to bfloat16,
    which turns its angles by up to ``position * 2^-9`` radians, so the patch then differs
    from the unpatched model by that much (and is the one that matches the config)."""

    def __init__(self, config: Any, device: Any = None) -> None:
        super().__init__()
        scaling = getattr(config, "rope_scaling", None) or None
        rope_type = "default"
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"TileOpsRotaryEmbedding: config.rope_scaling's rope_type must be "
                             f"one of {', '.join(ROPE_TYPES)}, seen {rope_type!r}; patch with "
                             f"rope=False")
        partial = getattr(config, "partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ValueError(f"TileOpsRotaryEmbedding: config.partial_rotary_factor must be 1.0 "
                             f"(these models rotate whole heads), seen {partial!r}; patch with "
                             f"rope=False")
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.config = config
        self.rope_type = rope_type
        top = getattr(config, "max_position_embeddings", None)
        if rope_type == "longrope":
            scaling = _longrope_scaling(config, scaling, top)
        try:
            self.rotary = tnn.RotaryEmbedding(
                head_dim, base=float(config.rope_theta), layout="bshd",
                scaling=scaling if rope_type != "default" else None,
                max_position_embeddings=top)
        except ValueError as e:  # a key or value of config.rope_scaling the layer refuses
            raise ValueError(f"TileOpsRotaryEmbedding: config.rope_scaling: "
                             f"{str(e).removeprefix('RotaryEmbedding: ')}; patch with "
                             f"rope=False") from None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple:
        """``(positions, self)``: ``position_ids`` as int64 ``[B, S]`` (a ``[1, S]`` row, as
        the models make it, expanded over ``x``'s batch)."""
        positions = position_ids
        if positions.shape[0] != x.shape[0]:
            positions = positions.expand(x.shape[0], -1)
        if positions.dtype != torch.int64:
            positions = positions.long()
        return positions, self

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated at ``positions``. The attention blocks pass ``[B, H, S, D]`` views
        of the projections' ``[B, S, H, D]`` output (``unsqueeze_dim`` 1): the op reads that
        layout, contiguous as it is, and the results go back as the same kind of views."""
        if unsqueeze_dim == 2:  # q and k as [B, S, H, D]
            return self.rotary(q, k, positions)
        if unsqueeze_dim != 1:
            raise ValueError(f"apply_rotary_pos_emb: unsqueeze_dim must be 1 ([B, H, S, D] q "
                             f"and k) or 2 ([B, S, H, D]), seen {unsqueeze_dim}")
        q_out, k_out = self.rotary(q.transpose(1, 2), k.transpose(1, 2), positions)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)


def rotary_dispatch(original: Any) -> Any:
    """The modeling module's ``apply_rotary_pos_emb`` for patched and unpatched models alike:
    a call whose ``sin`` slot holds a :class:`TileOpsRotaryEmbedding` (a patched model's) goes
    to it; any other is ``original``'s. Installing it changes nothing for a model that is not
    patched, so an instance patch may install it in the module every model of the kind
    shares."""

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        if isinstance(sin, TileOpsRotaryEmbedding):
            return sin.rotate(q, k, cos, unsqueeze_dim)
        return original(q, k, cos, sin, position_ids, unsqueeze_dim)

    apply_rotary_pos_emb.__doc__ = rotary_dispatch.__doc__
    apply_rotary_pos_emb.tileops_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb
