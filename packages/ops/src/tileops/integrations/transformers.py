"""Hugging Face ``transformers`` models on TileOPs: ``apply_tileops_to_llama`` and its
siblings for Qwen2, Qwen3, Mistral and Mixtral.

Each ``apply_tileops_to_<model>(model_or_class, *, rms_norm, rope, swiglu, attention,
cross_entropy, fused_linear_cross_entropy)`` patches one kind of model in one of two ways:

- an instance (a ``LlamaForCausalLM``, a ``LlamaModel``...): its modules are swapped in place
  for ours holding the same ``Parameter`` objects (nothing copied; an optimizer made before
  still steps them, the ``state_dict`` is unchanged);
- the class level (``None``, the modeling module, or one of its model classes): the modeling
  module's classes and functions are replaced, as Liger-Kernel's
  ``apply_liger_kernel_to_llama`` does, so models built afterwards are built of ours.

What each flag swaps (the names are Llama's; the other models have the same under their own):

- ``rms_norm``: ``LlamaRMSNorm`` -> :class:`~tileops.nn.RMSNorm` (``TileOpsRMSNorm``);
- ``rope``: ``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb`` ->
  :class:`~tileops.nn.RotaryEmbedding`, which computes the angles from the positions in the
  kernel (``_hf_modules.py`` says how the positions travel in the ``(cos, sin)`` slot);
- ``swiglu``: ``LlamaMLP`` -> :class:`~tileops.nn.SwiGLUMLP`;
- ``attention``: the ``"tileops"`` attention implementation (``AttentionInterface``,
  :class:`~tileops.ops.GroupedQueryAttentionFwdOp`; ``_hf_attention.py`` says which calls it
  serves and which go to ``sdpa``), set on the instance, or at class level made the default of
  models built without an ``attn_implementation`` of their own;
- ``cross_entropy``: the causal LM's ``loss_function`` -> :class:`~tileops.nn.CrossEntropyLoss`;
- ``fused_linear_cross_entropy``: ``ForCausalLM.forward`` -> one whose training step with
  labels takes the loss from :class:`~tileops.nn.FusedLinearCrossEntropyLoss` and returns no
  logits (the ``[tokens, vocab]`` logits are never formed); off by default, as it changes
  what the forward returns. With both loss flags, the fused loss serves training and the
  cross-entropy the calls that form logits (evaluation with labels).

:func:`apply_tileops_to_mixtral` has the same flags and ``moe``: ``MixtralSparseMoeBlock`` ->
:class:`~tileops.nn.MoE` (``TileOpsMixtralSparseMoeBlock``; an instance patch copies the
experts' weights into the layer's stacked parameters, so build the optimizer after patching;
``_hf_moe.py`` says how its routing matches Hugging Face's and how it trains); with
``moe=False``, ``swiglu`` puts each expert (``MixtralBlockSparseTop2MLP``) on the SwiGLU op
instead.

:func:`generate_paged` decodes greedily with the keys and values in a paged cache (pages of 64
tokens, a block table a sequence), each step's attention the paged decode op
(``_hf_paged.py``), for any of these models, patched or not.

A model that is not a causal LM has no loss to patch: the loss flags do nothing there.
``transformers`` is imported when a function here is called (it is the ``transformers``
extra of tileops-ops), never by ``import tileops.ops`` or ``tileops.nn``. The integration is
written against transformers 4.57 (its attention and mask interfaces, the rotary module handing
``(cos, sin)`` to the attention blocks); an older one lacking them is refused by name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from . import _hf_attention, _hf_loss
from ._hf_attention import ATTN_IMPLEMENTATION, register
from ._hf_loss import causal_lm_forward, causal_lm_loss
from ._hf_modules import TileOpsRMSNorm, TileOpsRotaryEmbedding, TileOpsSwiGLUMLP, rotary_dispatch
from ._hf_moe import TileOpsMixtralExpertMLP, TileOpsMixtralSparseMoeBlock, block_class
from ._hf_paged import PagedKVCache, generate_paged

__all__ = [
    "ATTN_IMPLEMENTATION",
    "EXTRA",
    "PagedKVCache",
    "TileOpsMixtralExpertMLP",
    "TileOpsMixtralSparseMoeBlock",
    "TileOpsRMSNorm",
    "TileOpsRotaryEmbedding",
    "TileOpsSwiGLUMLP",
    "apply_tileops_to_llama",
    "apply_tileops_to_mistral",
    "apply_tileops_to_mixtral",
    "apply_tileops_to_qwen2",
    "apply_tileops_to_qwen3",
    "causal_lm_loss",
    "generate_paged",
    "register_attention",
]

#: what to install for this module
EXTRA = "tileops-ops[transformers]"
_FLAGS = ("rms_norm", "rope", "swiglu", "attention", "cross_entropy",
          "fused_linear_cross_entropy")
#: (modeling module, name) -> the object a class-level patch replaced there
_originals: dict[tuple[str, str], Any] = {}


@dataclass(frozen=True)
class _Kind:
    """One kind of model: ``llama`` is ``transformers.models.llama.modeling_llama``, whose
    classes are named ``Llama...``."""

    name: str
    prefix: str
    #: the dense MLP's class (``<prefix><mlp>``), or None where the model has experts instead
    mlp: str | None = "MLP"

    @property
    def flags(self) -> tuple[str, ...]:
        return _FLAGS if self.mlp is not None else (*_FLAGS, "moe")

    @property
    def function(self) -> str:
        return f"apply_tileops_to_{self.name}"

    def modeling(self) -> Any:
        _require(self.function)
        return importlib.import_module(f"transformers.models.{self.name}.modeling_{self.name}")


def _require(function: str) -> None:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"{function}: transformers is not installed; install the extra: "
                          f"pip install '{EXTRA}'") from e
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{function}: transformers {transformers.__version__} has no "
                          f"AttentionInterface / AttentionMaskInterface; the integration "
                          f"needs a newer one (written against 4.57): pip install -U "
                          f"'{EXTRA}'") from e


def register_attention() -> None:
    """Register the ``"tileops"`` attention implementation with transformers, so that
    ``from_pretrained(..., attn_implementation="tileops")`` or
    ``model.set_attn_implementation("tileops")`` selects it without patching anything else."""
    _require("register_attention")
    register()


def apply_tileops_to_llama(model_or_class: Any = None, *, rms_norm: bool = True,
                           rope: bool = True, swiglu: bool = True, attention: bool = True,
                           cross_entropy: bool = True,
                           fused_linear_cross_entropy: bool = False) -> Any:
    """Patch a Llama model (an instance, or with ``None`` / a class the modeling module):
    see the module docstring for what each flag swaps. Returns ``model_or_class``."""
    return _apply(_LLAMA, model_or_class, locals())


def apply_tileops_to_qwen2(model_or_class: Any = None, *, rms_norm: bool = True,
                           rope: bool = True, swiglu: bool = True, attention: bool = True,
                           cross_entropy: bool = True,
                           fused_linear_cross_entropy: bool = False) -> Any:
    """:func:`apply_tileops_to_llama` for Qwen2 (its q/k/v biases stay in its projections;
    its sliding-window layers get the op's window)."""
    return _apply(_QWEN2, model_or_class, locals())


def apply_tileops_to_qwen3(model_or_class: Any = None, *, rms_norm: bool = True,
                           rope: bool = True, swiglu: bool = True, attention: bool = True,
                           cross_entropy: bool = True,
                           fused_linear_cross_entropy: bool = False) -> Any:
    """:func:`apply_tileops_to_llama` for Qwen3 (``rms_norm`` also swaps the per-head
    ``q_norm`` and ``k_norm``)."""
    return _apply(_QWEN3, model_or_class, locals())


def apply_tileops_to_mistral(model_or_class: Any = None, *, rms_norm: bool = True,
                             rope: bool = True, swiglu: bool = True, attention: bool = True,
                             cross_entropy: bool = True,
                             fused_linear_cross_entropy: bool = False) -> Any:
    """:func:`apply_tileops_to_llama` for Mistral (``config.sliding_window`` becomes the op's
    window)."""
    return _apply(_MISTRAL, model_or_class, locals())


def apply_tileops_to_mixtral(model_or_class: Any = None, *, rms_norm: bool = True,
                             rope: bool = True, swiglu: bool = True, attention: bool = True,
                             cross_entropy: bool = True,
                             fused_linear_cross_entropy: bool = False, moe: bool = True) -> Any:
    """:func:`apply_tileops_to_llama` for Mixtral, and ``moe``: its sparse MoE blocks on
    :class:`~tileops.nn.MoE` (the module docstring; an instance patch copies the experts'
    weights, so build the optimizer after it). ``swiglu`` swaps the experts one by one where
    ``moe`` is off."""
    return _apply(_MIXTRAL, model_or_class, locals())


_LLAMA, _QWEN2, _QWEN3, _MISTRAL = (_Kind("llama", "Llama"), _Kind("qwen2", "Qwen2"),
                                    _Kind("qwen3", "Qwen3"), _Kind("mistral", "Mistral"))
_MIXTRAL = _Kind("mixtral", "Mixtral", mlp=None)


def _apply(kind: _Kind, target: Any, args: dict[str, Any]) -> Any:
    flags = {name: args[name] for name in kind.flags}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{kind.function}: argument {name} must be a bool, seen "
                            f"{type(value).__name__} {value!r}")
    modeling = kind.modeling()
    base = _original(modeling, f"{kind.prefix}PreTrainedModel")
    if target is None or target is modeling or (isinstance(target, type)
                                                 and issubclass(target, base)):
        _patch_classes(kind, modeling, flags)
    elif isinstance(target, base):
        _patch_instance(kind, modeling, target, flags)
    else:
        seen = target.__name__ if isinstance(target, type) else type(target).__name__
        raise TypeError(f"{kind.function}: argument model_or_class must be a {kind.prefix} "
                        f"model (a {base.__name__}), one of its classes, or None for the "
                        f"modeling module {modeling.__name__}; seen {seen}")
    return target


def _original(modeling: Any, name: str) -> Any:
    """``modeling.<name>`` as transformers defined it, before any class-level patch."""
    return _originals.get((modeling.__name__, name), getattr(modeling, name))


def _replace(modeling: Any, name: str, value: Any) -> None:
    _originals.setdefault((modeling.__name__, name), getattr(modeling, name))
    setattr(modeling, name, value)


def _install_rotary_dispatch(modeling: Any) -> None:
    if not hasattr(modeling.apply_rotary_pos_emb, "tileops_original"):
        _replace(modeling, "apply_rotary_pos_emb",
                 rotary_dispatch(modeling.apply_rotary_pos_emb))


def _check_fused_head(function: str, model: Any) -> None:
    head = model.lm_head
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{function}: fused_linear_cross_entropy reads lm_head's weight only; "
                         f"this lm_head has a bias (pass fused_linear_cross_entropy=False)")


def _patch_instance(kind: _Kind, modeling: Any, model: Any, flags: dict[str, bool]) -> None:
    config = model.config
    swapped = {
        "rms_norm": (_original(modeling, f"{kind.prefix}RMSNorm"),
                     TileOpsRMSNorm.sharing),
        "rope": (_original(modeling, f"{kind.prefix}RotaryEmbedding"),
                 lambda rotary: TileOpsRotaryEmbedding(config)),
    }
    if kind.mlp is not None:
        swapped["swiglu"] = (_original(modeling, f"{kind.prefix}{kind.mlp}"),
                             lambda mlp: TileOpsSwiGLUMLP.sharing(mlp, config))
    else:
        block = _original(modeling, f"{kind.prefix}SparseMoeBlock")
        swapped["moe"] = (block, lambda moe: block_class(block).sharing(moe, config))
        if not flags["moe"]:
            swapped["swiglu"] = (_original(modeling, f"{kind.prefix}BlockSparseTop2MLP"),
                                 lambda mlp: TileOpsMixtralExpertMLP.sharing(mlp, config))
    by_class = {cls: make for flag, (cls, make) in swapped.items() if flags[flag]}
    causal_lm = isinstance(model, _original(modeling, f"{kind.prefix}ForCausalLM"))
    if causal_lm and flags["fused_linear_cross_entropy"]:
        _check_fused_head(kind.function, model)
    # every replacement is built (and may refuse) before the model is changed at all
    swaps = [(parent, name, by_class[type(child)](child))
             for parent in model.modules() for name, child in parent.named_children()
             if type(child) in by_class]
    if flags["attention"]:
        register()
    for parent, name, new in swaps:
        if isinstance(new, TileOpsMixtralSparseMoeBlock):
            new.take(getattr(parent, name))  # the experts' weights copied a block at a time
        setattr(parent, name, new)
    if flags["rope"]:
        _install_rotary_dispatch(modeling)
    if flags["attention"]:
        _hf_attention.prepare(config)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:
            config._attn_implementation = ATTN_IMPLEMENTATION
    if causal_lm and (flags["cross_entropy"] or flags["fused_linear_cross_entropy"]):
        _hf_loss.prepare()
    if causal_lm and flags["cross_entropy"]:
        model.loss_function = causal_lm_loss
    if causal_lm and flags["fused_linear_cross_entropy"]:
        model.forward = causal_lm_forward(kind.mlp is None).__get__(model)


def _patch_classes(kind: _Kind, modeling: Any, flags: dict[str, bool]) -> None:
    prefix = kind.prefix
    if flags["attention"]:
        _default_attention(kind, _original(modeling, f"{prefix}PreTrainedModel"))
    if flags["rms_norm"]:
        _replace(modeling, f"{prefix}RMSNorm", TileOpsRMSNorm)
    if kind.mlp is not None and flags["swiglu"]:
        _replace(modeling, f"{prefix}{kind.mlp}", TileOpsSwiGLUMLP)
    if kind.mlp is None and flags["moe"]:
        _replace(modeling, f"{prefix}SparseMoeBlock",
                 block_class(_original(modeling, f"{prefix}SparseMoeBlock")))
    elif kind.mlp is None and flags["swiglu"]:
        _replace(modeling, f"{prefix}BlockSparseTop2MLP", TileOpsMixtralExpertMLP)
    if flags["rope"]:
        _replace(modeling, f"{prefix}RotaryEmbedding", TileOpsRotaryEmbedding)
        _install_rotary_dispatch(modeling)
    causal_lm = _original(modeling, f"{prefix}ForCausalLM")
    if flags["cross_entropy"] or flags["fused_linear_cross_entropy"]:
        _hf_loss.prepare()
    if flags["cross_entropy"]:
        causal_lm.loss_function = _LOSS_FUNCTION
    if flags["fused_linear_cross_entropy"]:
        causal_lm.forward = causal_lm_forward(kind.mlp is None)


def _loss_function(self: Any) -> Any:
    # a loss set on the instance (model.loss_function = ...) still wins, as transformers' own
    return self.__dict__.get("_loss_function", causal_lm_loss)


def _set_loss_function(self: Any, value: Any) -> None:
    self.__dict__["_loss_function"] = value


#: the class-level ``loss_function``: :func:`causal_lm_loss` unless the instance set its own
_LOSS_FUNCTION = property(_loss_function, _set_loss_function,
                          doc="The causal-LM loss: tileops' causal_lm_loss unless set.")


def _default_attention(kind: _Kind, base: type) -> None:
    """Make ``"tileops"`` the attention of models of ``base`` built without an
    ``attn_implementation`` (an explicit one still wins), by wrapping the method transformers
    resolves the default with."""
    register()
    current = getattr(base, "get_correct_attn_implementation", None)
    if current is None:
        import transformers
        raise ImportError(f"{kind.function}: transformers {transformers.__version__} has no "
                          f"PreTrainedModel.get_correct_attn_implementation to default the "
                          f"attention with; pass attention=False and build the model with "
                          f"attn_implementation={ATTN_IMPLEMENTATION!r}")
    if getattr(current, "tileops_default", False):
        return

    def get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
        requested = ATTN_IMPLEMENTATION if requested_attention is None else requested_attention
        chosen = current(self, requested, is_init_check)
        if chosen == ATTN_IMPLEMENTATION:
            _hf_attention.prepare(self.config)
        return chosen

    get_correct_attn_implementation.tileops_default = True  # type: ignore[attr-defined]
    base.get_correct_attn_implementation = get_correct_attn_implementation
