"""tileops.ops: TileOPs operators for PyTorch.

Importing this package registers the shipped specs (``specs/*.yaml``) and imports each
family's module, named after the entries' ``family:`` (``norm`` -> ``tileops.ops.norm``); its
``__all__`` (the family base and its ops) is exported here. A new family is its spec file and
its module: nothing here names it. Every op declares its reference beside it, which is how the
``reference`` target serves it on any device.
"""

from importlib import import_module
from importlib.util import find_spec
from pathlib import Path

from tileops.runtime import register_specs

SPEC_DIR = Path(__file__).parent / "specs"
_specs = register_specs(SPEC_DIR)

__version__ = "0.1.0"

#: the families of the shipped entries that have a module here, in name order
FAMILIES: tuple[str, ...] = tuple(sorted(
    f for f in {_specs.find(n)[0].family for n in _specs.names()}
    if f.isidentifier() and find_spec(f"{__name__}.{f}") is not None))

__all__ = ["FAMILIES", "SPEC_DIR"]
for _family in FAMILIES:
    _module = import_module(f".{_family}", __name__)
    for _name in _module.__all__:
        globals()[_name] = getattr(_module, _name)
        __all__.append(_name)
del _family, _module, _name
