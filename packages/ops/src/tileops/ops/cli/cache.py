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

from .core import version

__all__ = ["cache", "env_cmd"]


def _dir_size(path: Path) -> tuple[int, int]:
    files = size = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            files += 1
            size += p.stat().st_size
    return files, size


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
    info["cache"] = {"dir": str(cache), "exists": cache.is_dir(), "files": files, "bytes": size}
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
    state = f"{c['files']} files, {c['bytes'] / 2**20:.1f} MiB" if c["exists"] else "not created"
    lines.append(f"cache: {c['dir']} ({state})")
    lines.append(f"targets: {', '.join(info['targets'])}; default: {info['default_target']}")
    lines.append("knobs:")
    width = max(map(len, info["knobs"]))
    for k, v in info["knobs"].items():
        shown = repr(v) if v is not None else "(unset)"
        lines.append(f"  {k:<{width}}  {shown:<10}  {env.KNOBS[k]}")
    click.echo("\n".join(lines))


@click.group()
def cache() -> None:
    """The cache directory (TILEOPS_CACHE_DIR): tuned configs and compiled kernels."""


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


@cache.command(name="clear")
@click.option("--yes", "-y", is_flag=True, help="do not ask for confirmation")
def cache_clear(yes: bool) -> None:
    """Delete everything in the cache directory."""
    path = env.cache_dir()
    if not path.exists():
        click.echo(f"{path} does not exist; nothing to clear")
        return
    if not path.is_dir():
        raise click.ClickException(f"{path} is not a directory")
    why = _unsafe_to_clear(path)
    if why is not None:
        raise click.ClickException(f"refusing to clear {path}: {why} (check TILEOPS_CACHE_DIR)")
    files, size = _dir_size(path)
    if not yes:
        click.confirm(f"Delete {files} files ({size / 2**20:.1f} MiB) in {path}?", abort=True)
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    click.echo(f"cleared {path} ({files} files, {size / 2**20:.1f} MiB)")


@cache.command(name="info")
def cache_info() -> None:
    """Where the cache directory is and what it holds."""
    path = env.cache_dir()
    if not path.is_dir():
        click.echo(f"{path} (not created)")
        return
    files, size = _dir_size(path)
    click.echo(f"{path} ({files} files, {size / 2**20:.1f} MiB)")
