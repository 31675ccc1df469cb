"""What the benchmark scripts share: CUDA timing and the machine they ran on.

The timing is the harness's (:mod:`tileops.ops.cli.timing`, behind ``tileops bench``), in the
milliseconds the scripts report, so a sweep and the side-by-side tables measure alike. The
scripts run standalone (``python benchmarks/<name>.py``, the packages' sources put on
``sys.path`` first), so this module is imported as a sibling from the script's directory; it
imports torch and TileOPs only when a function needs them, so the CPU-only scripts load it
without either.
"""

from __future__ import annotations

import importlib.metadata as _md
import platform
from pathlib import Path


def events(fn, iters: int, trials: int = 5) -> float:
    """Median milliseconds per call over ``trials`` runs of ``iters`` back-to-back calls,
    timed with CUDA events (:func:`tileops.ops.cli.timing.events_time`, the harness's own)."""
    from tileops.ops.cli.timing import events_time

    return events_time(fn, iters, trials) * 1e3


def graph_events(fn, iters: int, trials: int = 5) -> float:
    """Median milliseconds per call, replaying a CUDA graph of ``iters`` calls of ``fn``
    (warmed up on a side stream first): the device time, without the host's launch cost
    (:func:`tileops.ops.cli.timing.graph_time`, what ``tileops bench`` times with)."""
    from tileops.ops.cli.timing import graph_time

    return graph_time(fn, iters, trials) * 1e3


def version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def versions() -> dict:
    """Python, torch, CUDA, TileLang, Triton and Liger-Kernel (None where absent) and the GPU."""
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "tilelang": version("tilelang"),
            "triton": version("triton"), "liger_kernel": version("liger-kernel"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved_us(timers: dict, number: int, rounds: int, seconds: float) -> dict[str, list]:
    """Microseconds per call of each ``timeit.Timer`` in ``timers``, one sample per timer per
    round: the timers take turns round by round (so a disturbance from elsewhere hits them
    alike), for at least ``rounds`` rounds and at least ``seconds`` seconds. On a shared
    machine whose speed drifts over seconds, spreading the rounds over time is what lets the
    best sample of each timer come from an undisturbed moment."""
    import time

    samples: dict[str, list] = {k: [] for k in timers}
    start = time.perf_counter()
    done = 0
    while done < rounds or time.perf_counter() - start < seconds:
        for k, t in timers.items():
            samples[k].append(t.timeit(number) / number * 1e6)
        done += 1
    return samples
