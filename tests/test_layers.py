"""The import-linter contracts in .importlinter hold on this repository and catch a breach.

Each check runs `lint-imports` with the repository's own config, either on the real
packages or on a throwaway tree of the five packages in which one module imports a higher
layer (or a forbidden third-party package). import-linter reads sources statically, so the
fake tree needs no real code and torch need not be installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"
PACKAGES = ("spec", "signature", "runtime", "kernels", "ops")  # innermost first


def _lint_imports() -> str:
    # Prefer the script beside this interpreter (the test venv), then PATH.
    here = Path(sys.executable).parent / "lint-imports"
    found = str(here) if here.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.skip("lint-imports (import-linter) is not installed")
    return found


def _run(cwd: Path, src_dirs: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(d) for d in src_dirs)}
    return subprocess.run(
        [_lint_imports(), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _fake_tree(tmp_path: Path, imports: dict[str, str]) -> Path:
    """The five packages under tmp_path/src/tileops (a namespace), the real config beside."""
    src = tmp_path / "src"
    for name in PACKAGES:
        package = src / "tileops" / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(imports.get(name, ""))
    shutil.copy(CONFIG, tmp_path / ".importlinter")
    return src


def test_real_tree_keeps_the_contracts() -> None:
    src_dirs = [ROOT / "packages" / name / "src" for name in PACKAGES]
    result = _run(ROOT, src_dirs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_inward_imports_are_allowed(tmp_path: Path) -> None:
    # Control for the tests below: the fake tree itself satisfies the contracts.
    imports = {
        "ops": "import tileops.kernels\n",
        "kernels": "import tileops.runtime\nimport tilelang\n",
        "runtime": "import tileops.signature\nimport torch\n",
        "signature": "from tileops import spec\n\n\ndef adapter():\n    import torch\n",
    }
    result = _run(tmp_path, [_fake_tree(tmp_path, imports)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("spec", "signature"),  # one layer up
        ("runtime", "ops"),  # several layers up
    ],
)
def test_outward_import_breaks_the_layers_contract(
    tmp_path: Path, importer: str, imported: str
) -> None:
    src = _fake_tree(tmp_path, {importer: f"import tileops.{imported}\n"})
    result = _run(tmp_path, [src])
    assert result.returncode != 0
    assert ("Layers: integrations -> nn -> ops -> kernels -> runtime -> signature -> spec "
            "BROKEN") in result.stdout
    assert f"tileops.{importer} -> tileops.{imported}" in result.stdout


@pytest.mark.parametrize(
    ("importer", "imported", "contract"),
    [
        ("spec", "torch", "spec does not import torch"),
        ("runtime", "tilelang", "spec, signature and runtime do not import tilelang"),
    ],
)
def test_forbidden_third_party_import_breaks_a_contract(
    tmp_path: Path, importer: str, imported: str, contract: str
) -> None:
    src = _fake_tree(tmp_path, {importer: f"import {imported}\n"})
    result = _run(tmp_path, [src])
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout
    assert f"tileops.{importer} -> {imported}" in result.stdout
