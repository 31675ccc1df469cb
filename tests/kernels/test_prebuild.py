"""The GPU test files' shared ``--prebuild`` entry point (tests/kernels/_prebuild.py) on the
CPU: every key is built in a spawned worker, a line a key with its time and status, a failing
build reported by its exception's first line while the others go on, and the exit status 1
when any failed."""

from __future__ import annotations

import importlib.util
import math
import operator
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _prebuild import build_all, main  # noqa: E402


def test_every_key_is_built_and_a_failure_is_reported_by_its_first_line(capsys) -> None:
    assert build_all([3, -1, 5], math.factorial, lambda k: f"factorial {k}", workers=2) == 1
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"factorial 3 \d+\.\ds ok", lines[0])
    assert re.fullmatch(r"factorial -1 \d+\.\ds ValueError: factorial\(\) not defined for "
                        r"negative values", lines[1])
    assert re.fullmatch(r"factorial 5 \d+\.\ds ok", lines[2])
    assert re.fullmatch(r"prebuilt 3 programs in \d+s, 1 failed", lines[3])


def test_the_entry_point_takes_the_workers_and_succeeds_when_all_build(capsys) -> None:
    assert main(lambda: [1, 2], math.factorial, str, ["--prebuild", "--workers", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("prebuilt 2 programs in ")


def test_kinds_build_only_the_keys_of_those_kinds(capsys) -> None:
    keys = [("a", 1), ("b", 2), ("c", 3), ("a", 4)]
    # (the builder goes to spawned workers by name: a library's, as a test module's is not
    # importable there under every import mode)
    build = operator.itemgetter(1)
    assert main(lambda: keys, build, str, ["--prebuild", "--workers", "1", "--kinds", "a,c"]) \
        == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in lines[:-1]] == ["('a',", "('c',", "('a',"]
    assert lines[-1].startswith("prebuilt 3 programs in ")
    with pytest.raises(SystemExit):
        main(lambda: keys, build, str, ["--prebuild", "--kinds", "z"])
    assert "no program of the kinds ['z']" in capsys.readouterr().err



#: the GPU test files whose prebuilt programs' keys are computed without a GPU (the others'
#: keys read the device's properties)
_PREBUILT = ["test_attention_cuda", "test_fp8_cuda", "test_moe_cuda", "test_scan_cuda",
             "test_topk_cuda"]


@pytest.mark.parametrize("module", _PREBUILT)
def test_each_gpu_file_names_every_program_it_prebuilds(module, monkeypatch) -> None:
    """The description of each key a GPU test file prebuilds is computed on the CPU (a key
    that gained a field broke the GPU run's progress lines before). The file is loaded as the
    prebuild's spawned workers load it (``__mp_main__``: no module-level skip)."""
    path = Path(__file__).parent / f"{module}.py"
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "__mp_main__", mod)
    spec.loader.exec_module(mod)
    keys = mod.program_keys()
    assert keys
    for key in keys:
        line = mod._describe(key)
        assert isinstance(line, str) and line and "\n" not in line
