"""The machinery behind ``tileops run`` and ``tileops bench``: finding ops, devices, dtypes
and targets, making inputs, checking against float64, timing and the roofline.

Kept apart from :mod:`tileops.ops.cli` (the commands) so it can be used and tested without the
command line.
"""

from __future__ import annotations

import difflib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tileops.runtime import REFERENCE, Op, default_specs, targets
from tileops.signature import SignatureCallError
from tileops.spec import DTYPES

from .cli_refs import FP64
from .workloads import TOLERANCE, Case, as_outputs, clone_inputs, compare, make_inputs

__all__ = [
    "ALIASES",
    "CaseResult",
    "Peaks",
    "Ran",
    "UsageProblem",
    "available_devices",
    "closest",
    "did_you_mean",
    "op_classes",
    "parse_device",
    "parse_dtype",
    "peaks",
    "reference_fp64",
    "run_case",
    "shipped_op_names",
    "targets_here",
    "time_call",
]

#: short dtype names accepted on the command line
ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


class UsageProblem(ValueError):
    """Bad input from the user (an unknown op, device, dtype, target or workload)."""


def closest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The nearest names to ``word`` (difflib, case-insensitive)."""
    choices = list(choices)
    lower = {c.lower(): c for c in choices}
    found = difflib.get_close_matches(word.lower(), list(lower), n=n, cutoff=0.5)
    return [lower[f] for f in found]


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    return did_you_mean(closest(word, choices))


def did_you_mean(near: Sequence[str]) -> str:
    """``"; did you mean A, B or C?"`` (empty when there is nothing near)."""
    if not near:
        return ""
    text = near[0] if len(near) == 1 else f"{', '.join(near[:-1])} or {near[-1]}"
    return f"; did you mean {text}?"


# --- ops ------------------------------------------------------------------------------------


def _import_ops() -> None:
    import tileops.ops  # noqa: F401  (registers the shipped specs, ops and reference target)


def op_classes() -> dict[str, type[Op]]:
    """Every op class whose spec entry has status ``implemented``, by entry name. Where two
    classes serve one name, the one whose entry is in the process-wide specs wins."""
    _import_ops()
    out: dict[str, type[Op]] = {}
    seen: set[type] = set()
    stack: list[type] = list(Op.__subclasses__())
    while stack:
        cls = stack.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        plan = cls.__dict__.get("_signature")
        if plan is None or plan.entry.status != "implemented":
            continue
        prev = out.get(plan.name)
        if prev is None or (_registered(cls) and not _registered(prev)):
            out[plan.name] = cls
    return out


def _registered(cls: type[Op]) -> bool:
    plan = cls._signature
    found = default_specs().find(plan.name) if plan is not None else None
    return found is not None and found[0] is plan.entry


def shipped_op_names() -> list[str]:
    """The implemented ops of the process-wide specs that have a class, in spec order."""
    classes = op_classes()
    return [n for n in default_specs().names()
            if n in classes and _registered(classes[n])]


def resolve_ops(names: Sequence[str]) -> list[tuple[str, type[Op]]]:
    """Op classes for the names given (every shipped implemented op when none is)."""
    classes = op_classes()
    if not names:
        return [(n, classes[n]) for n in shipped_op_names()]
    out = []
    for n in names:
        cls = classes.get(n)
        if cls is None:
            found = default_specs().find(n)
            if found is not None:
                raise UsageProblem(f"{n} is {found[0].status} in the specs: no class implements "
                                   f"it yet (tileops scaffold {n} writes one)")
            known = sorted(set(classes) | set(default_specs().names()))
            raise UsageProblem(f"unknown op {n!r}{_did_you_mean(n, known)} "
                               f"(tileops list shows them all)")
        out.append((n, cls))
    return out


# --- devices, dtypes, targets --------------------------------------------------------------


def available_devices() -> list[str]:
    """The devices this machine can run on, as ``--device`` accepts them."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device(text: str) -> torch.device:
    valid = available_devices()
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageProblem(f"unknown device {text!r}; valid here: {', '.join(valid)}") from None
    name = str(dev)
    if name not in valid:
        why = "is not available on this machine" if dev.type in ("cuda", "mps", "xpu") \
            else "is not a device TileOPs runs on"
        raise UsageProblem(f"device {text!r} {why}; valid here: {', '.join(valid)}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def parse_dtype(text: str) -> str:
    name = ALIASES.get(text.lower(), text.lower())
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in DTYPES:
        valid = ", ".join([*DTYPES, *(f"{a} ({b})" for a, b in ALIASES.items())])
        raise UsageProblem(f"unknown dtype {text!r}; valid: {valid}")
    return name


def _tilelang_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("tilelang") is not None


def targets_here(cls: type[Op], devices: Sequence[str] | None = None) -> list[str]:
    """The targets that can serve ``cls`` on this machine's devices: ``tileops`` (the in-tree
    kernels) where one of its implementations runs on an available device and architecture,
    then every registered target with a builder for it that runs on one."""
    kinds = {torch.device(d).type for d in (devices or available_devices())}
    out = []
    impls = [k for ks in cls.kernel_types.values() for k in ks]
    for k in impls:
        for dev in kinds & set(k.devices):
            if dev == "cuda" and not _arch_ok(k):
                continue
            if dev == "cuda" and not _tilelang_importable():
                continue
            out.append(targets.IN_TREE)
            break
        if out:
            break
    for name in targets.targets():
        devs = targets.target_devices(name)
        if targets.builder_for(name, cls) is not None and (devs is None or kinds & set(devs)):
            out.append(name)
    return out


def _arch_ok(kernel: type) -> bool:
    archs = getattr(kernel, "supported_archs", None)
    if archs is None:
        return True
    return tuple(torch.cuda.get_device_capability()) in archs


def in_tree_first(cls: type[Op], device: torch.device) -> bool:
    """Whether the op, left to choose by device, would try its in-tree kernels first."""
    if targets.default_target() is not None:
        return False
    return any(device.type in k.devices for ks in cls.kernel_types.values() for k in ks)


def parse_target(text: str | None) -> str | None:
    if text is None:
        return None
    valid = [targets.IN_TREE, *targets.targets()]
    if text not in valid:
        raise UsageProblem(f"unknown target {text!r}; valid: {', '.join(valid)}")
    return text


# --- timing and the roofline -----------------------------------------------------------------


def _sync(device: torch.device) -> None:
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
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            one = max(start.elapsed_time(end) * 1e-3, 1e-6)
            batch = max(1, min(repeat, int(budget_s / 5 / one)))
            times = []
            for _ in range(5):
                start.record()
                for _ in range(batch):
                    fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e-3 / batch)
            return statistics.median(times)
    times = []
    spent = 0.0
    while len(times) < repeat and (spent < budget_s or not times):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return min(times)


@dataclass(frozen=True)
class Peaks:
    """What the roofline of a device is drawn from: measured copy bandwidth (bytes read plus
    written per second) and measured dense matmul throughput (FLOP/s). None where there is no
    meaningful peak (the CPU)."""

    bandwidth: float | None = None
    flops: float | None = None
    source: str = "none"

    def roof_seconds(self, flops: int, nbytes: int) -> float | None:
        if self.bandwidth is None or self.flops is None:
            return None
        return max(flops / self.flops, nbytes / self.bandwidth)

    def memory_bound(self, flops: int, nbytes: int) -> bool:
        if self.bandwidth is None or self.flops is None:
            return flops / max(nbytes, 1) < 10.0
        return nbytes / self.bandwidth >= flops / self.flops


_PEAKS: dict[str, Peaks] = {}


def peaks(device: torch.device) -> Peaks:
    """Measured peaks of ``device`` (cached): on CUDA a 512 MiB device-to-device copy and a
    bf16 8192^3 matmul; elsewhere none."""
    key = str(device)
    found = _PEAKS.get(key)
    if found is not None:
        return found
    if device.type != "cuda":
        p = Peaks(source=f"no roofline peak on {device.type}")
    else:
        with torch.cuda.device(device):
            a = torch.empty(1 << 28, dtype=torch.bfloat16, device=device).normal_()
            b = torch.empty_like(a)
            b.copy_(a)
            t = time_call(lambda: b.copy_(a), device, repeat=10)
            bw = 2 * a.numel() * a.element_size() / t
            del a, b
            n = 8192
            x = torch.randn(n, n, dtype=torch.bfloat16, device=device)
            y = torch.randn(n, n, dtype=torch.bfloat16, device=device)
            x @ y
            t = time_call(lambda: x @ y, device, repeat=10)
            fl = 2 * n**3 / t
            del x, y
        p = Peaks(bw, fl, "measured: device copy bandwidth and bf16 matmul")
    _PEAKS[key] = p
    return p


# --- one case ---------------------------------------------------------------------------------


@dataclass
class CaseResult:
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
        if not self.time_s or self.flops is None or self.bytes is None:
            return None
        roof = p.roof_seconds(self.flops, self.bytes)
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


def reference_fp64(cls: type[Op], op: Op, inputs: Sequence[Any]) -> tuple | None:
    """The op's outputs in float64, for ``inputs`` (which are not written).

    :data:`tileops.ops.cli_refs.FP64` where it has the op; otherwise the ``reference``
    target's builder for the op, run on float64 copies of the floating-point inputs into
    float64 outputs (the reference builders compute in float64 when handed float64). None
    when the op has neither."""
    name = cls._signature.name
    if name in FP64:
        return FP64[name](op, *inputs)
    builder = targets.builder_for(REFERENCE, cls)
    if builder is None:
        return None
    plan = cls._signature
    point = plan.construct(**{n: getattr(op, n) for n in plan.param_names})
    call = point.check(*inputs)  # shapes, dtypes and the effect branch of the real call

    def wide(t):
        if t is None:
            return None
        return t.to(torch.float64) if t.is_floating_point() else t.clone()

    inputs64 = [wide(t) for t in inputs]
    written = set(call.branch[0])
    outs: list[torch.Tensor | None] = []
    _, out_shapes, out_dtypes = call.derived()
    for decl, shape, dtype in zip(plan.sig.outputs.values(), out_shapes, out_dtypes,
                                  strict=True):
        if shape is None:
            outs.append(None)
        elif decl.alias and decl.alias in written:  # the output is that (written) input
            outs.append(inputs64[plan.input_names.index(decl.alias)])
        else:
            dt = torch.float64 if dtype.is_floating_point else dtype
            outs.append(torch.empty(tuple(shape), dtype=dt, device=call.device))
    builder(op, call)(*inputs64, *outs)
    return tuple(outs)


def run_case(cls: type[Op], case: Case, device: torch.device, *, target: str | None = None,
             repeat: int = 20, budget_s: float = 0.25, check: bool = True,
             status: Callable[[str], None] | None = None) -> Ran:
    """Build the op for ``case``, run it once (checking it against float64), then time it.
    Left to choose, an op whose in-tree kernels fail on the device runs on the reference
    target instead, and the result says why (``note``)."""
    res = CaseResult(case.op, case.label, case.dtype, case.shape, case.scaled,
                     {i.name: i.shape for i in case.inputs}, tol=TOLERANCE.get(case.dtype, 0.0))
    say = status or (lambda _msg: None)
    try:
        op = cls(target=target, **case.params)
    except Exception as exc:  # noqa: BLE001 - reported per row
        res.error = f"construction: {type(exc).__name__}: {exc}"
        return Ran(res, None, [], None)
    inputs = make_inputs(case, device)
    refs = None
    if check:
        say("float64 reference")
        try:
            with torch.no_grad():
                refs = reference_fp64(cls, op, inputs)
        except Exception as exc:  # noqa: BLE001 - the row is run unchecked, and says why
            res.add_note(f"no float64 reference: {type(exc).__name__}: {exc}")
        else:
            if refs is None:
                res.add_note("no float64 reference (none in cli_refs.FP64, no reference "
                             "builder)")
    try:
        say("building and running the kernel")
        t0 = time.perf_counter()
        with torch.no_grad():
            out = as_outputs(op(*clone_inputs(inputs)))
        _sync(device)
        res.first_call_s = time.perf_counter() - t0
    except SignatureCallError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return Ran(res, op, inputs, refs)
    except Exception as exc:  # noqa: BLE001 - fall back below, else reported per row
        if target is not None or not in_tree_first(cls, device) \
                or targets.builder_for(REFERENCE, cls) is None:
            res.error = f"{type(exc).__name__}: {exc}"
            return Ran(res, op, inputs, refs)
        res.add_note(f"in-tree kernels failed, so the reference target ran: "
                     f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        return _retry_reference(cls, case, device, res, inputs, refs, repeat, budget_s, say)
    res.target = op.serving_target
    return _finish(op, res, device, inputs, out, refs, repeat, budget_s, say)


def _retry_reference(cls, case, device, res, inputs, refs, repeat, budget_s, say):
    op = cls(target=REFERENCE, **case.params)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = as_outputs(op(*clone_inputs(inputs)))
        _sync(device)
        res.first_call_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - reported per row
        res.error = f"{type(exc).__name__}: {exc}"
        return Ran(res, op, inputs, refs)
    res.target = op.serving_target
    return _finish(op, res, device, inputs, out, refs, repeat, budget_s, say)


def _finish(op, res, device, inputs, out, refs, repeat, budget_s, say):
    if refs is not None:
        res.rel_err = compare(out, refs)
        res.checked = True
    res.flops, res.bytes = (int(v) for v in op.eval_roofline())
    say("timing")
    timing_inputs = clone_inputs(inputs)
    with torch.no_grad():
        res.time_s = time_call(lambda: op(*timing_inputs), device, repeat=repeat,
                               budget_s=budget_s)
    return Ran(res, op, inputs, refs)
