"""tileops.ops: TileOPs operators for PyTorch.

Importing this package registers the shipped specs (``specs/*.yaml``), defines the op classes
and registers the ``reference`` target's builders, so every op runs on any device.
"""

from pathlib import Path

from tileops.runtime import register_specs

SPEC_DIR = Path(__file__).parent / "specs"
register_specs(SPEC_DIR)

from . import reference  # noqa: E402,F401  (registers the reference target's builders)
from .gemm import GemmFwdOp  # noqa: E402
from .norm import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp  # noqa: E402

__version__ = "0.1.0"

__all__ = ["SPEC_DIR", "FusedAddRMSNormFwdOp", "GemmFwdOp", "LayerNormFwdOp", "RMSNormFwdOp"]
