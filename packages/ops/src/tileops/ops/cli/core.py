"""What every ``tileops`` command shares: bad usage and near-name suggestions, finding op
classes, parsing devices, dtypes and targets, and package versions.

Nothing here prints or exits; the commands turn :class:`UsageProblem` into click's usage error
(exit status 2), so these functions are usable and testable without the command line.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Iterable, Sequence

import torch

from tileops.runtime import Op, default_specs, device_arch, targets
from tileops.spec import DTYPES

__all__ = [
    "ALIASES",
    "UsageProblem",
    "available_devices",
    "closest",
    "default_device",
    "describe",
    "did_you_mean",
    "in_tree_first",
    "op_classes",
    "parse_device",
    "parse_dtype",
    "parse_target",
    "resolve_ops",
    "serving_problem",
    "shipped_op_names",
    "split_list",
    "targets_here",
    "version",
    "without_op",
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


def without_op(op: str, text: str) -> str:
    """``text`` without a leading ``"<op>: "``. An op's own errors start with its name
    (``RMSNormFwdOp: construction param ...``); where the context names the op already (a row
    of the op, a message that starts with it) the name would read twice."""
    head = f"{op}: "
    return text[len(head):] if text.startswith(head) else text


def describe(op: str, exc: BaseException) -> str:
    """``"<Type>: <message>"`` of an exception raised for ``op``, its leading op name left
    out (:func:`without_op`): the text of a row or a note that already names the op."""
    return f"{type(exc).__name__}: {without_op(op, str(exc))}"


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
        # the class's own entry (a subclass without one inherits its base's plan)
        plan = cls._signature if "_signature" in cls.__dict__ else None
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


def parse_dtype(text: str, accepted: Sequence[str] | None = None) -> str:
    """The dtype name ``text`` spells (an alias, ``torch.`` prefixed or not). An unknown
    name's message lists ``accepted`` (the dtypes the ops at hand take, with the aliases that
    spell them) rather than every dtype the spec language knows, most of which no op takes."""
    name = ALIASES.get(text.lower(), text.lower())
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in DTYPES:
        shown = list(DTYPES) if accepted is None else [d for d in DTYPES if d in accepted]
        aliases = [f"{a} ({b})" for a, b in ALIASES.items() if b in shown]
        raise UsageProblem(f"unknown dtype {text!r}; valid: {', '.join([*shown, *aliases])}"
                           f"{_did_you_mean(text, [*shown, *ALIASES])}")
    return name


def _tilelang_importable() -> bool:
    return importlib.util.find_spec("tilelang") is not None


def serving_problem(cls: type[Op], target: str, device: torch.device) -> str | None:
    """Why ``target`` cannot serve ``cls`` on ``device`` (None when it can): the in-tree
    kernels (``tileops``) where none runs on the device's type, or TileLang is missing, or no
    kernel supports the GPU's architecture (a composite op: where one of its delegates'
    cannot); a registered target where it has no builder for
    the op or does not run on the device. The text names neither the op nor the target (and
    reads the same for several ops), so a caller puts it after both."""
    if target == targets.IN_TREE:
        if cls.delegate_types and not cls.kernel_types:
            # a composite runs where its delegates' kernels run: the first one that cannot
            # says why
            problems = (serving_problem(d, target, device) for d in cls.delegate_types.values())
            return next((p for p in problems if p is not None), None)
        impls = [k for ks in cls.kernel_types.values() for k in ks]
        if not impls:
            return "the op has no in-tree kernels"
        on = sorted({d for k in impls for d in k.devices})
        here = [k for k in impls if device.type in k.devices]
        if not here:
            return f"the in-tree kernels run on {', '.join(on)} only"
        if device.type == "cuda":
            if not _tilelang_importable():
                return "the in-tree kernels need TileLang, which is not installed"
            arch = device_arch(device)
            archs = [k.supported_archs for k in here]
            if None not in archs and not any(arch in a for a in archs):
                known = sorted({a for a_set in archs for a in a_set})
                return (f"no in-tree kernel supports sm_{arch[0]}{arch[1]} (they support "
                        f"{', '.join(f'sm_{a}{b}' for a, b in known)})")
        return None
    if targets.builder_for(target, cls) is None:
        return "the target has no builder for the op"
    devs = targets.target_devices(target)
    if devs is not None and device.type not in devs:
        return f"the target runs on {', '.join(devs)} only"
    return None


def targets_here(cls: type[Op], devices: Sequence[str] | None = None) -> list[str]:
    """The targets that can serve ``cls`` on one of this machine's devices (or of
    ``devices``): ``tileops`` (the in-tree kernels) first, then the registered targets;
    :func:`serving_problem` decides each."""
    devs = [torch.device(d) for d in (devices or available_devices())]
    return [t for t in (targets.IN_TREE, *targets.targets())
            if any(serving_problem(cls, t, d) is None for d in devs)]


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


def split_list(values: Iterable[str]) -> list[str]:
    """``("a,b", "c")`` -> ``["a", "b", "c"]``: a repeatable, comma-separated option."""
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def version(dist: str, module: str | None = None) -> str | None:
    """The installed version of distribution ``dist``; for a package run from a source tree
    (importable, not installed), ``"<__version__> (source tree)"`` of ``module``; None when
    neither is there."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    if module is None:
        return None
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    found = getattr(mod, "__version__", None)
    return f"{found} (source tree)" if found else "source tree"
