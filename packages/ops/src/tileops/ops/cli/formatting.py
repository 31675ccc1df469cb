"""Number and table formatting shared by the ``tileops`` commands."""

from __future__ import annotations

import math
import sys

from rich.console import Console

__all__ = ["console", "fmt_err", "fmt_frac", "fmt_inputs", "fmt_rate", "fmt_shape", "fmt_time"]


def console(stderr: bool = False) -> Console:
    """A console on the current stdout (or stderr): terminal width on a terminal; otherwise
    wide enough that tables do not wrap when piped or pasted."""
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, width=None if tty else 200, highlight=False,
                   soft_wrap=not tty)


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_err(err: float | None) -> str:
    if err is None:
        return "-"
    if not math.isfinite(err):
        return str(err)
    return f"{err:.1e}"


def fmt_rate(flops: int | None, nbytes: int | None, seconds: float | None,
             memory_bound: bool) -> str:
    """Achieved GB/s (memory-bound calls) or TFLOP/s."""
    if not seconds or flops is None or nbytes is None:
        return "-"
    if memory_bound:
        return _si(nbytes / seconds, "B/s")
    return _si(flops / seconds, "FLOP/s")


def _si(value: float, unit: str) -> str:
    """``4.2e12, "B/s"`` -> ``"4.2 TB/s"``; three significant digits."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def fmt_frac(frac: float | None) -> str:
    return "-" if frac is None else f"{frac * 100:.0f}%"


def fmt_shape(shape: tuple[int, ...] | None, scaled: bool = False) -> str:
    if shape is None:
        return "-"
    text = "×".join(str(d) for d in shape) if shape else "scalar"
    return text + ("*" if scaled else "")


def fmt_inputs(inputs: dict, scaled: bool = False) -> str:
    """Every input's shape in order (``-`` for an absent optional input)."""
    text = " ".join(fmt_shape(s) for s in inputs.values()) or "-"
    return text + (" *" if scaled else "")
