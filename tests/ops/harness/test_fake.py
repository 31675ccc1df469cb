"""Output inference without data: on every workload of every op at full size (no data is
allocated), the outputs' shapes and dtypes equal the spec's inference (evaluated from the
entry by the spec language, not by the generated checks), and an output aliasing a written
input is that input:

- ``fake``: an eager call on fake tensors (``FakeTensorMode``);
- ``meta``: an eager call on meta tensors;
- ``traced``: a compiled call on meta tensors, whose traced node's outputs come from the
  custom op's fake implementation (the generated symbolic check).
"""

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402

from tileops.ops.workloads import as_outputs, cases_of  # noqa: E402

from ._harness import (  # noqa: E402
    OPS,
    Capture,
    case_id,
    dtype_name,
    node_outputs,
    presence,
    returned_by_node,
    returned_only,
    spec_outputs,
)

CASES = [c for cls in OPS.values() for c in cases_of(cls)]


def _empty(case, device):
    out = []
    for i in case.inputs:
        dtype = None if i.dtype is None else getattr(torch, i.dtype)
        if i.shape is None:
            out.append(None)
        elif i.values is not None:
            out.append(torch.tensor(i.values, dtype=dtype, device=device).reshape(i.shape))
        else:
            out.append(torch.empty(i.shape, dtype=dtype, device=device))
    return out


def _check(op, inputs, outs, expected, written, fake: bool) -> None:
    """The outputs ``op`` returns (``expected``: one per declared output)."""
    plan = op._signature
    assert [None if o is None else (tuple(o.shape), dtype_name(o.dtype)) for o in outs] \
        == returned_only(op, expected)
    decls = [d for n, d in plan.sig.outputs.items() if n in op.returned_outputs]
    for d, o in zip(decls, outs, strict=True):
        if d.alias in written:
            assert o is inputs[plan.input_names.index(d.alias)]
        elif o is not None:
            assert isinstance(o, FakeTensor) if fake else o.device.type == "meta"


def _expected(op, case):
    return spec_outputs(op._signature, case.values, presence(case))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fake_tensors(case):
    op = OPS[case.op](**case.params)
    with FakeTensorMode():
        inputs = _empty(case, "cpu")
        outs = as_outputs(op(*inputs))
    _check(op, inputs, outs, _expected(op, case), op.last_call.written_inputs, True)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_meta_tensors(case):
    op = OPS[case.op](**case.params)
    inputs = _empty(case, "meta")
    outs = as_outputs(op(*inputs))
    _check(op, inputs, outs, _expected(op, case), op.last_call.written_inputs, False)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_traced(case):
    """On meta tensors the compiled graph runs the custom op's fake implementation too."""
    torch._dynamo.reset()
    cls = OPS[case.op]
    eager = cls(**case.params)
    eager(*_empty(case, "meta"))
    written = eager.last_call.written_inputs
    op = cls(**case.params)
    capture = Capture(op)
    inputs = _empty(case, "meta")
    outs = as_outputs(capture.compiled()(*inputs))
    expected = _expected(op, case)
    (node,) = capture.calls()
    assert node_outputs(node) == returned_by_node(op._signature, expected, written)
    _check(op, inputs, outs, expected, written, False)
