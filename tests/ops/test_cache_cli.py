"""``tileops cache info`` and ``tileops cache clear`` over every state the cache directory and
its parts (tuned configs, TileLang's compiled kernels, tvm-ffi's addon) can be in, and
``tileops env``'s line for it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tileops.ops.cli import main
from tileops.runtime import env


def invoke(*args: str, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(path))
    return path


def _fill(cache: Path) -> None:
    """A tuned entry (300 B), a compiled kernel (3 KiB) in TileLang's layout and a stray file
    (10 B) beside the parts."""
    (cache / "gemm").mkdir(parents=True)
    (cache / "gemm" / "k.json").write_bytes(b"{" + b" " * 298 + b"}")
    kernels = cache / "tilelang" / "0.1.15" / "linux-x86_64" / "kernels" / "abc"
    kernels.mkdir(parents=True)
    (kernels / "kernel_lib.so").write_bytes(b"\0" * 3072)
    (cache / "stray.txt").write_bytes(b"x" * 10)


def _rows(output: str) -> dict[str, str]:
    """The part lines of ``cache info``, by name."""
    return {line.split()[0]: line for line in output.splitlines()[1:]}


def test_info_lists_every_part_with_its_files_and_size(cache: Path) -> None:
    _fill(cache)
    result = invoke("cache", "info")
    assert result.exit_code == 0
    first, *_ = result.output.splitlines()
    assert first == f"{cache} (3 files, 3.3 KiB)"
    rows = _rows(result.output)
    assert set(rows) == {*env.CACHE_PARTS, "stray.txt"}
    assert "1 file, 300 B" in rows["gemm"] and "tuned GEMM configurations" in rows["gemm"]
    assert "1 file, 3.0 KiB" in rows["tilelang"] and "compiled kernels" in rows["tilelang"]
    assert "not created" in rows["tvm-ffi"]
    assert "1 file, 10 B" in rows["stray.txt"] and "clear` leaves it" in rows["stray.txt"]


def test_info_reports_a_regular_file_where_a_directory_should_be(cache: Path) -> None:
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(b"12345")
    result = invoke("cache", "info")
    assert result.exit_code == 0
    assert result.output == f"{cache} (a regular file of 5 B, not a directory)\n"
    cache.unlink()
    cache.mkdir()
    (cache / "tilelang").write_bytes(b"x" * 2048)
    rows = _rows(invoke("cache", "info").output)
    assert "a regular file of 2.0 KiB, not a directory" in rows["tilelang"]
    assert "not created" in rows["gemm"]


def test_info_of_a_cache_not_created(cache: Path) -> None:
    assert invoke("cache", "info").output == f"{cache} (not created)\n"


def test_info_names_what_is_neither_file_nor_directory(cache: Path) -> None:
    cache.mkdir(parents=True)
    os.mkfifo(cache / "gemm")
    rows = _rows(invoke("cache", "info").output)
    assert "neither a file nor a directory" in rows["gemm"]


def test_clear_with_nothing_to_delete_says_so_and_does_not_prompt(cache: Path) -> None:
    # no input is given: a prompt would read end-of-file and abort with status 1
    result = invoke("cache", "clear")
    assert (result.exit_code, result.output) == (0, f"{cache} does not exist; nothing to clear\n")
    cache.mkdir(parents=True)
    nothing = f"{cache} holds no files of TileOPs's; nothing to clear\n"
    result = invoke("cache", "clear")
    assert (result.exit_code, result.output) == (0, nothing)
    (cache / "tilelang" / "0.1.15" / ".staging").mkdir(parents=True)  # what TileLang's import makes
    (cache / "gemm").mkdir()
    (cache / "theirs.txt").write_bytes(b"not ours")  # another program's file: not counted
    result = invoke("cache", "clear")
    assert (result.exit_code, result.output) == (0, nothing)
    assert (cache / "theirs.txt").read_bytes() == b"not ours"


def test_clear_asks_then_deletes_every_part_and_nothing_else(cache: Path) -> None:
    """Only TileOPs's parts go: TILEOPS_CACHE_DIR may name a folder other programs use too,
    whose files (the stray one here, a folder of another program's) stay."""
    _fill(cache)
    (cache / "other" / "sub").mkdir(parents=True)
    (cache / "other" / "sub" / "keep").write_bytes(b"k")
    result = invoke("cache", "clear", input="n\n")
    assert result.exit_code == 1
    assert f"Delete 2 files (3.3 KiB) in gemm, tilelang under {cache}?" in result.output
    assert (cache / "tilelang").is_dir()
    result = invoke("cache", "clear", input="y\n")
    assert result.exit_code == 0 and result.output.endswith(
        f"cleared {cache} (2 files, 3.3 KiB)\n")
    assert sorted(p.name for p in cache.iterdir()) == ["other", "stray.txt"]
    assert (cache / "other" / "sub" / "keep").read_bytes() == b"k"
    (cache / "specs").write_bytes(b"1")  # a part that is a file: deleted as one
    result = invoke("cache", "clear", input="y\n")
    assert f"Delete 1 file (1 B) in specs under {cache}?" in result.output
    assert not (cache / "specs").exists() and (cache / "stray.txt").exists()


def test_clear_refuses_a_regular_file(cache: Path) -> None:
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(b"keep")
    result = invoke("cache", "clear", "--yes")
    assert result.exit_code == 1
    assert (f"{cache} is a regular file of 4 B, not a directory: TILEOPS_CACHE_DIR must name "
            "a directory") in result.output
    assert cache.read_bytes() == b"keep"


def test_env_line_and_json(cache: Path) -> None:
    _fill(cache)
    result = invoke("env")
    assert f"cache: {cache} (3 files, 3.3 KiB)" in result.output
    doc = json.loads(invoke("env", "--json").stdout)["cache"]
    assert (doc["kind"], doc["files"], doc["bytes"]) == ("directory", 3, 3382)
    shutil.rmtree(cache)
    cache.write_bytes(b"")
    assert f"cache: {cache} (a regular file of 0 B, not a directory)" in invoke("env").output
    doc = json.loads(invoke("env", "--json").stdout)["cache"]
    assert (doc["kind"], doc["exists"]) == ("file", False)


def test_the_command_s_own_start_leaves_no_trace_in_the_cache(tmp_path: Path) -> None:
    """Every ``tileops`` command imports the ops, which validates the specs and records them
    in the cache; ``cache info`` and ``cache clear`` take that record back first, so a cache
    never used reads as not created and a second clear has nothing to clear, while a record
    an earlier process wrote is the cache's."""
    import subprocess
    import sys

    path = tmp_path / "never-used"
    run_env = {**os.environ, "TILEOPS_CACHE_DIR": str(path)}

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "tileops.ops.cli", *args], env=run_env,
                              capture_output=True, text=True, timeout=120, check=True)
        return done.stdout

    assert cli("cache", "info").splitlines()[0] == f"{path} (not created)"
    assert not path.exists()
    subprocess.run([sys.executable, "-c", "import tileops.ops"], env=run_env, check=True,
                   timeout=120)
    assert cli("cache", "clear", "--yes").startswith(f"cleared {path} (1 file, ")
    assert "nothing to clear" in cli("cache", "clear", "--yes")
