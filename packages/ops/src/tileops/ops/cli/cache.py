"""``tileops env`` (versions, GPUs, the cache directory, the knobs) and ``tileops cache``."""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import click
import torch

from tileops.runtime import env, targets
from tileops.runtime.specs import own_records_removed

from .core import version

__all__ = ["cache", "env_cmd"]


def _dir_size(path: Path) -> tuple[int, int]:
    files = size = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            files += 1
            size += p.stat().st_size
    return files, size


def _size(n: int) -> str:
    """``10 B``, ``1.5 KiB``, ``3.4 MiB``, ``1.2 GiB``: a tuning entry is a few hundred bytes
    and a compiled kernel a few hundred KiB, so one unit for all would hide one or the other."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024  # type: ignore[assignment]
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _files(files: int, size: int) -> str:
    return f"{files} file{'' if files == 1 else 's'}, {_size(size)}"


def _kind(path: Path) -> str:
    """``directory``, ``absent``, ``file`` (a regular file) or ``other`` (a FIFO, a device, a
    broken link: nothing the cache can live in)."""
    if path.is_dir():
        return "directory"
    if not path.exists() and not path.is_symlink():
        return "absent"
    return "file" if path.is_file() else "other"


def _describe(path: Path) -> str:
    """What is at ``path``, for a folder the cache needs: its files and size, ``not
    created``, or what stands where the folder should be."""
    kind = _kind(path)
    if kind == "directory":
        return _files(*_dir_size(path))
    if kind == "absent":
        return "not created"
    if kind == "file":
        return f"a regular file of {_size(path.stat().st_size)}, not a directory"
    return "neither a file nor a directory"


def _entry_state(path: Path) -> str:
    """What an entry of the cache directory that is not one of its parts holds."""
    if path.is_file() and not path.is_symlink():
        return _files(1, path.stat().st_size)
    return _describe(path)


def _env_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "tileops": {name: version(f"tileops-{name}", f"tileops.{name}") or "not installed"
                    for name in ("spec", "signature", "runtime", "kernels", "ops")},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "tilelang": version("tilelang", "tilelang") or "not installed",
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": prop.name,
                                 "arch": f"sm_{prop.major}{prop.minor}",
                                 "memory_GiB": round(prop.total_memory / 2**30, 1)})
    cache = env.cache_dir()
    files, size = _dir_size(cache) if cache.is_dir() else (0, 0)
    info["cache"] = {"dir": str(cache), "exists": cache.is_dir(), "kind": _kind(cache),
                     "state": _describe(cache), "files": files, "bytes": size}
    info["knobs"] = {k: os.environ.get(k) for k in env.KNOBS}
    info["targets"] = [targets.IN_TREE, *targets.targets()]
    info["default_target"] = targets.default_target() or "chosen by device"
    return info


@click.command(name="env")
@click.option("--json", "as_json", is_flag=True, help="print as JSON")
def env_cmd(as_json: bool) -> None:
    """Versions, GPUs and their architectures, the cache directory and the knobs."""
    info = _env_info()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    t = info["tileops"]
    lines = [f"tileops-ops {t['ops']}  (spec {t['spec']}, signature {t['signature']}, "
             f"runtime {t['runtime']}, kernels {t['kernels']})",
             f"python {info['python']} on {info['platform']}",
             f"torch {info['torch']} (CUDA build: {info['torch_cuda'] or 'none'})",
             f"tilelang {info['tilelang']}"]
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"gpu {g['index']}: {g['name']}, {g['arch']}, {g['memory_GiB']} GiB")
    else:
        lines.append("gpu: none (torch.cuda.is_available() is False): ops run on the "
                     "reference target")
    c = info["cache"]
    lines.append(f"cache: {c['dir']} ({c['state']})")
    lines.append(f"targets: {', '.join(info['targets'])}; default: {info['default_target']}")
    lines.append("knobs:")
    width = max(map(len, info["knobs"]))
    for k, v in info["knobs"].items():
        shown = repr(v) if v is not None else "(unset)"
        lines.append(f"  {k:<{width}}  {shown:<10}  {env.KNOBS[k]}")
    click.echo("\n".join(lines))


@click.group()
def cache() -> None:
    """The cache directory (TILEOPS_CACHE_DIR): everything TileOPs writes, tuned configs and
    compiled kernels (TileLang's cache is pointed inside it)."""
    # the spec record this command's own start wrote (importing the ops) is not the cache's
    own_records_removed()


def _unsafe_to_clear(path: Path) -> str | None:
    p = path.resolve()
    home = Path.home().resolve()
    if p == Path(p.anchor):
        return "it is a filesystem root"
    if p == home or p in home.parents:
        return "it is the home directory or holds it"
    if p == Path.cwd().resolve() or p in Path.cwd().resolve().parents:
        return "it is the working directory or holds it"
    return None


def _not_a_directory(path: Path) -> click.ClickException:
    return click.ClickException(f"{path} is {_describe(path)}: TILEOPS_CACHE_DIR must name a "
                                f"directory (or a path where one can be created)")


def _parts(path: Path) -> list[Path]:
    """The parts of the cache TileOPs writes that exist under ``path`` (files the directory
    holds besides them are not TileOPs's: the variable may name a folder shared with
    other things)."""
    return [path / name for name in env.CACHE_PARTS
            if (path / name).exists() or (path / name).is_symlink()]


def _parts_size(parts: list[Path]) -> tuple[int, int]:
    files = size = 0
    for part in parts:
        if part.is_dir() and not part.is_symlink():
            f, s = _dir_size(part)
        else:
            f, s = 1, (part.lstat().st_size if part.is_file() else 0)
        files, size = files + f, size + s
    return files, size


@cache.command(name="clear")
@click.option("--yes", "-y", is_flag=True, help="do not ask for confirmation")
def cache_clear(yes: bool) -> None:
    """Delete TileOPs's parts of the cache directory: tuned configs, validated specs and
    compiled kernels (anything else in it is left alone). Asks first unless --yes, and only
    when there is a file to delete."""
    path = env.cache_dir()
    kind = _kind(path)
    if kind == "absent":
        click.echo(f"{path} does not exist; nothing to clear")
        return
    if kind != "directory":
        raise _not_a_directory(path)
    why = _unsafe_to_clear(path)
    if why is not None:
        raise click.ClickException(f"refusing to clear {path}: {why} (check TILEOPS_CACHE_DIR)")
    parts = _parts(path)
    files, size = _parts_size(parts)
    if files == 0:
        click.echo(f"{path} holds no files of TileOPs's; nothing to clear")
        return
    if not yes:
        plural = "" if files == 1 else "s"
        click.confirm(f"Delete {files} file{plural} ({_size(size)}) in "
                      f"{', '.join(p.name for p in parts)} under {path}?", abort=True)
    for part in parts:
        if part.is_dir() and not part.is_symlink():
            shutil.rmtree(part)
        else:
            part.unlink()
    click.echo(f"cleared {path} ({_files(files, size)})")


@cache.command(name="info")
def cache_info() -> None:
    """Where the cache directory is and what each of its parts holds (tuned configs, compiled
    kernels, anything else in it), with sizes."""
    path = env.cache_dir()
    click.echo(f"{path} ({_describe(path)})")
    if _kind(path) != "directory":
        return
    rows = [(name, _describe(path / name), what) for name, what in env.CACHE_PARTS.items()]
    rows += [(child.name, _entry_state(child),
              "not a part of the cache; `tileops cache clear` leaves it")
             for child in sorted(path.iterdir()) if child.name not in env.CACHE_PARTS]
    name_w = max(len(r[0]) for r in rows)
    state_w = max(len(r[1]) for r in rows)
    for name, state, what in rows:
        click.echo(f"  {name:<{name_w}}  {state:<{state_w}}  {what}")
