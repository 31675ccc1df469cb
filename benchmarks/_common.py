"""What the benchmark scripts share: CUDA timing, the machine they ran on, and the results
files (a header of where, when and with what; Markdown tables; JSON and Markdown written
side by side; parallel prebuilds of the kernels a run times).

The timing is the harness's (:mod:`tileops.ops.cli.timing`, behind ``tileops bench``), in the
milliseconds the scripts report, so a sweep and the side-by-side tables measure alike. The
scripts run standalone (``python benchmarks/<name>.py``, the packages' sources put on
``sys.path`` first), so this module is imported as a sibling from the script's directory; it
imports torch and TileOPs only when a function needs them, so the CPU-only scripts load it
without either.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any


def events(fn, iters: int, trials: int = 5) -> float:
    """Median milliseconds per call over ``trials`` runs of ``iters`` back-to-back calls,
    timed with CUDA events (:func:`tileops.ops.cli.timing.events_time`, the harness's own)."""
    from tileops.ops.cli.timing import events_time

    return events_time(fn, iters, trials) * 1e3


def graph_events(fn, iters: int, trials: int = 5) -> float:
    """Median milliseconds per call, replaying a CUDA graph of ``iters`` calls of ``fn`` (or
    of enough to fill 200 us where those take less; warmed up on a side stream first): the
    device time, without the host's launch cost
    (:func:`tileops.ops.cli.timing.filled_graph_time`, what ``tileops bench`` times with)."""
    from tileops.ops.cli.timing import filled_graph_time

    return filled_graph_time(fn, iters, trials) * 1e3


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


# --- results files -------------------------------------------------------------------------------


def parse_device(text: str) -> Any:
    """``text`` as a device with its index (``cuda`` is the current CUDA device)."""
    import torch

    dev = torch.device(text)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def header(script: str, dev: Any, **extra: Any) -> dict[str, Any]:
    """Where, when and with what a run ran: the script, the UTC time, the device (and GPU or
    CPU model), :func:`versions`, and ``extra``."""
    import torch

    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
    return {"script": script, "when": when, "device": str(dev), "machine": machine,
            "versions": versions(), **extra}


def title(head: dict[str, Any], what: str) -> list[str]:
    """The first lines of a results file: what, where and when, then the versions."""
    v = ", ".join(f"{k} {val}" for k, val in head["versions"].items() if val and k != "gpu")
    return [f"# {what} on {head['machine']} ({head['when']})", "",
            f"`benchmarks/{head['script']}.py` on {head['device']}; {v}.", ""]


def md_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def _plain(value: Any) -> Any:
    """``value`` with every non-finite float as its text (JSON has no inf or nan)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_results(out: Path, stem: str, dev: Any, doc: dict[str, Any],
                  markdown: str, echo: bool = True) -> list[Path]:
    """``<stem>-<device>.json`` (``doc``) and ``.md`` (``markdown``) under ``out``; with
    ``echo``, prints the Markdown, then the paths. The scripts write after every shape too
    (``echo=False``), so a run stopped part way leaves the shapes it finished."""
    out.mkdir(parents=True, exist_ok=True)
    base = f"{stem}-{str(dev).replace(':', '')}"
    paths = [out / f"{base}.json", out / f"{base}.md"]
    paths[0].write_text(json.dumps(_plain(doc), indent=1) + "\n")
    paths[1].write_text(markdown)
    if echo:
        print(markdown, end="")
        print("wrote " + ", ".join(str(p) for p in paths))
    return paths


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def prebuild(jobs: Sequence[Any], worker: Callable[[Any], tuple[str, float, str]],
             workers: int) -> int:
    """Run ``worker`` over ``jobs`` in ``workers`` spawned processes (each job builds the
    kernels of one shape, so the run that follows loads them from TileLang's disk cache);
    prints a line per job and a total; 1 if one failed."""
    t = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        for label, secs, status in pool.map(worker, jobs):
            failed += status != "ok"
            print(f"{label} {secs:.1f}s {status}", flush=True)
    print(f"prebuilt {len(jobs)} shapes in {time.perf_counter() - t:.0f}s, {failed} failed")
    return 1 if failed else 0
