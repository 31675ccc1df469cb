"""What the benchmark scripts share: CUDA-event timing and the machine they ran on.

The scripts run standalone (``python benchmarks/<name>.py``), so this module is imported as
a sibling from the script's directory.
"""

from __future__ import annotations

import importlib.metadata as _md
import platform
import statistics
from pathlib import Path


def events(fn, iters: int, trials: int = 5) -> float:
    """Median milliseconds per call over ``trials`` runs of ``iters`` back-to-back calls,
    timed with CUDA events."""
    import torch

    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def graph_events(fn, iters: int, trials: int = 5) -> float:
    """Median milliseconds per call, replaying a CUDA graph of ``iters`` calls of ``fn``
    (warmed up on a side stream first): the device time, without the host's launch cost."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    for _ in range(3):
        g.replay()
    return events(g.replay, 1, trials) / iters


def version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


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
