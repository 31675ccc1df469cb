"""The ``--prebuild`` entry point of the GPU test files (``python3 tests/kernels/test_<family>_cuda.py
--prebuild --workers N``): compile every program a file's tests use in spawned processes before
the tests run, so that the run loads them from TileLang's cache instead of compiling one after
another. A file gives its program keys, the builder of one key and how a key is shown; a
program that fails to build is reported (its exception's first line) and the rest go on.
``--kinds a,b`` builds only the keys whose first field is one of those kinds."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from typing import Any

__all__ = ["build_all", "main"]


def _timed(build: Callable[[Any], Any], key: Any) -> tuple[float, str]:
    t = time.perf_counter()
    try:
        build(key)
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, the others go on
        lines = str(exc).strip().splitlines()
        status = f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
    return time.perf_counter() - t, status


def build_all(keys: Iterable[Any], build: Callable[[Any], Any], describe: Callable[[Any], str],
              workers: int) -> int:
    """Build each key with ``build`` (a module-level function: it is pickled by name into the
    spawned workers) on ``workers`` processes, a line a key; 1 when any failed."""
    keys = list(keys)
    t, failed = time.perf_counter(), 0
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        for key, (secs, status) in zip(keys, pool.map(partial(_timed, build), keys),
                                       strict=True):
            failed += status != "ok"
            print(f"{describe(key)} {secs:.1f}s {status}", flush=True)
    print(f"prebuilt {len(keys)} programs in {time.perf_counter() - t:.0f}s, {failed} failed")
    return 1 if failed else 0


def main(keys: Callable[[], Iterable[Any]], build: Callable[[Any], Any],
         describe: Callable[[Any], str], argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="compile this file's programs in parallel")
    ap.add_argument("--prebuild", action="store_true", required=True)
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--kinds", default=None,
                    help="comma-separated kinds (a key's first field, where it names one) to "
                         "build, the others left out (default: every program)")
    args = ap.parse_args(argv)
    chosen = list(keys())
    if args.kinds:
        kinds = set(args.kinds.split(","))
        chosen = [k for k in chosen if isinstance(k, tuple) and k and k[0] in kinds]
        if not chosen:
            ap.error(f"no program of the kinds {sorted(kinds)}")
    return build_all(chosen, build, describe, args.workers)
