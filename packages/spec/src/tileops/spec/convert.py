"""The located YAML tree and its conversion into the schema's Structs, with the entry path
and the line in every error.

The YAML reader (:mod:`.loader`) builds :class:`LocatedMap` and :class:`LocatedSeq`, which
remember the line of every key and item; :class:`Lines` flattens them into ``entry path ->
line``. :func:`convert` runs msgspec and turns its ``$.inputs[...].shape`` into the entry
path (``RMSNormFwdOp.signature.inputs.x.shape``), a line and a message in the words of YAML.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, get_args, get_origin, get_type_hints

import msgspec

from . import expr as E
from .errors import Diagnostic, SpecLoadError
from .schema import Expr

__all__ = [
    "Lines",
    "LocatedMap",
    "LocatedSeq",
    "convert",
    "fail",
    "join_path",
    "line_for",
    "plain",
]


class LocatedMap(dict):
    """A mapping that remembers its line and the line of each key."""

    line: int = 0
    key_lines: dict

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.key_lines = {}


class LocatedSeq(list):
    """A list that remembers its line and the line of each item."""

    line: int = 0
    item_lines: list


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


def join_path(prefix: str, segs: list[str]) -> str:
    out = prefix
    for s in segs:
        out = f"{out}{s}" if s.startswith("[") else (f"{out}.{s}" if out else s)
    return out


class Lines:
    """Collects ``entry path -> line`` from the located YAML tree."""

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}

    def record(self, path: str, node: Any, line: int | None = None) -> None:
        if line:
            self.lines.setdefault(path, line)
        if isinstance(node, LocatedMap):
            self.lines.setdefault(path, node.line)
            for k, v in node.items():
                self.record(join_path(path, [str(k)]), v, node.key_lines.get(k))
        elif isinstance(node, LocatedSeq):
            self.lines.setdefault(path, node.line)
            for i, v in enumerate(node):
                self.record(f"{path}[{i}]", v, node.item_lines[i])


def line_for(lines: Mapping[str, int], path: str) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return None


def fail(file: str, lines: Mapping[str, int], path: str, message: str) -> SpecLoadError:
    """The loading error at ``path``, on its line (or its nearest written ancestor's)."""
    return SpecLoadError(Diagnostic(file, line_for(lines, path), path, message, "schema"))


def convert(data: Any, tp: Any, prefix: str, file: str, lines: Mapping[str, int]) -> Any:
    try:
        return msgspec.convert(data, tp, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH_RE.search(text)
        message = text[: m.start()] if m else text
        segs, _ = _resolve(tp, data, m.group(1)) if m else ([], None)
        path = join_path(prefix, segs)
        line = line_for(lines, path)
        unknown = re.match(r"Object contains unknown field `(.+)`", message)
        if unknown:  # point at the misspelt key itself, not at its mapping
            line = lines.get(join_path(path, [unknown.group(1)]), line)
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


def plain(v: Any) -> Any:
    """A located YAML value as plain lists and dicts (what a workload row holds)."""
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v
