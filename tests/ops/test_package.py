"""tileops-ops installs as one portion of the `tileops` namespace, with the dependencies
the architecture gives it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import tileops
import tileops.ops


def test_tileops_is_a_namespace_package() -> None:
    # PEP 420: no distribution ships tileops/__init__.py, so the portions merge.
    assert getattr(tileops, "__file__", None) is None
    portions = [Path(p).resolve() for p in tileops.__path__]
    assert not [p for p in portions if (p / "__init__.py").exists()]
    assert Path(tileops.ops.__file__).resolve().parent.parent in portions


def test_declared_dependencies() -> None:
    try:
        dist = importlib.metadata.distribution("tileops-ops")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tileops-ops is imported from a source path, not installed")
    assert dist.version == "0.1.0"
    requires = [Requirement(r) for r in dist.requires or []]
    # the kernels (and through them the lower layers); click and rich for the `tileops`
    # command; matplotlib (its plot) and transformers (the Hugging Face integration) only as
    # extras (packages/ops/README.md says why each)
    assert {r.name for r in requires if r.marker is None} == {"tileops-kernels", "click", "rich"}
    extras = {(str(r.marker), r.name) for r in requires if r.marker is not None}
    assert extras == {('extra == "plot"', "matplotlib"),
                      ('extra == "transformers"', "transformers")}


def test_the_tileops_command_is_installed() -> None:
    try:
        dist = importlib.metadata.distribution("tileops-ops")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tileops-ops is imported from a source path, not installed")
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"tileops": "tileops.ops.cli:main"}
    script = Path(sys.executable).parent / "tileops"
    if script.exists():  # the venv's console script runs
        proc = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                              check=False, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "tileops 0.1.0"
