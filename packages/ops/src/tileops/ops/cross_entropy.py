"""Cross-entropy over class indices: the loss and its gradient.

:class:`CrossEntropyOp` is the family base of both ops. They share the call spec
(:class:`~tileops.kernels.cross_entropy.CrossEntropySpec`: the row count and vocabulary the
signature check read, the logits' dtype and the options), built once a configuration from the
op's params (:meth:`CrossEntropyOp.derive` reads them once), and the layout the kernels read:
contiguous ``(N, V)`` logits and gradient, a contiguous ``(N,)`` int64 target and a float32
loss gradient (a view where the caller's tensor is one, else a copy: the gradient of a sum of
the per-row losses arrives as an expanded scalar).

The gradient is its own op (:class:`CrossEntropyBwdOp`, the entry's ``backward:`` block): the
forward saves the logits and the target only, and the backward's kernel recomputes each row's
log-sum-exp (two passes over the row, the second from L2) before it writes the gradient once.
With ``inplace_grad`` the backward writes the gradient over the saved logits (an effect of the
backward's entry: ``logits`` mutated, ``dlogits`` its alias), so training holds no second
``N x V`` tensor, as with Liger-Kernel. Liger also computes the gradient in the forward (the
row read once, the backward only scaling it), which saves one read of the logits; that needs
a forward output the caller does not see, which the spec's ``backward:`` block cannot
express.

Each op's reference, torch eager function and Liger-Kernel peer are declared here once.
"""

from __future__ import annotations

from typing import Any, get_args

import torch
import torch.nn.functional as F

from tileops.kernels.cross_entropy import (
    CrossEntropyBwdInterface,
    CrossEntropyBwdKernel,
    CrossEntropyDType,
    CrossEntropyFwdInterface,
    CrossEntropyFwdKernel,
    CrossEntropySpec,
    Reduction,
)
from tileops.runtime import Op

from ._dtypes import NAMES, refuse_unserved

__all__ = ["CrossEntropyBwdOp", "CrossEntropyFwdOp", "CrossEntropyOp"]

#: the dtypes the cross-entropy kernels state they serve
_KERNEL_DTYPES = frozenset(get_args(CrossEntropyDType))


class CrossEntropyOp(Op):
    """Family base of the cross-entropy ops (see the module docstring)."""

    def derive(self) -> None:
        self._reduction = Reduction(self.reduction)
        #: the call spec's fields that the params fix
        self._options = dict(ignore_index=self.ignore_index, reduction=self._reduction,
                             label_smoothing=float(self.label_smoothing),
                             lse_square_scale=float(self.lse_square_scale),
                             softcap=None if self.softcap is None else float(self.softcap))

    def _entry(self, call: Any, interface: type, logits: torch.Tensor) -> Any:
        rows, classes = logits.shape
        dtype = logits.dtype
        key = (call.device, dtype, rows, classes)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "cross-entropy")
            entry = self.kernel_for(key, interface, lambda: CrossEntropySpec(
                device=call.device, rows=rows, classes=classes, dtype=NAMES[dtype],
                **self._options))
        return entry

    # --- shared by the references: x is the logits in float32, or float64 -----------------

    def _rows(self, x: torch.Tensor, target: torch.Tensor) -> tuple:
        """``(z, lse, valid, safe target)``."""
        z = x if self.softcap is None else self.softcap * torch.tanh(x / self.softcap)
        valid = target != self.ignore_index
        return z, torch.logsumexp(z, dim=-1), valid, torch.where(valid, target, 0)

    def _loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z, lse, valid, t = self._rows(x, target)
        eps = self.label_smoothing
        rows = lse - (1.0 - eps) * z.gather(1, t[:, None])[:, 0]
        if eps > 0.0:
            rows = rows - eps * z.mean(dim=-1)
        if self.lse_square_scale > 0.0:
            rows = rows + self.lse_square_scale * lse * lse
        rows = torch.where(valid, rows, 0.0)
        if self._reduction is Reduction.NONE:
            return rows
        if self._reduction is Reduction.SUM:
            return rows.sum()
        return rows.sum() / valid.sum().to(rows.dtype)

    def _grad(self, x: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
        z, lse, valid, t = self._rows(x, target)
        eps, zscale = self.label_smoothing, self.lse_square_scale
        p = torch.softmax(z, dim=-1)
        if zscale > 0.0:
            p = p * (1.0 + 2.0 * zscale * lse)[:, None]
        g = p - eps / z.shape[-1]
        g = g.scatter_add(1, t[:, None], torch.full_like(g[:, :1], -(1.0 - eps)))
        if self.softcap is not None:
            g = g * (1.0 - (z / self.softcap) ** 2)
        d = dloss.to(g.dtype)
        if self._reduction is Reduction.NONE:
            scale = d[:, None]
        elif self._reduction is Reduction.SUM:
            scale = d
        else:
            scale = d / valid.sum().to(g.dtype)
        return torch.where(valid[:, None], g * scale, 0.0)


class CrossEntropyFwdOp(CrossEntropyOp):
    kernel_types = {CrossEntropyFwdInterface: (CrossEntropyFwdKernel,)}

    def forward(self, call, logits, target, loss) -> None:
        entry = self._entry(call, CrossEntropyFwdInterface, logits)
        entry(_laid(logits), target.contiguous(), loss)

    def reference(self, call, logits, target):
        return (self._loss(_wide(logits), target),)

    def eager(self):
        ignore, reduction, eps = self.ignore_index, self.reduction, self.label_smoothing
        zscale, softcap = self.lse_square_scale, self.softcap

        def cross_entropy(logits, target):  # torch.nn.functional.cross_entropy
            # the loss is float32, float64 for float64 logits (the entry's dtype rule)
            wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
            z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
            if zscale == 0.0:
                return F.cross_entropy(z, target, ignore_index=ignore, reduction=reduction,
                                       label_smoothing=eps).to(wide)
            # the z-loss: scale * lse^2 of each row not ignored, reduced as the loss is
            rows = F.cross_entropy(z, target, ignore_index=ignore, reduction="none",
                                   label_smoothing=eps).to(wide)
            valid = target != ignore
            lse = torch.logsumexp(z.to(wide), dim=-1)
            rows = rows + torch.where(valid, zscale * lse * lse, 0.0)
            if reduction == "none":
                return rows
            return rows.sum() if reduction == "sum" else rows.sum() / valid.sum()

        return cross_entropy

    peers = {"liger": lambda op: _liger_ce(op)}


class CrossEntropyBwdOp(CrossEntropyOp):
    kernel_types = {CrossEntropyBwdInterface: (CrossEntropyBwdKernel,)}

    def forward(self, call, logits, target, dloss, dlogits) -> None:
        # with inplace_grad, dlogits is logits: the kernel writes each element after its
        # second read of it, by the same thread, so the row may be overwritten as it goes
        entry = self._entry(call, CrossEntropyBwdInterface, logits)
        g = dloss if dloss.dtype == torch.float32 else dloss.float()
        x = _laid(logits)
        d = dlogits if dlogits is not logits else x
        if d is not x and not (d.is_contiguous() and d.data_ptr() % 16 == 0):
            d = torch.empty_like(x)
        entry(x, target.contiguous(), g.contiguous(), d)
        if d is not dlogits:  # a strided or misaligned logits written in place
            dlogits.copy_(d)

    def reference(self, call, logits, target, dloss):
        return (self._grad(_wide(logits), target, dloss),)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or as it is when it is float64 already."""
    return t if t.dtype == torch.float64 else t.float()


def _laid(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address (the kernels read 16-byte vectors): a
    view where it is one already, else a copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


# --- Liger-Kernel peer (present when liger_kernel is installed) ---------------------------------


def _liger_ce(op: CrossEntropyFwdOp) -> Any:
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return None
    options = dict(ignore_index=op.ignore_index, reduction=op.reduction,
                   label_smoothing=op.label_smoothing, lse_square_scale=op.lse_square_scale,
                   softcap=op.softcap)

    def liger_cross_entropy_loss(logits, target):
        out = liger_cross_entropy(logits, target, **options)
        # versions differ: a tensor, a (loss, z_loss) tuple, or an output with .loss
        out = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
        return out.float()

    return liger_cross_entropy_loss

