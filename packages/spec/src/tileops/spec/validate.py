"""The static validator: every rule a spec must satisfy before anything is generated from it.

Rules (each :class:`~tileops.spec.errors.Diagnostic` carries its rule id):

``index-source``  every index has exactly one source: forall, construction param, let or data.
``unknown-name``  expressions name only known indices, tensors, families and primitives.
``kind``          kinds agree wherever an index is used (a Shape is spliced with ``*``, a
                  predicate is Bool, a formula is a number, a dtype is a DType, ...).
``family``        every type family is total over its discriminant, with no case twice.
``let-cycle``     ``let`` definitions do not depend on each other in a cycle.
``solvable``      every forall index is solved by unification from the required inputs.
``effects``       effects are consistent: alias names an input of the same dtype and shape
                  that is mutated (at least in some calls: the output is that input object
                  in the calls that write it, a fresh tensor in the others); write_only only
                  on a mutated input; buffer never with alias; effect predicates depend only
                  on construction params and presence; present(x) only on a tensor that may
                  be absent.
``workload``      every workload row instantiates: all indices given, dtypes from the declared
                  sets, values of the right kind, shapes non-negative, refinements hold.
``default``       a construction param's default is a value of its kind.
``adt``           ADT constructors have valid field kinds, a Python class path and a Bool
                  invariant.
``composition``   stages are uniquely named and name known ops.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import expr as E
from .errors import Diagnostic, SpecError
from .evaluate import AdtValue, EvalError, Scope, eval_shape, evaluate
from .kinds import (
    DTYPES,
    AdtK,
    BoolK,
    DimK,
    DTypeK,
    EnumK,
    FloatK,
    IntK,
    Kind,
    KindError,
    MaybeK,
    PerAxisK,
    ShapeK,
    is_discriminant,
    is_numeric,
    kind_from_expr,
)
from .primitives import GENERATORS, PRIMITIVES, Primitive, accepts, describe
from .schema import AdtDef, Expr, OpEntry, SpecFile, TypeFamily, TypesFile

__all__ = [
    "EntryModel",
    "RULES",
    "check_paths",
    "validate_entry",
    "validate_spec_file",
    "validate_types",
]

RULES = (
    "index-source",
    "unknown-name",
    "kind",
    "family",
    "let-cycle",
    "solvable",
    "effects",
    "workload",
    "default",
    "adt",
    "composition",
)

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*(\.[A-Za-z_][A-Za-z_0-9]*)+$")


class _KErr(Exception):
    def __init__(self, message: str, rule: str = "kind") -> None:
        super().__init__(message)
        self.message = message
        self.rule = rule


class _NoneK(Kind, frozen=True):
    def __str__(self) -> str:
        return "None"


@dataclass
class EntryModel:
    """What the validator learns about an entry: every index with its kind and source."""

    name: str
    kinds: dict[str, Kind] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # name -> forall|param|let|data
    let_order: list[str] = field(default_factory=list)
    optional_inputs: set[str] = field(default_factory=set)
    nullable_outputs: set[str] = field(default_factory=set)


# --- kind inference ---------------------------------------------------------------------------


class _Kinds:
    def __init__(
        self,
        scope: Mapping[str, Kind],
        families: Mapping[str, TypeFamily],
        tensors: Mapping[str, bool],  # name -> may be absent
        adts: Mapping[str, AdtDef],
        generators: bool = False,
        family_kinds: Mapping[str, dict[str, Kind]] | None = None,
    ) -> None:
        self.scope = scope
        self.families = families
        self.tensors = tensors
        self.adts = adts
        self.generators = generators
        self.family_kinds = family_kinds or {}

    def infer(self, node: E.Node) -> Kind:  # noqa: C901 - one case per node type
        if isinstance(node, E.Name):
            if node.id in self.scope:
                return self.scope[node.id]
            if node.id in self.tensors:
                raise _KErr(f"tensor {node.id!r} is not a value; write present({node.id})")
            if node.id in DTYPES:
                return DTypeK((node.id,))
            raise _KErr(f"unknown name {node.id!r}{self._suggest(node.id)}", "unknown-name")
        if isinstance(node, E.Int):
            return DimK()
        if isinstance(node, E.Float):
            return FloatK()
        if isinstance(node, E.Bool):
            return BoolK()
        if isinstance(node, E.Str):
            return EnumK((node.value,))
        if isinstance(node, E.NoneLit):
            return _NoneK()
        if isinstance(node, E.Ellipsis_):
            raise _KErr("'...' is only part of kind syntax")
        if isinstance(node, E.Attr):
            return self._attr(node)
        if isinstance(node, E.List | E.Tuple):
            for item in node.items:
                self._shape_item(item)
            return ShapeK()
        if isinstance(node, E.Subscript):
            return self._family_app(node)
        if isinstance(node, E.Call):
            return self._call(node)
        if isinstance(node, E.Starred):
            raise _KErr(f"{node}: '*' splices a Shape into a list; use it inside [...]")
        if isinstance(node, E.UnaryOp):
            k = self.infer(node.operand)
            if node.op == "not":
                self._want_bool(k, node.operand)
                return BoolK()
            if not is_numeric(k):
                raise _KErr(f"'-' needs a number; {E.unparse(node.operand)} is {k}")
            return FloatK() if isinstance(k, FloatK) else IntK()
        if isinstance(node, E.BinOp):
            if node.op == "|":
                raise _KErr(f"{E.unparse(node)}: '|' is only part of kind syntax")
            a, b = self.infer(node.left), self.infer(node.right)
            for k, side in ((a, node.left), (b, node.right)):
                if not is_numeric(k):
                    raise _KErr(f"{node.op!r} needs numbers; {E.unparse(side)} is {k}")
            if node.op == "/" or isinstance(a, FloatK) or isinstance(b, FloatK):
                return FloatK()
            if node.op == "-" or isinstance(a, IntK) or isinstance(b, IntK):
                return IntK()
            return DimK()
        if isinstance(node, E.BoolOp):
            for v in node.values:
                self._want_bool(self.infer(v), v)
            return BoolK()
        if isinstance(node, E.Compare):
            left = node.left
            lk = self.infer(left)
            for op, right in zip(node.ops, node.comparators, strict=True):
                rk = self.infer(right)
                self._comparable(op, lk, rk, left, right)
                left, lk = right, rk
            return BoolK()
        if isinstance(node, E.IfExp):
            self._want_bool(self.infer(node.test), node.test)
            a, b = self.infer(node.body), self.infer(node.orelse)
            return _join(a, b, node)
        raise _KErr(f"{E.unparse(node)} has no kind")  # pragma: no cover

    # -- helpers --

    def _suggest(self, name: str) -> str:
        import difflib

        pool = list(self.scope) + list(self.tensors)
        close = difflib.get_close_matches(name, pool, n=1)
        return f" (did you mean {close[0]!r}?)" if close else ""

    def _want_bool(self, k: Kind, node: E.Node) -> None:
        if not isinstance(k, BoolK):
            raise _KErr(f"{E.unparse(node)} is {k}, but a Bool is needed here")

    def _shape_item(self, item: E.Node) -> None:
        if isinstance(item, E.Starred):
            k = self.infer(item.value)
            if not isinstance(k, ShapeK):
                raise _KErr(f"*{E.unparse(item.value)} splices a Shape, but it is {k}")
            return
        k = self.infer(item)
        if isinstance(k, ShapeK):
            raise _KErr(
                f"{E.unparse(item)} is a Shape; splice it into the list as *{E.unparse(item)}"
            )
        if not isinstance(k, DimK | IntK):
            raise _KErr(f"an axis length must be a Dim, but {E.unparse(item)} is {k}")

    def _attr(self, node: E.Attr) -> Kind:
        base = self.infer(node.value)
        if isinstance(base, MaybeK) and node.attr == "value":
            return base.inner
        if isinstance(base, AdtK):
            adt = self.adts.get(base.name)
            for ctor in (adt.constructors.values() if adt else []):
                if node.attr in ctor.fields:
                    return kind_from_expr(ctor.fields[node.attr].node, set(self.adts))
            raise _KErr(f"ADT {base.name} has no field {node.attr!r}")
        raise _KErr(f"{E.unparse(node)}: {E.unparse(node.value)} is {base}, which has no fields")

    def _family_app(self, node: E.Subscript) -> Kind:
        head = E.dotted_name(node.value)
        if head is None or head not in self.families:
            known = ", ".join(self.families) or "none declared"
            raise _KErr(
                f"{E.unparse(node)}: unknown type family {head or E.unparse(node.value)!r} "
                f"(declared in signature.types: {known})",
                "unknown-name",
            )
        fam = self.families[head]
        params = self.family_kinds.get(head, {})
        if len(node.index) != len(fam.params):
            raise _KErr(
                f"{E.unparse(node)}: {head} takes {len(fam.params)} arguments "
                f"({', '.join(fam.params)}), got {len(node.index)}"
            )
        for (pname, pkind), arg in zip(params.items(), node.index, strict=False):
            ak = self.infer(arg)
            if not _assignable(ak, pkind):
                raise _KErr(
                    f"{E.unparse(node)}: {head}'s parameter {pname} is {pkind}, but "
                    f"{E.unparse(arg)} is {ak}"
                )
        return ShapeK()

    def _call(self, node: E.Call) -> Kind:
        prim: Primitive | None = PRIMITIVES.get(node.func)
        if prim is None and self.generators:
            prim = GENERATORS.get(node.func)
        if prim is None:
            known = sorted(PRIMITIVES) + (sorted(GENERATORS) if self.generators else [])
            raise _KErr(
                f"unknown primitive {node.func!r}; known: {', '.join(known)}", "unknown-name"
            )
        n = len(node.args)
        lo, hi = len(prim.params) - prim.optional, len(prim.params)
        if n < lo or (n > hi and not prim.variadic):
            raise _KErr(f"{node.func} takes {prim.arity_text()} arguments, got {n}")
        if prim.takes_names:
            name = E.dotted_name(node.args[0])
            if name in self.tensors:
                if not self.tensors[name]:
                    raise _KErr(
                        f"present({name}): {name} is never absent (it is not optional or "
                        f"nullable)",
                        "effects",
                    )
                return BoolK()
            k = self.infer(node.args[0])
            if not isinstance(k, MaybeK):
                raise _KErr(
                    f"present({E.unparse(node.args[0])}) needs an optional tensor or a Maybe "
                    f"parameter; it is {k}"
                )
            return BoolK()
        kinds = []
        for i, arg in enumerate(node.args):
            want = prim.params[i] if i < len(prim.params) else prim.variadic
            k = self.infer(arg.value if isinstance(arg, E.Starred) else arg)
            if isinstance(arg, E.Starred):
                if not isinstance(k, ShapeK):
                    raise _KErr(f"{node.func}: *{E.unparse(arg.value)} splices a Shape, got {k}")
                continue
            if not accepts(want, k):  # type: ignore[arg-type]
                raise _KErr(
                    f"{node.func}: argument {i + 1} must be {describe(want)}, but "  # type: ignore[arg-type]
                    f"{E.unparse(arg)} is {k}"
                )
            kinds.append(k)
        for kw, v in node.kwargs:
            if kw not in prim.kwargs:
                raise _KErr(f"{node.func} takes no keyword {kw!r}")
            k = self.infer(v)
            if not accepts(prim.kwargs[kw], k):
                raise _KErr(f"{node.func}: {kw}= must be {describe(prim.kwargs[kw])}, got {k}")
        return prim.result(kinds)

    def _comparable(self, op: str, a: Kind, b: Kind, ln: E.Node, rn: E.Node) -> None:
        if op in ("in", "not in"):
            if not isinstance(b, ShapeK):
                raise _KErr(f"{op!r} needs a tuple on the right; {E.unparse(rn)} is {b}")
            return
        ok = False
        if is_numeric(a) and is_numeric(b):
            ok = True
        elif op in ("==", "!="):
            if isinstance(a, EnumK) and isinstance(b, EnumK):
                lit, dom = (a, b) if isinstance(ln, E.Str) else (b, a)
                if isinstance(ln, E.Str) or isinstance(rn, E.Str):
                    missing = [v for v in lit.values if v not in dom.values]
                    if missing and not (isinstance(ln, E.Str) and isinstance(rn, E.Str)):
                        raise _KErr(
                            f"{missing[0]!r} is not a value of {dom}; the comparison "
                            f"{E.unparse(ln)} {op} {E.unparse(rn)} is always "
                            f"{'False' if op == '==' else 'True'}"
                        )
                ok = True
            elif isinstance(a, DTypeK) and isinstance(b, DTypeK):
                ok = True
            elif type(a) is type(b) and not isinstance(a, AdtK):
                ok = True
            elif isinstance(a, MaybeK | _NoneK) and isinstance(b, MaybeK | _NoneK):
                ok = True
        if not ok:
            raise _KErr(
                f"cannot compare {E.unparse(ln)} ({a}) {op} {E.unparse(rn)} ({b}): the kinds "
                f"differ"
            )


def _assignable(value: Kind, target: Kind) -> bool:
    if value == target:
        return True
    if isinstance(target, IntK | DimK) and isinstance(value, DimK | IntK):
        return True
    if isinstance(target, FloatK) and is_numeric(value):
        return True
    if isinstance(target, DTypeK) and isinstance(value, DTypeK):
        return set(value.members) <= set(target.members)
    if isinstance(target, EnumK) and isinstance(value, EnumK):
        return set(value.values) <= set(target.values)
    if isinstance(target, MaybeK):
        return isinstance(value, _NoneK) or _assignable(value, target.inner)
    return False


def _join(a: Kind, b: Kind, node: E.Node) -> Kind:
    if a == b:
        return a
    if is_numeric(a) and is_numeric(b):
        if isinstance(a, FloatK) or isinstance(b, FloatK):
            return FloatK()
        return IntK()
    if isinstance(a, EnumK) and isinstance(b, EnumK):
        return EnumK(tuple(dict.fromkeys(a.values + b.values)))
    if isinstance(a, DTypeK) and isinstance(b, DTypeK):
        return DTypeK(tuple(dict.fromkeys(a.members + b.members)))
    raise _KErr(f"{E.unparse(node)}: the branches have different kinds ({a} and {b})")


# --- the validator ----------------------------------------------------------------------------


class _Report:
    def __init__(self, file: str, spec: SpecFile | None, lines: Mapping[str, int] | None = None):
        self.file = file
        self.spec = spec
        self.lines = lines or {}
        self.items: list[Diagnostic] = []

    def add(self, path: str, message: str, rule: str) -> None:
        line = self.spec.line_of(path) if self.spec else _line_of(self.lines, path)
        self.items.append(Diagnostic(self.file, line, path, message, rule))


def _line_of(lines: Mapping[str, int], path: str) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path.rpartition(".")[0]
    return None


def validate_entry(
    name: str,
    entry: OpEntry,
    *,
    spec: SpecFile | None = None,
    adts: Mapping[str, AdtDef] | None = None,
    known_ops: Iterable[str] | None = None,
) -> list[Diagnostic]:
    """Every rule on one entry. Returns the diagnostics (empty when the entry is valid)."""
    report = _Report(spec.path if spec else "<entry>", spec)
    _EntryValidator(name, entry, report, dict(adts or {}), known_ops).run()
    return report.items


class _EntryValidator:
    def __init__(self, name, entry: OpEntry, report: _Report, adts, known_ops) -> None:
        self.name = name
        self.entry = entry
        self.sig = entry.signature
        self.r = report
        self.adts: dict[str, AdtDef] = adts
        self.known_ops = set(known_ops) if known_ops is not None else None
        self.model = EntryModel(name)
        self.family_kinds: dict[str, dict[str, Kind]] = {}
        #: declared names whose kind could not be read (already reported): expressions that
        #: name them are not checked again, so one bad kind gives one diagnostic
        self.broken: set[str] = set()
        self.p = f"{name}.signature"

    # -- helpers --

    def kinds(self, scope=None, generators=False) -> _Kinds:
        tensors = {n: n in self.model.optional_inputs for n in self.sig.inputs}
        tensors.update({n: n in self.model.nullable_outputs for n in self.sig.outputs})
        return _Kinds(
            self.model.kinds if scope is None else scope,
            self.sig.types,
            tensors,
            self.adts,
            generators,
            self.family_kinds,
        )

    def check(self, path: str, ex: Expr, want: str, scope=None, generators=False,
              broken: set[str] | None = None) -> Kind | None:
        if any(n in (self.broken if broken is None else broken) for n in ex.names()):
            return None
        try:
            k = self.kinds(scope, generators).infer(ex.node)
        except _KErr as err:
            self.r.add(path, f"{ex.text!r}: {err.message}", err.rule)
            return None
        bad = (
            (want == "bool" and not isinstance(k, BoolK))
            or (want == "num" and not is_numeric(k))
            or (want == "shape" and not isinstance(k, ShapeK))
            or (want == "dtype" and not isinstance(k, DTypeK))
        )
        if bad:
            noun = {"bool": "a Bool predicate", "num": "a number", "shape": "a shape",
                    "dtype": "a DType"}[want]
            self.r.add(path, f"{ex.text!r} is {k}, but {noun} is expected here", "kind")
            return None
        return k

    def kind_of(self, path: str, ex: Expr) -> Kind | None:
        try:
            return kind_from_expr(ex.node, set(self.adts))
        except KindError as err:
            self.r.add(path, str(err), "kind")
            return None

    # -- the rules, in dependency order --

    def run(self) -> None:
        self.sources()
        self.families()
        self.lets()
        self.tensors()
        self.refinements()
        self.solvability()
        self.roofline()
        self.composition()
        if not any(d.rule in ("kind", "unknown-name", "index-source", "let-cycle", "family")
                   for d in self.r.items):
            self.workloads()

    def sources(self) -> None:
        seen: dict[str, str] = {}
        groups = [
            ("forall", self.sig.forall),
            ("params", self.sig.params),
            ("let", self.sig.let),
            ("data", self.sig.data),
        ]
        tensor_names = set(self.sig.inputs) | set(self.sig.outputs)
        for group, table in groups:
            for n in table:
                path = f"{self.p}.{group}.{n}"
                if not n.isidentifier():
                    self.r.add(path, f"{n!r} is not a valid index name", "index-source")
                    continue
                if n in seen:
                    self.r.add(
                        path,
                        f"index {n!r} has two sources: {seen[n]} and {group}; an index is "
                        f"declared exactly once",
                        "index-source",
                    )
                    continue
                if n in tensor_names:
                    self.r.add(path, f"{n!r} names both an index and a tensor", "index-source")
                if n in self.sig.types:
                    self.r.add(path, f"{n!r} names both an index and a type family",
                               "index-source")
                seen[n] = group
                self.model.sources[n] = group
        for n, ex in self.sig.forall.items():
            k = self.kind_of(f"{self.p}.forall.{n}", ex)
            if k is not None:
                self.model.kinds[n] = k
            else:
                self.broken.add(n)
        for n, prm in self.sig.params.items():
            k = self.kind_of(f"{self.p}.params.{n}.type", prm.type)
            if self.model.sources.get(n) != "params":
                continue  # a second source, already reported: the first one's kind stands
            if k is None:
                self.broken.add(n)
                continue
            self.model.kinds[n] = k
            if not prm.required:
                err = _conforms(prm.default, k, self.adts)
                if err:
                    self.r.add(f"{self.p}.params.{n}.default",
                               f"default {prm.default!r} is not {k}: {err}", "default")
        for n, ex in self.sig.data.items():
            k = self.kind_of(f"{self.p}.data.{n}", ex)
            if self.model.sources.get(n) != "data":
                continue  # a second source, already reported: the first one's kind stands
            if k is None:
                self.broken.add(n)
            else:
                self.model.kinds[n] = k
        for n, d in self.sig.inputs.items():
            if d.optional != Expr("False"):
                self.model.optional_inputs.add(n)
        for n, d in self.sig.outputs.items():
            if d.nullable != Expr("False"):
                self.model.nullable_outputs.add(n)

    def families(self) -> None:
        for fname, fam in self.sig.types.items():
            path = f"{self.p}.types.{fname}"
            kinds: dict[str, Kind] = {}
            for pn, pex in fam.params.items():
                k = self.kind_of(f"{path}.params.{pn}", pex)
                if k is not None:
                    kinds[pn] = k
            fam_broken = set(fam.params) - set(kinds)
            self.family_kinds[fname] = kinds
            discs = fam.discriminants
            domains: list[list[Any]] = []
            for d in discs:
                if d not in fam.params:
                    self.r.add(f"{path}.match", f"match names {d!r}, which is not a parameter "
                               f"of {fname} ({', '.join(fam.params)})", "family")
                    return
                k = kinds.get(d)
                if k is None:
                    return
                if not is_discriminant(k):
                    self.r.add(f"{path}.match", f"{fname} matches on {d}, which is {k}; a "
                               f"discriminant is Bool, an enum, a DType or an ADT", "family")
                    return
                domains.append(_domain(k, self.adts))
            covered: dict[tuple, int] = {}
            for i, case in enumerate(fam.cases):
                cpath = f"{path}.cases[{i}]"
                whens = [case.when] if len(discs) == 1 else case.when
                if not isinstance(whens, list | tuple) or len(whens) != len(discs):
                    self.r.add(cpath, f"when must give {len(discs)} values ({', '.join(discs)})",
                               "family")
                    continue
                for w, dom, d in zip(whens, domains, discs, strict=True):
                    if w != "_" and not any(_same(w, v) for v in dom):
                        self.r.add(cpath, f"when {w!r} is not a value of {d} "
                                   f"({', '.join(map(_fmt, dom))})", "family")
                        break
                else:
                    combos = itertools.product(*[
                        dom if w == "_" else [w] for w, dom in zip(whens, domains, strict=True)
                    ])
                    new = [c for c in map(_key, combos) if c not in covered]
                    if not new:
                        prev = covered[_key(tuple(whens))] if _key(tuple(whens)) in covered else (
                            min(covered.values()) if covered else 0)
                        self.r.add(cpath, f"this case is already covered by case {prev} "
                                   f"(cases are tried in order; remove the duplicate)", "family")
                    for c in new:
                        covered[c] = i
                scope = dict(kinds)
                self.check(f"{cpath}.is", case.is_, "shape", scope=scope, broken=fam_broken)
            missing = [c for c in itertools.product(*domains) if _key(c) not in covered]
            if missing and domains:
                shown = ", ".join("(" + ", ".join(map(_fmt, c)) + ")" if len(c) > 1 else
                                  _fmt(c[0]) for c in missing[:4])
                self.r.add(f"{path}.cases", f"{fname} is not total: no case for "
                           f"{' x '.join(discs)} = {shown}", "family")

    def lets(self) -> None:
        deps = {n: [m for m in ex.names() if m in self.sig.let] for n, ex in self.sig.let.items()}
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(n: str, stack: list[str]) -> bool:
            if state.get(n) == 2:
                return True
            if state.get(n) == 1:
                cyc = stack[stack.index(n):] + [n]
                self.r.add(f"{self.p}.let.{cyc[0]}", "let has a cycle: " + " -> ".join(cyc),
                           "let-cycle")
                return False
            state[n] = 1
            ok = all(visit(m, stack + [n]) for m in deps[n])
            state[n] = 2
            order.append(n)
            return ok

        for n in self.sig.let:
            if not visit(n, []):
                return
        self.model.let_order = order
        for n in order:
            k = self.check(f"{self.p}.let.{n}", self.sig.let[n], "any")
            if k is not None and self.model.sources.get(n) == "let":
                self.model.kinds[n] = k

    def tensors(self) -> None:
        params_only = {n: k for n, k in self.model.kinds.items()
                       if self.model.sources.get(n) == "params"}
        first_optional = None
        for n in self.sig.inputs:
            if n in self.model.optional_inputs:
                first_optional = first_optional or n
            elif first_optional is not None:
                self.r.add(f"{self.p}.inputs.{n}", f"input {n} is required but comes after the "
                           f"optional input {first_optional}; optional inputs come last, so a "
                           f"positional call can leave them out", "effects")
        for group, table in (("inputs", self.sig.inputs), ("outputs", self.sig.outputs)):
            for n, d in table.items():
                path = f"{self.p}.{group}.{n}"
                if not n.isidentifier():
                    self.r.add(path, f"{n!r} is not a valid tensor name", "index-source")
                self.check(f"{path}.dtype", d.dtype, "dtype")
                if not isinstance(d.shape.node, E.List | E.Subscript):
                    self.r.add(f"{path}.shape", f"{d.shape.text!r}: a shape is a list "
                               f"([M, N], [*S]) or a type family application (Mat[t, M, K])",
                               "kind")
                else:
                    self.check(f"{path}.shape", d.shape, "shape")
                flags = (("optional", d.optional), ("mutated", d.mutated)) if group == "inputs" \
                    else (("nullable", d.nullable),)
                for flag, ex in flags:
                    bad = [m for m in ex.names() if m not in params_only
                           and m not in self.sig.inputs and m not in self.sig.outputs]
                    if bad:
                        self.r.add(f"{path}.{flag}", f"{ex.text!r}: {flag} may depend only on "
                                   f"construction params and present(...); {bad[0]!r} is not "
                                   f"a construction param", "effects")
                        continue
                    self.check(f"{path}.{flag}", ex, "bool")
                if group == "inputs":
                    if d.write_only and d.mutated == Expr("False"):
                        self.r.add(f"{path}.write_only", "write_only is for an input the op "
                                   "writes; set mutated too", "effects")
                    if d.values is not None:
                        self.check_values(f"{path}.values", d.values)
                else:
                    self.check_alias(path, n, d)

    def check_values(self, path: str, ex: Expr) -> None:
        if not (isinstance(ex.node, E.Call) and ex.node.func in GENERATORS):
            self.r.add(path, f"{ex.text!r}: values is a generator call, one of "
                       f"{', '.join(sorted(GENERATORS))}", "unknown-name")
            return
        self.check(path, ex, "any", generators=True)

    def check_alias(self, path: str, n: str, d) -> None:
        if d.alias is None:
            return
        if d.buffer:
            self.r.add(f"{path}.buffer", "an aliased output is the input itself; it cannot also "
                       "take a caller's buffer", "effects")
        src = self.sig.inputs.get(d.alias)
        if src is None:
            self.r.add(f"{path}.alias", f"alias {d.alias!r} is not an input (inputs: "
                       f"{', '.join(self.sig.inputs) or 'none'})", "effects")
            return
        if src.mutated == Expr("False"):
            self.r.add(f"{path}.alias", f"output {n} aliases input {d.alias}, which is never "
                       f"written; declare mutated on {d.alias}", "effects")
        if src.dtype != d.dtype or src.shape != d.shape:
            self.r.add(f"{path}.alias", f"output {n} aliases input {d.alias} but their types "
                       f"differ: Tensor[{src.dtype}, {src.shape}] vs "
                       f"Tensor[{d.dtype}, {d.shape}]", "effects")
        # A conditional mutation (mutated: inplace) is fine: the output is the input object
        # in the calls that write it and a fresh tensor in the others, as in the design
        # documents' activation example.

    def refinements(self) -> None:
        for i, ex in enumerate(self.sig.shape_rules):
            self.check(f"{self.p}.shape_rules[{i}]", ex, "bool")

    def roofline(self) -> None:
        rf = self.entry.roofline
        if rf is None:
            return
        self.check(f"{self.name}.roofline.flops", rf.flops, "num")
        if rf.bytes is not None:
            self.check(f"{self.name}.roofline.bytes", rf.bytes, "num")

    def composition(self) -> None:
        comp = self.entry.composition
        if comp is None:
            return
        seen: set[str] = set()
        for i, st in enumerate(comp.stages):
            path = f"{self.name}.composition.stages[{i}]"
            if st.name in seen:
                self.r.add(path, f"stage {st.name!r} is declared twice", "composition")
            seen.add(st.name)
            if self.known_ops is not None and st.op not in self.known_ops:
                self.r.add(path, f"stage {st.name!r} runs {st.op!r}, which is not a known op",
                           "composition")
            if st.op == self.name:
                self.r.add(path, f"{self.name} cannot be a stage of itself", "composition")

    # -- solvability --

    def solvability(self) -> None:
        if any(d.rule in ("kind", "unknown-name", "family", "index-source")
               for d in self.r.items):
            return
        targets = [n for n in self.sig.forall if n in self.model.kinds]
        required = [(n, d) for n, d in self.sig.inputs.items()
                    if n not in self.model.optional_inputs]
        dtype_solved = {d.dtype.node.id for _, d in required if isinstance(d.dtype.node, E.Name)}
        apps = _family_apps([d.shape.node for _, d in required], self.sig.types)
        choices = [[(app, i) for i in range(len(self.sig.types[app[0]].cases))] for app in apps]
        unsolved: dict[str, str] = {}
        for combo in itertools.product(*choices) if choices else [()]:
            chosen = dict(combo)
            forms = [_instantiate(d.shape.node, self.sig.types, chosen) for _, d in required]
            known = {n for n, s in self.model.sources.items() if s == "params"}
            solved = _solve(forms, set(targets), known, self.model.kinds)
            for n in targets:
                k = self.model.kinds[n]
                ok = n in dtype_solved if isinstance(k, DTypeK) else n in solved
                if not ok and n not in unsolved:
                    unsolved[n] = ", ".join(
                        f"{app[0]}[{', '.join(map(E.unparse, app[1]))}] is "
                        f"{self.sig.types[app[0]].cases[i].is_.text}"
                        for app, i in combo) if combo else ""
        for n, where in unsolved.items():
            k = self.model.kinds[n]
            how = ("no required input has dtype " + n) if isinstance(k, DTypeK) else (
                f"{n} does not appear where unification can read it (a bare axis, an affine "
                f"axis like 2 * {n} + 1, or the only unknown-length *{n} of a required input)")
            self.r.add(f"{self.p}.forall.{n}", f"forall index {n} is not solvable from the "
                       f"inputs: {how}" + (f" (when {where})" if where else ""), "solvable")

    # -- workloads --

    def workloads(self) -> None:
        forall_dtype = [n for n, k in self.model.kinds.items()
                        if self.model.sources.get(n) == "forall" and isinstance(k, DTypeK)]
        needed = [n for n in self.sig.forall if n not in forall_dtype]
        for i, row in enumerate(self.entry.workloads):
            path = f"{self.name}.workloads[{i}]"
            errors_before = len(self.r.items)
            allowed = set(self.sig.forall) | set(self.sig.params) | set(self.sig.data)
            for k in row.values:
                if k not in allowed:
                    hint = " (let values are computed, not given)" if k in self.sig.let else ""
                    self.r.add(f"{path}.{k}", f"{k!r} is not an index or a param of "
                               f"{self.name}{hint}", "workload")
            missing = [n for n in needed if n not in row.values]
            missing += [n for n, p in self.sig.params.items()
                        if p.required and n not in row.values]
            missing += [n for n in self.sig.data if n not in row.values]
            if missing:
                self.r.add(path, f"workload {row.label!r} does not give "
                           f"{', '.join(missing)}", "workload")
            for k, v in row.values.items():
                kind = self.model.kinds.get(k)
                if kind is not None:
                    err = _conforms(v, kind, self.adts)
                    if err:
                        self.r.add(f"{path}.{k}", f"{k} = {v!r} is not {kind}: {err}", "workload")
            for s in row.some:
                if s not in self.model.optional_inputs:
                    self.r.add(f"{path}.some", f"some names {s!r}, which is not an optional "
                               f"input ({', '.join(sorted(self.model.optional_inputs)) or 'none'})",
                               "workload")
            cases = list(row.dtype_cases) or [{}]
            for j, case in enumerate(cases):
                cpath = f"{path}.dtype_cases[{j}]" if row.dtype_cases else path
                for n in forall_dtype:
                    members = self.model.kinds[n].members  # type: ignore[attr-defined]
                    if n not in case and len(members) != 1:
                        self.r.add(cpath, f"dtype case does not give {n} "
                                   f"({' | '.join(members)})", "workload")
                    elif n in case and case[n] not in members:
                        self.r.add(cpath, f"{n} = {case[n]!r} is not in "
                                   f"DType[{' | '.join(members)}]", "workload")
                for n in case:
                    if n not in forall_dtype:
                        self.r.add(cpath, f"{n!r} is not a DType index of {self.name}",
                                   "workload")
            if len(self.r.items) > errors_before:
                continue
            for j, case in enumerate(cases):
                self.instantiate(row, case, f"{path}.dtype_cases[{j}]" if row.dtype_cases else path)

    def instantiate(self, row, case: dict, path: str) -> None:
        values: dict[str, Any] = {}
        for n, k in self.model.kinds.items():
            src = self.model.sources.get(n)
            if src == "let":
                continue
            if n in case:
                values[n] = case[n]
            elif n in row.values:
                values[n] = _to_value(row.values[n], k, self.adts)
            elif src == "params":
                values[n] = _to_value(self.sig.params[n].default, k, self.adts)
            elif isinstance(k, DTypeK) and len(k.members) == 1:
                values[n] = k.members[0]
        present = {n: (n in row.some) for n in self.model.optional_inputs}
        scope = Scope(values, self.sig.types, present)
        try:
            for n in self.model.let_order:
                values[n] = evaluate(self.sig.let[n].node, scope)
        except EvalError as exc:
            self.r.add(path, f"workload {row.label!r}: let {n} = "
                       f"{self.sig.let[n].text}: {exc}", "workload")
            return
        for n in self.model.optional_inputs:
            d = self.sig.inputs[n]
            if d.optional != Expr("True"):
                try:
                    may_omit = evaluate(d.optional.node, scope)
                except EvalError as exc:
                    self.r.add(path, f"workload {row.label!r}: optional of {n}: {exc}",
                               "workload")
                    return
                if not may_omit and not present[n]:
                    self.r.add(path, f"workload {row.label!r} omits {n}, which is required "
                               f"here ({d.optional.text} is False)", "workload")
        for rule in self.sig.shape_rules:
            try:
                ok = evaluate(rule.node, scope)
            except EvalError as exc:
                self.r.add(path, f"workload {row.label!r}: refinement {rule.text!r}: {exc}",
                           "workload")
                continue
            if not ok:
                shown = ", ".join(f"{n}={values[n]!r}" for n in rule.names() if n in values)
                self.r.add(path, f"workload {row.label!r} breaks refinement {rule.text!r} "
                           f"({shown})", "workload")
        for group, table in (("inputs", self.sig.inputs), ("outputs", self.sig.outputs)):
            for n, d in table.items():
                if group == "inputs" and n in present and not present[n]:
                    continue
                try:
                    shape = eval_shape(d.shape.node, scope)
                except EvalError as exc:
                    self.r.add(path, f"workload {row.label!r}: shape of {n} "
                               f"({d.shape.text}): {exc}", "workload")
                    continue
                if any(s < 0 for s in shape):
                    self.r.add(path, f"workload {row.label!r}: {n} would have shape {shape} "
                               f"({d.shape.text}), with a negative axis", "workload")
                if group == "inputs" and d.values is not None:
                    try:
                        data = evaluate(d.values.node, Scope(values, self.sig.types, present,
                                                             generators=True))
                    except EvalError as exc:
                        self.r.add(path, f"workload {row.label!r}: values of {n}: {exc}",
                                   "workload")
                        continue
                    numel = 1
                    for s in shape:
                        numel *= s
                    if len(data) != numel:
                        self.r.add(path, f"workload {row.label!r}: values of {n} "
                                   f"({d.values.text}) gives {len(data)} elements, but its shape "
                                   f"{shape} holds {numel}", "workload")


# --- value conformance -----------------------------------------------------------------------


def _domain(k: Kind, adts: Mapping[str, AdtDef]) -> list[Any]:
    if isinstance(k, BoolK):
        return [False, True]
    if isinstance(k, EnumK):
        return list(k.values)
    if isinstance(k, DTypeK):
        return list(k.members)
    if isinstance(k, AdtK):
        return list(adts[k.name].constructors) if k.name in adts else []
    return []


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def _key(combo: tuple) -> tuple:
    return tuple((type(v).__name__, v) for v in combo)


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _conforms(v: Any, k: Kind, adts: Mapping[str, AdtDef]) -> str | None:  # noqa: C901
    if isinstance(k, MaybeK):
        return None if v is None else _conforms(v, k.inner, adts)
    if v is None:
        return "None is only a value of Maybe[...] (write the type as X | None)"
    if isinstance(k, BoolK):
        return None if isinstance(v, bool) else "expected true or false"
    if isinstance(k, DimK):
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        return None if ok else "expected a non-negative integer"
    if isinstance(k, IntK):
        ok = isinstance(v, int) and not isinstance(v, bool)
        return None if ok else "expected an integer"
    if isinstance(k, FloatK):
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        return None if ok else "expected a number"
    if isinstance(k, ShapeK):
        ok = isinstance(v, list | tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
        return None if ok else "expected a list of non-negative integers"
    if isinstance(k, PerAxisK):
        if isinstance(v, int) and not isinstance(v, bool):
            return None
        ok = isinstance(v, list | tuple) and len(v) in (1, k.n) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v)
        return None if ok else f"expected an integer or a list of {k.n} integers"
    if isinstance(k, EnumK):
        return None if v in k.values else f"expected one of {', '.join(map(repr, k.values))}"
    if isinstance(k, DTypeK):
        return None if v in k.members else f"expected one of {', '.join(k.members)}"
    if isinstance(k, AdtK):
        adt = adts.get(k.name)
        if adt is None:
            return f"ADT {k.name} is not defined"
        if not (isinstance(v, dict) and len(v) == 1):
            return (f"write an ADT value as {{constructor: {{field: value}}}}; constructors: "
                    f"{', '.join(adt.constructors)}")
        (ctor_name, fields), = v.items()
        ctor = adt.constructors.get(ctor_name)
        if ctor is None:
            return f"{ctor_name!r} is not a constructor of {k.name} ({', '.join(adt.constructors)})"
        fields = fields or {}
        if set(fields) != set(ctor.fields):
            return f"{ctor_name} has fields {', '.join(ctor.fields) or 'none'}; got " \
                   f"{', '.join(fields) or 'none'}"
        for fn, fex in ctor.fields.items():
            err = _conforms(fields[fn], kind_from_expr(fex.node, set(adts)), adts)
            if err:
                return f"{ctor_name}.{fn}: {err}"
        if ctor.invariant is not None:
            scope = Scope({fn: _to_value(fv, kind_from_expr(ctor.fields[fn].node, set(adts)),
                                         adts) for fn, fv in fields.items()})
            try:
                if not evaluate(ctor.invariant.node, scope):
                    return f"{ctor_name} breaks its invariant {ctor.invariant.text!r}"
            except EvalError as exc:
                return f"{ctor_name}: invariant: {exc}"
        return None
    return None


def _to_value(v: Any, k: Kind, adts: Mapping[str, AdtDef]) -> Any:
    if isinstance(k, MaybeK):
        return None if v is None else _to_value(v, k.inner, adts)
    if isinstance(k, ShapeK) or (isinstance(k, PerAxisK) and isinstance(v, list)):
        return tuple(v)
    if isinstance(k, AdtK) and isinstance(v, dict):
        (ctor_name, fields), = v.items()
        ctor = adts[k.name].constructors[ctor_name]
        return AdtValue(ctor_name, {
            fn: _to_value(fv, kind_from_expr(ctor.fields[fn].node, set(adts)), adts)
            for fn, fv in (fields or {}).items()
        })
    return v


# --- unification solvability -----------------------------------------------------------------


def _family_apps(shapes: list[E.Node], families: Mapping[str, TypeFamily]) -> list[tuple]:
    apps: dict[tuple, None] = {}
    for s in shapes:
        for n in E.walk(s):
            if isinstance(n, E.Subscript) and E.dotted_name(n.value) in families:
                apps[(E.dotted_name(n.value), n.index)] = None
    return list(apps)


def _substitute(node: E.Node, env: Mapping[str, E.Node]) -> E.Node:
    if isinstance(node, E.Name):
        return env.get(node.id, node)
    if isinstance(node, E.List | E.Tuple):
        return type(node)(tuple(_substitute(i, env) for i in node.items))
    if isinstance(node, E.Starred):
        return E.Starred(_substitute(node.value, env))
    if isinstance(node, E.BinOp):
        return E.BinOp(node.op, _substitute(node.left, env), _substitute(node.right, env))
    if isinstance(node, E.UnaryOp):
        return E.UnaryOp(node.op, _substitute(node.operand, env))
    if isinstance(node, E.Call):
        return E.Call(node.func, tuple(_substitute(a, env) for a in node.args),
                      tuple((k, _substitute(v, env)) for k, v in node.kwargs))
    return node


def _instantiate(shape: E.Node, families, chosen: Mapping[tuple, int]) -> E.Node:
    """The shape with each family application replaced by its chosen case (spliced where
    it is starred inside a list)."""
    if isinstance(shape, E.Subscript):
        name = E.dotted_name(shape.value)
        fam = families[name]
        case = fam.cases[chosen[(name, shape.index)]]
        env = dict(zip(fam.params, shape.index, strict=True))
        return _substitute(case.is_.node, env)
    if isinstance(shape, E.List):
        items: list[E.Node] = []
        for it in shape.items:
            if isinstance(it, E.Starred) and isinstance(it.value, E.Subscript) \
                    and E.dotted_name(it.value.value) in families:
                inner = _instantiate(it.value, families, chosen)
                if isinstance(inner, E.List):
                    items.extend(inner.items)
                    continue
            items.append(it)
        return E.List(tuple(items))
    return shape


def _affine_unknown(node: E.Node, known: set[str], dims: set[str]) -> str | None:
    """The single unknown Dim in an invertible (+, -, * by known) expression, if any."""
    unknown = [n for n in E.names(node) if n not in known]
    if len(unknown) != 1 or unknown[0] not in dims:
        return None

    def invertible(n: E.Node) -> bool:
        if isinstance(n, E.Name | E.Int):
            return True
        if isinstance(n, E.BinOp) and n.op in ("+", "-"):
            return invertible(n.left) and invertible(n.right)
        if isinstance(n, E.BinOp) and n.op == "*":
            lu = any(x not in known for x in E.names(n.left))
            ru = any(x not in known for x in E.names(n.right))
            return not (lu and ru) and invertible(n.left) and invertible(n.right)
        if isinstance(n, E.UnaryOp) and n.op == "-":
            return invertible(n.operand)
        return not any(x not in known for x in E.names(n))

    return unknown[0] if invertible(node) else None


def _solve(forms: list[E.Node], targets: set[str], known: set[str],
           kinds: Mapping[str, Kind]) -> set[str]:
    solved = set(known)
    dims = {n for n, k in kinds.items() if isinstance(k, DimK | IntK)}
    shapes = {n for n, k in kinds.items() if isinstance(k, ShapeK)}
    changed = True
    while changed:
        changed = False
        for form in forms:
            if not isinstance(form, E.List):
                continue
            items = form.items
            unknown_stars = [i for i, it in enumerate(items) if isinstance(it, E.Starred)
                             and any(n not in solved for n in E.names(it.value))]
            if len(unknown_stars) <= 1:
                positional = range(len(items))
            else:  # only the axes before the first / after the last unknown star are placed
                positional = [*range(unknown_stars[0]), *range(unknown_stars[-1] + 1, len(items))]
            for i in positional:
                it = items[i]
                if isinstance(it, E.Starred):
                    if isinstance(it.value, E.Name) and it.value.id in shapes \
                            and it.value.id not in solved and len(unknown_stars) == 1:
                        solved.add(it.value.id)
                        changed = True
                    continue
                n = _affine_unknown(it, solved, dims)
                if n is not None and n not in solved:
                    solved.add(n)
                    changed = True
    return solved


# --- files ------------------------------------------------------------------------------------


def validate_types(types: TypesFile, file: str = "types.yaml",
                   lines: Mapping[str, int] | None = None) -> list[Diagnostic]:
    report = _Report(file, None, lines)
    names = set(types.adts)
    for an, adt in types.adts.items():
        if not an.isidentifier():
            report.add(f"adts.{an}", f"{an!r} is not a valid ADT name", "adt")
        if not adt.constructors:
            report.add(f"adts.{an}", f"ADT {an} has no constructors", "adt")
        for cn, ctor in adt.constructors.items():
            path = f"adts.{an}.constructors.{cn}"
            if not _DOTTED.match(ctor.python):
                report.add(f"{path}.python", f"python must be a dotted class path "
                           f"(package.module.Class), got {ctor.python!r}", "adt")
            scope: dict[str, Kind] = {}
            for fn, fex in ctor.fields.items():
                try:
                    scope[fn] = kind_from_expr(fex.node, names)
                except KindError as err:
                    report.add(f"{path}.fields.{fn}", str(err), "adt")
            if ctor.invariant is not None:
                try:
                    k = _Kinds(scope, {}, {}, types.adts).infer(ctor.invariant.node)
                    if not isinstance(k, BoolK):
                        report.add(f"{path}.invariant", f"{ctor.invariant.text!r} is {k}, but "
                                   f"an invariant is a Bool predicate", "adt")
                except _KErr as err:
                    report.add(f"{path}.invariant", f"{ctor.invariant.text!r}: {err.message}",
                               err.rule)
    return report.items


def validate_spec_file(spec: SpecFile, adts: Mapping[str, AdtDef] | None = None,
                       known_ops: Iterable[str] | None = None) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    known = set(known_ops) if known_ops is not None else set(spec.entries)
    for name, entry in spec.entries.items():
        out += validate_entry(name, entry, spec=spec, adts=adts, known_ops=known)
    return out


def check_paths(paths: Iterable[str | Path]) -> tuple[list[SpecFile], list[Diagnostic]]:
    """Load and validate spec files and folders. A ``types.yaml`` found among them (or beside
    them) provides the shared ADTs. Returns the loaded files and every diagnostic."""
    from .loader import load_spec_file, load_types_file

    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*.yaml") if q.is_file())
        else:
            files.append(p)
    type_files = [f for f in files if f.name == "types.yaml"]
    if not type_files:
        for f in files:
            beside = f.parent / "types.yaml"
            if beside.is_file() and beside not in type_files:
                type_files.append(beside)
    diags: list[Diagnostic] = []
    adts: dict[str, AdtDef] = {}
    for tf in type_files:
        try:
            types, lines = load_types_file(tf)
        except SpecError as err:
            diags += err.diagnostics
            continue
        diags += validate_types(types, str(tf), lines)
        adts.update(types.adts)
    loaded: list[SpecFile] = []
    for f in files:
        if f.name == "types.yaml":
            continue
        try:
            loaded.append(load_spec_file(f))
        except SpecError as err:
            diags += err.diagnostics
        except OSError as err:
            diags.append(Diagnostic(str(f), None, "", f"cannot read: {err.strerror}", "io"))
    known = {n for s in loaded for n in s.entries}
    seen: dict[str, str] = {}
    for s in loaded:
        for n in s.entries:
            if n in seen:
                diags.append(Diagnostic(s.path, s.line_of(n), n,
                                        f"op {n} is also declared in {seen[n]}", "index-source"))
            seen.setdefault(n, s.path)
        diags += validate_spec_file(s, adts, known)
    return loaded, diags
