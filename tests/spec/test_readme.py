"""packages/spec/README.md documents the language as it is: every primitive, generator, rule
and dtype is named, and its complete examples load, validate and run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tileops.spec import (
    DTYPES,
    GENERATORS,
    PRIMITIVES,
    RULES,
    SpecLoadError,
    check_paths,
    kind_from_expr,
    load_spec_text,
    load_types_text,
    validate_spec_file,
    validate_types,
)
from tileops.spec.__main__ import main

README = Path(__file__).resolve().parents[2] / "packages" / "spec" / "README.md"
TEXT = README.read_text(encoding="utf-8")


def block(heading: str, lang: str) -> str:
    """The first ``lang`` code block after ``heading``."""
    after = TEXT[TEXT.index(f"\n{heading}\n"):]
    m = re.search(rf"```{lang}\n(.*?)```", after, re.S)
    assert m, (heading, lang)
    return m.group(1)


@pytest.mark.parametrize(
    "name",
    [*PRIMITIVES, *GENERATORS, *RULES, *DTYPES],
)
def test_every_table_name_is_documented(name: str) -> None:
    assert f"`{name}" in TEXT


def test_the_first_spec_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ops.yaml").write_text(block("## A first spec", "yaml"), encoding="utf-8")
    assert check_paths([tmp_path])[1] == []
    assert main(["check", str(tmp_path / "ops.yaml")]) == 0
    expected = block("## A first spec", "console").splitlines()[1]
    assert capsys.readouterr().out.strip() == expected


def test_the_adt_example_validates() -> None:
    types, lines = load_types_text(block("## ADTs", "yaml"), "types.yaml")
    assert validate_types(types, "types.yaml", lines) == []
    assert list(types.adts) == ["MGroupedLayout"]


def test_the_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ops.yaml").write_text(block("## A first spec", "yaml"), encoding="utf-8")
    (tmp_path / "types.yaml").write_text(block("## ADTs", "yaml"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    code = block("## The Python API", "python")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the README's own example
    assert namespace["diags"] == []
    assert namespace["node"].index[0].id == "trans_a"
    # the values the comments promise
    assert "'Mat[trans_a, M, K]'" in code and "(3, 2)" in code
    spec = namespace["spec"]
    gemm = spec.entries["GemmFwdOp"]
    assert namespace["eval_shape"](namespace["node"], namespace["Scope"](
        {"trans_a": True, "M": 2, "K": 3}, gemm.signature.types)) == (3, 2)
    assert namespace["print_expr"](namespace["node"]) == "Mat[trans_a, M, K]"


FAMILIES = "## Family blocks and workload grids"
#: edits of the family example, in the order of the errors the README lists for them
FAMILY_EDITS = [
    ('grid: rows-by-hidden\n    map: {B: "[rows]", normalized_shape',
     'grid: rows-by-hiden\n    map: {B: "[rows]", normalized_shape'),
    ('map: {B: "[rows]", normalized_shape: "[hidden]"}', 'map: {B: "[rows]"}'),
    ('map: {B: "[rows]", normalized_shape: "[hidden]"}',
     'map: {B: "[rows]", normalized_shape: "[hidden]", M: rows}'),
    ('map: {B: "[rows]", normalized_shape: "[hidden]"}',
     'map: {B: "[row]", normalized_shape: "[hidden]"}'),
    ("families:\n", "families:\n  gemm: {status: planned}\n"),
    ("    grids:\n", "    grids:\n      decode: {rows: [{rows: 1, hidden: 64, label: d}]}\n"),
]


def test_the_family_example_loads_as_its_rows_written_out() -> None:
    spec = load_spec_text(block(FAMILIES, "yaml"), "norm.yaml")
    assert validate_spec_file(spec) == []
    assert {e.status for e in spec.entries.values()} == {"implemented"}
    written = yaml.safe_load(block("### What it loads as", "yaml"))
    assert [{**w.values, "dtype_cases": list(w.dtype_cases), "label": w.label}
            for w in spec.entries["FusedAddRMSNormFwdOp"].workloads] == written


def test_the_family_errors_are_what_the_readme_says() -> None:
    text = block(FAMILIES, "yaml")
    after = TEXT[TEXT.index("saved as `norm.yaml`"):]
    shown = re.search(r"```text\n(.*?)```", after, re.S).group(1).splitlines()
    assert len(shown) == len(FAMILY_EDITS)
    for (old, new), expected in zip(FAMILY_EDITS, shown, strict=True):
        assert old in text, old
        with pytest.raises(SpecLoadError) as exc:
            load_spec_text(text.replace(old, new, 1), "norm.yaml")
        assert str(exc.value) == expected


def test_the_dtype_expression_example_validates_and_infers() -> None:
    from tileops.spec.kinds import DTypeK
    from tileops.spec.validate.context import EntryContext, Report

    text = block("### Dtype expressions", "yaml")
    spec = load_spec_text(text, "ops.yaml")
    assert validate_spec_file(spec) == []
    entry = spec.entries["AddOp"]
    ctx = EntryContext("AddOp", entry, Report("ops.yaml", spec), {}, None)
    kinds = {n: kind_from_expr(ex.node) for n, ex in entry.signature.forall.items()}
    ctx.model.kinds.update(kinds)
    infer = ctx.kinds().infer
    assert infer(entry.signature.outputs["mean"].dtype.node) == DTypeK(
        ("float16", "bfloat16", "float32", "float64"))  # as the README says
    assert infer(entry.signature.outputs["eq"].dtype.node) == DTypeK(("bool",))
