"""Leveled logging that costs nothing when off.

Hot paths test a module-level boolean (``if log.DEBUG:``) before building any message, so a
disabled level costs one global read. The level comes from ``TILEOPS_LOG_LEVEL``.
"""

from __future__ import annotations

import logging

from . import env

__all__ = ["DEBUG", "INFO", "debug", "info", "logger", "set_log_level", "warning"]

logger = logging.getLogger("tileops")
DEBUG = False
INFO = False


def set_log_level(level: str) -> None:
    """Set the level for the ``tileops`` logger and the fast-path flags."""
    global DEBUG, INFO
    level = level.upper()
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[tileops %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    DEBUG = logger.isEnabledFor(logging.DEBUG)
    INFO = logger.isEnabledFor(logging.INFO)


def debug(msg: str, *args: object) -> None:
    if DEBUG:
        logger.debug(msg, *args)


def info(msg: str, *args: object) -> None:
    if INFO:
        logger.info(msg, *args)


def warning(msg: str, *args: object) -> None:
    logger.warning(msg, *args)


set_log_level(env.log_level())
