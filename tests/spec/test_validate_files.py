"""The validator's library calls and ``check_paths`` (files, folders, types.yaml, ops across
files); every rule has a passing and a failing case; the validator's modules import each other
without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import tileops.spec
from tileops.spec import (
    RULES,
    Diagnostic,
    load_spec_text,
    validate_entry,
    validate_spec_file,
)
from tileops.spec.validate import check_paths

from . import (
    test_backward,
    test_bounds,
    test_validate_adts,
    test_validate_effects,
    test_validate_families,
    test_validate_kinds,
    test_validate_signature,
    test_validate_workloads,
)
from .validate_base import (
    BASE,
    FLAG,
    FLOPS,
    LAYOUT,
    ROW,
    TYPES,
    TYPES_TEXT,
    diagnostics,
    edit,
    types_edit,
)

RULE_MODULES = (test_validate_signature, test_validate_kinds, test_validate_families, test_bounds,
                test_validate_effects, test_validate_workloads, test_backward)


def test_the_base_spec_is_valid() -> None:
    assert diagnostics(BASE) == []



def test_every_rule_has_a_passing_and_a_failing_case() -> None:
    failing = [p for m in RULE_MODULES for p in m.FAILING]
    failing_rules = {p.id.split(":")[0] for p in failing} | {
        p.id.split(":")[0] for p in test_validate_adts.ADT_FAILING}
    assert failing_rules == set(RULES)
    passing_rules = [r for m in RULE_MODULES for r in m.PASSING]
    assert len(passing_rules) == len(set(passing_rules))  # each rule's cases in one module
    assert set(passing_rules) | {"adt"} == set(RULES)
    # each failing case's id names the rule of its first diagnostic
    for p in failing:
        assert p.values[1][0][0] == p.id.split(":")[0], p.id


# --- the library calls --------------------------------------------------------------------------


def test_validate_entry_without_a_file_has_no_line() -> None:
    spec = load_spec_text(edit(FLOPS, 'flops: "M * Q"'), "op.yaml")
    (d,) = validate_entry("Op", spec.entries["Op"], adts=TYPES.adts)
    assert d == Diagnostic("<entry>", None, "Op.roofline.flops", "'M * Q': unknown name 'Q'",
                           "unknown-name")
    assert str(d) == "<entry>: in Op.roofline.flops: 'M * Q': unknown name 'Q'"
    # with the file it names the line
    (d,) = validate_entry("Op", spec.entries["Op"], spec=spec, adts=TYPES.adts)
    assert str(d) == "op.yaml:15: in Op.roofline.flops: 'M * Q': unknown name 'Q'"


def test_validate_spec_file_takes_the_known_ops() -> None:
    text = edit("  roofline:", "  composition:\n    stages:\n    - {name: a, op: Elsewhere}\n"
                               "  roofline:")
    spec = load_spec_text(text, "op.yaml")
    assert validate_spec_file(spec, TYPES.adts, known_ops={"Op", "Elsewhere"}) == []
    assert [d.rule for d in validate_spec_file(spec, TYPES.adts)] == ["composition"]



# --- check_paths: files, folders, types.yaml, ops across files ----------------------------------


def write(folder: Path, name: str, text: str) -> Path:
    p = folder / name
    p.write_text(text, encoding="utf-8")
    return p


def test_check_paths_reads_a_folder_with_its_types(tmp_path: Path) -> None:
    write(tmp_path, "types.yaml", TYPES_TEXT)
    write(tmp_path, "a.yaml", edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"))
    loaded, diags = check_paths([tmp_path])
    assert diags == []
    assert [Path(s.path).name for s in loaded] == ["a.yaml"]


def test_check_paths_finds_types_beside_a_file(tmp_path: Path) -> None:
    write(tmp_path, "types.yaml", TYPES_TEXT)
    a = write(tmp_path, "a.yaml", edit(FLAG, LAYOUT,
                                       ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"))
    assert check_paths([a])[1] == []


def test_check_paths_knows_the_ops_of_every_file(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", edit("  roofline:", "  composition:\n    stages:\n"
                                                  "    - {name: a, op: Other}\n  roofline:"))
    write(tmp_path, "b.yaml", "Other:\n  family: test\n  status: planned\n  signature: {}\n")
    assert check_paths([tmp_path])[1] == []


def test_check_paths_rejects_an_op_declared_in_two_files(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", BASE)
    write(tmp_path, "b.yaml", "\n" + BASE)
    _, diags = check_paths([tmp_path])
    assert [(d.rule, str(d)) for d in diags] == [
        ("index-source", f"{tmp_path / 'b.yaml'}:2: in Op: op Op is also declared in "
                         f"{tmp_path / 'a.yaml'}"),
    ]


def test_check_paths_reports_load_errors_and_goes_on(tmp_path: Path) -> None:
    write(tmp_path, "types.yaml", types_edit("python: tileops.ops.moe.MaskedLayoutSpec",
                                             "python: Masked"))
    write(tmp_path, "a.yaml", edit("status: spec-only", "status: done"))
    write(tmp_path, "b.yaml", edit(FLOPS, 'flops: "Q"'))
    loaded, diags = check_paths([tmp_path])
    # a.yaml's one entry fails to load; the file is still counted, with no entries
    assert [(Path(s.path).name, list(s.entries)) for s in loaded] == [
        ("a.yaml", []), ("b.yaml", ["Op"])]
    assert [(d.rule, Path(d.file).name, d.line) for d in diags] == [
        ("adt", "types.yaml", 15), ("schema", "a.yaml", 3), ("unknown-name", "b.yaml", 15)]


def test_check_paths_reports_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    loaded, diags = check_paths([missing])
    assert loaded == []
    assert [str(d) for d in diags] == [f"{missing}: cannot read: No such file or directory"]
    assert diags[0].rule == "io"


# --- the modules of the package -----------------------------------------------------------------


def _imports(package: Path) -> dict[str, set[str]]:
    """Module (dotted, relative to ``tileops.spec``) -> the package's modules it imports,
    anywhere in its body. ``from . import m`` counts as importing ``m``, not the package."""
    modules = {}
    for f in package.rglob("*.py"):
        parts = list(f.relative_to(package).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    graph: dict[str, set[str]] = {}
    for name, (f, is_pkg) in modules.items():
        here = name.split(".") if name else []
        base = here if is_pkg else here[:-1]
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                root = base[: len(base) - (node.level - 1)]
                target = root + (node.module.split(".") if node.module else [])
                for alias in node.names:
                    sub = ".".join([*target, alias.name])
                    deps.add(sub if sub in modules else ".".join(target))
            elif isinstance(node, ast.ImportFrom | ast.Import):
                for mod in [node.module] if isinstance(node, ast.ImportFrom) else [
                        a.name for a in node.names]:
                    if mod and mod.startswith("tileops.spec"):
                        deps.add(mod.removeprefix("tileops.spec").lstrip("."))
        deps.discard(name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> list[str] | None:
        if state.get(n) == 1:
            return stack[stack.index(n):] + [n]
        if state.get(n) == 2:
            return None
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            found = visit(m, [*stack, n])
            if found:
                return found
        state[n] = 2
        return None

    for n in sorted(graph):
        found = visit(n, [])
        if found:
            return found
    return None


def test_the_modules_of_the_package_import_each_other_without_a_cycle() -> None:
    graph = _imports(Path(tileops.spec.__file__).parent)
    assert {"validate", "validate.infer", "validate.workloads"} <= set(graph)
    assert "validate.context" in graph["validate.workloads"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]

