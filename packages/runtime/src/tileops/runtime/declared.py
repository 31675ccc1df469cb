"""What an op class with a spec entry gets from the entry instead of writing it.

For each class with an entry, ``Op.__init_subclass__`` asks :func:`deferred_members` what the
class does not write itself, and :func:`build_members` builds it on the class's first use
(lazy.py):

- ``__init__``, unless the class writes one: keyword-only parameters in the entry's manifest
  order with the spec's defaults (a param without one is required), then ``target``,
  ``kernel_map`` and ``tune``. It hands everything to the next ``__init__`` up the class's MRO
  (a family base that derives something at construction, else ``Op.__init__``, which runs the
  construction check and stores the params). The function is built as an AST from the entry's
  validated param names (identifiers, checked again here), never from text; its defaults are set
  on the function object, so a list default is never one shared mutable object.
- a docstring built from the entry's ``doc``, its params (type, default, ``doc``), inputs and
  outputs, unless the class has its own.
- ``__repr__``: ``RMSNormFwdOp(normalized_shape=(4096,), eps=None)``, the params in manifest
  order, then ``target`` when one was chosen.

It also holds the generic ``reference`` target builder for ops that declare
``Op.reference``: the outputs computed by the declaration, copied into the call's outputs.
"""

from __future__ import annotations

import ast
import keyword
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

if TYPE_CHECKING:  # pragma: no cover
    from tileops.signature import SignatureCall

    from .op import Op

__all__ = ["REQUIRED", "Equivalents", "build_members", "deferred_members", "reference_builder"]

_RUNTIME_PARAMS = (("target", None), ("kernel_map", None), ("tune", False))


class _Required:
    def __repr__(self) -> str:
        return "<required>"


#: the generated default of a param the spec gives no default: "not given"
REQUIRED: Any = _Required()


def _frozen(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_frozen(x) for x in v)
    return v


_SKELETON = """
def _make(__class__):
    def __init__(self):
        super(__class__, self).__init__()
    return __init__
"""


def _check_names(cls: type, names: list[str]) -> None:
    for n in names:
        if not n.isidentifier() or keyword.iskeyword(n) or n in ("self", "unknown"):
            raise TypeError(f"{cls.__name__}: construction param {n!r} is not an identifier")


def _make_init(cls: type, params: dict[str, Any]) -> Callable[..., None]:
    """``__init__(self, *, p1, p2=d2, ..., target=None, kernel_map=None, tune=False)``."""
    names = [*params, *(n for n, _ in _RUNTIME_PARAMS)]
    _check_names(cls, names)
    defaults: dict[str, Any] = {}
    for n, decl in params.items():
        # a required param defaults to REQUIRED, which Op.__init__ drops: the construction
        # check then names it with the spec's line, as for every other construction error
        defaults[n] = REQUIRED if decl.default is msgspec.UNSET else _frozen(decl.default)
    defaults.update(_RUNTIME_PARAMS)
    # a fixed skeleton (no name of the entry in its text), then the entry's names as nodes;
    # the inner function closes over __class__ as a method using super() would
    module = ast.parse(_SKELETON)
    init = module.body[0].body[0]
    init.args.kwonlyargs = [ast.arg(n) for n in names]
    init.args.kw_defaults = [None] * len(names)
    # **unknown: a misspelt param reaches the construction check, whose error names it, the
    # params the entry has and the spec's line (Python's own says only "unexpected")
    init.args.kwarg = ast.arg("unknown")
    call = init.body[0].value
    call.keywords = [ast.keyword(arg=n, value=ast.Name(n, ast.Load())) for n in names]
    call.keywords.append(ast.keyword(arg=None, value=ast.Name("unknown", ast.Load())))
    module = ast.fix_missing_locations(module)
    ns: dict[str, Any] = {}
    exec(compile(module, f"<tileops.runtime {cls.__name__}.__init__>", "exec"), ns)  # noqa: S102
    init = ns["_make"](cls)
    init.__kwdefaults__ = defaults
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    return init


def _docstring(cls: type, entry: Any) -> str:
    sig = entry.signature
    lines = [f"{cls.__name__}: {entry.doc}" if entry.doc else cls.__name__, ""]
    if sig.params:
        lines.append("Args:")
        for n, decl in sig.params.items():
            default = ("required" if decl.default is msgspec.UNSET
                       else f"default {_frozen(decl.default)!r}")
            extra = f" {decl.doc}" if decl.doc else ""
            lines.append(f"    {n} ({decl.type}): {default}.{extra}")
    lines.append("    target, kernel_map, tune: see :class:`tileops.runtime.Op`.")
    plan = cls._signature
    optional = set(plan.optional_inputs) if plan is not None else set()
    if sig.inputs:
        lines += ["", "Inputs:"]
        for n, d in sig.inputs.items():
            opt = ", optional" if n in optional else ""
            lines.append(f"    {n}: {d.dtype}{opt}, shape {d.shape}")
    if sig.outputs:
        lines += ["", "Outputs:"]
        for n, d in sig.outputs.items():
            lines.append(f"    {n}: {d.dtype}, shape {d.shape}")
    return "\n".join(lines) + "\n"


def _repr(self: Op) -> str:
    parts = [f"{n}={getattr(self, n)!r}" for n in type(self)._param_names]
    if self.target is not None:
        parts.append(f"target={self.target!r}")
    return f"{type(self).__name__}({', '.join(parts)})"


def deferred_members(cls: type, entry: Any) -> list[str]:
    """The members :func:`build_members` gives ``cls`` (``__init__`` and the docstring, those
    the class does not write itself), after checking what must fail when the class is defined:
    the params' names. ``__repr__`` is installed here (it is one shared function)."""
    _check_names(cls, [*entry.signature.params, *(n for n, _ in _RUNTIME_PARAMS)])
    if "__repr__" not in cls.__dict__:
        cls.__repr__ = _repr  # type: ignore[method-assign]
    names = []
    if "__init__" not in cls.__dict__:
        names.append("__init__")
    if cls.__dict__.get("__doc__") is None:
        names.append("__doc__")
    return names


def build_members(cls: type, entry: Any, names: list[str]) -> dict[str, Any]:
    """The members :func:`deferred_members` named: ``__init__`` (its docstring the class's)
    and the docstring."""
    doc = _docstring(cls, entry)
    out: dict[str, Any] = {}
    if "__init__" in names:
        init = _make_init(cls, dict(entry.signature.params))
        init.__doc__ = doc
        out["__init__"] = init
    if "__doc__" in names:
        out["__doc__"] = doc
    return out


class Equivalents:
    """What an op declares beside itself, once (a base of :class:`~tileops.runtime.Op`): its
    reference (:meth:`reference`, read by the ``reference`` target, :meth:`fp64_reference`,
    the tests and ``tileops run``) and its contenders (:meth:`eager`, :attr:`peers`, read by
    ``tileops bench``)."""

    _n_inputs: int
    _n_required: int

    #: named third-party equivalents (``"liger"``): name -> ``factory(op)`` returning a
    #: callable with the op's inputs and outputs, or None where the library is missing or does
    #: not cover the op's configuration
    peers: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    #: inputs :meth:`fp64_reference` hands :meth:`reference` in their own dtype, which the
    #: reference widens a slice at a time (DeepSeek-V3's expert bank, 15 GB in bfloat16, is
    #: 60 GB in float64 at once)
    reference_widens: ClassVar[frozenset[str]] = frozenset()

    def reference(self, call: SignatureCall, *inputs: Any) -> tuple:
        """The op's outputs (entry order) computed in plain PyTorch: in float32 for narrower
        inputs, in the inputs' dtype when they are float64. ``call`` is the record of the call
        in its storage dtypes (a step that rounds to the storage dtype reads it there);
        ``inputs`` may be wider copies. Never writes its inputs. Declared once per op (or
        family); the ``reference`` target, the tests and ``tileops run`` all read it."""
        raise NotImplementedError(f"{type(self).__name__} declares no reference")

    def fp64_reference(self, *inputs: Any) -> tuple:
        """The op's outputs in float64 for these inputs (absent optional ones as None), those
        a call returns (:attr:`returned_outputs`), as a tuple: the call is checked as the op
        would check it, then :meth:`reference` runs on float64 copies of the floating-point
        inputs (those in :attr:`reference_widens` as they are: the reference widens them)."""
        n = self._n_inputs
        if len(inputs) > n:
            raise self._arity_error(inputs)
        given = list(inputs)
        while given and given[-1] is None:
            given.pop()
        if len(given) < self._n_required:
            raise self._arity_error(tuple(given))
        call = self._point.check(*given)
        keep = self.reference_widens
        wide = [t.double() if t is not None and t.is_floating_point() and name not in keep
                else t for t, name in zip(inputs, self._signature.input_names, strict=False)]
        wide += [None] * (n - len(wide))
        outs = self.reference(call, *wide)
        outs = tuple(o.double() if o is not None and o.is_floating_point() else o
                     for o in outs)
        if self._point.plan.may_leave_out:  # the outputs a call returns (a tuple still)
            outs = tuple(outs[self._signature.output_names.index(n)]
                         for n in self.returned_outputs)
        return outs

    def eager(self) -> Any:
        """The torch eager equivalent (the entry's ``ref_api``) as a callable taking the op's
        inputs (None for absent optional ones) and returning its outputs, with the op's effects;
        None when there is none."""
        return None

    def contenders(self) -> dict[str, Any]:
        """Named equivalents available in this process: ``"torch"`` (:meth:`eager`) first, then
        each of :attr:`peers` that applies. Benchmarks derive ``torch.compile`` from
        ``"torch"``."""
        out: dict[str, Any] = {}
        fn = self.eager()
        if fn is not None:
            out["torch"] = fn
        for name, make in self.peers.items():
            fn = make(self)
            if fn is not None:
                out[name] = fn
        return out


def reference_builder(op: Op, call: SignatureCall) -> Callable[..., None]:
    """The ``reference`` target's kernel for an op declaring ``reference``: its outputs
    computed by the declaration (fp32 for narrower inputs), copied into the call's outputs
    (which may be inputs: every output is computed before any is written). The declaration
    runs with the caller's autocast off: its float32 arithmetic stays float32 (an autocast
    region made its matmuls bfloat16), as the in-tree kernels' does and as torch keeps the
    accumulation of its own ops."""
    import torch

    n_inputs = op._n_inputs
    device = call.device.type if getattr(call, "device", None) is not None else "cpu"
    try:
        torch.is_autocast_enabled(device)
    except RuntimeError:  # a device autocast has no form for (meta)
        device = None

    def kernel(*tensors: Any) -> None:
        inputs, outputs = tensors[:n_inputs], tensors[n_inputs:]
        if device is not None and torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                results = op.reference(call, *inputs)
        else:
            results = op.reference(call, *inputs)
        for i, (out, r) in enumerate(zip(outputs, results, strict=True)):
            if out is not None and r is not None:
                if r.shape != out.shape:  # copy_ would broadcast it: a wrong answer
                    raise RuntimeError(
                        f"{type(op).__name__}: its reference gave output "
                        f"{op._signature.output_names[i]} the shape {tuple(r.shape)}, not "
                        f"the {tuple(out.shape)} its signature states")
                out.copy_(r)

    return kernel
