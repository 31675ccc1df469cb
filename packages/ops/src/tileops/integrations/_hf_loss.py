"""The causal-LM loss of a patched model: :func:`causal_lm_loss`, Hugging Face's
``ForCausalLMLoss`` on :class:`tileops.nn.CrossEntropyLoss`, and :func:`causal_lm_forward`,
the ``ForCausalLM.forward`` whose training step with labels takes the loss from
:class:`tileops.nn.FusedLinearCrossEntropyLoss` and never forms the logits.

Both keep Hugging Face's conventions: the labels are shifted left by one (position ``t``
predicts token ``t + 1``; the last position's label is ``ignore_index``) unless
``shift_labels`` is given, the mean is over the labels that are not ``ignore_index``, and with
``num_items_in_batch`` (the Trainer's count over gradient-accumulation steps) the loss is the
sum divided by it. The logits are not upcast first: the op reads them in their dtype and forms
the loss in float32, as ``ForCausalLMLoss`` gets by upcasting (an ``N x V`` float32 copy).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
import torch.nn.functional as F

import tileops.nn as tnn

from ._hf_attention import target_for

__all__ = ["causal_lm_forward", "causal_lm_loss", "fused_causal_lm_loss", "prepare"]

_layers: dict[tuple, torch.nn.Module] = {}
_lock = threading.Lock()


def _layer(cls: type, ignore_index: int, reduction: str, device: torch.device) -> Any:
    """The loss layer of one configuration, built once per process, one for CUDA tensors and
    one for the others (``_hf_attention.target_for`` says why)."""
    target = target_for(device)
    key = (cls, ignore_index, reduction, target)
    layer = _layers.get(key)
    if layer is None:
        built = cls(ignore_index=ignore_index, reduction=reduction, target=target)
        with _lock:
            layer = _layers.setdefault(key, built)
    return layer


def prepare() -> None:
    """Build the loss layers of Hugging Face's defaults (``ignore_index`` -100, the mean, and
    the sum the Trainer's ``num_items_in_batch`` asks for) where a patch is applied: a step
    compiled before any eager one then finds them (a layer built while torch.compile traces
    would construct an op there)."""
    for cls in (tnn.CrossEntropyLoss, tnn.FusedLinearCrossEntropyLoss):
        for reduction in ("mean", "sum"):
            for device in (torch.device("cuda"), torch.device("cpu")):
                _layer(cls, -100, reduction, device)


def _shifted(labels: torch.Tensor, shift_labels: torch.Tensor | None,
             ignore_index: int) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _per_item(loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: Any = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """``ForCausalLMLoss`` (``transformers.loss.loss_utils``) through
    :class:`tileops.nn.CrossEntropyLoss`; the model's ``loss_function`` once patched."""
    target = _shifted(labels, shift_labels, ignore_index).reshape(-1).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _layer(tnn.CrossEntropyLoss, ignore_index, reduction, logits.device)(
        logits.reshape(-1, vocab_size), target)
    return _per_item(loss, num_items_in_batch)


def fused_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         num_items_in_batch: Any = None, ignore_index: int = -100,
                         shift_labels: torch.Tensor | None = None,
                         **kwargs: Any) -> torch.Tensor:
    """:func:`causal_lm_loss` of the logits ``hidden @ weight.T`` (``hidden`` ``[B, S, H]``,
    the head's ``weight`` ``[V, H]``) through :class:`tileops.nn.FusedLinearCrossEntropyLoss`,
    without forming them. Every position's hidden row is read in place: the last position's
    label is ``ignore_index`` after the shift, so no ``[B, S - 1, H]`` slice is copied."""
    target = _shifted(labels, shift_labels, ignore_index).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _layer(tnn.FusedLinearCrossEntropyLoss, ignore_index, reduction, hidden.device)(
        hidden, weight, target.contiguous())
    return _per_item(loss, num_items_in_batch)


@functools.cache
def causal_lm_forward(moe: bool = False) -> Any:
    """The ``ForCausalLM.forward`` of a patch with ``fused_linear_cross_entropy``: Hugging
    Face's (4.57: the decoder, the logits of the last ``logits_to_keep`` positions, the loss),
    except that a call in training mode with ``labels`` returns the loss of
    :func:`fused_causal_lm_loss` and ``logits=None`` (Liger-Kernel's rule). With ``moe``,
    Mixtral's: ``output_router_logits`` (else the config's) returns the router logits and
    adds ``router_aux_loss_coef`` times the load-balancing loss to the loss, as
    ``MixtralForCausalLM.forward``. Built on first use, as it wraps transformers'
    ``can_return_tuple`` (``return_dict=False``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.utils.generic import can_return_tuple

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                cache_position=None, logits_to_keep=0, output_router_logits=None, **kwargs):
        if moe:
            if output_router_logits is None:
                output_router_logits = self.config.output_router_logits
            kwargs["output_router_logits"] = output_router_logits
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=past_key_values,
                             inputs_embeds=inputs_embeds, use_cache=use_cache,
                             cache_position=cache_position, **kwargs)
        kwargs.pop("output_router_logits", None)
        hidden = outputs.last_hidden_state
        logits = loss = None
        if self.training and labels is not None:
            loss = fused_causal_lm_loss(hidden, self.lm_head.weight, labels, **kwargs)
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) \
                else logits_to_keep
            logits = self.lm_head(hidden[:, keep, :])
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels,
                                          vocab_size=self.config.vocab_size, **kwargs)
        common = dict(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        if not moe:
            return CausalLMOutputWithPast(**common)
        aux_loss = None
        if output_router_logits:
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts,
                                                self.num_experts_per_tok, attention_mask)
            if labels is not None:
                common["loss"] = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(**common, aux_loss=aux_loss,
                                         router_logits=outputs.router_logits)

    forward.tileops_fused = True  # type: ignore[attr-defined]
    return forward
