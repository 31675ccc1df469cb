"""Every workload of every implemented op, through the ``reference`` target on CPU, against
the op's float64 reference (scaled to :data:`~._harness.CPU_CAP` elements per tensor), with
the effects the spec declares (see :func:`~._harness.check_outputs`)."""

import pytest

torch = pytest.importorskip("torch")

from tileops.ops.workloads import as_outputs, cases_of, clone_inputs, make_inputs  # noqa: E402
from tileops.runtime import REFERENCE  # noqa: E402

from ._harness import (  # noqa: E402
    CPU_CAP,
    IMPLEMENTED,
    OPS,
    case_id,
    check_outputs,
    presence,
    spec_outputs,
)

CASES = [c for cls in OPS.values() for c in cases_of(cls, max_elements=CPU_CAP)]


def test_every_implemented_entry_has_a_class():
    """The harness covers an op by its entry; an entry marked implemented whose class
    tileops.ops does not export (under the entry's name, bound to that entry) would be left
    out of every other test here."""
    assert IMPLEMENTED, "no implemented entry found in the shipped specs"
    missing = [n for n in IMPLEMENTED if n not in OPS]
    assert not missing, f"implemented in the specs, but not exported by tileops.ops: {missing}"
    for name, cls in OPS.items():
        assert cls._signature.entry is IMPLEMENTED[name], f"{cls.__name__} is not bound to {name}"
    assert {c.op for c in CASES} == set(OPS), "an implemented op has no workload"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_workload_matches_float64(case):
    cls = OPS[case.op]
    op = cls(target=REFERENCE, **case.params)
    inputs = make_inputs(case, "cpu")
    before = clone_inputs(inputs)
    refs = op.fp64_reference(*inputs)
    for t, t0 in zip(inputs, before, strict=True):
        assert t is None or torch.equal(t, t0), "the float64 reference wrote an input"
    outs = as_outputs(op(*inputs))
    assert op.serving_target == REFERENCE
    check_outputs(op, inputs, before, outs, refs,
                  spec_outputs(cls._signature, case.values, presence(case)))
