"""YAML -> typed spec Structs, with ``file:line`` and the entry path in every error.

PyYAML silently keeps the last of two equal keys and reads some plain scalars in surprising
ways. The loader here:

- rejects duplicate keys (naming both lines);
- rejects the YAML 1.1 traps: ``1e-6`` (read as the *string* "1e-6"; write ``1.0e-6``) and
  ``yes``/``no``/``on``/``off`` (read as booleans; write ``true``/``false`` or quote the
  string);
- records the line of every key, so a schema error deep inside an entry is reported as
  ``norm.yaml:41: in RMSNormFwdOp.signature.inputs.x.shape: ...``;
- converts entry by entry and field by field, so an error names the entry, not ``[...]``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import msgspec
import yaml

from . import expr as E
from .errors import Diagnostic, SpecLoadError
from .schema import Expr, OpEntry, SpecFile, TypesFile, Workload

__all__ = ["load_spec_file", "load_spec_text", "load_types_file", "load_types_text"]

_FLOAT_TRAP = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
_BOOL_WORDS = {"yes", "no", "on", "off", "y", "n"}
_WORKLOAD_RESERVED = ("label", "dtype_cases", "some")


class _Trap(Exception):
    def __init__(self, node: yaml.Node, message: str) -> None:
        self.line = node.start_mark.line + 1
        self.index = node.start_mark.index  # finds the entry path once the error is caught
        self.message = message


class _Map(dict):
    """A mapping that remembers its line and the line of each key."""

    line: int = 0
    key_lines: dict

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.key_lines = {}


class _Seq(list):
    line: int = 0
    item_lines: list


def _make_loader():
    class Loader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: Loader, node: yaml.MappingNode, deep: bool = False) -> _Map:
        loader.flatten_mapping(node)
        m = _Map()
        m.line = node.start_mark.line + 1
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str | int | float | bool) and key is not None:
                what = "a list" if isinstance(key, list) else "a mapping"
                raise _Trap(key_node, f"a mapping key must be a scalar, got {what}")
            if key in m:
                raise _Trap(
                    key_node,
                    f"duplicate key {key!r} (first written at line {m.key_lines[key]}); "
                    f"YAML would silently keep only the last one",
                )
            m[key] = loader.construct_object(value_node, deep=True)
            m.key_lines[key] = line
        return m

    def construct_sequence(loader: Loader, node: yaml.SequenceNode, deep: bool = False) -> _Seq:
        s = _Seq(loader.construct_object(child, deep=True) for child in node.value)
        s.line = node.start_mark.line + 1
        s.item_lines = [child.start_mark.line + 1 for child in node.value]
        return s

    def construct_scalar_checked(loader: Loader, node: yaml.ScalarNode):
        value = loader.construct_yaml_str(node)
        if node.style is None and _FLOAT_TRAP.match(value):
            mantissa, _, exponent = value.lower().partition("e")
            fixed = (mantissa if "." in mantissa else mantissa + ".0") + "e" + exponent
            raise _Trap(
                node,
                f"{value} is read by YAML as the string {value!r}, not a number; "
                f"write {fixed} (YAML 1.1 needs a dot in the mantissa), or quote it if a "
                f"string is meant",
            )
        return value

    def construct_bool_checked(loader: Loader, node: yaml.ScalarNode):
        if node.value.lower() in _BOOL_WORDS:
            raise _Trap(
                node,
                f"{node.value!r} is read by YAML as the boolean "
                f"{node.value.lower() in ('yes', 'on', 'y')}; write true or false for a "
                f"boolean, or quote it ('{node.value}') for a string",
            )
        return loader.construct_yaml_bool(node)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, construct_sequence)
    Loader.add_constructor("tag:yaml.org,2002:str", construct_scalar_checked)
    Loader.add_constructor("tag:yaml.org,2002:bool", construct_bool_checked)
    return Loader


_Loader = _make_loader()


def _read_yaml(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except _Trap as trap:
        path = _path_at(text, trap.index)
        raise SpecLoadError(Diagnostic(file, trap.line, path, trap.message, "yaml")) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        msg = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise SpecLoadError(Diagnostic(file, line, "", f"YAML syntax: {msg}", "yaml")) from None


def _path_at(text: str, index: int) -> str:
    """The entry path of the key or scalar that starts at character ``index`` (found on the
    composed node tree, which a trap does not stop), or "" if there is none."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:  # pragma: no cover - the text composed once already
        return ""

    def find(node: yaml.Node, path: str) -> str | None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                sub = _join(path, [str(key.value)]) if isinstance(key, yaml.ScalarNode) else path
                if key.start_mark.index == index:
                    return sub
                found = find(value, sub)
                if found is not None:
                    return found
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                found = find(item, f"{path}[{i}]")
                if found is not None:
                    return found
        elif node.start_mark.index == index:
            return path
        return None

    return (find(root, "") if root is not None else None) or ""


# --- msgspec conversion with named paths -----------------------------------------------------


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is Expr:
        if isinstance(obj, bool):
            return Expr.of(E.Bool(obj))
        if isinstance(obj, int) and not isinstance(obj, bool) and obj >= 0:
            return Expr.of(E.Int(obj))
        if isinstance(obj, str):
            return Expr(obj)  # raises ExprSyntaxError (a ValueError): msgspec adds the path
        if isinstance(obj, list):
            text = "[" + ", ".join(map(str, obj)) + "]"
            raise TypeError(f"expected an expression string, got a YAML list; quote it: "
                            f"{text!r}")
        what = "a mapping" if isinstance(obj, dict) else f"{type(obj).__name__} {obj!r}"
        raise TypeError(f"expected an expression string, got {what}")
    raise NotImplementedError(tp)


_PATH_RE = re.compile(r" - at `\$(.*)`$")
_SEG_RE = re.compile(r"\.([A-Za-z_][A-Za-z_0-9]*)|\[(\d+|\.\.\.)\]")


def _resolve(tp: Any, data: Any, raw_path: str) -> tuple[list[str], Any]:
    """Turn msgspec's ``$.inputs[...].shape`` into ``['inputs', 'x', 'shape']`` by finding the
    dict entry that fails; returns the segments and the innermost container reached."""
    segs: list[str] = []
    node = data
    for m in _SEG_RE.finditer(raw_path):
        name, index = m.group(1), m.group(2)
        tp = _unwrap_optional(tp)
        if name is not None:
            hints = _hints(tp)
            field_name = _encode_names(tp).get(name, name)
            segs.append(name)
            node = node.get(name) if isinstance(node, dict) else None
            tp = hints.get(field_name, Any)
        elif index == "...":
            key_tp, val_tp = (get_args(tp) + (Any, Any))[:2] if get_origin(tp) is dict else (
                Any,
                Any,
            )
            bad = None
            if isinstance(node, dict):
                for k, v in node.items():
                    try:
                        msgspec.convert(k, key_tp, dec_hook=_dec_hook)
                        msgspec.convert(v, val_tp, dec_hook=_dec_hook)
                    except msgspec.ValidationError:
                        bad = k
                        break
            segs.append(str(bad) if bad is not None else "[...]")
            node = node.get(bad) if isinstance(node, dict) and bad is not None else None
            tp = val_tp
        else:
            i = int(index)
            segs.append(f"[{i}]")
            node = node[i] if isinstance(node, list) and i < len(node) else None
            args = get_args(tp)
            tp = args[0] if args else Any
    return segs, node


def _unwrap_optional(tp: Any) -> Any:
    args = get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _hints(tp: Any) -> dict[str, Any]:
    try:
        return get_type_hints(tp)
    except Exception:  # noqa: BLE001 - not a class with annotations
        return {}


def _encode_names(tp: Any) -> dict[str, str]:
    """Encoded (YAML) field name -> attribute name, for renamed fields (``is`` -> ``is_``)."""
    try:
        info = msgspec.structs.fields(tp)
    except TypeError:
        return {}
    return {f.encode_name: f.name for f in info}


def _join(prefix: str, segs: list[str]) -> str:
    out = prefix
    for s in segs:
        out = f"{out}{s}" if s.startswith("[") else (f"{out}.{s}" if out else s)
    return out


class _Lines:
    """Collects ``entry path -> line`` from the located YAML tree."""

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}

    def record(self, path: str, node: Any, line: int | None = None) -> None:
        if line:
            self.lines.setdefault(path, line)
        if isinstance(node, _Map):
            self.lines.setdefault(path, node.line)
            for k, v in node.items():
                self.record(_join(path, [str(k)]), v, node.key_lines.get(k))
        elif isinstance(node, _Seq):
            self.lines.setdefault(path, node.line)
            for i, v in enumerate(node):
                self.record(f"{path}[{i}]", v, node.item_lines[i])


def _line_for(lines: dict[str, int], path: str) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return None


def _convert(data: Any, tp: Any, prefix: str, file: str, lines: dict[str, int]) -> Any:
    try:
        return msgspec.convert(data, tp, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH_RE.search(text)
        message = text[: m.start()] if m else text
        segs, _ = _resolve(tp, data, m.group(1)) if m else ([], None)
        path = _join(prefix, segs)
        line = _line_for(lines, path)
        unknown = re.match(r"Object contains unknown field `(.+)`", message)
        if unknown:  # point at the misspelt key itself, not at its mapping
            line = lines.get(_join(path, [unknown.group(1)]), line)
        message = _friendly(message, segs, tp)
        raise SpecLoadError(Diagnostic(file, line, path, message, "schema")) from None


_YAML_TYPE_WORDS = {
    "array": "list",
    "object": "mapping",
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "null": "null",
}


def _yaml_words(msgspec_types: str) -> str:
    """msgspec's ``str | null`` in the words of YAML: ``string or null``."""
    return " or ".join(_YAML_TYPE_WORDS.get(t.strip(), t.strip())
                       for t in msgspec_types.split("|"))


def _type_at(tp: Any, segs: list[str]) -> Any:
    """The schema type at ``segs`` below ``tp``."""
    inner = tp
    for s in segs:
        inner = _unwrap_optional(inner)
        if s.startswith("["):
            args = get_args(inner)
            inner = args[0] if args else Any
        elif get_origin(inner) is dict:
            inner = get_args(inner)[1]
        else:
            inner = _hints(inner).get(_encode_names(inner).get(s, s), Any)
    return _unwrap_optional(inner)


def _friendly(message: str, segs: list[str], tp: Any) -> str:
    m = re.match(r"Invalid enum value (.+)", message)
    if m:
        allowed = [a for a in get_args(_type_at(tp, segs)) if isinstance(a, str)]
        if allowed:
            return (f"invalid value {m.group(1)}; expected one of: "
                    f"{', '.join(map(repr, allowed))}")
    m = re.match(r"Expected `(.+)`, got `(.+)`$", message)
    if m:
        return f"expected {_yaml_words(m.group(1))}, got {_yaml_words(m.group(2))}"
    m = re.match(r"Object contains unknown field `(.+)`", message)
    if m:
        # Name the fields that are accepted where the unknown one was written.
        inner = _type_at(tp, segs)
        known = list(_encode_names(inner))
        if known:
            return f"unknown field {m.group(1)!r}; expected one of: {', '.join(known)}"
        return f"unknown field {m.group(1)!r}"
    m = re.match(r"Object missing required field `(.+)`", message)
    if m:
        return f"missing required field {m.group(1)!r}"
    return message


# --- entry points -----------------------------------------------------------------------------


def load_spec_text(text: str, file: str = "<string>") -> SpecFile:
    """Load a spec file's text: a mapping of op class name -> entry."""
    data = _read_yaml(text, file)
    if data is None:
        data = _Map()
    if not isinstance(data, dict):
        raise SpecLoadError(
            Diagnostic(file, 1, "", "a spec file is a mapping of op name -> entry", "schema")
        )
    rec = _Lines()
    for name, entry in data.items():
        rec.record(str(name), entry, data.key_lines.get(name) if isinstance(data, _Map) else None)
    entries: dict[str, OpEntry] = {}
    for name, raw in data.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecLoadError(
                Diagnostic(file, rec.lines.get(str(name)), str(name),
                           f"an op name is a Python class name, got {name!r}", "schema")
            )
        if not isinstance(raw, dict):
            raise SpecLoadError(
                Diagnostic(file, rec.lines.get(name), name,
                           f"an entry is a mapping, got {type(raw).__name__}", "schema")
            )
        raw = dict(raw)
        workloads = raw.pop("workloads", None)
        entry = _convert(raw, OpEntry, name, file, rec.lines)
        if workloads is not None:
            entry = msgspec.structs.replace(
                entry, workloads=_workloads(workloads, name, file, rec.lines)
            )
        entries[name] = entry
    return SpecFile(path=file, entries=entries, lines=rec.lines)


def _workloads(raw: Any, name: str, file: str, lines: dict[str, int]) -> tuple[Workload, ...]:
    path = f"{name}.workloads"
    if not isinstance(raw, list):
        raise SpecLoadError(
            Diagnostic(file, _line_for(lines, path), path, "workloads is a list of rows", "schema")
        )
    rows = []
    for i, row in enumerate(raw):
        rpath = f"{path}[{i}]"
        if not isinstance(row, dict):
            raise SpecLoadError(
                Diagnostic(file, _line_for(lines, rpath), rpath,
                           f"a workload row is a mapping, got {type(row).__name__}", "schema")
            )
        reserved = {k: row[k] for k in _WORKLOAD_RESERVED if k in row}
        values = {k: _plain(v) for k, v in row.items() if k not in _WORKLOAD_RESERVED}
        rows.append(_convert({**reserved, "values": values}, Workload, rpath, file, lines))
    return tuple(rows)


def _plain(v: Any) -> Any:
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def load_spec_file(path: str | Path) -> SpecFile:
    p = Path(path)
    return load_spec_text(p.read_text(encoding="utf-8"), str(p))


def load_types_text(text: str, file: str = "<string>") -> tuple[TypesFile, dict[str, int]]:
    """Load a ``types.yaml`` (shared ADTs). Returns the Struct and its line table."""
    data = _read_yaml(text, file) or _Map()
    rec = _Lines()
    rec.record("", data)
    return _convert(data, TypesFile, "", file, rec.lines), rec.lines


def load_types_file(path: str | Path) -> tuple[TypesFile, dict[str, int]]:
    p = Path(path)
    return load_types_text(p.read_text(encoding="utf-8"), str(p))
