"""tileops-runtime installs as one portion of the `tileops` namespace, with the dependencies
the architecture gives it."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import tileops
import tileops.runtime


def test_tileops_is_a_namespace_package() -> None:
    # PEP 420: no distribution ships tileops/__init__.py, so the portions merge.
    assert getattr(tileops, "__file__", None) is None
    portions = [Path(p).resolve() for p in tileops.__path__]
    assert not [p for p in portions if (p / "__init__.py").exists()]
    assert Path(tileops.runtime.__file__).resolve().parent.parent in portions


def test_declared_dependencies() -> None:
    try:
        dist = importlib.metadata.distribution("tileops-runtime")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tileops-runtime is imported from a source path, not installed")
    assert dist.version == "0.1.0"
    requires = {Requirement(r).name for r in dist.requires or []}
    assert requires == {"tileops-signature", "torch"}
