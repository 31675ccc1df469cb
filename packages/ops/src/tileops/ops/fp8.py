"""fp8: quantising to float8 with float32 scales, and the GEMM of fp8 operands.

The scale convention is torch._scaled_mm's and DeepGEMM's (``specs/fp8.yaml`` states it):
scales are float32 and multiply, ``dequantised = q * scale``; quantising a scale block takes
``scale = max(amax(|x|), AMAX_FLOOR) / fp8_max`` and ``q = clamp(x / scale, -fp8_max,
fp8_max)`` rounded to the fp8 dtype. A scale block is the whole tensor, a row, a 1 x 128 group
along a row or a 128 x 128 block (:data:`SCALE_BLOCKS`), and a scale tensor holds one scale a
block, blocks in row-major order (``[]`` for the tensor, ``[R, 1]``, ``[R, ceil(C / 128)]``,
``[ceil(R / 128), ceil(C / 128)]``): :class:`Fp8QuantFwdOp` writes them and
:class:`GemmFp8FwdOp` reads them, so one's outputs are the other's operands.

:class:`Fp8Op` is the family base. Both ops bring their tensors to the kernels' layout (row-major
contiguous at 16-byte aligned addresses: the kernels' vector and TMA copies assume it; a view
that is not is copied), key the cached entry on the call's solved sizes and dtypes, and run
their slot (``fp8_quant``, ``gemm_fp8``). The kernels decide everything about the launch.

The references dequantise and multiply in float32 (float64 when handed float64: the tests and
``tileops run`` compare against the float64 product of the dequantised operands).
"""

from __future__ import annotations

from typing import Any, get_args

import torch

from tileops.kernels.fp8_gemm import (
    GemmFp8BlockKernel,
    GemmFp8Interface,
    GemmFp8OutDType,
    GemmFp8ScaledKernel,
    GemmFp8Spec,
    Scaling,
)
from tileops.kernels.fp8_quant import (
    AMAX_FLOOR,
    Fp8QuantDType,
    Fp8QuantInterface,
    Fp8QuantKernel,
    Fp8QuantSpec,
    Granularity,
)
from tileops.runtime import Op

from ._dtypes import NAMES, refuse_unserved

__all__ = ["Fp8Op", "Fp8QuantFwdOp", "GemmFp8FwdOp", "SCALE_BLOCKS", "dequantise"]

#: the scale block of each granularity as (rows, columns); 0 means the whole extent
SCALE_BLOCKS: dict[str, tuple[int, int]] = {
    "tensor": (0, 0), "row": (1, 0), "group": (1, 128), "block": (128, 128)}
#: the granularity of each GEMM operand's scale under each ``scaling``
_OPERAND_GRANULARITY = {"tensor": ("tensor", "tensor"), "row": ("row", "row"),
                        "block": ("group", "block")}


def _layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` row-major contiguous at a 16-byte aligned address: itself where it is, else a
    copy."""
    if not t.is_contiguous():
        return t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


def _block_dims(granularity: str, r: int, c: int) -> tuple[int, int]:
    """The block extent (rows, columns) of ``granularity`` on an ``[r, c]`` tensor, each at
    least 1 (a whole extent of 0 is one empty block)."""
    br, bc = SCALE_BLOCKS[granularity]
    return br or max(r, 1), bc or max(c, 1)


def _blocks(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """``x`` ``[r, c]`` zero-padded to whole blocks and viewed ``[rb, br, cb, bc]``."""
    r, c = x.shape
    br, bc = _block_dims(granularity, r, c)
    rb, cb = -(-r // br), -(-c // bc)
    if granularity in ("tensor", "row"):  # a whole extent is one block, even an empty one
        cb = 1
        rb = 1 if granularity == "tensor" else r
    padded = torch.nn.functional.pad(x, (0, cb * bc - c, 0, rb * br - r))
    return padded.view(rb, br, cb, bc)


def quantise(x: torch.Tensor, granularity: str, fp8_dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / scale, scale)`` unrounded in ``x``'s dtype (float32 or float64): the clamped
    quotients and the scales of the module docstring, ``scale`` shaped as the spec states.
    The quotients divide by the scales spread over ``x`` (:func:`_spread`), not block by block
    in the padded view: torch.compile (inductor, torch 2.13) miscomputes the fp8 cast of the
    latter's slice back to ``[r, c]``."""
    fmax = torch.finfo(fp8_dtype).max
    amax = _blocks(x, granularity).abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)  # [rb, cb]
    scale = amax / fmax
    if granularity == "tensor":
        scale = scale.reshape(())
    return (x / _spread(scale, x, granularity)).clamp(-fmax, fmax), scale


def _spread(scale: torch.Tensor, q: torch.Tensor, granularity: str) -> torch.Tensor:
    """Each block's scale at each element of ``q``: a gather by block index (torch.compile
    miscomputes products with ``repeat_interleave(...)[:, :c]`` where ``c`` is not a whole
    number of blocks)."""
    if granularity == "tensor":
        return scale
    r, c = q.shape
    br, bc = _block_dims(granularity, r, c)
    rows = torch.arange(r, device=q.device) // br
    cols = torch.arange(c, device=q.device) // bc
    return scale[rows[:, None], cols[None, :]]


def dequantise(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """``q * scale`` with each scale spread over its block, in ``scale``'s dtype."""
    return q.to(scale.dtype) * _spread(scale, q, granularity)


class Fp8Op(Op):
    """Family base of the fp8 ops (see the module docstring): the kernels' layout and the
    dtypes their call specs state they serve. A dtype param (``out_dtype``, ``fp8_dtype``)
    may be given as a torch dtype or its name; the op keeps the name."""

    @classmethod
    def normalize_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        return {n: NAMES.get(v, v) if isinstance(v, torch.dtype) else v
                for n, v in params.items()}

    def _entry(self, key: tuple, interface: type, served: frozenset[str], dtype: Any,
               make_spec: Any) -> Any:
        """The slot's entry for ``key`` (the cached call's one lookup, then a build)."""
        entry = self._entries_by_call.get(key)
        if entry is None:
            refuse_unserved(self, dtype, served, "fp8")
            entry = self.kernel_for(key, interface, make_spec)
        return entry


class Fp8QuantFwdOp(Fp8Op):
    """``(q, scale)`` of ``x`` at the op's ``granularity`` in ``fp8_dtype``."""

    kernel_types = {Fp8QuantInterface: (Fp8QuantKernel,)}

    def derive(self) -> None:
        self._read_mk = self.index_reader("M", "K")
        self._granularity = Granularity(self.granularity)

    def forward(self, call, x, q, scale) -> None:
        m, k = self._read_mk(call)
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = _layout(x)
        dtype = call.d_x
        entry = self._entry(
            (call.device, dtype, m, k), Fp8QuantInterface, _QUANT_DTYPES, dtype,
            lambda: Fp8QuantSpec(device=call.device, m=m, k=k, dtype=NAMES[dtype],
                                 fp8_dtype=self.fp8_dtype, granularity=self._granularity))
        entry(x, q, scale)

    def reference(self, call, x):
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        return quantise(x.to(wide), self.granularity, getattr(torch, self.fp8_dtype))

    def eager(self):
        granularity, fp8 = self.granularity, getattr(torch, self.fp8_dtype)

        def quantise_fp8(x):  # the reference's torch ops in float32, cast to fp8
            q, scale = quantise(x.float(), granularity, fp8)
            return q.to(fp8), scale

        return quantise_fp8


class GemmFp8FwdOp(Fp8Op):
    """``c = (a * a_scale) @ (b * b_scale)^T + bias`` in ``out_dtype``."""

    kernel_types = {GemmFp8Interface: (GemmFp8ScaledKernel, GemmFp8BlockKernel)}
    peers = {"torch._scaled_mm": lambda op: _scaled_mm_peer(op),
             "torch._scaled_mm_fast": lambda op: _scaled_mm_peer(op, fast=True),
             "scaled_mm_blockwise": lambda op: _blockwise_peer(op)}

    def derive(self) -> None:
        self._read_mnk = self.index_reader("M", "N", "K")
        self._scaling = Scaling(self.scaling)

    def forward(self, call, a, b, a_scale, b_scale, bias, c) -> None:
        m, n, k = self._read_mnk(call)
        if not a.is_contiguous() or a.data_ptr() % 16:
            a = _layout(a)
        if not b.is_contiguous() or b.data_ptr() % 16:
            b = _layout(b)
        if not a_scale.is_contiguous():
            a_scale = a_scale.contiguous()
        if not b_scale.is_contiguous():
            b_scale = b_scale.contiguous()
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        has_bias = bias is not None
        da, db = call.d_a, call.d_b
        entry = self._entry(
            (call.device, da, db, m, n, k, has_bias), GemmFp8Interface, _GEMM_DTYPES,
            c.dtype, lambda: GemmFp8Spec(
                device=call.device, m=m, n=n, k=k, a_dtype=NAMES[da], b_dtype=NAMES[db],
                out_dtype=self.out_dtype, scaling=self._scaling, has_bias=has_bias))
        entry(a, b, a_scale, b_scale, bias, c)

    def reference(self, call, a, b, a_scale, b_scale, bias):
        wide = torch.float64 if a.dtype == torch.float64 else torch.float32
        ga, gb = _OPERAND_GRANULARITY[self.scaling]
        c = dequantise(a, a_scale.to(wide), ga) @ dequantise(b, b_scale.to(wide), gb).T
        return (c if bias is None else c + bias.to(wide),)

    def eager(self):
        ga, gb = _OPERAND_GRANULARITY[self.scaling]
        out = getattr(torch, self.out_dtype)

        def dequantised_matmul(a, b, a_scale, b_scale, bias=None):
            # torch's ops everywhere: dequantise to out_dtype, then one matmul (cuBLAS)
            c = dequantise(a, a_scale, ga).to(out) @ dequantise(b, b_scale, gb).to(out).T
            return c if bias is None else c + bias

        return dequantised_matmul


#: the dtypes the kernels state they serve (their call specs'): the quant kernel's inputs, the
#: GEMM's outputs (its operands are every fp8 dtype the entry admits)
_QUANT_DTYPES = frozenset(get_args(Fp8QuantDType))
_GEMM_DTYPES = frozenset(get_args(GemmFp8OutDType))


# --- peers ------------------------------------------------------------------------------------


def _scaled_mm_peer(op: GemmFp8FwdOp, fast: bool = False) -> Any:
    """``torch._scaled_mm`` (cuBLASLt) where it takes the op's scales: per tensor (a 0-dim
    scale each) or per row (``[M, 1]`` and ``b``'s ``[N, 1]`` viewed ``[1, N]``), ``b`` as the
    column-major ``[K, N]`` view of its ``[N, K]``. None for block scales. ``fast``: with
    ``use_fast_accum``, accumulating in wgmma's fp8 accumulator throughout as the in-tree
    tensor and row kernels do (its default promotes partial sums to float32)."""
    if op.scaling == "block" or not hasattr(torch, "_scaled_mm"):
        return None
    out = getattr(torch, op.out_dtype)
    row = op.scaling == "row"

    def scaled_mm(a, b, a_scale, b_scale, bias=None):
        sb = b_scale.view(1, -1) if row else b_scale
        return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=sb, bias=bias,
                                out_dtype=out, use_fast_accum=fast)

    return scaled_mm


def _blockwise_peer(op: GemmFp8FwdOp) -> Any:
    """``torch.nn.functional.scaled_mm`` with DeepSeek-style block scales (1 x 128 on ``a``,
    128 x 128 on ``b``), where the installed torch has it; None for the other scalings. Its
    1 x 128 scales are read M-major, so ``a_scale`` is handed as such a view of a copy."""
    F = torch.nn.functional
    recipe = getattr(F, "ScalingType", None)
    if op.scaling != "block" or not hasattr(F, "scaled_mm") or recipe is None:
        return None
    out = getattr(torch, op.out_dtype)

    def scaled_mm(a, b, a_scale, b_scale, bias=None):
        sa = a_scale.t().contiguous().t()
        return F.scaled_mm(a, b.t(), sa, recipe.BlockWise1x128, b_scale,
                           recipe.BlockWise128x128, bias=bias, output_dtype=out)

    return scaled_mm
