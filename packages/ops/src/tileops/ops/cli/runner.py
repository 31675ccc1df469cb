"""One case of ``tileops run`` (and the tileops row of ``tileops bench``): build the op for a
workload, run it once, check it against float64, and time it.

An op left to choose its target whose in-tree kernels fail on the device (a kernel that does
not compile there, say) runs on the ``reference`` target instead and the row says why, so one
broken kernel does not hide the rest of a run; an op given ``--target`` fails its row instead.

A row names its op, so the errors and notes it holds leave out the op name the op's own
messages begin with (:func:`~.core.describe`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tileops.runtime import REFERENCE, Op, targets
from tileops.signature import SignatureCallError

from ..workloads import (
    TOLERANCE,
    Case,
    as_outputs,
    clone_inputs,
    compare,
    make_inputs,
    tolerance,
)
from .core import describe, in_tree_first
from .timing import Peaks, sync, time_call

__all__ = ["CaseResult", "Ran", "run_case"]


@dataclass
class CaseResult:
    """What one case gave: the row of ``tileops run`` and of its JSON."""

    op: str
    workload: str
    dtype: str
    shape: tuple[int, ...] | None  # the largest input's
    scaled: dict[str, tuple[Any, Any]]
    inputs: dict[str, tuple[int, ...] | None] = field(default_factory=dict)  # None: absent
    target: str | None = None
    note: str | None = None  # why the target is not the first choice, or no reference
    rel_err: float | None = None  # max over outputs of the relative L2 error
    tol: float | None = None
    checked: bool = False
    time_s: float | None = None
    first_call_s: float | None = None
    flops: int | None = None
    bytes: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def add_note(self, text: str) -> None:
        self.note = text if self.note is None else f"{self.note}; {text}"

    @property
    def ok(self) -> bool:
        if self.error is not None:
            return False
        return not self.checked or (self.rel_err is not None and self.rel_err <= self.tol)

    def gbps(self) -> float | None:
        if self.time_s and self.bytes is not None:
            return self.bytes / self.time_s / 1e9
        return None

    def tflops(self) -> float | None:
        if self.time_s and self.flops is not None:
            return self.flops / self.time_s / 1e12
        return None

    def roof_fraction(self, p: Peaks) -> float | None:
        """The roofline time over the measured time, the roof drawn from the matmul peak of
        this workload's dtype (:meth:`Peaks.for_dtype`)."""
        if not self.time_s or self.flops is None or self.bytes is None:
            return None
        roof = p.for_dtype(self.dtype).roof_seconds(self.flops, self.bytes)
        return None if roof is None else roof / self.time_s

    def as_dict(self, p: Peaks) -> dict[str, Any]:
        d = asdict(self)
        del d["extra"]
        d["shape"] = list(self.shape) if self.shape is not None else None
        d["inputs"] = {n: (list(v) if v is not None else None) for n, v in self.inputs.items()}
        d["scaled"] = {k: [list(a) if isinstance(a, tuple) else a,
                           list(b) if isinstance(b, tuple) else b]
                       for k, (a, b) in self.scaled.items()}
        d["ok"] = self.ok
        d["gbps"] = self.gbps()
        d["tflops"] = self.tflops()
        d["roof_fraction"] = self.roof_fraction(p)
        for k in ("rel_err", "tol"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


@dataclass
class Ran:
    """One case run: its result, the op (None if it could not be built), the inputs and the
    float64 reference outputs (None where the op has none)."""

    result: CaseResult
    op: Op | None
    inputs: list
    refs: tuple | None


def run_case(cls: type[Op], case: Case, device: torch.device, *, target: str | None = None,
             repeat: int = 20, budget_s: float = 0.25, timed: bool = True,
             tune: bool = False, status: Callable[[str], None] | None = None) -> Ran:
    """Build the op for ``case``, run it once (checking it against float64), then time it
    with :func:`~.timing.time_call` (unless ``timed`` is false: ``tileops bench`` times every
    contender itself, the op included). Left to choose, an op whose in-tree kernels fail on
    the device runs on the reference target instead, and the result says why (``note``)."""
    timer = None
    if timed:
        def timer(fn: Callable[[], Any]) -> float:
            return time_call(fn, device, repeat=repeat, budget_s=budget_s)

    res = CaseResult(case.op, case.label, case.dtype, case.shape, case.scaled,
                     {i.name: i.shape for i in case.inputs}, tol=TOLERANCE.get(case.dtype, 0.0))
    say = status or (lambda _msg: None)
    try:
        op = cls(target=target, tune=tune, **case.params)
    except Exception as exc:  # noqa: BLE001 - reported per row
        res.error = f"construction: {describe(case.op, exc)}"
        return Ran(res, None, [], None)
    inputs = make_inputs(case, device)
    refs = None
    say("float64 reference")
    try:
        with torch.no_grad():
            refs = op.fp64_reference(*inputs)
    except Exception as exc:  # noqa: BLE001 - the row is run unchecked, and says why
        res.add_note(f"no float64 reference: {describe(case.op, exc)}")
    try:
        say("building and running the kernel")
        t0 = time.perf_counter()
        with torch.no_grad():
            out = as_outputs(op(*clone_inputs(inputs)))
        sync(device)
        res.first_call_s = time.perf_counter() - t0
    except SignatureCallError as exc:
        res.error = describe(case.op, exc)
        return Ran(res, op, inputs, refs)
    except Exception as exc:  # noqa: BLE001 - fall back below, else reported per row
        if target is not None or not in_tree_first(cls, device) \
                or targets.builder_for(REFERENCE, cls) is None:
            res.error = describe(case.op, exc)
            return Ran(res, op, inputs, refs)
        res.add_note(f"in-tree kernels failed, so the reference target ran: "
                     f"{describe(case.op, exc).splitlines()[0]}")
        return _retry_reference(cls, case, device, res, inputs, refs, timer, say)
    res.target = op.serving_target
    return _finish(op, res, inputs, out, refs, timer, say)


def _retry_reference(cls, case, device, res, inputs, refs, timer, say):
    op = cls(target=REFERENCE, **case.params)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = as_outputs(op(*clone_inputs(inputs)))
        sync(device)
        res.first_call_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - reported per row
        res.error = describe(case.op, exc)
        return Ran(res, op, inputs, refs)
    res.target = op.serving_target
    return _finish(op, res, inputs, out, refs, timer, say)


def _finish(op, res, inputs, out, refs, timer, say):
    if refs is not None:
        res.rel_err = compare(out, refs)
        # the coarsest floating dtype the call reads or writes (a bool condition reads none)
        res.tol = tolerance([t.dtype for t in (*inputs, *out) if t is not None])
        res.checked = True
    res.flops, res.bytes = (int(v) for v in op.eval_roofline(*inputs))
    if timer is not None:
        say("timing")
        timing_inputs = clone_inputs(inputs)
        with torch.no_grad():
            res.time_s = timer(lambda: op(*timing_inputs))
    return Ran(res, op, inputs, refs)
