"""``torch.compile(fullgraph=True)`` of every op, through a capturing backend, on its base
cases (one per structure of its calls: given optional inputs, layout and effect params; a few
per op, as compiling is slow on the 2-core CI machine).

The contract: one graph, whose only call is one of the op's own custom ops
(``type(op).compile_op_names``), the one of the call's effect branch (it declares as written
exactly the inputs the eager call writes); tracing binds no target and runs nothing (the op
is fresh, and still is when the backend receives the graph); the traced node's fake outputs
are the spec's inference; the compiled call matches float64 with the spec's effects.
"""

import pytest

torch = pytest.importorskip("torch")

from tileops.ops.workloads import as_outputs, clone_inputs, make_inputs  # noqa: E402

from ._harness import (  # noqa: E402
    OPS,
    Capture,
    base_cases,
    case_id,
    check_outputs,
    node_outputs,
    presence,
    returned_by_node,
    spec_outputs,
)

CASES = [c for cls in OPS.values() for c in base_cases(cls)]


def _written(overload) -> list[str]:
    return [a.name for a in overload._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_compiles_to_its_own_node(case):
    torch._dynamo.reset()
    cls = OPS[case.op]
    plan = cls._signature
    eager = cls(**case.params)
    eager(*clone_inputs(make_inputs(case, "cpu")))
    op = cls(**case.params)
    capture = Capture(op)
    inputs = make_inputs(case, "cpu")
    before = clone_inputs(inputs)
    refs = op.fp64_reference(*inputs)
    outs = as_outputs(capture.compiled()(*inputs))

    assert capture.state == [(None, None)], "tracing bound a target or ran the op"
    own = {getattr(torch.ops.tileops, q.split("::", 1)[1]).default for q in cls.compile_op_names}
    calls = capture.calls()
    assert [n.target in own for n in calls] == [True], \
        f"the graph holds {[str(n.target) for n in calls]}, not one of {cls.compile_op_names}"
    assert _written(calls[0].target) == list(eager.last_call.written_inputs)
    expected = spec_outputs(plan, case.values, presence(case))
    assert node_outputs(calls[0]) == returned_by_node(plan, expected,
                                                      eager.last_call.written_inputs)
    check_outputs(op, inputs, before, outs, refs, expected)
