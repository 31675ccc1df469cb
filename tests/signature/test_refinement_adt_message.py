"""A call-time refinement that reads an ADT construction param (through a type family that
matches on its constructor) describes its failure with the param's value, which the generated
check holds as a value: an ADT value has no source text to evaluate back."""

from __future__ import annotations

import pytest

from tileops.signature import SignatureCallError, SignaturePlan, torch_adapter
from tileops.spec import AdtValue, load_spec_text, load_types_text

torch = pytest.importorskip("torch")

TYPES = """\
adts:
  MGroupedLayout:
    constructors:
      contiguous:
        python: tileops.ops.moe.ContiguousLayoutSpec
        fields: {alignment: Dim}
      masked:
        python: tileops.ops.moe.MaskedLayoutSpec
        fields: {max_m: Dim}
"""

SPEC = """\
BlocksOp:
  family: misc
  status: spec-only
  signature:
    types:
      Block:
        params: {layout: MGroupedLayout, M: Dim}
        match: layout
        cases:
        - {when: contiguous, is: "[M]"}
        - {when: masked, is: "[layout.max_m]"}
    forall: {E: Dim, M: Dim, T: "DType[float32]"}
    params:
      layout: {type: MGroupedLayout}
    inputs:
      a: {dtype: T, shape: "[E, M]"}
    outputs:
      c: {dtype: T, shape: "[E, M]"}
    shape_rules:
    - "prod(Block[layout, M]) == M"
"""


def test_the_refinement_names_the_adt_value_and_the_index() -> None:
    types, _ = load_types_text(TYPES, "types.yaml")
    spec = load_spec_text(SPEC, "blocks.yaml")
    plan = SignaturePlan("BlocksOp", spec.entries["BlocksOp"], spec=spec, adts=types.adts,
                         adapter=torch_adapter())
    point = plan.construct(layout=AdtValue("masked", {"max_m": 4}))
    point.check(torch.empty(2, 4))  # four rows a block: holds
    with pytest.raises(SignatureCallError) as info:
        point.check(torch.empty(2, 3))
    assert str(info.value).splitlines()[3] == (
        "  because:  refinement 'prod(Block[layout, M]) == M' does not hold (layout = "
        "AdtValue(constructor='masked', fields={'max_m': 4}), M = 3)")
