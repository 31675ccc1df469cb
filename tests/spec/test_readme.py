"""packages/spec/README.md documents the language as it is: every primitive, generator, rule
and dtype is named, and its complete examples load, validate and run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tileops.spec import (
    DTYPES,
    GENERATORS,
    PRIMITIVES,
    RULES,
    check_paths,
    load_types_text,
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
