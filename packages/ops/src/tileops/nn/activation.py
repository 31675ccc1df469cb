"""Activation layers: :class:`SiLU`, :class:`GELU`, :class:`ReLU` (subclasses of torch.nn's)
and :class:`SwiGLUMLP`, the Llama MLP on TileOPs' GEMM and fused SwiGLU."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tileops.ops import GeluFwdOp, ReluFwdOp, SiluFwdOp, SwiGLUFwdOp

from ._holder import HoldsOp, PassesTarget
from .linear import Linear

__all__ = ["GELU", "ReLU", "SiLU", "SwiGLUMLP"]


class _Activation(HoldsOp):
    """What the activation layers share: the input through the op, torch's repr plus the
    target."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.op(input)

    def extra_repr(self) -> str:
        return super().extra_repr() + self._target_repr()  # type: ignore[misc]


class SiLU(_Activation, nn.SiLU):
    """``torch.nn.SiLU`` running :class:`~tileops.ops.SiluFwdOp` (``inplace`` as torch's)."""

    op_class = SiluFwdOp
    op_attrs = ("inplace",)

    def __init__(self, inplace: bool = False, *, target: str | None = None) -> None:
        super().__init__(inplace)
        self.target = target
        self._build_op()


class ReLU(_Activation, nn.ReLU):
    """``torch.nn.ReLU`` running :class:`~tileops.ops.ReluFwdOp` (``inplace`` as torch's; its
    gradient reads the output, so it trains in place)."""

    op_class = ReluFwdOp
    op_attrs = ("inplace",)

    def __init__(self, inplace: bool = False, *, target: str | None = None) -> None:
        super().__init__(inplace)
        self.target = target
        self._build_op()


class GELU(_Activation, nn.GELU):
    """``torch.nn.GELU`` running :class:`~tileops.ops.GeluFwdOp` (``approximate`` ``'none'``
    or ``'tanh'``, as torch's)."""

    op_class = GeluFwdOp
    op_attrs = ("approximate",)

    def __init__(self, approximate: str = "none", *, target: str | None = None) -> None:
        super().__init__(approximate)
        self.target = target
        self._build_op()


class SwiGLUMLP(PassesTarget, nn.Module):
    """The Llama MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``: three bias-free (by
    default) :class:`~tileops.nn.Linear` projections on TileOPs' GEMM and
    :class:`~tileops.ops.SwiGLUFwdOp` between them, which reads the two projections once and
    writes the product once (torch's ``silu`` then ``*`` makes two passes and an intermediate).
    The submodules' names are Hugging Face's ``LlamaMLP``'s, so its ``state_dict`` loads as
    is; :meth:`from_mlp` takes the three layers of one."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 device: Any = None, dtype: Any = None, *, target: str | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "target": target}
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = Linear(hidden_size, intermediate_size, bias, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, bias, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, **kw)
        self.target = target
        self._build_held()
        self._parts_done()

    def _build_held(self) -> None:
        self.swiglu = SwiGLUFwdOp(target=self.target)

    @classmethod
    def from_mlp(cls, mlp: nn.Module, *, target: str | None = None) -> SwiGLUMLP:
        """A :class:`SwiGLUMLP` holding copies of the weights of ``mlp``, any module with
        ``gate_proj``, ``up_proj`` and ``down_proj`` ``torch.nn.Linear`` layers (Hugging
        Face's ``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``)."""
        layers = []
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(mlp, name, None)
            if not isinstance(layer, nn.Linear):
                raise TypeError(f"SwiGLUMLP.from_mlp: mlp.{name} must be a torch.nn.Linear, "
                                f"seen {type(layer).__name__}")
            layers.append(layer)
        gate, up, down = layers
        biases = {layer.bias is not None for layer in layers}
        if len(biases) != 1:
            raise ValueError("SwiGLUMLP.from_mlp: gate_proj, up_proj and down_proj must all "
                             "have a bias or all have none")
        if (up.in_features, up.out_features) != (gate.in_features, gate.out_features) or \
                (down.in_features, down.out_features) != (gate.out_features, gate.in_features):
            raise ValueError(
                f"SwiGLUMLP.from_mlp: the projections do not chain: gate_proj "
                f"{gate.in_features} -> {gate.out_features}, up_proj {up.in_features} -> "
                f"{up.out_features}, down_proj {down.in_features} -> {down.out_features}")
        w = gate.weight
        out = cls(gate.in_features, gate.out_features, biases.pop(), device=w.device,
                  dtype=w.dtype, target=target)
        out.load_state_dict(mlp.state_dict(), strict=False)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        t = "" if self.target is None else f", target={self.target!r}"
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}{t}"
