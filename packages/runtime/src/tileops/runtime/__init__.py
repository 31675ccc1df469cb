"""tileops.runtime: the Op base class, kernel selection, targets, composite ops and tuning.

See ``packages/runtime/README.md`` for how one call flows.
"""

from . import env, log, targets
from .errors import (
    AmbiguousKernelError,
    NoKernelError,
    StageError,
    TargetError,
    TileOpsRuntimeError,
)
from .kernel import CallSpec, Kernel, KernelInterface, device_arch, select
from .op import Op, instance_for_key
from .specs import SpecSet, default_specs, register_specs
from .targets import (
    IN_TREE,
    REFERENCE,
    register_builder,
    register_target,
    set_default_target,
)

__version__ = "0.1.0"

__all__ = [
    "IN_TREE",
    "REFERENCE",
    "AmbiguousKernelError",
    "CallSpec",
    "Kernel",
    "KernelInterface",
    "NoKernelError",
    "Op",
    "SpecSet",
    "StageError",
    "TargetError",
    "TileOpsRuntimeError",
    "default_specs",
    "device_arch",
    "env",
    "instance_for_key",
    "log",
    "register_builder",
    "register_specs",
    "register_target",
    "select",
    "set_default_target",
    "targets",
]
