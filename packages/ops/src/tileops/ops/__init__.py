"""tileops.ops: TileOPs operators for PyTorch.

Importing this package registers the shipped specs (``specs/*.yaml``) and defines the op
classes. Every op declares its reference beside it, which is how the ``reference`` target
serves it on any device.
"""

from pathlib import Path

from tileops.runtime import register_specs

SPEC_DIR = Path(__file__).parent / "specs"
register_specs(SPEC_DIR)

from .gemm import GemmFwdOp, GemmOp  # noqa: E402
from .norm import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp, RowNormOp  # noqa: E402

__version__ = "0.1.0"

__all__ = ["SPEC_DIR", "FusedAddRMSNormFwdOp", "GemmFwdOp", "GemmOp", "LayerNormFwdOp",
           "RMSNormFwdOp", "RowNormOp"]
