"""``cast(model, *args)``: ``model.to(*args)`` with the rotary modules' frequencies kept in
float32 or wider, as ``from_pretrained(dtype=...)`` leaves them.

``model.to(torch.bfloat16)`` also rounds a Hugging Face rotary module's ``inv_freq`` buffer to
bfloat16, and the unpatched model then rotates by angles off by up to ``position * 2^-9``
radians: a reference that drifts from the patched model (whose RoPE op takes its frequencies
from the config) with the sequence length. The module keeps its float32 frequencies as
``original_inv_freq`` (a plain attribute, not cast); they are put back."""

from __future__ import annotations

import torch

_NARROW = (torch.float16, torch.bfloat16)


def cast(model: torch.nn.Module, *args, **kwargs) -> torch.nn.Module:
    model.to(*args, **kwargs)
    for module in model.modules():
        wide = getattr(module, "original_inv_freq", None)
        inv = module._buffers.get("inv_freq")
        if isinstance(wide, torch.Tensor) and inv is not None and inv.dtype in _NARROW:
            module.inv_freq = wide.to(device=inv.device, dtype=torch.float32)
    return model
