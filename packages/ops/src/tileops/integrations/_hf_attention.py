"""The ``"tileops"`` attention implementation of ``transformers``: the attention function
(:func:`attention_forward`, registered in ``AttentionInterface``) and its mask function
(:func:`attention_mask`, registered in ``AttentionMaskInterface``), which decide together
which calls :class:`~tileops.ops.GroupedQueryAttentionFwdOp` serves.

The op's mask is causal (bottom-right aligned) with an optional window, and it takes no mask
tensor. So the mask function returns None exactly where the mask Hugging Face would build is
that one: a causal or sliding-window causal mask, no padding (no 2-D ``attention_mask``, or
one of all ones outside torch.compile, whose check reads the device), queries and keys of one
length from position 0 (a training step, a prefill), and skipping allowed (no extra mask
function, no static cache). A call without a cache (a training step) always comes with
Hugging Face's packed-sequence mask, made from the position ids: it is read (outside
torch.compile, as the padding) and taken as the plain causal mask where every row holds one
sequence (the position ids count up by one along it). Every other call gets the
``sdpa`` implementation's mask and the attention function hands it to ``sdpa`` as it is: a
padded batch, packed sequences and decode steps over a cache stay exactly Hugging Face's.

The attention function runs the op on a mask-less call unless the op cannot serve it, where it
falls back to ``sdpa`` (the window made an explicit mask): attention dropout in training, a
call that needs gradients while the op has no backward, or on a CUDA device a dtype or head
dim the in-tree kernels do not serve (they serve float16 and bfloat16 at the head dims of
:data:`tileops.kernels.attention.HEAD_DIMS`, and a call that needs gradients at those of
:data:`tileops.kernels.attention_bwd.BWD_HEAD_DIMS`).
"""

from __future__ import annotations

import functools
from typing import Any, get_args

import torch

from tileops.kernels.attention import HEAD_DIMS, AttentionDType
from tileops.kernels.attention_bwd import BWD_HEAD_DIMS
from tileops.nn.functional import op_for
from tileops.ops import GroupedQueryAttentionFwdOp

__all__ = ["ATTN_IMPLEMENTATION", "attention_forward", "attention_mask", "prepare", "register",
           "target_for"]

#: the name the implementation is registered under (``attn_implementation="tileops"``)
ATTN_IMPLEMENTATION = "tileops"
_KERNEL_DTYPES = frozenset(getattr(torch, name) for name in get_args(AttentionDType))


def register() -> None:
    """Register :func:`attention_forward` and :func:`attention_mask` as ``"tileops"`` with
    transformers (idempotent; both registries are process-wide)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)


def prepare(config: Any) -> None:
    """Build the op instances a model of ``config`` calls (both layouts; with and without
    its sliding window; for CUDA and for other devices, :func:`target_for`), so that a model compiled before its first eager step does not build
    an op while torch.compile traces it (the op cache's miss constructs one)."""
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    sliding = getattr(config, "sliding_window", None)
    windows = [None] if sliding is None else [None, (sliding - 1, 0)]
    for target in (None, "reference"):
        for layout in ("bshd", "bhsd"):
            for window in windows:
                op_for(GroupedQueryAttentionFwdOp, is_causal=True, scale=head_dim ** -0.5,
                       window=window, softcap=None, layout=layout, target=target)


def target_for(device: torch.device) -> str | None:
    """The target an op instance of the process-wide caches is made with: an op binds its
    target at its first call and keeps it, so the instances that serve CUDA tensors (the
    in-tree kernels, chosen by device) and those that serve any other device (the reference
    target) are kept apart; a model moved from the CPU to the GPU then calls the kernels."""
    return None if device.type == "cuda" else "reference"


def attention_mask(batch_size: int, cache_position: torch.Tensor, kv_length: int,
                   kv_offset: int = 0, mask_function: Any = None,
                   attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                   allow_is_causal_skip: bool = True, **kwargs: Any) -> Any:
    """None where the call's mask is the op's own (see the module docstring), else the
    ``sdpa`` implementation's mask for the same arguments."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    skip = allow_is_causal_skip
    # a traced call cannot read the packed-sequence mask (nor the closures holding it)
    base, packed = (mask_function, None) if torch.compiler.is_compiling() else \
        _split_packed(mask_function)
    plain = base is causal_mask_function or local_size is not None
    if packed is not None:  # Hugging Face refused skipping for the packed-sequence mask alone
        plain = _causal_or_window(base, local_size)
        skip = plain and _one_sequence_a_row(packed)
    if (skip and plain and kv_offset == 0
            and cache_position.shape[0] == kv_length and _unpadded(attention_mask, kv_length)):
        return None
    return sdpa_mask(batch_size=batch_size, cache_position=cache_position, kv_length=kv_length,
                     kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def _closure(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__), strict=True))


@functools.cache
def _mask_codes() -> tuple[Any, Any, Any]:
    """The code objects of the functions ``and_masks``, ``packed_sequence_mask_function`` and
    ``sliding_window_overlay`` return (their closures are read by :func:`_split_packed` and
    :func:`_causal_or_window`)."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        packed_sequence_mask_function,
        sliding_window_overlay,
    )

    return (and_masks(causal_mask_function).__code__,
            packed_sequence_mask_function(torch.zeros(1, 1, dtype=torch.long)).__code__,
            sliding_window_overlay(1).__code__)


def _causal_or_window(fn: Any, local_size: int | None) -> bool:
    """Whether ``fn`` is Hugging Face's causal mask function, or with ``local_size`` its
    sliding-window causal one of that window (``and_masks(sliding_window_overlay(w),
    causal_mask_function)``): nothing else is and'ed in."""
    from transformers.masking_utils import causal_mask_function

    if fn is causal_mask_function:
        return True
    and_code, _, overlay_code = _mask_codes()
    if local_size is None or getattr(fn, "__code__", None) is not and_code:
        return False
    parts = _closure(fn).get("mask_functions")
    return (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function
            and getattr(parts[0], "__code__", None) is overlay_code
            and _closure(parts[0]).get("sliding_window") == local_size)


def _split_packed(fn: Any) -> tuple[Any, torch.Tensor | None]:
    """``(base, packed)`` where ``fn`` is ``and_masks(base, packed_sequence_mask_function(
    packed))``, the mask function Hugging Face makes for a call without a cache (``packed``
    the ``[B, S]`` sequence index of each position: a running count of the places where the
    position ids do not step by one); else ``(fn, None)``."""
    and_code, packed_code, _ = _mask_codes()
    if getattr(fn, "__code__", None) is not and_code:
        return fn, None
    parts = _closure(fn).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2
            and getattr(parts[1], "__code__", None) is packed_code):
        return fn, None
    packed = _closure(parts[1]).get("packed_sequence_mask")
    if not (isinstance(packed, torch.Tensor) and packed.ndim == 2):
        return fn, None
    return parts[0], packed


def _one_sequence_a_row(packed: torch.Tensor) -> bool:
    """Whether every row of the packed-sequence index holds one sequence (its count, which
    never decreases, stays 0)."""
    return packed.shape[-1] == 0 or not bool(packed[:, -1].any())


def _unpadded(mask: torch.Tensor | None, kv_length: int) -> bool:
    if mask is None:
        return True
    if torch.compiler.is_compiling() or mask.shape[-1] != kv_length:
        return False  # a traced step cannot read the mask's values; sdpa's mask then
    return bool(mask.all())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple:
    """``(attn_output [B, S, H, D], None)`` for ``[B, H, S, D]`` query, key and value, as
    every ``transformers`` attention function: the op where it serves the call, else
    ``sdpa`` (see the module docstring). ``sliding_window`` W lets a query see itself and the
    W - 1 keys before it (Hugging Face's sliding window)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    left = -1 if sliding_window is None else sliding_window - 1
    s_q, s_kv = query.shape[2], key.shape[2]
    if (attention_mask is not None or dropout > 0.0 or (causal and s_q > s_kv)
            or not _op_serves(query, key, value)):
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                     causal, left, kwargs)
    window = None if left < 0 else (left, 0 if causal else -1)
    # the projections' [B, S, H, D] output, seen as [B, H, S, D]: read in place as bshd
    bshd = query.transpose(1, 2).is_contiguous()
    op = op_for(GroupedQueryAttentionFwdOp, is_causal=causal, scale=scaling, window=window,
                softcap=softcap, layout="bshd" if bshd else "bhsd",
                target=target_for(query.device))
    if bshd:
        out = op(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        return out, None
    out = op(query, key, value)
    return out.transpose(1, 2), None


def _op_serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                        or value.requires_grad)
    if grad and GroupedQueryAttentionFwdOp._gradient is None:
        return False
    if query.device.type == "cuda":
        dims = (query.shape[-1], value.shape[-1])
        return query.dtype in _KERNEL_DTYPES and dims in (BWD_HEAD_DIMS if grad else HEAD_DIMS)
    return True


def _sdpa(module, query, key, value, mask, dropout, scaling, is_causal, causal, left, kwargs):
    """Hugging Face's ``sdpa`` attention; a mask-less call with a window gets the window as
    a bool mask (sdpa has no window of its own)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if mask is None and left >= 0:
        mask, is_causal = window_mask(query.shape[2], key.shape[2], left, causal,
                                      query.device), False
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def window_mask(s_q: int, s_kv: int, left: int, causal: bool, device: Any) -> torch.Tensor:
    """``[1, 1, s_q, s_kv]`` bool: the keys each query row sees, its diagonal bottom-right
    aligned (key ``i + s_kv - s_q`` for row ``i``), ``left`` keys before it (-1: every one)
    and none after it where ``causal``: the op's mask."""
    diag = torch.arange(s_q, device=device)[:, None] + (s_kv - s_q)
    j = torch.arange(s_kv, device=device)[None, :]
    seen = torch.ones(s_q, s_kv, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= j >= diag - left
    if causal:
        seen &= j <= diag
    return seen[None, None]
