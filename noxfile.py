"""Nox sessions for the TileOPs monorepo.

    nox -s tests                # every package, each in its own venv
    nox -s "tests(signature)"   # one package: tests/signature/
    nox -s lint                 # ruff + import-linter (layers ops -> kernels -> runtime -> ...)
    nox -s demo                 # `tileops run`: every implemented op on its spec workloads

Each `tests(<package>)` venv gets that package and the siblings it depends on, installed
editable in one pip call (installed alone, pip would look for the siblings on the index),
and nothing else: a package that imports something it does not declare fails its own tests.
Repository-wide tests (`tests/test_*.py`) run in `tests(ops)`, whose venv holds the whole
stack. Sessions use the interpreter that runs nox.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"  # nox.project.dependency_groups
nox.options.default_venv_backend = "uv|venv"  # uv when it is installed, else venv
nox.options.sessions = ["tests", "lint"]

ROOT = Path(__file__).parent.resolve()
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")

# Innermost first; a package depends on the ones before it (see README.md).
PACKAGES = ("spec", "signature", "runtime", "kernels", "ops")
NEEDS_TORCH = frozenset({"runtime", "kernels", "ops"})

# The package ranges admit any torch >= 2.4. An unpinned torch pulls the default (CUDA)
# build, several GB; pinning it in the same pip call lets a local build satisfy it.
# Override with e.g. TILEOPS_TORCH="torch==2.11.0".
TORCH = os.environ.get("TILEOPS_TORCH", "torch==2.13.0")


def _stack(package: str) -> list[str]:
    """pip arguments installing `package` and its in-repo dependencies, editable."""
    args: list[str] = []
    for name in PACKAGES[: PACKAGES.index(package) + 1]:
        args += ["-e", f"packages/{name}"]
    if package in NEEDS_TORCH:
        args.append(TORCH)
    return args


def _has_tests(path: Path) -> bool:
    return any(path.rglob("test_*.py")) or any(path.rglob("*_test.py"))


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Run tests/<package>/ against that package and its dependencies only."""
    stack = _stack(package)
    if package == PACKAGES[-1]:  # tests/integrations: the transformers extra
        stack[stack.index("packages/ops")] = "packages/ops[transformers]"
    session.install(*stack, *nox.project.dependency_groups(PYPROJECT, "test"))

    paths = []
    if _has_tests(ROOT / "tests" / package):
        paths.append(f"tests/{package}")
    if package == "runtime":
        # tests(signature) runs without torch, proving the package needs none; its tests of the
        # torch adapter (skipped there) run here, where torch is installed
        paths.append("tests/signature")
    if package == PACKAGES[-1]:  # the whole stack is installed here
        # tileops.nn ships in tileops-ops; the benchmark scripts' tiny modes need the stack
        paths += [f"tests/{d}" for d in ("nn", "benchmarks", "integrations")
                  if _has_tests(ROOT / "tests" / d)]
        paths += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    if not paths:
        session.skip(f"no tests in tests/{package}/")
    session.run("pytest", *paths, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, then import-linter's layer contract (.importlinter)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    targets = [p for p in ("noxfile.py", "packages", "tests", "benchmarks", "examples")
               if (ROOT / p).exists()]
    session.run("ruff", "check", *targets, *session.posargs)
    # import-linter reads the sources statically; it needs them importable, not installed
    # (installing would pull torch and tilelang for nothing).
    src = os.pathsep.join(str(ROOT / "packages" / name / "src") for name in PACKAGES)
    session.run("lint-imports", env={"PYTHONPATH": src})


@nox.session
def demo(session: nox.Session) -> None:
    """Install the whole stack and run `tileops run`: every implemented op on its spec
    workloads, on the GPU's in-tree kernels or else the reference target, checked against
    float64 and timed. Arguments after `--` go to `tileops run` (e.g. `-- RMSNormFwdOp`)."""
    session.install(*_stack(PACKAGES[-1]))
    session.run("tileops", "run", *session.posargs)
