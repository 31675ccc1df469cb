"""Names a spec declares are identifiers, and a file's load errors are all reported: one an
entry, the other entries loading and validating on their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tileops.spec import SpecLoadError, check_paths, load_spec_text
from tileops.spec.__main__ import main

from .validate_base import BASE, FORALL, MAT, diagnostics, edit, shown

FAM = MAT + "        - {when: true, is: '[R, C]'}\n        - {when: false, is: '[C, R]'}\n"


@pytest.mark.parametrize(("text", "expected"), [
    (edit(FORALL, FAM.replace("Mat:", '"Ma\\nt":') + FORALL),
     [("family", "op.yaml:6: in Op.signature.types.Ma\\nt: 'Ma\\nt' is not a valid type family "
                 "name (an identifier that is not a Python keyword)")]),
    (edit(FORALL, FAM.replace("Mat:", "if:") + FORALL),
     [("family", "op.yaml:6: in Op.signature.types.if: 'if' is not a valid type family name "
                 "(an identifier that is not a Python keyword)")]),
    (edit("M: Dim,", '"M\\n": Dim,', 'shape: "[M, N]"', 'shape: "[N]"',
          'shape: "[M, N]"', 'shape: "[N]"', "{M: 2, N: 3,", "{N: 3,", '"M * N"', '"N"'),
     [("index-source", "op.yaml:5: in Op.signature.forall.M\\n: 'M\\n' is not a valid index "
                       "name")]),
])
def test_declared_names_are_identifiers(text: str, expected: list) -> None:
    assert shown(diagnostics(text)) == expected


@pytest.mark.parametrize(("text", "message"), [
    (BASE.replace("Op:", '"Op\\n":', 1),
     "op.yaml:1: in Op\\n: an op name is a Python class name, got 'Op\\n'"),
    (BASE.replace("family: test", 'family: "te\\nst"', 1),
     "op.yaml:2: in Op.family: a family name is an identifier (it names the family's module), "
     "got 'te\\nst'"),
])
def test_entry_and_family_names_are_identifiers(text: str, message: str) -> None:
    with pytest.raises(SpecLoadError) as info:
        load_spec_text(text, "op.yaml")
    assert str(info.value) == message
    assert "\n" not in str(info.value)


TWO_BAD = (BASE.replace("status: spec-only", "status: done", 1)
           + BASE.replace("Op:", "Other:", 1).replace("family: test", "family: test\n  colour: 1", 1)
           + BASE.replace("Op:", "Good:", 1).replace('"M * N"', '"Q"', 1))


def test_every_load_error_of_a_file_is_reported(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SpecLoadError) as info:
        load_spec_text(TWO_BAD, "op.yaml")
    assert str(info.value).splitlines() == [
        "op.yaml:3: in Op.status: invalid value 'done'; expected one of: 'implemented', "
        "'spec-only', 'planned'",
        "op.yaml:18: in Other: unknown field 'colour'; expected one of: family, status, "
        "signature, ref_api, doc, workloads, roofline, composition, backward",
    ]
    (tmp_path / "ops.yaml").write_text(TWO_BAD, encoding="utf-8")
    loaded, diags = check_paths([tmp_path])
    assert [list(s.entries) for s in loaded] == [["Good"]]
    assert main(["check", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4  # two load errors, the good entry's own, and the summary
    assert err[-1] == "3 error(s) in 1 entries (1 files)"


def test_an_adt_with_an_unknown_field_kind_is_a_diagnostic_not_a_crash(tmp_path: Path) -> None:
    from .validate_base import TYPES_TEXT
    (tmp_path / "types.yaml").write_text(TYPES_TEXT.replace("max_m: Dim", "max_m: Frob", 1),
                                         encoding="utf-8")
    (tmp_path / "op.yaml").write_text(edit(
        "flag: {type: bool, default: false}", "flag: {type: bool, default: false}\n"
        "      lay: {type: MGroupedLayout, default: {masked: {max_m: 8}}}"), encoding="utf-8")
    _, diags = check_paths([tmp_path])
    assert [(Path(d.file).name, d.line, d.path) for d in diags] == [
        ("types.yaml", 16, "adts.MGroupedLayout.constructors.masked.fields.max_m"),
        ("op.yaml", 8, "Op.signature.params.lay.type"),
    ]
    assert diags[0].message.startswith("unknown kind 'Frob'")
