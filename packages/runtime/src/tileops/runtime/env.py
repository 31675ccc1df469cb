"""Every environment knob of TileOPs, in one place.

| variable              | default                  | meaning                                        |
|-----------------------|--------------------------|------------------------------------------------|
| ``TILEOPS_CACHE_DIR`` | ``~/.cache/tileops``     | where tuned configs and compiled kernels live  |
| ``TILEOPS_LOG_LEVEL`` | ``WARNING``              | ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``  |
| ``TILEOPS_TARGET``    | unset (choose by device) | the process default target (``reference``, ...)|

Values are read when first asked for and can be overridden in-process (``set_default_target``
in :mod:`tileops.runtime.targets`, ``set_log_level`` in :mod:`tileops.runtime.log`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["KNOBS", "cache_dir", "default_target", "log_level"]

KNOBS = {
    "TILEOPS_CACHE_DIR": "directory for tuned configs and compiled kernels",
    "TILEOPS_LOG_LEVEL": "DEBUG | INFO | WARNING | ERROR (default WARNING)",
    "TILEOPS_TARGET": "process default target name (default: choose by device)",
}

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def cache_dir() -> Path:
    raw = os.environ.get("TILEOPS_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "tileops"


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
