"""Every environment knob of TileOPs, in one place.

| variable              | default                  | meaning                                        |
|-----------------------|--------------------------|------------------------------------------------|
| ``TILEOPS_CACHE_DIR`` | ``~/.cache/tileops``     | everything TileOPs writes: tuned configs,      |
|                       |                          | validated specs, compiled kernels              |
| ``TILEOPS_LOG_LEVEL`` | ``WARNING``              | ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``  |
| ``TILEOPS_TARGET``    | unset (choose by device) | the process default target (``reference``, ...)|

Values are read when first asked for and can be overridden in-process (``set_default_target``
in :mod:`tileops.runtime.targets`, ``set_log_level`` in :mod:`tileops.runtime.log`).

``TILEOPS_CACHE_DIR`` is the one knob for what the library writes. TileLang keeps compiled
kernels in a directory of its own (``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``) and
tvm-ffi, which TileLang imports, may build an addon into ``TVM_FFI_CACHE_DIR``
(``~/.cache/tvm-ffi``); :func:`compiler_cache_env` gives both variables a folder under
``cache_dir()`` and ``tileops.kernels`` sets them before it imports TileLang, replacing any
value they had, so ``tileops cache clear`` deletes every file TileOPs caused to be written
(a process that also uses TileLang directly shares that folder). :data:`CACHE_PARTS` names
the folders, for ``tileops cache info``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_PARTS", "KNOBS", "cache_dir", "cache_part", "compiler_cache_env",
           "default_target", "log_level"]

KNOBS = {
    "TILEOPS_CACHE_DIR": "directory for everything TileOPs writes: tuned configs, validated "
                         "specs, compiled kernels",
    "TILEOPS_LOG_LEVEL": "DEBUG | INFO | WARNING | ERROR (default WARNING)",
    "TILEOPS_TARGET": "process default target name (default: choose by device)",
}

#: the folders under ``cache_dir()``, by name, with what each holds
CACHE_PARTS = {
    "gemm": "tuned GEMM configurations (json)",
    "kernels": "compiled kernels as shared libraries, loaded without importing TileLang",
    "specs": "validated spec files (msgpack), keyed by their bytes and the validator's code",
    "tilelang": "compiled kernels (TileLang's cache, TILELANG_CACHE_DIR)",
    "tvm-ffi": "tvm-ffi's build of its torch DLPack addon (TVM_FFI_CACHE_DIR)",
}

#: the compiler's own variables and the part of the cache each is pointed at
_COMPILER_VARS = {"TILELANG_CACHE_DIR": "tilelang", "TVM_FFI_CACHE_DIR": "tvm-ffi"}

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def cache_dir() -> Path:
    """The cache directory, absolute: TileLang is handed it as a path and must find the same
    folder whatever the working directory is when it compiles."""
    raw = os.environ.get("TILEOPS_CACHE_DIR")
    return Path(raw).expanduser().absolute() if raw else Path.home() / ".cache" / "tileops"


def cache_part(name: str) -> Path:
    """The folder of one of :data:`CACHE_PARTS` (a KeyError names an unknown part)."""
    if name not in CACHE_PARTS:
        raise KeyError(f"unknown cache part {name!r}; parts: {', '.join(CACHE_PARTS)}")
    return cache_dir() / name


def compiler_cache_env() -> dict[str, str]:
    """``TILELANG_CACHE_DIR`` and ``TVM_FFI_CACHE_DIR``, each a folder under
    :func:`cache_dir`: what ``tileops.kernels`` puts in ``os.environ`` before importing
    TileLang (both read the variable live or at import, never a value saved earlier)."""
    return {var: str(cache_part(part)) for var, part in _COMPILER_VARS.items()}


def log_level() -> str:
    raw = os.environ.get("TILEOPS_LOG_LEVEL", "WARNING").strip().upper()
    if raw not in _LEVELS:
        raise ValueError(
            f"TILEOPS_LOG_LEVEL must be one of {', '.join(_LEVELS)}, got {raw!r}"
        )
    return raw


def default_target() -> str | None:
    raw = os.environ.get("TILEOPS_TARGET", "").strip()
    return raw or None
