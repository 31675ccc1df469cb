"""What ``import tileops.ops`` does: it defines every shipped op class but builds the generated
members (plan, ``__init__``, ``__call__``, docstring) of almost none of them (runtime/lazy.py),
and with the validated spec record in the cache it imports no YAML parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROBE = """
import json, sys
import torch
import tileops.ops as ops
from tileops.runtime import Op
from tileops.runtime.lazy import is_deferred
classes = [c for c in vars(ops).values() if isinstance(c, type) and issubclass(c, Op)
           and "_signature" in c.__dict__]
print(json.dumps({"yaml": "yaml" in sys.modules, "classes": len(classes),
                  "built": sorted(c.__name__ for c in classes
                                  if not is_deferred(c, "_signature")
                                  and c.__dict__["_signature"] is not None)}))
"""


def test_importing_the_ops_builds_few_classes_and_no_yaml_parser_from_the_record(
        tmp_path) -> None:
    env = {**os.environ, "TILEOPS_CACHE_DIR": str(tmp_path)}

    def probe() -> dict:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = probe()  # an empty cache: the files are read and validated, the record written
    assert first["yaml"]
    second = probe()
    assert not second["yaml"]
    assert second["classes"] > 100
    # only the classes whose family base reads the plan when a class is defined (the row
    # normalizations' slot layout) are built by the import
    assert second["built"] and all("Norm" in n for n in second["built"]), second["built"]


_GC_PROBE = """
import gc, sys
import torch
if sys.argv[1] == "off":
    gc.disable()
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                    and full.append(1))
import tileops.ops
print(gc.isenabled(), len(full))
"""


def test_the_import_runs_no_full_collection_and_leaves_the_collector_as_it_found_it() -> None:
    """The import's long-lived objects would start the full collection over torch's objects
    that torch's import leaves due (the larger part of the import's time); the collector is
    off for it and as it was after, whether the caller had it on or off."""
    for state, enabled in (("on", "True"), ("off", "False")):
        out = subprocess.run([sys.executable, "-c", _GC_PROBE, state], capture_output=True,
                             text=True, check=True).stdout.split()
        assert out == [enabled, "0"], (state, out)
