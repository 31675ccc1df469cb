"""The ``adt`` rule on the shared ADTs of ``types.yaml``, and ADTs seen from a spec entry."""

from __future__ import annotations

import pytest

from tileops.spec import load_spec_text, load_types_text, validate_spec_file, validate_types

from .validate_base import FLAG, LAYOUT, ROW, TYPES_TEXT, edit, shown, types_edit


def test_adt_passing() -> None:
    types, lines = load_types_text(TYPES_TEXT, "types.yaml")
    assert validate_types(types, "types.yaml", lines) == []



ADT_FAILING = [
    pytest.param(
        types_edit("python: tileops.ops.moe.MaskedLayoutSpec", "python: MaskedLayoutSpec"),
        [(
            "adt",
            "types.yaml:15: in adts.MGroupedLayout.constructors.masked.python: python must be a "
            "dotted class path (package.module.Class), got 'MaskedLayoutSpec'",
        )],
        id="adt:bad-python-path",
    ),
    pytest.param(
        types_edit("fields: {max_m: Dim}", "fields: {max_m: Dimension}"),
        [(
            "adt",
            "types.yaml:16: in adts.MGroupedLayout.constructors.masked.fields.max_m: unknown kind "
            "'Dimension'; expected Dim, Shape, Axes, Bool, Int, Float, DType[...], a dtype name, an "
            "enum of quoted strings, Maybe[...] or an ADT (MGroupedLayout)",
        )],
        id="adt:bad-field-kind",
    ),
    pytest.param(
        types_edit("fields: {max_m: Dim}", 'fields: {max_m: Dim}\n        invariant: "max_m + 1"'),
        [(
            "adt",
            "types.yaml:17: in adts.MGroupedLayout.constructors.masked.invariant: 'max_m + 1' is "
            "Dim, but an invariant is a Bool predicate",
        )],
        id="adt:non-bool-invariant",
    ),
    pytest.param(
        types_edit("and alignment >= 1", "and alignmnt >= 1"),
        [(
            "unknown-name",
            "types.yaml:13: in adts.MGroupedLayout.constructors.contiguous.invariant: \"(packing "
            "== 'tight') == (alignment == 1) and alignmnt >= 1\": unknown name 'alignmnt' (did "
            "you mean 'alignment'?)",
        )],
        id="adt:invariant-names-an-unknown-field",
    ),
    pytest.param(
        "adts:\n  L: {constructors: {}}\n",
        [("adt", "types.yaml:2: in adts.L: ADT L has no constructors")],
        id="adt:no-constructors",
    ),
    pytest.param(
        'adts:\n  "a-b": {constructors: {c: {python: a.B}}}\n',
        [("adt", "types.yaml:2: in adts.a-b: 'a-b' is not a valid ADT name")],
        id="adt:bad-name",
    ),
]


@pytest.mark.parametrize(("text", "expected"), ADT_FAILING)
def test_adt_failing(text: str, expected: list[tuple[str, str]]) -> None:
    types, lines = load_types_text(text, "types.yaml")
    assert shown(validate_types(types, "types.yaml", lines)) == expected


def test_an_adt_field_may_be_another_adt() -> None:
    text = ("adts:\n  A: {constructors: {c: {python: a.C, fields: {inner: B}}}}\n"
            "  B: {constructors: {d: {python: a.D}}}\n")
    types, lines = load_types_text(text, "types.yaml")
    assert validate_types(types, "types.yaml", lines) == []



def test_an_adt_is_unknown_without_its_types_file() -> None:
    spec = load_spec_text(edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"),
                          "op.yaml")
    assert shown(validate_spec_file(spec)) == [(
        "kind",
        "op.yaml:7: in Op.signature.params.layout.type: unknown kind 'MGroupedLayout'; expected "
        "Dim, Shape, Axes, Bool, Int, Float, DType[...], a dtype name, an enum of quoted strings, "
        "Maybe[...] or an ADT (none declared)",
    )]

