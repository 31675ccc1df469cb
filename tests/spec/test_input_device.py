"""An input's ``device``: ``same`` (the default: on the call's device) or ``any`` (exempt from
the call's device comparison); any other value is a loading error with file:line."""

from __future__ import annotations

import pytest

from tileops.spec import SpecLoadError, load_spec_text, validate_spec_file
from tileops.spec.show import render_signature

SPEC = """\
IndexOp:
  family: test
  status: spec-only
  signature:
    forall: {N: Dim, T: "DType[float32]"}
    inputs:
      x: {dtype: T, shape: "[N]"}
      index: {dtype: int64, shape: "[N]", device: any}
      bias: {dtype: T, shape: "[N]", device: same, optional: true}
    outputs:
      y: {dtype: T, shape: "[N]"}
"""


def test_device_loads_with_same_as_the_default() -> None:
    spec = load_spec_text(SPEC, "op.yaml")
    inputs = spec.entries["IndexOp"].signature.inputs
    assert {n: d.device for n, d in inputs.items()} == {"x": "same", "index": "any",
                                                        "bias": "same"}
    assert validate_spec_file(spec) == []


def test_a_bad_device_is_a_loading_error_at_its_line() -> None:
    with pytest.raises(SpecLoadError) as info:
        load_spec_text(SPEC.replace("device: any", "device: host"), "op.yaml")
    assert str(info.value) == (
        "op.yaml:8: in IndexOp.signature.inputs.index.device: invalid value 'host'; expected "
        "one of: 'same', 'any'")


def test_a_device_is_a_string_not_a_boolean() -> None:
    with pytest.raises(SpecLoadError) as info:
        load_spec_text(SPEC.replace("device: any", "device: true"), "op.yaml")
    assert str(info.value) == (
        "op.yaml:8: in IndexOp.signature.inputs.index.device: expected string, got boolean")


def test_show_marks_an_input_on_any_device() -> None:
    entry = load_spec_text(SPEC, "op.yaml").entries["IndexOp"]
    assert render_signature("IndexOp", entry).splitlines()[1] == (
        "    x: Tensor[T, [N]] -> index: Tensor[int64, [N]] {any device} -> "
        "bias: Tensor[T, [N]] {?} -> y: Tensor[T, [N]]")
