"""``returned``: the outputs a construction's calls return, fixed by its params, and the
construction that would return none refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")  # a construction point adapts torch tensors

from tileops.signature import ConstructionError, SignaturePlan  # noqa: E402
from tileops.spec import load_spec_text  # noqa: E402

SPEC = """\
TwoOut:
  family: misc
  status: spec-only
  signature:
    forall: {N: Dim, T: "DType[float32]"}
    params:
      want_y: {type: bool, default: true}
      want_z: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[N]"}
    outputs:
      y: {dtype: T, shape: "[N]", returned: want_y}
      z: {dtype: T, shape: "[N]", returned: "want_z or not want_y"}
Plain:
  family: misc
  status: spec-only
  signature:
    forall: {N: Dim, T: "DType[float32]"}
    inputs:
      x: {dtype: T, shape: "[N]"}
    outputs:
      y: {dtype: T, shape: "[N]"}
      z: {dtype: T, shape: "[N]"}
"""


def _plan(name: str) -> SignaturePlan:
    spec = load_spec_text(SPEC, "returned.yaml")
    return SignaturePlan(name, spec.entries[name], spec=spec)


@pytest.mark.parametrize(("params", "returned"), [
    ({}, ("y",)),
    ({"want_z": True}, ("y", "z")),
    ({"want_y": False}, ("z",)),
    ({"want_y": False, "want_z": True}, ("z",)),
])
def test_the_result_holds_the_outputs_whose_returned_holds(params, returned) -> None:
    plan = _plan("TwoOut")
    assert plan.may_leave_out
    assert plan.construct(**params).returned_outputs == returned


def test_an_entry_without_returned_returns_every_output() -> None:
    plan = _plan("Plain")
    assert not plan.may_leave_out
    assert plan.construct().returned_outputs == ("y", "z")


def test_a_construction_returning_nothing_is_refused_by_name() -> None:
    spec = load_spec_text(SPEC.replace('"want_z or not want_y"', "want_z"), "returned.yaml")
    plan = SignaturePlan("TwoOut", spec.entries["TwoOut"], spec=spec)
    with pytest.raises(ConstructionError) as err:
        plan.construct(want_y=False)
    text = str(err.value)
    assert "TwoOut" in text and "want_y, want_z" in text
    assert "no output would be returned (each output's returned is false)" in text
    assert plan.construct(want_y=False, want_z=True).returned_outputs == ("z",)
