"""Kinds: reading every kind form from its expression, printing it, and the errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.spec.expr import parse
from tileops.spec.kinds import (
    DTYPES,
    AdtK,
    AxesK,
    BoolK,
    DimK,
    DTypeK,
    EnumK,
    FloatK,
    IntK,
    KindError,
    MaybeK,
    PerAxisK,
    ShapeK,
    is_discriminant,
    is_numeric,
    kind_from_expr,
)

ADTS = {"MGroupedLayout"}

# (written, kind, printed)
FORMS = [
    ("Dim", DimK(), "Dim"),
    ("Shape", ShapeK(), "Shape"),
    ("Bool", BoolK(), "Bool"),
    ("bool", BoolK(), "Bool"),
    ("Int", IntK(), "Int"),
    ("int", IntK(), "Int"),
    ("Float", FloatK(), "Float"),
    ("float", FloatK(), "Float"),
    ("DType[float16 | bfloat16]", DTypeK(("float16", "bfloat16")), "DType[float16 | bfloat16]"),
    ("DType[float16, bfloat16]", DTypeK(("float16", "bfloat16")), "DType[float16 | bfloat16]"),
    ("DType[float16 | float16]", DTypeK(("float16",)), "DType[float16]"),
    ("bfloat16", DTypeK(("bfloat16",)), "DType[bfloat16]"),
    ("float16 | bfloat16", DTypeK(("float16", "bfloat16")), "DType[float16 | bfloat16]"),
    ("'tight'", EnumK(("tight",)), "'tight'"),
    ("'tight' | 'aligned'", EnumK(("tight", "aligned")), "'tight' | 'aligned'"),
    ("'a' | 'b' | 'a'", EnumK(("a", "b")), "'a' | 'b'"),
    ("MGroupedLayout", AdtK("MGroupedLayout"), "MGroupedLayout"),
    ("PerAxis[2]", PerAxisK(2), "PerAxis[2]"),
    ("int | tuple[int, int]", PerAxisK(2), "PerAxis[2]"),
    ("tuple[int, int, int] | int", PerAxisK(3), "PerAxis[3]"),
    ("Dim | tuple[Dim, Dim]", PerAxisK(2), "PerAxis[2]"),
    ("list[int]", ShapeK(), "Shape"),
    ("tuple[int, ...]", ShapeK(), "Shape"),
    ("list[int] | tuple[int, ...]", ShapeK(), "Shape"),
    ("Maybe[Dim]", MaybeK(DimK()), "Maybe[Dim]"),
    ("int | None", MaybeK(IntK()), "Maybe[Int]"),
    ("None | float", MaybeK(FloatK()), "Maybe[Float]"),
    ("int | tuple[int, int] | None", MaybeK(PerAxisK(2)), "Maybe[PerAxis[2]]"),
    ("int | tuple[int, ...]", AxesK(), "Axes"),
    ("Axes | None", MaybeK(AxesK()), "Maybe[Axes]"),
    ("'a' | 'b' | None", MaybeK(EnumK(("a", "b"))), "Maybe['a' | 'b']"),
    ("float16 | bfloat16 | None", MaybeK(DTypeK(("float16", "bfloat16"))),
     "Maybe[DType[float16 | bfloat16]]"),
    ("MGroupedLayout | None", MaybeK(AdtK("MGroupedLayout")), "Maybe[MGroupedLayout]"),
]


@pytest.mark.parametrize(("text", "kind", "printed"), FORMS, ids=[f[0] for f in FORMS])
def test_every_kind_form(text, kind, printed) -> None:
    k = kind_from_expr(parse(text), ADTS)
    assert k == kind
    assert str(k) == printed


ERRORS = [
    ("Foo", "unknown kind 'Foo'; expected Dim, Shape, Axes, Bool, Int, Float, DType[...], a dtype "
            "name, an enum of quoted strings, Maybe[...] or an ADT (MGroupedLayout)"),
    ("DType[foo]", "DType[...] lists dtype names; foo is not one (known: " + ", ".join(DTYPES)
     + ")"),
    ("DType[Dim | float16]", "DType[...] lists dtype names; Dim is not one (known: "
     + ", ".join(DTYPES) + ")"),
    ("None", "'None' is not a kind"),
    ("None | None", "'None | None' is only None"),
    ("Maybe[int] | None", "'Maybe[int] | None' nests Maybe"),
    ("Maybe[Maybe[int]]", "'Maybe[Maybe[int]]' nests Maybe"),
    ("Maybe[int | None]", "'Maybe[int | None]' nests Maybe"),
    ("Maybe[int, int]", "'Maybe[int, int]' is not a kind"),
    ("PerAxis[n]", "'PerAxis[n]' is not a kind"),
    ("PerAxis[0]", "'PerAxis[0]' is not a kind"),
    ("tuple[int, int]", "'tuple[int, int]' is not a kind"),
    ("list[float]", "'list[float]' is not a kind"),
    ("Dim[2]", "'Dim[2]' is not a kind"),
    ("M + 1", "'M + 1' is not a kind"),
    ("3", "'3' is not a kind"),
    ("int | Dim", "'int | Dim' is not a kind: a union is a dtype set (float16 | bfloat16), an "
                  "enum ('a' | 'b'), an optional (X | None), int | tuple[int, ...n], "
                  "list[int] | tuple[int, ...] or axes (int | tuple[int, ...])"),
    ("int | tuple[int, ...] | float", "'int | tuple[int, ...] | float' is not a kind: a union "
     "is a dtype set (float16 | bfloat16), an enum ('a' | 'b'), an optional (X | None), "
     "int | tuple[int, ...n], list[int] | tuple[int, ...] or axes (int | tuple[int, ...])"),
    ("'a' | float16", "\"'a' | float16\" is not a kind: a union is a dtype set (float16 | "
     "bfloat16), an enum ('a' | 'b'), an optional (X | None), int | tuple[int, ...n], "
     "list[int] | tuple[int, ...] or axes (int | tuple[int, ...])"),
]


@pytest.mark.parametrize(("text", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_kind_errors(text, message) -> None:
    with pytest.raises(KindError) as exc:
        kind_from_expr(parse(text), ADTS)
    assert str(exc.value) == message


def test_an_adt_name_is_a_kind_only_where_the_adt_is_declared() -> None:
    assert kind_from_expr(parse("MGroupedLayout"), {"MGroupedLayout"}) == AdtK("MGroupedLayout")
    with pytest.raises(KindError) as exc:
        kind_from_expr(parse("MGroupedLayout"))
    assert str(exc.value).endswith("Maybe[...] or an ADT (none declared)")


def test_bool_is_the_bool_kind_unless_in_a_dtype_set() -> None:
    assert kind_from_expr(parse("bool")) == BoolK()
    assert kind_from_expr(parse("bool | None")) == MaybeK(BoolK())
    assert kind_from_expr(parse("DType[bool]")) == DTypeK(("bool",))
    assert kind_from_expr(parse("bool | uint8")) == DTypeK(("bool", "uint8"))


def test_numeric_and_discriminant_kinds() -> None:
    assert [is_numeric(k) for k in (DimK(), IntK(), FloatK(), BoolK(), ShapeK())] == [
        True, True, True, False, False]
    finite = (BoolK(), EnumK(("a",)), AdtK("L"), DTypeK(("float16",)))
    assert all(is_discriminant(k) for k in finite)
    infinite = (DimK(), IntK(), FloatK(), ShapeK(), PerAxisK(2), MaybeK(BoolK()))
    assert not any(is_discriminant(k) for k in infinite)


def test_kinds_are_frozen_values() -> None:
    assert DTypeK(("float16",)) == DTypeK(("float16",))
    assert hash(MaybeK(DimK())) == hash(MaybeK(DimK()))
    assert DimK() != IntK()
    with pytest.raises(AttributeError):
        DTypeK(("float16",)).members = ()  # type: ignore[misc]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(sorted(DTYPES)), min_size=1, max_size=5))
def test_any_dtype_set_reads_as_the_deduplicated_members(members: list[str]) -> None:
    expected = DTypeK(tuple(dict.fromkeys(members)))
    assert kind_from_expr(parse(f"DType[{' | '.join(members)}]")) == expected
    # a bare union of dtype names (the spelling of a param type) is the same kind, except
    # that a lone `bool` is the Bool kind (see test_bool_is_the_bool_kind_unless_in_a_dtype_set)
    if members != ["bool"] * len(members):
        assert kind_from_expr(parse(" | ".join(members))) == expected
    # printing the kind gives text that reads back as the same kind
    assert kind_from_expr(parse(str(expected))) == expected
