"""The ``"tileops"`` attention implementation of ``transformers``: the attention function
(:func:`attention_forward`, registered in ``AttentionInterface``) and its mask function
(:func:`attention_mask`, registered in ``AttentionMaskInterface``), which decide together
which calls :class:`~tileops.ops.GroupedQueryAttentionFwdOp` serves.

The op's mask is causal (bottom-right aligned) with an optional window, and it takes no mask
tensor. So the mask function returns None exactly where the mask Hugging Face would build is
that one: a causal or sliding-window causal mask, no padding (no 2-D ``attention_mask``, or
one of all ones outside torch.compile, whose check reads the device), queries and keys of one
length from position 0 (a training step, a prefill), and skipping allowed (no packed
sequences, no extra mask function, no static cache). Every other call gets the
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
    plain = mask_function is causal_mask_function or local_size is not None
    if (allow_is_causal_skip and plain and kv_offset == 0
            and cache_position.shape[0] == kv_length and _unpadded(attention_mask, kv_length)):
        return None
    return sdpa_mask(batch_size=batch_size, cache_position=cache_position, kv_length=kv_length,
                     kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


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
