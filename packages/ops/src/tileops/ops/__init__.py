"""tileops.ops: TileOPs operators for PyTorch.

Importing this package registers the shipped specs (``specs/*.yaml``) and imports each
family's module, named after the entries' ``family:`` (``norm`` -> ``tileops.ops.norm``); its
``__all__`` (the family base and its ops) is exported here. A new family is its spec file and
its module: nothing here names it. Every op declares its reference beside it, which is how the
``reference`` target serves it on any device.
"""

import gc
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path

SPEC_DIR = Path(__file__).parent / "specs"
__version__ = "0.1.0"

# The import makes tens of thousands of objects that live as long as the process (the specs'
# records, the op classes, their plans) and no garbage worth a pass. With the collector on,
# they start the full pass over every object torch's import left (some 170k, 0.1 s on a CI
# core), which torch leaves due: any program keeping some 20k objects after `import torch`
# pays it. The collector is off for this import and back as it was after, so the pass falls
# where it would without this package, not inside its import.
_collecting = gc.isenabled()
gc.disable()
try:
    from tileops.runtime import register_specs

    _specs = register_specs(SPEC_DIR)

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
    from ._dtypes import UnservedDtypeError as UnservedDtypeError

    __all__.append("UnservedDtypeError")
finally:
    if _collecting:
        gc.enable()
    del _collecting
