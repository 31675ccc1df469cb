"""``tileops scaffold``: an op in the shape the shipped ops have, from its spec entry.

Two cases, told apart by the entry's ``family:``:

- **a variant of a shipped family**: :func:`family_base` finds the family base in
  :mod:`tileops.ops` (the ``Op`` subclass with no entry of its own whose subclasses' entries
  are of that family). The scaffold is the leaf declaration only: the class line on the base,
  the base's variant attribute where it declares one (``kind = RowNormKind.RMS``: the enum's
  first member, a valid value the author edits), ``reference`` and, where derivable, ``eager``.
  Constructor, docstring and repr are generated from the entry (``tileops.runtime.declared``),
  so nothing of them is written.
- **a new family**: an ops module (the family base: ``kernel_types``, a ``derive`` making an
  ``index_reader`` of the entry's ``Dim`` indices, a ``forward`` that reads them and gets the
  entry with one lookup; then the leaf) and a kernels module (a frozen keyword-only call spec
  whose fields are the ``Dim`` indices and ``dtype: Literal[...]`` of the dtype union, the
  interface, one ``general`` implementation skeleton).

The reference is derived only where it is correct in general: the entry's ``ref_api`` names a
function of ``torch`` (resolved here, not trusted as text), the entry has no params, no optional
input and one output, so the function applied to the widened inputs *is* the op. Otherwise
``reference`` raises ``NotImplementedError`` naming the op, and the command says so.

Every identifier written passed ``str.isidentifier()`` and is no keyword; spec text reaches the
source only as string literals checked to read back equal. Each module is parsed with ``ast``
and its top-level classes compared with what was meant before anything is written. No path of
the generating machine is written: the op finds its entry in the registered specs
(``tileops.runtime.register_specs``; ``tileops.ops`` registers the shipped ones).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import keyword
import re
import sys
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import click

from tileops.runtime import Op, SpecSet, register_specs
from tileops.spec import AdtDef, OpEntry, SpecError
from tileops.spec.kinds import DimK, DTypeK

from .. import SPEC_DIR
from ..workloads import kinds_of
from .core import UsageProblem, closest, did_you_mean
from .driver import usage

__all__ = ["Scaffold", "ScaffoldError", "family_base", "module_name_for", "scaffold",
           "scaffold_source"]


class ScaffoldError(ValueError):
    """The entry cannot be scaffolded (a name that is not an identifier, a composite op)."""


def _snake(name: str) -> str:
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
    return s.lower()


def _stem(name: str) -> str:
    return name[:-2] if name.endswith("Op") and len(name) > 2 else name


def module_name_for(name: str) -> str:
    """``FusedAddRMSNormFwdOp`` -> ``fused_add_rms_norm_fwd``."""
    return _snake(_stem(name))


def _ident(text: str, what: str) -> str:
    if not isinstance(text, str) or not text.isidentifier() or keyword.iskeyword(text):
        raise ScaffoldError(f"{what} {text!r} is not a Python identifier")
    return text


def _dotted(text: str, what: str) -> str:
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in text.split(".")):
        raise ScaffoldError(f"{what} {text!r} is not a dotted name of Python identifiers")
    return text


def _string(text: str) -> str:
    """A one-line Python string literal for ``text``, checked to read back equal."""
    lit = f'"{text}"' if text.isprintable() and not set(text) & {'"', "\\"} else repr(text)
    if ast.literal_eval(lit) != text:  # pragma: no cover - both forms round-trip
        raise ScaffoldError("cannot write a string literal for the entry's text")
    return lit


def _doc(text: str, indent: str) -> str:
    """A one-paragraph docstring of generated (not spec) text, as a checked literal."""
    lit = f'"""{text}"""' if _string(text).startswith('"') else repr(text)
    if ast.literal_eval(lit) != text:  # pragma: no cover
        raise ScaffoldError("cannot write a docstring")
    return indent + lit


@dataclass(frozen=True)
class Scaffold:
    """What the scaffold writes for one entry: the ops module, the kernels module (a new
    family only) and what is left to the author (the command prints it)."""

    ops: str
    kernels: str | None = None
    notes: tuple[str, ...] = field(default=())


def family_base(family: str) -> type[Op] | None:
    """The family base of ``family``'s forward ops in :mod:`tileops.ops`: an exported ``Op``
    subclass with no entry of its own whose subclasses with entries all belong to ``family``
    (at least one) and are not all some op's backward (a family's gradients have a base of
    their own, which a new forward entry does not derive from)."""
    import tileops.ops as ops

    classes = [c for c in (getattr(ops, n) for n in ops.__all__)
               if isinstance(c, type) and issubclass(c, Op)]
    backward = {c._gradient.op_name for c in classes if c._gradient is not None}
    for cls in classes:
        if cls._signature is not None:
            continue
        subs = [s for s in cls.__subclasses__() if s._signature is not None]
        fams = {sub._signature.entry.family for sub in subs}
        if fams == {family} and not all(s._signature.name in backward for s in subs):
            return cls
    return None


def _variant(base: type) -> tuple[str, type[Enum]] | None:
    """The base's variant attribute: a ``ClassVar[SomeEnum]`` it declares without a value."""
    namespace = {**vars(sys.modules[base.__module__]), "ClassVar": typing.ClassVar}
    for attr, hint in base.__dict__.get("__annotations__", {}).items():
        if isinstance(hint, str):  # the base's own source (postponed annotations), not spec text
            try:
                hint = eval(hint, namespace)  # noqa: S307
            except NameError:
                continue
        if typing.get_origin(hint) is typing.ClassVar and attr not in base.__dict__:
            (inner,) = typing.get_args(hint)
            if isinstance(inner, type) and issubclass(inner, Enum):
                return _ident(attr, "variant attribute"), inner
    return None


def _torch_function(ref_api: str | None) -> str | None:
    """``ref_api`` when it names a callable of ``torch`` (``torch.add``), else None."""
    if not ref_api or not ref_api.startswith("torch.") or not all(
            p.isidentifier() and not keyword.iskeyword(p) for p in ref_api.split(".")):
        return None
    import torch

    obj = torch
    for part in ref_api.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return ref_api if callable(obj) else None


def _reference(cls: str, entry: OpEntry, inputs: list[str]) -> tuple[list[str], list[str]]:
    """The leaf's ``reference`` (and ``eager``) methods, and the notes for the author."""
    sig = entry.signature
    fn = _torch_function(entry.ref_api)
    optional = [n for n, d in sig.inputs.items() if d.optional.text != "False"]
    args = ", ".join(["self", "call", *inputs])
    derivable = fn is not None and not sig.params and not optional and len(sig.outputs) == 1
    if derivable:
        wide = ", ".join(f"_wide({n})" for n in inputs)
        lines = [f"    def reference({args}):",
                 f"        return ({fn}({wide}),)", "",
                 "    def eager(self):",
                 f"        return {fn}"]
        return lines, []
    message = f"{cls}.reference: state the op's outputs in plain PyTorch"
    lines = [f"    def reference({args}):",
             f"        raise NotImplementedError({_string(message)})"]
    why = ("its ref_api is not a torch function" if fn is None else
           "it has params, optional inputs or several outputs, so its ref_api call is not "
           "known")
    notes = [f"{cls}.reference raises NotImplementedError: {why}; write its outputs in plain "
             f"PyTorch"]
    if fn is not None:
        notes.append(f"{cls}.eager is not written: return {fn} called with the op's params")
    return lines, notes


_WIDE = [
    "def _wide(t: torch.Tensor) -> torch.Tensor:",
    '    """``t`` in float32 (float64 as it is); a tensor that is not floating-point as it is."""',
    "    if not t.is_floating_point() or t.dtype == torch.float64:",
    "        return t",
    "    return t.float()",
]


def _checked(source: str, classes: list[str], what: str) -> str:
    tree = ast.parse(source)  # what was assembled is Python, with the classes named as meant
    names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    if names != classes:  # pragma: no cover - a bug in this module
        raise ScaffoldError(f"the generated {what} defines {names}, not {classes}")
    return source


def scaffold_source(name: str, entry: OpEntry, adts: dict[str, AdtDef], *,
                    kernels_module: str | None = None) -> Scaffold:
    """The modules for the entry ``name``: the leaf on its family's base when one is shipped,
    else a family skeleton whose ops module imports ``kernels_module`` (default
    ``tileops.kernels.<family>``)."""
    cls = _ident(name, "the entry name")
    if entry.composition is not None:
        raise ScaffoldError(f"{name} is a composite op (composition:); the scaffold writes "
                            f"ops that run one kernel slot")
    sig = entry.signature
    inputs = [_ident(n, "input") for n in sig.inputs]
    outputs = [_ident(n, "output") for n in sig.outputs]
    if len(set(inputs + outputs)) != len(inputs + outputs) or {"self", "call"} & {
            *inputs, *outputs}:
        raise ScaffoldError(f"{name}: tensor names must be distinct and not self or call")
    family = _ident(entry.family, "the family")
    base = family_base(family)
    ref, notes = _reference(cls, entry, inputs)
    uses_wide = any("_wide(" in line for line in ref)
    if base is not None:
        return Scaffold(_leaf_module(cls, base, ref, uses_wide), None, tuple(notes))
    return _family(cls, entry, adts, family, inputs, outputs, ref, uses_wide,
                   _dotted(kernels_module or f"tileops.kernels.{family}", "kernels module"),
                   notes)


def _leaf_module(cls: str, base: type, ref: list[str], uses_wide: bool) -> str:
    variant = _variant(base)
    L = [_doc(f"{cls}: its declaration on {base.__name__}; move the class into "
              f"{base.__module__} and its name into tileops.ops' imports and __all__.", ""),
         "", "from __future__ import annotations", ""]
    if uses_wide:
        L += ["import torch", ""]
    if variant is not None:
        enum = variant[1]
        L.append(f"from {_dotted(enum.__module__, 'module')} import {_ident(enum.__name__, 'enum')}")
    L.append(f"from {_dotted(base.__module__, 'module')} import {_ident(base.__name__, 'base')}")
    L += ["", f"__all__ = [{_string(cls)}]", "", ""]
    if uses_wide:
        L += [*_WIDE, "", ""]
    L.append(f"class {cls}({base.__name__}):")
    if variant is not None:
        attr, enum = variant
        member = _ident(next(iter(enum)).name, "enum member")
        L += [f"    {attr} = {enum.__name__}.{member}", ""]
    L += ref
    return _checked("\n".join(L) + "\n", [cls], "module")


def _family(cls: str, entry: OpEntry, adts: dict[str, AdtDef], family: str,
            inputs: list[str], outputs: list[str], ref: list[str], uses_wide: bool,
            kernels_module: str, notes: list[str]) -> Scaffold:
    sig = entry.signature
    kinds = kinds_of(entry, adts)
    dims = [_ident(n, "index") for n in sig.forall if isinstance(kinds[n], DimK)]
    fields = [_ident(_snake(n), "index") for n in dims]
    dtypes = [n for n in sig.forall if isinstance(kinds[n], DTypeK)]
    if len(dtypes) != 1:
        raise ScaffoldError(f"{cls}: a new family's call spec reads one DType index; the entry "
                            f"has {len(dtypes)}")
    members = kinds[dtypes[0]].members
    carriers = [n for n, d in sig.inputs.items() if d.dtype.text == dtypes[0]
                and d.optional.text == "False"]
    if not carriers:
        raise ScaffoldError(f"{cls}: no required input has the dtype {dtypes[0]}")
    if len(set(fields)) != len(fields) or {"device", "dtype"} & set(fields):
        raise ScaffoldError(f"{cls}: the Dim indices {', '.join(dims)} do not give distinct "
                            f"call spec fields besides device and dtype")
    camel = "".join(p[:1].upper() + p[1:] for p in family.split("_"))
    fbase, iface, spec, kernel, dt = (f"{camel}Op", f"{camel}Interface", f"{camel}Spec",
                                      f"{camel}GeneralKernel", f"{camel}DType")
    if len({fbase, iface, spec, kernel, dt, cls}) != 6:
        raise ScaffoldError(f"{cls}: its name collides with the family's {fbase}")
    slot = _ident(f"{family}_fwd", "slot")
    tensors = ", ".join([*inputs, *outputs])

    K = [_doc(f"The {family} kernels: the {slot} slot, its call spec and implementations.", ""),
         "", "from __future__ import annotations", "",
         "from typing import Literal, get_args", "",
         "from tileops.runtime import CallSpec, Kernel, KernelInterface", "",
         f"__all__ = [{', '.join(_string(n) for n in sorted([dt, iface, kernel, spec]))}]", "",
         f"{dt} = Literal[{', '.join(_string(m) for m in members)}]",
         f"_DTYPES = frozenset(get_args({dt}))", "", "",
         f"class {spec}(CallSpec, frozen=True, kw_only=True):",
         _doc(f"What an implementation of {slot} is told about a call: the solved sizes (exact) "
              f"and the storage dtype. Launch facts are the implementation's to derive.",
              "    "), ""]
    K += [f"    {f}: int" for f in fields]
    sizes = "".join(_string(f) + ", " for f in fields).rstrip()
    K += [f"    dtype: {dt}", "", "    def __post_init__(self) -> None:",
          "        self.check_fields(choices={\"dtype\": _DTYPES}, "
          f"sizes=({sizes}))"]
    K += ["", "", f"class {iface}(KernelInterface):",
          _doc(f"One slot: forward({tensors}) writes the outputs.", "    "), "",
          f"    slot = {_string(slot)}", f"    call_spec = {spec}", "", "",
          f"class {kernel}({iface}, Kernel):",
          _doc("The general implementation: any call the spec admits.", "    "), "",
          "    general = True", "",
          f"    def __call__(self, {tensors}) -> None:",
          f"        raise NotImplementedError({_string(f'{kernel}: write the {slot} program')})"]
    kernels = _checked("\n".join(K) + "\n", [spec, iface, kernel], "kernels module")

    reads = ", ".join(fields)
    key = ", ".join(["call.device", "dtype", *fields])
    spec_args = ", ".join(["device=call.device", *(f"{f}={f}" for f in fields),
                           "dtype=NAMES[dtype]"])
    P = [_doc(f"The {family} family: {fbase}, the base owning the forward flow, and its ops.",
              ""), "", "from __future__ import annotations", ""]
    if uses_wide:
        P += ["import torch", ""]
    P += [f"from {kernels_module} import {iface}, {kernel}, {spec}",
          "from tileops.ops._dtypes import NAMES", "from tileops.runtime import Op", "",
          f"__all__ = [{', '.join(_string(n) for n in sorted([cls, fbase]))}]", "", ""]
    if uses_wide:
        P += [*_WIDE, "", ""]
    P += [f"class {fbase}(Op):", _doc(f"Family base of the {family} ops.", "    "), "",
          f"    kernel_types = {{{iface}: ({kernel},)}}", ""]
    if dims:
        P += ["    def derive(self) -> None:",
              f"        self._read_dims = self.index_reader({', '.join(map(_string, dims))})",
              ""]
    P.append(f"    def forward(self, call, {tensors}) -> None:")
    if dims:
        P.append(f"        {reads}{',' if len(fields) == 1 else ''} = self._read_dims(call)")
    P += [f"        dtype = call.d_{carriers[0]}",
          f"        key = ({key})",
          "        entry = self._entries_by_call.get(key)  # the cached call: one lookup",
          "        if entry is None:",
          f"            entry = self.kernel_for(key, {iface}, lambda: {spec}({spec_args}))",
          f"        entry({tensors})", "", "",
          f"class {cls}({fbase}):", *ref]
    ops = _checked("\n".join(P) + "\n", [fbase, cls], "ops module")
    notes = [*notes, f"{kernel}.__call__ raises NotImplementedError: write the {slot} program "
             f"(the reference target serves {cls} meanwhile)"]
    return Scaffold(ops, kernels, tuple(notes))


# --- the command ------------------------------------------------------------------------------


def _write(out: Path, text: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(out, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise click.ClickException(f"{out} exists; refusing to overwrite it") from None


@click.command()
@click.argument("op", metavar="OP")
@click.option("--spec", "spec_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="spec file or folder holding OP's entry (default: the shipped specs)")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="ops module to write (default: ./<op_name>.py); never "
              "overwritten")
@click.option("--kernels-out", "kernels_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="kernels module of a new family (default: ./<family>_kernels.py)")
@click.option("--kernels-module", default=None, metavar="DOTTED",
              help="import name of that kernels module (default: tileops.kernels.<family>)")
@usage
def scaffold(op: str, spec_path: Path | None, out_path: Path | None, kernels_path: Path | None,
             kernels_module: str | None) -> None:
    """Write OP in the shape the shipped ops have, from its spec entry.

    For a family with a shipped base: the leaf declaration (class line, variant, reference,
    eager). For a new family: the ops module (family base and leaf) and the kernels module
    (call spec, interface, a general implementation skeleton). Never overwrites a file.
    """
    source_path = spec_path or SPEC_DIR
    try:
        specs = SpecSet.load(source_path)
    except SpecError as exc:
        for d in exc.diagnostics:
            click.echo(f"{d}  [{d.rule}]", err=True)
        raise click.ClickException(f"{source_path} does not pass the checks; fix it first "
                                   f"(tileops check {source_path})") from None
    found = specs.find(op)
    if found is None:
        raise UsageProblem(f"no entry {op!r} in {source_path}"
                           f"{did_you_mean(closest(op, specs.names()))}")
    entry, file, adts = found
    out = out_path or Path(f"{module_name_for(op)}.py")
    kout = kernels_path or Path(f"{entry.family}_kernels.py")
    try:
        made = scaffold_source(op, entry, adts, kernels_module=kernels_module)
    except ScaffoldError as exc:
        raise click.ClickException(str(exc)) from None
    for path in [out, *([kout] if made.kernels is not None else [])]:
        if path.exists():
            raise click.ClickException(f"{path} exists; refusing to overwrite it")
    _write(out, made.ops)
    if made.kernels is not None:
        _write(kout, made.kernels)
    if spec_path is not None:
        register_specs(spec_path)  # the op finds its entry in the registered specs
    if made.kernels is None:  # a leaf on a shipped base: it must import and find its entry
        mod_name = f"_tileops_scaffold_{module_name_for(op)}"
        spec = importlib.util.spec_from_file_location(mod_name, out)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            assert getattr(module, op)._signature.name == op
        except Exception as exc:  # noqa: BLE001 - reported; the file stays for inspection
            raise click.ClickException(f"wrote {out}, but it does not import: "
                                       f"{type(exc).__name__}: {exc}") from None
        click.echo(f"wrote {out}: {op} ({entry.family}, {entry.status}) from {file.path}")
    else:
        click.echo(f"wrote {out} and {kout}: {op} (new family {entry.family}, {entry.status}) "
                   f"from {file.path}")
    for note in made.notes:
        click.echo(f"todo: {note}")
