"""Runtime errors. Call errors from the signature check are
:class:`tileops.signature.SignatureCallError`; these are about choosing and running kernels."""

from __future__ import annotations

__all__ = [
    "AmbiguousKernelError",
    "NoKernelError",
    "StageError",
    "TargetError",
    "TileOpsRuntimeError",
]


class TileOpsRuntimeError(RuntimeError):
    """Base of the runtime's errors."""


class NoKernelError(TileOpsRuntimeError):
    """No implementation of a slot applies to a call; lists each one's refusal."""


class AmbiguousKernelError(TileOpsRuntimeError):
    """Two specialised implementations claim the same call."""


class TargetError(TileOpsRuntimeError):
    """A target that does not exist or has no builder for the op."""


class StageError(TileOpsRuntimeError):
    """A composite op's sub-call made outside any stage, or a stage misuse."""
