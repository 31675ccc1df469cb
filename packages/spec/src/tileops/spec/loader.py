"""YAML -> typed spec Structs, with ``file:line`` and the entry path in every error.

PyYAML silently keeps the last of two equal keys and reads some plain scalars in surprising
ways. The loader here:

- rejects duplicate keys (naming both lines);
- rejects the YAML 1.1 traps: ``1e-6`` (read as the *string* "1e-6"; write ``1.0e-6``),
  ``010`` (octal 8), ``1:30`` (base 60: 90) and
  ``yes``/``no``/``on``/``off`` (read as booleans; write ``true``/``false`` or quote the
  string);
- records the line of every key, so a schema error deep inside an entry is reported as
  ``norm.yaml:41: in RMSNormFwdOp.signature.inputs.x.shape: ...``;
- converts entry by entry and field by field, so an error names the entry, not ``[...]``
  (:mod:`.convert`); a YAML trap in one entry is that entry's error (each of its traps
  reported), and the other entries load on.
- holds the file to the bounds of :mod:`.bounds` before anything walks it: its size, its
  nesting (checked as it is composed, so a ten-thousand-deep list never reaches the
  recursive code) and the size and depth of the tree once every alias is expanded (so an
  alias bomb is refused in time linear in the text), and every integer to ``MAX_INT``;
- applies the file's ``families:`` block (:mod:`.family_blocks`): an entry takes its
  family's status, and a workload item naming a grid is expanded into plain workloads.
"""

from __future__ import annotations

import functools
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .bounds import (
    MAX_FILE_WORKLOADS,
    MAX_INT,
    MAX_SPEC_BYTES,
    MAX_WORKLOADS,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    int_in_range,
)
from .convert import Lines, LocatedMap, LocatedSeq, convert, fail, join_path, plain
from .errors import Diagnostic, SpecLoadError
from .expr import is_name
from .family_blocks import (
    LineSource,
    check_families_used,
    expand_grid,
    load_families,
    relocate_lines,
)
from .schema import FamilyDef, OpEntry, SpecFile, TypesFile, Workload

if TYPE_CHECKING:  # pragma: no cover
    import yaml

__all__ = [
    "load_spec_entries",
    "load_spec_file",
    "load_spec_file_entries",
    "load_spec_text",
    "load_types_file",
    "load_types_text",
]

_FLOAT_TRAP = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
_BOOL_WORDS = {"yes", "no", "on", "off", "y", "n"}
#: YAML 1.1's octal ints: a leading 0 and more digits (010 is 8)
_OCTAL_TRAP = re.compile(r"^[-+]?0[0-7_]+$")


def _char(c: Any) -> str:
    """A character PyYAML's reader reports (a code point or a byte) as text: ``'\\x07'``."""
    return repr(chr(c)) if isinstance(c, int) else repr(c)


def _base60(text: str) -> str:
    """What YAML 1.1 makes of a base-60 scalar, for the message (without converting a long
    text)."""
    if len(text) > 40:
        return "a number"
    try:
        total = 0.0 if "." in text else 0
        for part in text.lstrip("+-").replace("_", "").split(":"):
            total = total * 60 + (float(part) if "." in part else int(part))
        return str(-total if text.startswith("-") else total)
    except ValueError:
        return "a number"
_WORKLOAD_RESERVED = ("label", "dtype_cases", "some")


#: what a trapped scalar reads as where traps are collected (its entry is not converted)
_TRAPPED = object()
#: the most traps one file reports (the next one raises: the file is a wreck)
MAX_TRAPS = 100


class _Trap(Exception):
    def __init__(self, node: yaml.Node, message: str) -> None:
        self.line = node.start_mark.line + 1
        self.index = node.start_mark.index  # finds the entry path once the error is caught
        self.message = message


class _Bound(Exception):
    """A bound of :mod:`.bounds` broken at a line: reported without an entry path, since
    finding one would walk the very tree the bound keeps anything from walking."""

    def __init__(self, line: int, message: str) -> None:
        self.line = line
        self.message = message


def _parser_base() -> type:
    """The loader's base: libyaml's scanner and parser (C; the shipped specs load 4x faster,
    most of what importing the ops costs) under PyYAML's own composer, constructor and
    resolver, where PyYAML was built with libyaml; else the pure-Python ``SafeLoader``. The
    composer stays Python's either way, so the depth bound below holds on both (libyaml also
    refuses flow nesting beyond its own limit while scanning, in C)."""
    import yaml

    if not getattr(yaml, "__with_libyaml__", False):
        return yaml.SafeLoader
    from yaml._yaml import CParser  # type: ignore[import-not-found]
    from yaml.composer import Composer
    from yaml.constructor import SafeConstructor
    from yaml.resolver import Resolver

    class CSafeComposingLoader(Composer, CParser, SafeConstructor, Resolver):
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    return CSafeComposingLoader


@functools.cache
def _loader() -> type:
    """The loader class, made on the first load: PyYAML (some 30 ms of imports and regular
    expressions) is imported only by a process that reads YAML, not by one whose specs come
    from the validated record (runtime/specs.py)."""
    import yaml

    class Loader(_parser_base()):
        depth = 0
        #: where traps are collected (the construction goes on past them), else None: the
        #: first one raises
        traps: list[_Trap] | None = None

        def compose_node(self, parent, index):
            """Compose one node, refusing nesting deeper than MAX_YAML_DEPTH before the
            composer (recursive) goes deeper."""
            if self.depth >= MAX_YAML_DEPTH:
                raise _Bound(self.peek_event().start_mark.line + 1,
                             f"the YAML nests deeper than {MAX_YAML_DEPTH} levels")
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def fetch_flow_collection_start(self, token_class):
            """Refuse flow nesting (``[[[...``) deeper than MAX_YAML_DEPTH as it is scanned
            (the pure-Python scanner only; libyaml's is C): the scanner looks ahead up to 1024
            characters for a key, and its cost grows with the square of the flow levels open,
            so the composer's check alone comes late."""
            if self.flow_level >= MAX_YAML_DEPTH:
                raise _Bound(self.get_mark().line + 1,
                             f"the YAML nests deeper than {MAX_YAML_DEPTH} levels")
            super().fetch_flow_collection_start(token_class)

    def trap(loader: Loader, node: yaml.Node, message: str) -> Any:
        """Raise the trap, or where the loader collects them, keep it and go on (the value
        stands for nothing: the entry that holds it is reported, not converted)."""
        t = _Trap(node, message)
        if loader.traps is None or len(loader.traps) >= MAX_TRAPS:
            raise t
        loader.traps.append(t)
        return _TRAPPED

    def construct_mapping(loader: Loader, node: yaml.MappingNode, deep: bool = False) -> LocatedMap:
        loader.flatten_mapping(node)
        m = LocatedMap()
        m.line = node.start_mark.line + 1
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str | int | float | bool) and key is not None:
                what = "a list" if isinstance(key, list) else "a mapping"
                trap(loader, key_node, f"a mapping key must be a scalar, got {what}")
                continue
            if key in m:
                trap(loader, key_node,
                     f"duplicate key {key!r} (first written at line {m.key_lines[key]}); "
                     f"YAML would silently keep only the last one")
                continue
            m[key] = loader.construct_object(value_node, deep=True)
            m.key_lines[key] = line
        return m

    def construct_sequence(loader: Loader, node: yaml.SequenceNode, deep: bool = False) -> LocatedSeq:
        s = LocatedSeq(loader.construct_object(child, deep=True) for child in node.value)
        s.line = node.start_mark.line + 1
        s.item_lines = [child.start_mark.line + 1 for child in node.value]
        return s

    def construct_scalar_checked(loader: Loader, node: yaml.ScalarNode):
        value = loader.construct_yaml_str(node)
        if not node.style and _FLOAT_TRAP.match(value):  # plain: None (Python), '' (libyaml)
            mantissa, _, exponent = value.lower().partition("e")
            fixed = (mantissa if "." in mantissa else mantissa + ".0") + "e" + exponent
            return trap(
                loader, node,
                f"{value} is read by YAML as the string {value!r}, not a number; "
                f"write {fixed} (YAML 1.1 needs a dot in the mantissa), or quote it if a "
                f"string is meant",
            )
        return value

    def construct_bool_checked(loader: Loader, node: yaml.ScalarNode):
        if node.value.lower() in _BOOL_WORDS:
            return trap(
                loader, node,
                f"{node.value!r} is read by YAML as the boolean "
                f"{node.value.lower() in ('yes', 'on', 'y')}; write true or false for a "
                f"boolean, or quote it ('{node.value}') for a string",
            )
        return loader.construct_yaml_bool(node)

    def construct_int_checked(loader: Loader, node: yaml.ScalarNode):
        text = node.value
        if ":" in text:
            return trap(loader, node, f"{text} is read by YAML 1.1 as a base-60 number "
                        f"({_base60(text)}); write the number itself, or quote it for a string")
        if _OCTAL_TRAP.match(text):
            return trap(loader, node, f"{text} is read by YAML 1.1 as the octal number "
                        f"{int(text.replace('_', '').lstrip('+-'), 8)}; write it without the "
                        f"leading 0, or quote it for a string")
        # An integer's text is bounded before it is converted (int() of a long text is
        # quadratic); 2**63 - 1 has 19 digits, and 64 characters leave room for '_' and '0x'.
        value = loader.construct_yaml_int(node) if len(node.value) <= 64 else None
        if value is None or not int_in_range(value):
            return trap(loader, node, f"an integer is at most {MAX_INT} (2**63 - 1), got "
                        f"{node.value[:40]}{'...' if len(node.value) > 40 else ''}")
        return value

    def construct_float_checked(loader: Loader, node: yaml.ScalarNode):
        if ":" in node.value:
            return trap(loader, node, f"{node.value} is read by YAML 1.1 as a base-60 number; "
                        f"write the number itself, or quote it for a string")
        return loader.construct_yaml_float(node)

    Loader.add_constructor("tag:yaml.org,2002:int", construct_int_checked)
    Loader.add_constructor("tag:yaml.org,2002:float", construct_float_checked)
    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, construct_sequence)
    Loader.add_constructor("tag:yaml.org,2002:str", construct_scalar_checked)
    Loader.add_constructor("tag:yaml.org,2002:bool", construct_bool_checked)
    return Loader


def _read_yaml(text: str, file: str, traps: list[Diagnostic] | None = None) -> Any:
    """The text's data. A trap (a YAML 1.1 reading, a duplicate key) raises, or, given a
    ``traps`` list, is kept there (with its entry path) while the rest is read on."""
    size = len(text.encode("utf-8"))
    if size > MAX_SPEC_BYTES:
        raise SpecLoadError(Diagnostic(
            file, text.encode("utf-8")[:MAX_SPEC_BYTES].count(b"\n") + 1, "",
            f"the file is {size} bytes; a spec file is at most {MAX_SPEC_BYTES}", "yaml"))
    import yaml

    loader = _loader()(text)
    if traps is not None:
        loader.traps = []
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded(node)
        data = loader.construct_document(node)
        if loader.traps:
            paths = _paths_at(text, {t.index for t in loader.traps})
            traps += [Diagnostic(file, t.line, paths.get(t.index, ""), t.message, "yaml")
                      for t in loader.traps]
        return data
    except _Bound as bound:
        raise SpecLoadError(Diagnostic(file, bound.line, "", bound.message, "yaml")) from None
    except _Trap as trap:
        path = _path_at(text, trap.index)
        raise SpecLoadError(Diagnostic(file, trap.line, path, trap.message, "yaml")) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        line = text.count("\n", 0, exc.position) + 1
        raise SpecLoadError(Diagnostic(
            file, line, "", f"the file holds the character {_char(exc.character)}, which YAML "
            f"does not allow (a control character)", "yaml")) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        if "maximum nesting depth" in str(exc.problem):  # libyaml's scanner ran into it first
            raise SpecLoadError(Diagnostic(
                file, line, "", f"the YAML nests deeper than {MAX_YAML_DEPTH} levels",
                "yaml")) from None
        msg = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise SpecLoadError(Diagnostic(file, line, "", f"YAML syntax: {msg}", "yaml")) from None
    finally:
        loader.dispose()


def _check_expanded(root: yaml.Node) -> None:
    """Refuse a tree that, with every alias replaced by the node it names, has more than
    MAX_YAML_NODES nodes, nests deeper than MAX_YAML_DEPTH, or contains itself. Each
    distinct node is visited once (an alias is the same node object as its anchor), so an
    alias bomb costs what its text does."""
    import yaml

    done: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, expanded depth)
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if key in done:
            continue
        children = ([c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        line = node.start_mark.line + 1
        if not finished:
            if key in open_:
                raise _Bound(line, "an alias names a node that contains it")
            open_.add(key)
            stack.append((node, True))
            for child in children:
                if id(child) in open_ and id(child) not in done:
                    raise _Bound(child.start_mark.line + 1,
                                 "an alias names a node that contains it")
                stack.append((child, False))
            continue
        open_.discard(key)
        size = 1 + sum(done[id(c)][0] for c in children)
        depth = 1 + max((done[id(c)][1] for c in children), default=0)
        if size > MAX_YAML_NODES:
            raise _Bound(line, f"with its aliases expanded, the YAML here has more than "
                         f"{MAX_YAML_NODES} nodes")
        if depth > MAX_YAML_DEPTH:
            raise _Bound(line, f"with its aliases expanded, the YAML here nests deeper than "
                         f"{MAX_YAML_DEPTH} levels")
        done[key] = (size, depth)


def _path_at(text: str, index: int) -> str:
    """The entry path of the key or scalar that starts at character ``index`` (found on the
    composed node tree, which a trap does not stop), or "" if there is none."""
    return _paths_at(text, {index}).get(index, "")


def _paths_at(text: str, indices: set[int]) -> dict[int, str]:
    """The entry path of each key or scalar starting at one of ``indices``, in one walk of
    the composed tree (a node reached twice through aliases is walked once)."""
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:  # pragma: no cover - the text composed once already
        return {}
    found: dict[int, str] = {}
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while stack and len(found) < len(indices):
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in reversed(node.value):
                sub = join_path(path, [str(key.value)]) if isinstance(key, yaml.ScalarNode) \
                    else path
                if key.start_mark.index in indices:
                    found.setdefault(key.start_mark.index, sub)
                stack.append((value, sub))
        elif isinstance(node, yaml.SequenceNode):
            stack += [(item, f"{path}[{i}]") for i, item in reversed(list(enumerate(node.value)))]
        elif node.start_mark.index in indices:
            found.setdefault(node.start_mark.index, path)
    return found


# --- entry points -----------------------------------------------------------------------------


def load_spec_text(text: str, file: str = "<string>") -> SpecFile:
    """Load a spec file's text: a mapping of op class name -> entry, and optionally a
    ``families:`` block of what the entries of a family share (:mod:`.family_blocks`),
    applied to the entries here. Raises SpecLoadError with the error of every entry that
    does not load."""
    spec, errors = load_spec_entries(text, file)
    if errors:
        raise SpecLoadError(errors)
    return spec


def load_spec_entries(text: str, file: str = "<string>") -> tuple[SpecFile, list[Diagnostic]]:
    """The file's entries that load, and the error of each one that does not (one error an
    entry: its first; the others load and validate on their own), then a family block or a
    grid no entry uses. An error of the file as a whole (YAML, a malformed ``families:``
    block) is still raised. A YAML trap in an entry (``yes``, ``1e-6``, a duplicate key) is
    that entry's error, every trap of it reported; one outside the entries is the file's."""
    traps: list[Diagnostic] = []
    data = _read_yaml(text, file, traps)
    if any(_root(d.path) in ("", "families") for d in traps):
        raise SpecLoadError(traps)
    trapped: dict[str, list[Diagnostic]] = {}
    for d in traps:
        trapped.setdefault(_root(d.path), []).append(d)
    if data is None:
        data = LocatedMap()
    if not isinstance(data, dict):
        raise SpecLoadError(
            Diagnostic(file, 1, "", "a spec file is a mapping of op name -> entry", "schema")
        )
    rec = Lines()
    for name, entry in data.items():
        rec.record(str(name), entry,
                   data.key_lines.get(name) if isinstance(data, LocatedMap) else None)
    families: dict[str, FamilyDef] = {}
    if "families" in data:
        families = load_families(data["families"], file, rec.lines)
    used_grids: set[tuple[str, str]] = set()
    entries: dict[str, OpEntry] = {}
    errors: list[Diagnostic] = []
    # the line table's paths by their top-level key (an entry's name, "families"), once: an
    # entry's workload relocation reads its own and the family blocks' paths only
    by_root: dict[str, list[str]] = {}
    for p in rec.lines:
        by_root.setdefault(_root(p), []).append(p)
    total = 0
    for name, raw in data.items():
        if name == "families":
            continue
        if str(name) in trapped:  # read wrongly by YAML: reported, not converted
            errors += trapped[str(name)]
            continue
        try:
            scope = (*by_root.get(str(name), ()), *by_root.get("families", ()))
            entries[name] = _entry(name, raw, families, used_grids, file, rec.lines, scope)
        except SpecLoadError as err:
            errors += err.diagnostics
            continue
        total += len(entries[name].workloads)
        if total > MAX_FILE_WORKLOADS:  # the validator checks every one: bounded per file
            raise SpecLoadError(Diagnostic(
                file, rec.lines.get(f"{name}.workloads", rec.lines.get(str(name))),
                f"{name}.workloads", f"the file's entries expand to more than "
                f"{MAX_FILE_WORKLOADS} workloads (this entry's reach past it); a spec file "
                f"holds at most {MAX_FILE_WORKLOADS}", "schema"))
    if not errors:  # a family's grid is unused only if no entry that might use it failed
        errors += check_families_used(families, entries, used_grids, file, rec.lines)
    return SpecFile(path=file, entries=entries, lines=rec.lines, families=families), errors


def _root(path: str) -> str:
    """A line-table path's top-level key: ``RMSNormFwdOp`` of ``RMSNormFwdOp.workloads[0]``."""
    cut = min((i for i in (path.find("."), path.find("[")) if i >= 0), default=len(path))
    return path[:cut]


def _entry(name: Any, raw: Any, families: dict[str, FamilyDef],
           used_grids: set[tuple[str, str]], file: str, lines: dict[str, int],
           scope: tuple[str, ...] | None = None) -> OpEntry:
    """One entry of a spec file, converted, its family's defaults and grids applied."""
    if not is_name(name):
        raise SpecLoadError(
            Diagnostic(file, lines.get(str(name)), str(name),
                       f"an op name is a Python class name, got {name!r}", "schema")
        )
    if not isinstance(raw, dict):
        raise SpecLoadError(
            Diagnostic(file, lines.get(name), name,
                       f"an entry is a mapping, got {type(raw).__name__}", "schema")
        )
    if isinstance(raw.get("family"), str) and not is_name(raw["family"]):
        raise fail(file, lines, f"{name}.family", f"a family name is an identifier (it "
                   f"names the family's module), got {raw['family']!r}")
    raw = dict(raw)
    family = families.get(raw["family"]) if isinstance(raw.get("family"), str) else None
    if family is not None and family.status is not None:
        raw.setdefault("status", family.status)
    workloads = raw.pop("workloads", None)
    entry = convert(raw, OpEntry, name, file, lines)
    if workloads is not None:
        rows = _workloads(workloads, name, entry, families, used_grids, file, lines, scope)
        entry = msgspec.structs.replace(entry, workloads=rows)
    return entry


def _workloads(raw: Any, name: str, entry: OpEntry, families: dict[str, FamilyDef],
               used_grids: set[tuple[str, str]], file: str,
               lines: dict[str, int], scope: tuple[str, ...] | None = None
               ) -> tuple[Workload, ...]:
    """The entry's workload list, each grid item expanded where it is written; the line
    table's workload paths are rewritten to the expanded numbering."""
    path = f"{name}.workloads"
    if not isinstance(raw, list):
        raise fail(file, lines, path, "workloads is a list of rows")
    rows: list[Workload] = []
    sources: list[list[LineSource]] = []
    for i, row in enumerate(raw):
        rpath = f"{path}[{i}]"
        if not isinstance(row, dict):
            raise fail(file, lines, rpath, f"a workload row is a mapping, got "
                       f"{type(row).__name__}")
        if "grid" in row:
            for workload, srcs in expand_grid(row, rpath, name, entry, families, file, lines):
                rows.append(workload)
                sources.append(srcs)
                if len(rows) > MAX_WORKLOADS:
                    raise fail(file, lines, rpath, f"{name} expands to more than {MAX_WORKLOADS} "
                               f"workloads (each is a test and a benchmark case); split the "
                               f"grid or use it in fewer items")
            used_grids.add((entry.family, row["grid"]))
            continue
        reserved = {k: row[k] for k in _WORKLOAD_RESERVED if k in row}
        values = {k: plain(v) for k, v in row.items() if k not in _WORKLOAD_RESERVED}
        rows.append(convert({**reserved, "values": values}, Workload, rpath, file, lines))
        sources.append([(rpath, "", True)])
        if len(rows) > MAX_WORKLOADS:
            raise fail(file, lines, rpath, f"{name} has more than {MAX_WORKLOADS} workloads "
                       f"(each is a test and a benchmark case)")
    relocate_lines(lines, path, sources, scope)
    return tuple(rows)


def _read_file(p: Path) -> str:
    """The text of a spec file, refused before it is read where it is not a regular file (a
    FIFO would block, a device would never end) or is too large, and refused by the line of
    its first byte that is not UTF-8."""
    st = p.stat()
    if not stat.S_ISREG(st.st_mode):
        raise SpecLoadError(Diagnostic(str(p), None, "", "not a regular file (a spec is read "
                                       "from a file, not a FIFO, device or socket)", "yaml"))
    if st.st_size > MAX_SPEC_BYTES:
        raise SpecLoadError(Diagnostic(str(p), None, "", f"the file is {st.st_size} bytes; a "
                                       f"spec file is at most {MAX_SPEC_BYTES}", "yaml"))
    with p.open("rb") as f:  # no more than the bound, whatever the size said
        data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise SpecLoadError(Diagnostic(str(p), None, "", f"the file is more than "
                                       f"{MAX_SPEC_BYTES} bytes; a spec file is at most "
                                       f"{MAX_SPEC_BYTES}", "yaml"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecLoadError(Diagnostic(
            str(p), data.count(b"\n", 0, exc.start) + 1, "",
            f"byte {exc.start} ({data[exc.start:exc.start + 1]!r}) is not UTF-8; a spec file "
            f"is UTF-8 text", "yaml")) from None


def load_spec_file(path: str | Path) -> SpecFile:
    p = Path(path)
    return load_spec_text(_read_file(p), str(p))


def load_spec_file_entries(path: str | Path) -> tuple[SpecFile, list[Diagnostic]]:
    """:func:`load_spec_entries` of a file."""
    p = Path(path)
    return load_spec_entries(_read_file(p), str(p))


def load_types_text(text: str, file: str = "<string>") -> tuple[TypesFile, dict[str, int]]:
    """Load a ``types.yaml`` (shared ADTs). Returns the Struct and its line table."""
    data = _read_yaml(text, file) or LocatedMap()
    rec = Lines()
    rec.record("", data)
    return convert(data, TypesFile, "", file, rec.lines), rec.lines


def load_types_file(path: str | Path) -> tuple[TypesFile, dict[str, int]]:
    p = Path(path)
    return load_types_text(_read_file(p), str(p))
