"""tileops.signature: signature plans that generate every check, inference and roofline.

Compile a spec entry into a :class:`SignaturePlan`; at a construction point it generates the
call check (unification of shapes and dtypes, refinements, presence), output inference, the
effect branch, traffic and roofline as plain Python. Works on any object with ``.shape`` and
``.dtype`` through a :class:`DTypeAdapter` (torch and numpy ship); imports no torch itself.
"""

from .adapters import DTypeAdapter, numpy_adapter, torch_adapter
from .call import SignatureCall, Stage
from .errors import ConstructionError, SignatureCallError, SignatureIndexError
from .explain import explain
from .plan import ConstructionPoint, SignaturePlan

_SignaturePlan = SignaturePlan  # the name the design documents use

__version__ = "0.1.0"

__all__ = [
    "ConstructionError",
    "ConstructionPoint",
    "DTypeAdapter",
    "SignatureCall",
    "SignatureCallError",
    "SignatureIndexError",
    "SignaturePlan",
    "Stage",
    "explain",
    "numpy_adapter",
    "torch_adapter",
]
