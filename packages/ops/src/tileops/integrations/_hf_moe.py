"""Mixtral's mixture-of-experts modules on TileOPs: :class:`TileOpsMixtralSparseMoeBlock`
(``MixtralSparseMoeBlock`` as a :class:`tileops.nn.MoE`) and :class:`TileOpsMixtralExpertMLP`
(one expert, ``MixtralBlockSparseTop2MLP``, on the SwiGLU op).

Hugging Face's block routes as ``F.softmax(router_logits, dim=1, dtype=torch.float)``, then
``torch.topk`` of the top 2, the pair divided by its sum, the weights cast to the hidden
states' dtype, each expert's SwiGLU output scaled by its weight and summed into the token's
row (``index_add_``), and returns ``(out, router_logits)``. :class:`~tileops.ops.FusedMoeFwdOp`
routes the same way (softmax in float32, float64 for float64 logits; the top ``top_k``
by score, ties to the lower expert id as ``torch.topk``; renormalised) and sums the weighted
rows in float32 before one rounding, so in float32 the two agree to rounding, and a float64
model agrees to float32's rounding of the softmax (Hugging Face's is float32 whatever the
model's dtype). The block returns the router logits as Hugging Face's does: the model's
``output_router_logits`` and its load-balancing loss see the same tensor.

The experts' weights: Hugging Face holds ``experts[e].w1``, ``w3`` and ``w2`` Linears; the layer
stacks them, ``w13[e]`` the rows of ``w1`` then of ``w3`` and ``w2[e]`` ``w2``'s. An instance
patch therefore copies the experts' weights into the stacked parameters (the router Linear,
``gate``, is shared as it is): build the optimizer after patching, and save the patched
model's ``state_dict`` under the stacked names. A Hugging Face checkpoint's per-expert keys
still load into a patched block through ``load_state_dict`` (they are stacked on the way in);
``from_pretrained`` sets parameters by name, so load a checkpoint into the unpatched model
first and patch the instance.

Gradients: a call that needs them (grad mode on and the input or a parameter requiring grad)
runs :class:`tileops.nn.MoE`'s training path (its stages as ops with gradients: routing,
grouping, grouped GEMMs, SiluAndMul, the weighted unpermutation), which trains ``gate``,
``w13`` and ``w2``; there the layer forms the router logits itself, so the block's returned
logits are a second ``[tokens, E]`` product of the same router (a fraction ``E / (3 * top_k *
intermediate_size)`` of the experts' work), whose gradient (the load-balancing loss's) adds to
the layer's. An expert that no token chose in a step gets a zero slice of the stacked
gradient where Hugging Face's expert gets none, which an optimizer skips (AdamW's decay and
moments then part ways for that expert); ``zero_grad(set_to_none=False)`` treats them alike.
Calls without gradients run the fused op on the returned logits. Hugging Face's
router jitter (``router_jitter_noise`` in training) is applied as Hugging Face's, drawing the
same random numbers.

The block is also an instance of transformers' ``MixtralSparseMoeBlock`` (:func:`block_class`
makes the subclass): the model records ``router_logits`` by ``isinstance`` on that class.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import tileops.nn as tnn
from tileops.nn.functional import autocast_operands
from tileops.ops import SwiGLUFwdOp

__all__ = ["TileOpsMixtralExpertMLP", "TileOpsMixtralSparseMoeBlock", "block_class"]


def _check_act(name: str, config: Any) -> None:
    act = getattr(config, "hidden_act", None)
    if act not in ("silu", "swish"):
        raise ValueError(f"{name}: config.hidden_act must be 'silu' (the fused op computes "
                         f"silu(gate) * up), seen {act!r}; patch with moe=False and "
                         f"swiglu=False")


class TileOpsMixtralSparseMoeBlock(tnn.MoE):
    """``MixtralSparseMoeBlock(config)`` as a :class:`tileops.nn.MoE`: ``config.
    num_local_experts`` experts of ``intermediate_size``, softmax routing to
    ``num_experts_per_tok`` of them, renormalised (the module docstring says how it matches
    Hugging Face's). ``forward(hidden_states [B, S, H])`` returns ``(out [B, S, H],
    router_logits [B * S, E])``. Built from a config, the experts' weights are drawn as Hugging
    Face's initialisation draws its Linears' (normal, ``config.initializer_range``)."""

    def __init__(self, config: Any, *, device: Any = None, dtype: Any = None) -> None:
        _check_act(type(self).__name__, config)
        super().__init__(config.hidden_size, config.intermediate_size,
                         config.num_local_experts, config.num_experts_per_tok, device=device,
                         dtype=dtype)
        self.jitter_noise = float(getattr(config, "router_jitter_noise", 0.0))
        std = float(getattr(config, "initializer_range", 0.02))
        with torch.no_grad():
            self.w13.normal_(0.0, std)
            self.w2.normal_(0.0, std)
        self._register_load_state_dict_pre_hook(_stack_expert_keys, with_module=True)

    @classmethod
    def sharing(cls, block: nn.Module, config: Any) -> TileOpsMixtralSparseMoeBlock:
        """The block to replace ``block`` with, built on the meta device; :meth:`take` then
        gives it ``block``'s router (shared) and its experts' weights (copied, stacked)."""
        new = cls(config, device="meta", dtype=block.gate.weight.dtype)
        new.train(block.training)
        return new

    def take(self, block: nn.Module) -> None:
        """Hold ``block.gate`` itself and copies of its experts' weights, stacked."""
        experts = block.experts
        grad = experts[0].w1.weight.requires_grad
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
            w2 = torch.stack([e.w2.weight for e in experts])
        self.gate = block.gate
        self.w13 = nn.Parameter(w13, requires_grad=grad)
        self.w2 = nn.Parameter(w2, requires_grad=grad)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._rows(hidden_states, "hidden_states")  # another hidden size: refused by name
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            j = self.jitter_noise
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - j,
                                                                                     1.0 + j)
        rows = hidden_states.reshape(-1, self.hidden_size)
        router_logits = self.gate(rows)
        if torch.is_grad_enabled() and any(
                t.requires_grad for t in (rows, self.gate.weight, self.w13, self.w2)):
            return super().forward(hidden_states), router_logits  # the training path
        rows, w13, w2 = autocast_operands(rows, self.w13, self.w2)
        out = self.op(rows, router_logits, w13, w2, None)
        return out.view(shape).to(hidden_states.dtype), router_logits


def _stack_expert_keys(module: TileOpsMixtralSparseMoeBlock, state_dict: dict, prefix: str,
                       *args: Any) -> None:
    """A ``load_state_dict`` pre-hook: Hugging Face's ``experts.{e}.w1/w3/w2.weight`` keys
    under ``prefix``, where present for every expert, become the stacked ``w13`` and ``w2``."""
    def key(e: int, w: str) -> str:
        return f"{prefix}experts.{e}.{w}.weight"

    n = module.num_experts
    if not all(key(e, w) in state_dict for e in range(n) for w in ("w1", "w2", "w3")):
        return
    state_dict[f"{prefix}w13"] = torch.stack(
        [torch.cat([state_dict.pop(key(e, "w1")), state_dict.pop(key(e, "w3"))])
         for e in range(n)])
    state_dict[f"{prefix}w2"] = torch.stack([state_dict.pop(key(e, "w2")) for e in range(n)])


@functools.cache
def block_class(original: type) -> type:
    """:class:`TileOpsMixtralSparseMoeBlock` as a subclass of ``original`` (transformers'
    ``MixtralSparseMoeBlock``), ``original`` first in the bases so that it precedes the layer
    in the method order but overrides nothing: this class's constructor and ``forward`` are the
    layer's, and ``original``'s constructor never runs."""
    mine = TileOpsMixtralSparseMoeBlock
    return type(mine.__name__, (original, mine), {
        "__init__": mine.__init__, "forward": mine.forward, "__doc__": mine.__doc__,
        "__module__": __name__, "__qualname__": mine.__qualname__})


class TileOpsMixtralExpertMLP(nn.Module):
    """``MixtralBlockSparseTop2MLP(config)``, one expert, ``w2(silu(w1(x)) * w3(x))``, its
    three projections :class:`tileops.nn.Linear` layers under Hugging Face's names and the
    SiLU and product one :class:`~tileops.ops.SwiGLUFwdOp` (the ``swiglu`` flag where the
    experts stay Hugging Face's block's, ``moe=False``)."""

    def __init__(self, config: Any, *, device: Any = None, dtype: Any = None) -> None:
        _check_act(type(self).__name__, config)
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        h, i = config.hidden_size, config.intermediate_size
        self.ffn_dim, self.hidden_dim = i, h
        self.w1, self.w2, self.w3 = tnn.Linear(h, i, **kw), tnn.Linear(i, h, **kw), \
            tnn.Linear(h, i, **kw)
        self.swiglu = SwiGLUFwdOp()

    @classmethod
    def sharing(cls, mlp: nn.Module, config: Any) -> TileOpsMixtralExpertMLP:
        """The expert holding ``mlp``'s three weights themselves."""
        new = cls(config, device="meta", dtype=mlp.w1.weight.dtype)
        for name in ("w1", "w2", "w3"):
            getattr(new, name).weight = getattr(mlp, name).weight
        return new

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # a fresh op on the new device, as tileops.nn.SwiGLUMLP's (its target chosen again)
        module = super()._apply(fn, *args, **kwargs)
        self.swiglu = SwiGLUFwdOp()
        return module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(self.swiglu(self.w1(hidden_states), self.w3(hidden_states)))
