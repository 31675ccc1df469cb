"""The ``reference`` target: every op in plain PyTorch, fp32 accumulation, any device.

It is how the library runs without a GPU and what the tests compare against. Builders follow
the target convention: ``builder(op, call) -> kernel(*inputs, *outputs)`` writing the outputs.
"""

import torch

from tileops.runtime import REFERENCE, register_builder

from .norm import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

__all__ = ["rms_norm_reference", "layer_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, dims: int,
                       eps: float) -> torch.Tensor:
    """fp32 (or wider) RMSNorm over the last ``dims`` axes, returned in fp32."""
    xf = x.float() if x.dtype != torch.float64 else x
    axes = tuple(range(-dims, 0))
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=axes, keepdim=True) + eps)
    if weight is not None:
        out = out * (weight.float() if weight.dtype != torch.float64 else weight)
    return out


def layer_norm_reference(x, weight, bias, dims: int, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    axes = tuple(range(-dims, 0))
    mean = xf.mean(dim=axes, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=axes, keepdim=True)
    out = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.to(out.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def _rms_builder(op: RMSNormFwdOp, call):
    dims = len(op.normalized_shape)

    def kernel(x, weight, y):
        eps = op.eps if op.eps is not None else torch.finfo(x.dtype).eps
        y.copy_(rms_norm_reference(x, weight, dims, eps))

    return kernel


def _fused_builder(op: FusedAddRMSNormFwdOp, call):
    def kernel(x, residual, weight, y, residual_out):
        s = (x.float() + residual.float()).to(x.dtype)
        out = rms_norm_reference(s, weight, 1, op.eps)
        residual_out.copy_(s)
        y.copy_(out)

    return kernel


def _layer_builder(op: LayerNormFwdOp, call):
    dims = len(op.normalized_shape)

    def kernel(x, weight, bias, y):
        y.copy_(layer_norm_reference(x, weight, bias, dims, op.eps))

    return kernel


register_builder(REFERENCE, RMSNormFwdOp, _rms_builder)
register_builder(REFERENCE, FusedAddRMSNormFwdOp, _fused_builder)
register_builder(REFERENCE, LayerNormFwdOp, _layer_builder)


# --- GEMM -----------------------------------------------------------------------------------

from .gemm import GemmFwdOp  # noqa: E402


def gemm_reference(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False,
                   trans_b: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)`` computed in fp32 (or fp64 for fp64 inputs), returned in that dtype."""
    wide = torch.float64 if a.dtype == torch.float64 else torch.float32
    am = a.to(wide)
    bm = b.to(wide)
    return torch.matmul(am.T if trans_a else am, bm.T if trans_b else bm)


def _gemm_builder(op: GemmFwdOp, call):
    def kernel(a, b, c):
        c.copy_(gemm_reference(a, b, op.trans_a, op.trans_b))

    return kernel


register_builder(REFERENCE, GemmFwdOp, _gemm_builder)
__all__ += ["gemm_reference"]
