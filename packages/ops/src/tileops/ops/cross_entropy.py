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
``N x V`` tensor, as with Liger-Kernel; never over logits someone else reads after it: a leaf
(the caller's tensor), or logits the node that made them saved for its own backward (an exp's,
a sigmoid's or a tanh's output, or a view of one; ``tileops.runtime.autograd.saved_by_node``):
those get a gradient of their own, as without ``inplace_grad`` (an ``N x V`` tensor more, and
the gradient is right; apply a softcap through the op's ``softcap``, not a tanh before it, to
keep the saving). A node that read the logits after they were made and saved them (another
term of the loss) is not visible from them: the write is counted by torch's version counter, so
that node's backward raises torch's error rather than reading the gradient. A second backward
through a retained graph whose logits hold the gradient is refused by name. In training with a
mean or sum loss the
forward computes the gradient itself, as Liger-Kernel does (the runtime's kept gradients,
``Op.keep_gradient``, for a 0-dim output): one kernel writes each row's loss and its gradient
for a unit upstream gradient, and the node's backward only scales it, by a kernel that returns
at once when the upstream gradient is 1 (:meth:`CrossEntropyFwdOp.scale_kept`), so the logits
are read once from HBM (the second pass from L2) in the whole step. The backward op serves
reduction none (a per-row upstream gradient), compiled calls and a retained graph's second
backward.

The fused linear cross-entropy (:class:`FusedLinearCrossEntropyFwdOp`, the loss of ``hidden @
weight.T``) is a composite of the GEMM ops and the two ops above over blocks of rows: a block's
logits (at most :data:`BLOCK_BYTES`), its loss, and in training its gradient written over the
logits, ``dhidden``'s rows (``dlogits @ weight``) and ``dweight``'s sum over blocks
(``dlogits.T @ hidden``): the forward's first block writes it (GemmFwdOp: its product is the
kept gradient), the next blocks add theirs to it (GemmAccumulateFwdOp: ``c + a @ b`` summed in
fp32 and rounded once a block, no per-block product held); the backward op, handed its
``dweight``, zeroes it and adds every block's. Writing the first block's product rather than
adding it to zeros saves a write and a read of ``dweight`` (2 GiB at 128256 x 4096 in
bfloat16, half a millisecond on an H200) a training step. A call is
one autograd node (the runtime records a composite with a ``backward:`` block as one), so no
block's logits outlive it. With a 0-dim loss the forward keeps ``dhidden`` and ``dweight``
(``Op.keep_gradient``) and the backward only scales them by ``dloss``: three products a training
step, as Liger-Kernel's, rather than four. :class:`FusedLinearCrossEntropyBwdOp` recomputes the
blocks where nothing was kept (reduction none, whose per-row ``dloss`` cannot scale a sum over
rows; compiled calls). The blocks' ops reduce by ``sum`` (``none`` for reduction none) and the
mean's division by the count of rows not ignored is the composite's, so blocks of any size give
the loss of the whole.

Each op's reference, torch eager function and Liger-Kernel peer are declared here once.
"""

from __future__ import annotations

import math
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
from tileops.kernels.gemm import GemmDType
from tileops.runtime import Op
from tileops.runtime.memory import has_data

from ._dtypes import NAMES, refuse_unserved
from .gemm import GemmAccumulateFwdOp, GemmFwdOp

__all__ = ["CrossEntropyBwdOp", "CrossEntropyFwdOp", "CrossEntropyOp",
           "FusedLinearCrossEntropyBwdOp", "FusedLinearCrossEntropyFwdOp"]

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

    def _entry(self, device: Any, interface: type, logits: torch.Tensor,
               kept: bool = False) -> Any:
        rows, classes = logits.shape
        dtype = logits.dtype
        key = (device, dtype, rows, classes, kept)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "cross-entropy")
            entry = self.kernel_for(key, interface, lambda: CrossEntropySpec(
                device=device, rows=rows, classes=classes, dtype=NAMES[dtype], kept=kept,
                **self._options))
        return entry

    # --- shared by the references: x is the logits in float32, or float64 -----------------

    def _rows(self, x: torch.Tensor, target: torch.Tensor) -> tuple:
        """``(z, lse, valid, safe target)``; a target that is neither a class of the logits nor
        ``ignore_index`` is refused by name where the tensors hold data (the kernels, which
        check nothing on the host, give its row a NaN loss and gradient)."""
        z = x if self.softcap is None else self.softcap * torch.tanh(x / self.softcap)
        valid = target != self.ignore_index
        if has_data(target):
            bad = (valid & ((target < 0) | (target >= x.shape[-1]))).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                raise IndexError(
                    f"{type(self).__name__}: target[{i}] is {int(target[i])}: not a class "
                    f"index in [0, {x.shape[-1]}) (the logits have {x.shape[-1]} classes) "
                    f"and not ignore_index ({self.ignore_index})")
        # a row holding +inf has a NaN log-sum-exp, as torch's log_softmax (and the kernels'
        # running maximum) give it, where torch.logsumexp gives inf (a loss of inf)
        lse = torch.logsumexp(z, dim=-1)
        lse = torch.where(lse == math.inf, math.nan, lse)
        return z, lse, valid, torch.where(valid, target, 0)

    def _loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z, lse, valid, t = self._rows(x, target)
        eps = self.label_smoothing
        # lse - (1 - eps) z[t] - eps mean(z) as the log-sum-exp above the row's maximum plus
        # each weight times its distance from it (the weights sum to 1), as log_softmax
        # subtracts the maximum first: lse - z[t] of logits near 1e4 loses 1e-3 to rounding
        m = z.amax(dim=-1, keepdim=True) if z.shape[-1] else z.sum(dim=-1, keepdim=True)
        m = torch.where(m.isfinite(), m, 0.0)
        rel = torch.logsumexp(z - m, dim=-1)
        rel = torch.where(rel == math.inf, math.nan, rel)
        rows = rel + (1.0 - eps) * (m[:, 0] - z.gather(1, t[:, None])[:, 0])
        if eps > 0.0:
            rows = rows + eps * (m - z).mean(dim=-1)
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
    """The loss; in training with a 0-dim loss (mean or sum), also the gradient of the logits.

    There the forward's kernel writes each row's loss and its gradient for a unit upstream
    gradient in one launch (the row read from HBM once, again from L2, the gradient written
    once), and keeps the gradient (:meth:`Op.keep_gradient`); the node's backward scales it by
    :meth:`scale_kept`, whose kernel returns at once for ``loss.backward()``'s 1, so a training
    step reads the logits once and writes the gradient once, where the forward's loss then the
    backward's two passes read them twice. With ``inplace_grad`` the gradient is written over
    the logits in the forward (as Liger-Kernel does): they hold the gradient once the loss is
    computed, not only after the backward. A leaf's values are never overwritten (its gradient
    would be the tensor itself), nor logits the node that made them saved for its own backward
    (:meth:`may_keep_over`: a tanh's or a sigmoid's output, which that backward reads after
    this one): they get a gradient of their own, as without ``inplace_grad``; the gradient is
    right either way, and the op serves the next call as before. Other readers of the logits
    are the module docstring's."""

    kernel_types = {CrossEntropyFwdInterface: (CrossEntropyFwdKernel,)}

    def forward(self, call, logits, target, loss) -> None:
        x = _laid(logits)
        if not self.gradient_wanted("logits"):
            self._entry(call.device, CrossEntropyFwdInterface, logits)(x, target.contiguous(),
                                                                       loss)
            return
        entry = self._entry(call.device, CrossEntropyFwdInterface, logits, kept=True)
        # over the logits with inplace_grad (their copy, where the kernels could not read
        # them), unless they are a leaf or a node saved them (may_keep_over): then a tensor
        # of their own, as without inplace_grad
        over = self.inplace_grad and (x is not logits or self.may_keep_over(logits))
        grad = x if over else _empty_as(x)
        entry(x, target.contiguous(), loss, grad)
        self.keep_gradient("logits", grad, logits)

    def scale_kept(self, name, grad, dout):
        # the kernel that computed grad (only a kernel call keeps), reading dout on the device
        entry = self._entry(grad.device, CrossEntropyFwdInterface, grad, kept=True)
        entry.scale(grad, dout if dout.dtype == torch.float32 else dout.float())
        return grad

    def reference(self, call, logits, target):
        return (self._loss(_wide(logits), target),)

    def eager(self):
        return _eager_cross_entropy(self)

    peers = {"liger": lambda op: _liger_ce(op)}


def _eager_cross_entropy(op: CrossEntropyOp) -> Any:
    """``torch.nn.functional.cross_entropy`` with ``op``'s options (the z-loss and the softcap
    spelled in torch)."""
    ignore, reduction, eps = op.ignore_index, op.reduction, op.label_smoothing
    zscale, softcap = op.lse_square_scale, op.softcap

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


class CrossEntropyBwdOp(CrossEntropyOp):
    kernel_types = {CrossEntropyBwdInterface: (CrossEntropyBwdKernel,)}

    def forward(self, call, logits, target, dloss, dlogits) -> None:
        # with inplace_grad, dlogits is logits: the kernel writes each element after its
        # second read of it, by the same thread, so the row may be overwritten as it goes
        entry = self._entry(call.device, CrossEntropyBwdInterface, logits)
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


# --- the fused linear cross-entropy ---------------------------------------------------------------

#: the most bytes a block's logits take: 256 MiB is 1024 rows of a 128256 vocabulary in
#: bfloat16, rows enough for each block's GEMMs to fill an H200 (1002 x 8 tiles of 128 x 128
#: for the logits), and the block's logits are all the loss holds beyond its inputs and their
#: gradients (within the bar of 0.5 GiB)
BLOCK_BYTES = 1 << 28


def block_rows(rows: int, classes: int, itemsize: int) -> int:
    """Rows per block: as many as :data:`BLOCK_BYTES` holds, a multiple of 128 (a GEMM tile's
    rows) where more fit, at least one, at most ``rows``."""
    fit = max(1, BLOCK_BYTES // max(1, classes * itemsize))
    if fit > 128:
        fit -= fit % 128
    return max(1, min(rows, fit))


class FusedLinearCrossEntropyOp(CrossEntropyOp):
    """Family base of the fused linear cross-entropy's two ops: the blocks of rows they both
    walk (see the module docstring)."""

    delegate_types = {"logits": GemmFwdOp, "loss": CrossEntropyFwdOp,
                      "grad": CrossEntropyBwdOp, "dhidden": GemmFwdOp, "dweight": GemmFwdOp,
                      "dweight_sum": GemmAccumulateFwdOp}

    def derive(self) -> None:
        super().derive()
        #: the blocks' cross-entropy params: a block's losses are summed, or kept per row
        self._block_params = dict(
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale, softcap=self.softcap,
            reduction="none" if self._reduction is Reduction.NONE else "sum")

    def _refuse_unserved(self, hidden: torch.Tensor) -> None:
        # on CUDA the GEMM delegates take the in-tree kernels (bound by device), which serve
        # fewer dtypes than the entry: refuse by this op's name, not the delegate's
        if hidden.is_cuda and self.target is None:
            refuse_unserved(self, hidden.dtype, _GEMM_DTYPES, "GEMM")

    def _scale(self, dloss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each row's share of ``dloss`` as the blocks' gradient op takes it: ``dloss`` (0-dim
        for sum, per row for none) or ``dloss / count`` for mean, in float64 for float64."""
        if self._reduction is Reduction.MEAN:
            return dloss / (target != self.ignore_index).sum().to(dloss.dtype)
        return dloss

    def _blocks(self, hidden, weight, target, *, loss, scale, dhidden, dweight,
                new_dweight=False):
        """Walk the blocks of rows: each block's logits, then (``loss`` given) its loss, summed
        into the returned 0-dim tensor or written into ``loss``'s rows for reduction none; then
        (a gradient given) the gradient of the logits scaled by ``scale`` written over them,
        ``dhidden``'s rows and ``dweight``'s sum over blocks: added to the given ``dweight``
        (zeroed here), or with ``new_dweight`` (``dweight`` None) the first block's product,
        to which the next blocks add theirs. Returns the loss total and ``dweight``."""
        n, v = hidden.shape[0], weight.shape[0]
        rows = block_rows(n, v, hidden.element_size())
        logits_of = self.delegate_for("logits", trans_b=True)
        loss_of = self.delegate_for("loss", **self._block_params)
        grad_of = self.delegate_for("grad", inplace_grad=True, **self._block_params)
        dhidden_of = self.delegate_for("dhidden")
        dweight_of = self.delegate_for("dweight", trans_a=True)  # dlogits.T @ hidden
        dweight_sum_of = self.delegate_for("dweight_sum", trans_a=True)
        per_row = self._reduction is Reduction.NONE
        total = None
        want_dweight = new_dweight or dweight is not None
        if new_dweight and n == 0:
            dweight = weight.new_zeros(weight.shape)
        elif dweight is not None:
            dweight.zero_()
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            h, t = hidden[r0:r1], target[r0:r1]
            with self.stage("logits"):
                z = logits_of(h, weight)
            if loss is not None:
                with self.stage("loss"):
                    part = loss_of(z, t)
                if per_row:
                    loss[r0:r1].copy_(part)
                else:
                    total = part if total is None else total + part
            if dhidden is not None or want_dweight:
                with self.stage("grad"):  # z is the gradient of the block's logits after it
                    grad_of(z, t, scale[r0:r1] if per_row else scale)
            if dhidden is not None:
                with self.stage("dhidden"):
                    dhidden[r0:r1].copy_(dhidden_of(z, weight))
            if want_dweight:
                if dweight is None:  # the first block's product is the new dweight
                    with self.stage("dweight"):
                        dweight = dweight_of(z, h)
                else:
                    with self.stage("dweight_sum"):
                        dweight_sum_of(dweight, z, h)
            # freed before the next block's logits are allocated: one block's at a time
            del z
        return total, dweight

    def _logits(self, call: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The references' logits: the product in float32 (float64 for float64 inputs),
        stored in the call's dtype as ``F.linear`` and the GEMM op store them, then widened
        (``fp64_reference`` passes float64 copies: the call has the dtype).
        The rounding is the loss's definition, not an error of the op: on standard normal
        inputs of 4096 features the logits are about 64 in size, a bfloat16 step there is 0.25
        to 1, and softmax's response to it alone puts the gradients 2e-2 from those of
        unrounded logits (measured at 256 x 4096 x 256), for torch's loss as for this one."""
        logits = _wide(hidden) @ _wide(weight).T
        return logits.to(call.d_hidden).to(logits.dtype)


class FusedLinearCrossEntropyFwdOp(FusedLinearCrossEntropyOp):
    def forward(self, call, hidden, weight, target, loss) -> None:
        self._refuse_unserved(hidden)
        # in training with a 0-dim loss, the gradients for dloss = 1 as the blocks go
        want_h, want_w = self.gradient_wanted("hidden"), self.gradient_wanted("weight")
        dhidden = _empty_as(hidden) if want_h else None
        scale = None
        if want_h or want_w:
            scale = self._scale(torch.ones((), dtype=loss.dtype, device=loss.device), target)
        total, dweight = self._blocks(hidden, weight, target, loss=loss, scale=scale,
                                      dhidden=dhidden, dweight=None, new_dweight=want_w)
        if self._reduction is not Reduction.NONE:
            if total is None:  # no rows: a sum of nothing (and the mean 0 / 0, NaN)
                total = loss.new_zeros(())
            if self._reduction is Reduction.MEAN:
                total = total / (target != self.ignore_index).sum().to(total.dtype)
            loss.copy_(total)
        if want_h:
            self.keep_gradient("hidden", dhidden, hidden)
        if want_w:
            self.keep_gradient("weight", dweight, weight)

    def reference(self, call, hidden, weight, target):
        return (self._loss(self._logits(call, hidden, weight), target),)

    def eager(self):
        cross_entropy = _eager_cross_entropy(self)

        def linear_cross_entropy(hidden, weight, target):  # F.cross_entropy of F.linear
            return cross_entropy(F.linear(hidden, weight), target)

        return linear_cross_entropy

    peers = {"liger": lambda op: _liger_flce(op)}


class FusedLinearCrossEntropyBwdOp(FusedLinearCrossEntropyOp):
    def forward(self, call, hidden, weight, target, dloss, dhidden, dweight) -> None:
        self._refuse_unserved(hidden)
        wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        self._blocks(hidden, weight, target, loss=None, scale=self._scale(dloss.to(wide), target),
                     dhidden=dhidden, dweight=dweight)

    def reference(self, call, hidden, weight, target, dloss):
        h, w = _wide(hidden), _wide(weight)
        g = self._grad(self._logits(call, hidden, weight), target, dloss)
        return (g @ w if self.grad_hidden else None, g.T @ h if self.grad_weight else None)


#: the dtypes the GEMM kernels serve (the fused loss's delegates on CUDA)
_GEMM_DTYPES = frozenset(get_args(GemmDType))


def _empty_as(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``t``'s shape, dtype and device: a kept gradient."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


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



def _liger_flce(op: FusedLinearCrossEntropyFwdOp) -> Any:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    if op.reduction == "none":  # Liger's fused loss reduces (mean or sum)
        return None
    options = dict(ignore_index=op.ignore_index, reduction=op.reduction,
                   label_smoothing=op.label_smoothing, lse_square_scale=op.lse_square_scale,
                   softcap=op.softcap)

    def liger_fused_linear_cross_entropy_loss(hidden, weight, target):
        out = liger_fused_linear_cross_entropy(hidden, weight, target, **options)
        out = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
        return out.float()

    return liger_fused_linear_cross_entropy_loss
