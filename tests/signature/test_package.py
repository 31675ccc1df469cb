"""tileops-signature installs as one portion of the `tileops` namespace, with the dependencies
the architecture gives it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import tileops
import tileops.signature


def test_tileops_is_a_namespace_package() -> None:
    # PEP 420: no distribution ships tileops/__init__.py, so the portions merge.
    assert getattr(tileops, "__file__", None) is None
    portions = [Path(p).resolve() for p in tileops.__path__]
    assert not [p for p in portions if (p / "__init__.py").exists()]
    assert Path(tileops.signature.__file__).resolve().parent.parent in portions


def test_declared_dependencies() -> None:
    try:
        dist = importlib.metadata.distribution("tileops-signature")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tileops-signature is imported from a source path, not installed")
    assert dist.version == "0.1.0"
    requires = {Requirement(r).name for r in dist.requires or []}
    assert requires == {"tileops-spec"}


def test_import_does_not_load_torch() -> None:
    # tileops.signature works on anything with .shape and .dtype; torch stays optional.
    code = "import sys, tileops.signature; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _package_imports(path: Path) -> set[str]:
    """The modules of this package that ``path`` imports when it runs: relative imports at
    any depth (a function-level import runs too), except those under ``if TYPE_CHECKING:``,
    which only annotations read."""
    import ast

    tree = ast.parse(path.read_text())
    type_only = {id(n) for st in ast.walk(tree) if isinstance(st, ast.If)
                 and isinstance(st.test, ast.Name) and st.test.id == "TYPE_CHECKING"
                 for n in ast.walk(st)}
    return {node.module.split(".")[0] for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
            and id(node) not in type_only}


def test_the_generator_modules_import_each_other_without_cycles() -> None:
    # One module per concern, each importing only those below it; `common` below them all.
    root = Path(tileops.signature.__file__).parent
    graph = {p.stem: _package_imports(p) for p in root.glob("*.py")}
    assert graph["common"] == set()
    done: list[str] = []
    while len(done) < len(graph):
        ready = [m for m in graph if m not in done and graph[m] <= set(done)]
        assert ready, f"an import cycle among {sorted(set(graph) - set(done))}"
        done += ready
