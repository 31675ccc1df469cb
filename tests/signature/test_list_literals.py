"""A list literal inside a comparison, arithmetic or a conditional of a generated check is the
same value as a shape (a tuple): ``B == [2, 3]`` holds for a shape ``(2, 3)``."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from tileops.signature import SignatureCallError, SignaturePlan  # noqa: E402
from tileops.spec import load_spec_text  # noqa: E402

SPEC = """\
ListOp:
  family: misc
  status: spec-only
  signature:
    types:
      Pair:
        params: {t: Bool, R: Dim, C: Dim}
        match: t
        cases:
        - {when: false, is: "[R, C]"}
        - {when: true, is: "[C, R]"}
    forall: {B: Shape, N: Dim, T: "DType[float32]"}
    params:
      t: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[*B, N]"}
    outputs:
      y: {dtype: T, shape: "[*B, N]"}
    shape_rules:
    - "B == [2, 3] or [*B, N] == [5, N]"
    - "[*B, N] != [1, 1, 1]"
    - "Pair[t, N, 1] != [7, 1]"
"""


@pytest.fixture(scope="module")
def point():
    spec = load_spec_text(SPEC, "lists.yaml")
    return SignaturePlan("ListOp", spec.entries["ListOp"], spec=spec).construct()


@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 1), (5, 6)])
def test_a_shape_equal_to_a_list_literal_holds(point, shape) -> None:
    point.check(torch.empty(shape))


@pytest.mark.parametrize(("shape", "rule"), [
    ((2, 4, 4), "B == [2, 3] or [*B, N] == [5, N]"),
    ((4, 7), "B == [2, 3] or [*B, N] == [5, N]"),
])
def test_a_shape_unequal_to_the_list_literals_is_refused(point, shape, rule) -> None:
    with pytest.raises(SignatureCallError, match=re.escape(f"refinement '{rule}' does not hold")):
        point.check(torch.empty(shape))


def test_a_family_value_compares_with_a_list_literal(point) -> None:
    rule = "Pair[t, N, 1] != [7, 1]"
    with pytest.raises(SignatureCallError, match=re.escape(f"refinement '{rule}' does not hold")):
        point.check(torch.empty(5, 7))
    point.check(torch.empty(5, 6))
