"""How the ``tileops`` commands time calls, and the roofline they compare with.

Two methods, one per command:

- :func:`time_call` (``tileops run``): on CUDA the median of five batches of back-to-back calls
  between CUDA events; elsewhere the fastest of a few wall-clock calls. It answers "how long
  does a call take here", host launch cost included.
- :func:`device_time` (``tileops bench``): on CUDA the replay of a CUDA graph of ``iters``
  calls between CUDA events, the median of ``trials`` replays: the device time, without the
  host's per-call launch cost, so a contender is not judged by how Python reaches its kernel.
  Where capture fails (a contender that syncs, allocates in a way graphs refuse, or a library
  that does not support capture) it falls back to events around back-to-back calls and says
  so in its note. :func:`eager_time` is the events figure on its own: what an eager model
  sees. On the CPU both are wall time.

Cold L2 (:func:`input_sets`, :func:`rotating`): each call of a timed loop takes the next of
several input sets that together span :data:`ROTATE_BYTES`, so a call does not find its
operands left in L2 by the call before (the H200's L2 is 50 MB). The benchmarks did this for
GEMM, whose weight operand comes from HBM in a model; :mod:`tileops.ops.cli.bench` decides
per op.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..workloads import Case, make_inputs

__all__ = [
    "MATH_CLASSES",
    "ROTATE_BYTES",
    "Peaks",
    "Timing",
    "device_time",
    "eager_time",
    "events_time",
    "graph_time",
    "input_sets",
    "math_class",
    "measured_flops",
    "peaks",
    "rotating",
    "sync",
    "time_call",
]

#: input sets are rotated until they span this many bytes (at most :data:`MAX_SETS` sets)
ROTATE_BYTES = 256 << 20
MAX_SETS = 8


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_call(fn: Callable[[], Any], device: torch.device, *, repeat: int = 20,
              budget_s: float = 0.25) -> float:
    """Seconds per call of ``fn`` (already warmed up). On CUDA: the median of five batches of
    back-to-back calls timed with CUDA events. Elsewhere: the fastest of at most ``repeat``
    calls or ``budget_s`` seconds of calls (at least one), wall time with a synchronisation
    after each; the fastest call is the one least disturbed by other load on a shared CPU."""
    repeat = max(1, repeat)
    if device.type == "cuda":
        with torch.cuda.device(device):
            one = max(events_time(fn, 1, trials=1), 1e-6)
            return events_time(fn, max(1, min(repeat, int(budget_s / 5 / one))))
    times = []
    spent = 0.0
    while len(times) < repeat and (spent < budget_s or not times):
        t0 = time.perf_counter()
        fn()
        sync(device)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return min(times)


@dataclass(frozen=True)
class Peaks:
    """What the roofline of a device is drawn from: measured copy bandwidth (bytes read plus
    written per second) and measured dense matmul throughput (FLOP/s) of one math class (see
    :func:`math_class`). None where there is no meaningful peak (the CPU). ``device`` names
    the CUDA device the figures were measured on, so :meth:`for_dtype` can measure another
    class's matmul there."""

    bandwidth: float | None = None
    flops: float | None = None
    source: str = "none"
    device: str | None = None
    math: str = "bf16"

    def roof_seconds(self, flops: int, nbytes: int) -> float | None:
        if self.bandwidth is None or self.flops is None:
            return None
        return max(flops / self.flops, nbytes / self.bandwidth)

    def memory_bound(self, flops: int, nbytes: int) -> bool:
        if self.bandwidth is None or self.flops is None:
            return flops / max(nbytes, 1) < 10.0
        return nbytes / self.bandwidth >= flops / self.flops

    def for_dtype(self, dtype: str) -> Peaks:
        """The peaks a workload of ``dtype`` is judged by: this device's bandwidth and the
        matmul peak of the dtype's math class (measured once per device and class)."""
        cls = math_class(dtype)
        if self.device is None or cls == self.math:
            return self
        return peaks(torch.device(self.device), cls)


#: the math classes whose matmul peak is measured, and what measures it
MATH_CLASSES = {
    "bf16": "a bf16 8192^3 matmul",
    "fp8": "torch._scaled_mm of float8_e4m3fn 8192^3 operands with unit scales, bf16 out",
    "fp32": "a float32 8192^3 matmul at torch's float32 matmul precision",
    "fp64": "a float64 4096^3 matmul",
}


def math_class(dtype: str) -> str:
    """The matmul a workload of ``dtype`` (a torch dtype's name, as the workloads write it)
    is measured against: fp8 for the float8 dtypes, fp32 and fp64 for those floats, bf16 for
    16-bit floats and for everything else (integers and bool, whose ops move bytes)."""
    if dtype.startswith("float8"):
        return "fp8"
    return {"float32": "fp32", "float64": "fp64"}.get(dtype, "bf16")


_PEAKS: dict[tuple[str, str], Peaks] = {}


def measured_flops(device: torch.device) -> dict[str, float]:
    """The matmul peaks measured so far on ``device``, by math class."""
    return {cls: p.flops for (dev, cls), p in _PEAKS.items()
            if dev == str(device) and p.flops is not None}


def _matmul(cls: str, device: torch.device) -> tuple[Callable[[], Any], int] | None:
    """A matmul of ``cls`` on ``device`` and its FLOP count (None where the device has no
    such product: fp8 below compute capability 8.9)."""
    n = 4096 if cls == "fp64" else 8192
    if cls == "fp8":
        if torch.cuda.get_device_capability(device) < (8, 9):
            return None
        x = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        y = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return (lambda: torch._scaled_mm(x, y, scale_a=one, scale_b=one,
                                         out_dtype=torch.bfloat16)), 2 * n**3
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[cls]
    x = torch.randn(n, n, dtype=dt, device=device)
    y = torch.randn(n, n, dtype=dt, device=device)
    return (lambda: x @ y), 2 * n**3


def peaks(device: torch.device, math: str = "bf16") -> Peaks:
    """Measured peaks of ``device`` (cached): on CUDA a 512 MiB device-to-device copy and the
    matmul of the math class ``math`` (:data:`MATH_CLASSES`); elsewhere none."""
    key = (str(device), math)
    found = _PEAKS.get(key)
    if found is not None:
        return found
    if device.type != "cuda":
        p = Peaks(source=f"no roofline peak on {device.type}", math=math)
    elif math != "bf16":
        base = peaks(device)
        with torch.cuda.device(device):
            mm = _matmul(math, device)
            if mm is None:
                p = Peaks(base.bandwidth, None, f"no {math} matmul on this device",
                          str(device), math)
            else:
                fn, count = mm
                fn()
                t = time_call(fn, device, repeat=10)
                p = Peaks(base.bandwidth, count / t,
                          f"measured: device copy bandwidth and {MATH_CLASSES[math]}",
                          str(device), math)
    else:
        with torch.cuda.device(device):
            a = torch.empty(1 << 28, dtype=torch.bfloat16, device=device).normal_()
            b = torch.empty_like(a)
            b.copy_(a)
            t = time_call(lambda: b.copy_(a), device, repeat=10)
            bw = 2 * a.numel() * a.element_size() / t
            del a, b
            fn, count = _matmul("bf16", device)
            fn()
            t = time_call(fn, device, repeat=10)
        p = Peaks(bw, count / t, f"measured: device copy bandwidth and {MATH_CLASSES[math]}",
                  str(device), math)
    _PEAKS[key] = p
    return p


# --- device time (tileops bench) -------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Seconds per call and how they were measured: ``"cuda graph"``, ``"cuda events"`` or
    ``"wall clock"``; ``note`` says why the method is not the one asked for."""

    seconds: float
    method: str
    note: str | None = None


def events_time(fn: Callable[[], Any], iters: int, trials: int = 5) -> float:
    """Seconds per call: the median over ``trials`` of ``iters`` back-to-back calls of ``fn``
    between two CUDA events on the current stream."""
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / iters)
    return statistics.median(times)


def graph_time(fn: Callable[[], Any], iters: int, trials: int = 5) -> float:
    """Seconds per call, replaying a CUDA graph of ``iters`` calls of ``fn`` (warmed up on a
    side stream first, as capture requires): the median over ``trials`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    for _ in range(3):
        graph.replay()
    return events_time(graph.replay, 1, trials) / iters


#: a graph shorter than this is replayed again with more calls: the events around one replay
#: and the graph's own launch are a few microseconds, which a graph of 20 one-microsecond calls
#: would spread over them (and their jitter with it)
MIN_GRAPH_S = 200e-6
#: the most calls a graph of :func:`device_time` holds
MAX_GRAPH_CALLS = 1000


def filled_graph_time(fn: Callable[[], Any], iters: int, trials: int = 5) -> float:
    """:func:`graph_time` of ``iters`` calls, or of as many as fill :data:`MIN_GRAPH_S` (at
    most :data:`MAX_GRAPH_CALLS`) where ``iters`` calls take less."""
    seconds = graph_time(fn, iters, trials)
    if 0 < seconds * iters < MIN_GRAPH_S:
        calls = min(MAX_GRAPH_CALLS, math.ceil(MIN_GRAPH_S / seconds - 1e-9))
        seconds = graph_time(fn, calls, trials)
    return seconds


def device_time(fn: Callable[[], Any], device: torch.device, *, iters: int = 20,
                trials: int = 5) -> Timing:
    """The device time per call of ``fn`` (already warmed up): a CUDA graph replay
    (:func:`filled_graph_time`), else CUDA events around back-to-back calls (with a note),
    else (not CUDA) wall time."""
    if device.type != "cuda":
        return Timing(time_call(fn, device, repeat=iters), "wall clock")
    with torch.cuda.device(device):
        try:
            return Timing(filled_graph_time(fn, iters, trials), "cuda graph")
        except Exception as exc:  # noqa: BLE001 - the fallback below says why
            torch.cuda.synchronize()
            why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            note = (f"CUDA graph capture failed ({type(exc).__name__}: {why}), so CUDA events "
                    f"around back-to-back calls timed it (launch gaps included)")
            return Timing(events_time(fn, iters, trials), "cuda events", note)


def eager_time(fn: Callable[[], Any], device: torch.device, *, iters: int = 20,
               trials: int = 5) -> float | None:
    """Seconds per call of back-to-back eager calls between CUDA events (host launch cost
    included); None off CUDA, where it would repeat the wall time."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        return events_time(fn, iters, trials)


def input_sets(case: Case, device: torch.device, first: Sequence[Any],
               span: int = ROTATE_BYTES) -> list[list[Any]]:
    """``first`` and further input sets of ``case`` (seeds 1, 2, ...) until together they
    span ``span`` bytes, at most :data:`MAX_SETS` sets: the inputs a cold-L2 loop rotates."""
    nbytes = sum(t.numel() * t.element_size() for t in first if t is not None)
    count = max(1, min(MAX_SETS, math.ceil(span / max(nbytes, 1))))
    return [list(first), *(make_inputs(case, device, seed=i) for i in range(1, count))]


def rotating(sets: Sequence[Sequence[Any]], fn: Callable[..., Any]) -> Callable[[], Any]:
    """A callable running ``fn(*sets[i])`` for the next ``i`` each call (round robin)."""
    turn = [0]

    def call() -> Any:
        s = sets[turn[0] % len(sets)]
        turn[0] += 1
        return fn(*s)

    return call
