"""``tileops scaffold``: the op module skeleton for one spec entry (:func:`scaffold_source`),
and the command that writes it and proves it imports.

The module follows the scaffold playbook of the op interface design, on this library's
``Op`` base class:

1. header and imports: ``Op`` and the kernel-slot types from ``tileops.runtime``;
2. ``__all__``, and the class named after the entry, its docstring listing the params;
3. ``__init__`` taking exactly the entry's ``signature.params`` (keyword-only, in spec order,
   spec defaults) plus ``target``, ``kernel_map`` and ``tune``; no shape and no dtype;
4. the kernel slot: a call spec (the device, the DType indices read from the tensors, the
   params, which optional inputs are present) and an interface; ``kernel_types`` maps the
   slot to its implementations (none yet); ``forward`` builds the call spec and runs the
   slot's entry on the inputs and outputs;
5-6. checks, output inference and roofline come from the entry: nothing is written for them;
7. registration: the module loads the spec file it came from (``SpecSet.load``) and names it
   in the class statement (``specs=``); the docstring says how to add the op to a package.

Every identifier written into the source passed ``str.isidentifier()`` and is not a keyword;
spec text (the entry's ``doc``, the spec path) reaches the source only as string literals
(:func:`_docstring`, :func:`_string`: ``repr`` where a quoted literal could not hold it), and
defaults only as ``repr`` of plain values that ``ast.literal_eval`` reads back equal. The
result is parsed before it is written.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import keyword
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import click

from tileops.runtime import SpecSet
from tileops.spec import AdtDef, OpEntry, SpecError
from tileops.spec.kinds import (
    AdtK,
    BoolK,
    DimK,
    DTypeK,
    EnumK,
    FloatK,
    IntK,
    Kind,
    MaybeK,
    PerAxisK,
    ShapeK,
)

from .. import SPEC_DIR
from ..workloads import kinds_of
from .core import UsageProblem, closest, did_you_mean
from .driver import usage

__all__ = ["ScaffoldError", "module_name_for", "scaffold", "scaffold_source"]

#: arguments every op's constructor takes besides the entry's params
_RESERVED = {"self", "target", "kernel_map", "tune"}


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


def _plain(text: str) -> bool:
    """Whether ``text`` can sit verbatim between triple double quotes."""
    return (
        '"""' not in text
        and "\\" not in text
        and not text.endswith('"')
        and all(c == "\n" or c.isprintable() for c in text)
    )


def _string(text: str) -> str:
    """A one-line Python string literal for ``text`` (double quotes where they hold it)."""
    lit = f'"{text}"' if _plain(text) and '"' not in text and "\n" not in text else repr(text)
    if ast.literal_eval(lit) != text:  # pragma: no cover - both forms round-trip
        raise ScaffoldError("cannot write a string literal for the entry's text")
    return lit


def _docstring(text: str, indent: str, width: int = 96) -> list[str]:
    """The lines of a docstring holding ``text`` at ``indent``: paragraphs are filled to
    ``width``, lines starting with spaces are kept as they are. Spec text that a triple-quoted
    literal cannot hold verbatim is written with ``repr`` on one line."""
    paragraphs = []
    for para in text.strip().split("\n\n"):
        if para.startswith(" ") or "\n " in para:
            paragraphs.append(para)
        else:
            paragraphs.append(textwrap.fill(para, width - len(indent),
                                            break_long_words=False, break_on_hyphens=False))
    body = "\n\n".join(paragraphs)
    if not _plain(body):
        return [indent + _string(text.strip())]
    lines = body.split("\n")
    if len(lines) == 1:
        out = [f'{indent}"""{lines[0]}"""']
    else:
        out = [f'{indent}"""{lines[0]}']
        out += [(indent + line) if line.strip() else "" for line in lines[1:]]
        out.append(f'{indent}"""')
    value = ast.literal_eval("\n".join(out).strip())
    if inspect.cleandoc(value) != inspect.cleandoc(body):  # pragma: no cover
        raise ScaffoldError("cannot write a docstring for the entry's text")
    return out


def _value(v: Any) -> str:
    """``repr`` of a plain default value, checked to read back equal."""
    if isinstance(v, list):
        v = tuple(v)
    text = repr(v)
    try:
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ScaffoldError(f"default {v!r} is not a plain value") from None
    if back != v or type(back) is not type(v):
        raise ScaffoldError(f"default {v!r} does not read back as itself")
    return text


def _annotation(k: Kind) -> str:
    if isinstance(k, MaybeK):
        return f"{_annotation(k.inner)} | None"
    if isinstance(k, DimK | IntK):
        return "int"
    if isinstance(k, FloatK):
        return "float"
    if isinstance(k, BoolK):
        return "bool"
    if isinstance(k, ShapeK):
        return "Sequence[int]"
    if isinstance(k, PerAxisK):
        return "Sequence[int] | int"
    if isinstance(k, EnumK | DTypeK):
        return "str"
    return "Any"  # an ADT value


def _field_type(k: Kind) -> str:
    if isinstance(k, MaybeK):
        return f"{_field_type(k.inner)} | None"
    if isinstance(k, DimK | IntK):
        return "int"
    if isinstance(k, FloatK):
        return "float"
    if isinstance(k, BoolK):
        return "bool"
    if isinstance(k, ShapeK):
        return "tuple[int, ...]"
    if isinstance(k, EnumK | DTypeK):
        return "str"
    return "Any"


def _needs_freeze(k: Kind) -> bool:
    inner = k.inner if isinstance(k, MaybeK) else k
    return isinstance(inner, ShapeK | PerAxisK | AdtK)


def _wrap(items: list[str], first: str, indent: str, last: str, width: int = 100) -> list[str]:
    """``first + ", ".join(items) + last`` on one line, or one item a line."""
    one = first + ", ".join(items) + last
    if len(one) <= width:
        return [one]
    return [first.rstrip(), *(f"{indent}{it}," for it in items), indent[:-4] + last.lstrip()]


def scaffold_source(name: str, entry: OpEntry, adts: dict[str, AdtDef], spec_path: Path,
                    out_path: Path) -> str:
    """The source of the op module for the entry ``name`` of ``spec_path``, to be written to
    ``out_path`` (the spec file is found relative to it)."""
    cls = _ident(name, "the entry name")
    if entry.composition is not None:
        raise ScaffoldError(f"{name} is a composite op (composition:); the scaffold writes "
                            f"ops that run one kernel slot")
    stem = _stem(cls)
    iface, call_spec = f"{stem}Interface", f"{stem}Spec"
    slot = module_name_for(cls)
    if len({cls, iface, call_spec}) != 3:
        raise ScaffoldError(f"{name}: the op, interface and call spec names collide")
    sig = entry.signature
    kinds = kinds_of(entry, adts)
    params = {_ident(n, "param"): p for n, p in sig.params.items()}
    for n in params:
        if n in _RESERVED:
            raise ScaffoldError(f"param {n!r} clashes with an argument every op takes")
    inputs = [_ident(n, "input") for n in sig.inputs]
    outputs = [_ident(n, "output") for n in sig.outputs]
    tensors = inputs + outputs
    if len(set(tensors)) != len(tensors):
        raise ScaffoldError(f"{name}: an input and an output share a name")
    # forward takes the tensors positionally, so a name clashing with `self`/`call` is renamed
    local = {t: (t + "_" if t in ("self", "call", "spec") else t) for t in tensors}
    optional = [n for n, d in sig.inputs.items() if d.optional.text != "False"]
    nullable = {n for n, d in sig.outputs.items() if d.nullable.text != "False"}

    # the call spec's fields: DType indices (read from a tensor), params, presence
    fields: list[tuple[str, str, str]] = []  # (field, type, value expression)
    taken = {"device"}

    def add(fname: str, ftype: str, value: str) -> None:
        while fname in taken:
            fname += "_"
        taken.add(fname)
        fields.append((fname, ftype, value))

    for n, k in kinds.items():
        if n not in sig.forall or not isinstance(k, DTypeK):
            continue
        carriers = [t for t, d in [*sig.inputs.items(), *sig.outputs.items()]
                    if d.dtype.text == n]
        sure = [t for t in carriers if t not in optional and t not in nullable]
        if sure:
            add(_ident(n, "index"), "str", f"_dtype_name({local[sure[0]]}.dtype)")
        elif carriers:
            t = local[carriers[0]]
            add(_ident(n, "index"), "str | None",
                f"None if {t} is None else _dtype_name({t}.dtype)")
    for n in params:
        k = kinds[n]
        value = f"_frozen(self.{n})" if _needs_freeze(k) else f"self.{n}"
        add(n, _field_type(k), value)
    for n in optional:
        add(f"has_{n}", "bool", f"{local[n]} is not None")
    uses_any = any(t == "Any" or "Any" in t for _, t, _ in fields) or any(
        "Any" in _annotation(kinds[n]) for n in params)
    uses_seq = any("Sequence" in _annotation(kinds[n]) for n in params)
    uses_freeze = any("_frozen(" in v for _, _, v in fields)

    rel = _relative_parts(spec_path, out_path)
    doc = entry.doc.strip()
    L: list[str] = []
    L += _docstring(
        f"{cls}: the op of the spec entry {cls} ({spec_path.name}).\n\n"
        + (f"The entry: {doc}\n\n" if doc else "")
        + f"Checks, output inference, effects and the roofline come from the entry. What is "
        f"left to write: an implementation of {iface} (a tileops.runtime.Kernel subclass that "
        f"also subclasses {iface}, usually in tileops.kernels) listed in kernel_types, or a "
        f"target builder (tileops.runtime.register_builder). To ship the op, import it in its "
        f"package's __init__ and list it in that module's __all__.", "")
    L.append("")
    L.append("from __future__ import annotations")
    L.append("")
    if uses_seq:
        L.append("from collections.abc import Sequence")
    L.append("from pathlib import Path")
    if uses_any:
        L.append("from typing import Any")
    L.append("")
    L.append("from tileops.runtime import CallSpec, KernelInterface, Op, SpecSet")
    L.append("")
    L.append(f"__all__ = [{', '.join(_string(x) for x in sorted([cls, iface, call_spec]))}]")
    L.append("")
    L.append("#: the spec file the entry comes from; the op reads its entry from this set")
    if rel is None:
        L.append(f"SPEC_FILE = Path({_string(str(spec_path))})")
    else:
        line = f"SPEC_FILE = Path(__file__).resolve().parent / {_string(rel)}"
        if len(line) <= 100:
            L.append(line)
        elif len(inner := f"    Path(__file__).resolve().parent / {_string(rel)}") <= 100:
            L += ["SPEC_FILE = (", inner, ")"]
        else:
            L += ["SPEC_FILE = (", "    Path(__file__).resolve().parent", f"    / {_string(rel)}", ")"]
    L.append("SPECS = SpecSet.load(SPEC_FILE)")
    L.append("")
    L.append("")
    L.append("def _dtype_name(dtype) -> str:")
    L.append('    return str(dtype).removeprefix("torch.")')
    L.append("")
    L.append("")
    if uses_freeze:
        L.append("def _frozen(v):")
        L.append("    if isinstance(v, list | tuple):")
        L.append("        return tuple(_frozen(x) for x in v)")
        L.append("    return v")
        L.append("")
        L.append("")
    L.append(f"class {call_spec}(CallSpec, frozen=True):")
    L += _docstring(f"What an implementation of the {slot} slot is told about a call, besides "
                    f"the device.", "    ")
    L.append("")
    for fname, ftype, _ in fields:
        L.append(f"    {fname}: {ftype}")
    L.append("")
    L.append("")
    L.append(f"class {iface}(KernelInterface):")
    sig_text = ", ".join(local[t] for t in tensors)
    L += _docstring(f"The {slot} slot: forward({sig_text}) writes the outputs; absent optional "
                    f"inputs are None.", "    ")
    L.append("")
    L.append(f"    slot = {_string(slot)}")
    L.append(f"    call_spec = {call_spec}")
    L.append("")
    L.append("")
    L.append(f"class {cls}(Op, specs=SPECS):")
    args_doc = []
    for n, p in params.items():
        default = "" if p.required else f" (default {_value(p.default)})"
        args_doc.append(f"    {n}: {_annotation(kinds[n])}{default}.")
    args_doc.append("    target, kernel_map, tune: see tileops.runtime.Op.")
    L += _docstring((doc or f"The {cls} op.") + "\n\nArgs:\n" + "\n".join(args_doc), "    ")
    L.append("")
    L.append("    #: the kernel slot this op runs, and its implementations (Kernel classes)")
    L.append(f"    kernel_types = {{{iface}: ()}}")
    L.append("")
    sig_args = []
    for n, p in params.items():
        ann = _annotation(kinds[n])
        sig_args.append(f"{n}: {ann}" if p.required else f"{n}: {ann} = {_value(p.default)}")
    sig_args += ["target: str | None = None", "kernel_map=None", "tune: bool = False"]
    L += _wrap(["self", "*", *sig_args], "    def __init__(", "        ", ") -> None:")
    super_args = [f"{n}={n}" for n in params] + ["target=target", "kernel_map=kernel_map",
                                                 "tune=tune"]
    L += _wrap(super_args, "        super().__init__(", "            ", ")")
    L.append("")
    fwd = ["self", "call", *(local[t] for t in tensors)]
    L += _wrap(fwd, "    def forward(", "        ", ") -> None:")
    L.append(f"        spec = {call_spec}(")
    L.append("            call.device,")
    for fname, _, value in fields:
        L.append(f"            {fname}={value},")
    L.append("        )")
    L += _wrap([local[t] for t in tensors], f"        self.kernel({iface}, spec)(",
               "            ", ")")
    source = "\n".join(L) + "\n"
    tree = ast.parse(source)  # what was assembled is Python, with the classes named as meant
    names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    if names != [call_spec, iface, cls]:  # pragma: no cover - a bug in this module
        raise ScaffoldError(f"the generated module defines {names}")
    return source


def _relative_parts(spec_path: Path, out_path: Path) -> str | None:
    spec_path = spec_path.resolve()
    base = out_path.resolve().parent
    try:
        rel = os.path.relpath(spec_path, base)
    except ValueError:  # another drive
        return None
    return Path(rel).as_posix()


# --- the command ------------------------------------------------------------------------------


@click.command()
@click.argument("op", metavar="OP")
@click.option("--spec", "spec_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="spec file or folder holding OP's entry (default: the shipped specs)")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="module to write (default: ./<op_name>.py); never overwritten")
@usage
def scaffold(op: str, spec_path: Path | None, out_path: Path | None) -> None:
    """Write the op module skeleton for OP's spec entry.

    The module defines OP as an Op subclass reading its entry from the spec file it came from:
    a constructor taking the entry's params, the kernel slot (a call spec and an interface)
    and a forward that runs the slot. Checks, output inference and roofline come from the
    entry. Refuses to overwrite an existing file.
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
    if out.exists():
        raise click.ClickException(f"{out} exists; refusing to overwrite it")
    try:
        text = scaffold_source(op, entry, adts, Path(file.path), out)
    except ScaffoldError as exc:
        raise click.ClickException(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(out, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise click.ClickException(f"{out} exists; refusing to overwrite it") from None
    # the result must import and define the op with its entry
    mod_name = f"_tileops_scaffold_{module_name_for(op)}"
    spec = importlib.util.spec_from_file_location(mod_name, out)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        cls = getattr(module, op)
        assert cls._signature is not None and cls._signature.name == op
    except Exception as exc:  # noqa: BLE001 - reported; the file stays for inspection
        raise click.ClickException(f"wrote {out}, but it does not import: "
                                   f"{type(exc).__name__}: {exc}") from None
    click.echo(f"wrote {out}: {op} ({entry.family}, {entry.status}) from {file.path}")
    click.echo(f"next: implement {op.removesuffix('Op') or op}Interface as a Kernel and list it "
               f"in {op}.kernel_types (or register a target builder), then import {op} in its "
               f"package's __init__ and __all__")
