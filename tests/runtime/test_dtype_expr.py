"""A binary op with broadcasting and torch's type promotion, end to end through the runtime:
an ``Op`` built from its spec (``result_type(TA, len(SA), TB, len(SB))``, a ``bool`` output,
``let S = broadcast(SA, SB)``), called through the ``reference`` target (outputs allocated in
the computed dtypes, the fused call on later calls), ``out=``, the refusals, the roofline, and
the compile boundary's fake function (the computed dtype under tracing, fake tensors and
dynamic shapes); and the in-place activation form (``mutated: inplace``, ``alias: x``)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tileops.runtime import REFERENCE, Op, SpecSet  # noqa: E402
from tileops.signature import SignatureCallError  # noqa: E402

SPEC = """
DxAddOp:
  family: test
  status: implemented
  signature:
    forall:
      SA: Shape
      SB: Shape
      TA: "DType[bool | int32 | int64 | float16 | bfloat16 | float32 | float64]"
      TB: "DType[bool | int32 | int64 | float16 | bfloat16 | float32 | float64]"
    inputs:
      a: {dtype: TA, shape: "[*SA]"}
      b: {dtype: TB, shape: "[*SB]"}
    let: {S: "broadcast(SA, SB)"}
    outputs:
      out: {dtype: "result_type(TA, len(SA), TB, len(SB))", shape: "[*S]", buffer: true}
      eq: {dtype: bool, shape: "[*S]"}
  roofline:
    flops: "prod(S)"
DxReluOp:
  family: test
  status: implemented
  signature:
    forall: {S: Shape, T: "DType[float16 | bfloat16 | float32]"}
    params:
      inplace: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[*S]", mutated: inplace}
    outputs:
      y: {dtype: T, shape: "[*S]", alias: x}
"""


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("spec")) / "dtype_expr.yaml"
    path.write_text(SPEC)
    specs = SpecSet.load(path)

    class DxAddOp(Op, specs=specs):
        def reference(self, call, a, b):
            return torch.add(a, b), torch.eq(a, b)

    class DxReluOp(Op, specs=specs):
        def reference(self, call, x):
            return (torch.relu(x),)

    return DxAddOp, DxReluOp


CASES = [  # (a, b) shapes and dtypes, each a rule of torch's promotion
    (((4, 1), "int32"), ((3,), "float16")),     # categories: the float wins
    (((2, 3), "float32"), ((), "float64")),     # a 0-dim operand of the same category: ignored
    (((2, 3), "int64"), ((), "float64")),       # a 0-dim operand of a higher one counts
    (((2, 1, 3), "float16"), ((5, 1), "bfloat16")),  # float16 with bfloat16: float32
    (((3,), "bool"), ((3,), "bool")),
]


@pytest.mark.parametrize(("ta", "tb"), CASES)
def test_a_call_through_the_reference_target_computes_torchs_dtype(ops, ta, tb) -> None:
    add_cls, _ = ops
    op = add_cls(target=REFERENCE)
    a = torch.arange(torch.Size(ta[0]).numel()).reshape(ta[0]).to(getattr(torch, ta[1]))
    b = torch.ones(tb[0], dtype=getattr(torch, tb[1]))
    for _ in range(2):  # the first call builds; the second takes the fused call
        out, eq = op(a, b)
        want = torch.add(a, b)
        assert out.dtype == want.dtype and out.shape == want.shape
        assert torch.equal(out, want) and torch.equal(eq, torch.eq(a, b))
        assert eq.dtype == torch.bool
    assert op.serving_target == REFERENCE
    assert op.last_call.roofline()[0] == want.numel()


def test_an_out_buffer_takes_the_computed_dtype(ops) -> None:
    add_cls, _ = ops
    op = add_cls(target=REFERENCE)
    a, b = torch.ones(4, 1, dtype=torch.int32), torch.ones(3, dtype=torch.float16)
    buf = torch.empty(4, 3, dtype=torch.float16)
    out, _ = op(a, b, out=buf)
    assert out is buf and torch.equal(buf, torch.full((4, 3), 2.0, dtype=torch.float16))
    with pytest.raises(SignatureCallError) as info:
        op(a, b, out=torch.empty(4, 3))
    assert info.value.because == "the buffer given for out must be f16[4, 3], but is f32[4, 3]"


def test_shapes_that_do_not_broadcast_are_refused(ops) -> None:
    add_cls, _ = ops
    op = add_cls(target=REFERENCE)
    with pytest.raises(SignatureCallError) as info:
        op(torch.ones(2, 3), torch.ones(4))
    assert str(info.value).splitlines()[0] == "DxAddOp: argument b does not match the signature"
    assert info.value.because == ("let S = broadcast(SA, SB) fails on these sizes: shapes "
                                  "(2, 3), (4,) do not broadcast (axis -1: 3 vs 4)")
    assert op.last_call is None


def test_the_compile_boundary_fakes_the_computed_dtype(ops) -> None:
    add_cls, _ = ops
    torch._dynamo.reset()
    op = add_cls(target=REFERENCE)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda a, b: op(a, b), backend=backend, fullgraph=True, dynamic=True)
    for n in (3, 5):
        a, b = torch.ones(n, 1, dtype=torch.int64), torch.ones(4, dtype=torch.bfloat16)
        out, eq = f(a, b)
        assert out.dtype == torch.bfloat16 and out.shape == (n, 4) and eq.dtype == torch.bool
    assert len(graphs) == 1
    fake = [n.meta["example_value"] for n in graphs[0].graph.nodes
            if n.op == "call_function" and "tileops" in str(n.target)][0]
    assert [v.dtype for v in fake] == [torch.bfloat16, torch.bool]


def test_the_inplace_activation_form_returns_its_input(ops) -> None:
    _, relu_cls = ops
    x = torch.randn(2, 3)
    y = relu_cls(target=REFERENCE)(x)
    assert y is not x and torch.equal(y, torch.relu(x))
    z = x.clone()
    y = relu_cls(inplace=True, target=REFERENCE)(z)
    assert y is z and torch.equal(z, torch.relu(x))
