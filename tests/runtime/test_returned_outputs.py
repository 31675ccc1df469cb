"""``returned``: an output a construction leaves out of the call's result is still produced
(its backward saves it), on every path a call takes: the general call, the fused one, the
autograd node, the compile boundary and ``fp64_reference``. The ops here run on the
reference target (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tileops.runtime import Op, SpecSet  # noqa: E402

SPEC = """
SquareSumOp:
  family: test
  status: implemented
  signature:
    forall: {M: Dim, N: Dim, T: "DType[float32 | float64]"}
    params:
      return_sum: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[M, N]"}
    outputs:
      y: {dtype: T, shape: "[M, N]"}
      s: {dtype: T, shape: "[M]", returned: return_sum}
  backward:
    op: SquareSumBwdOp
    saves: [x, s]
    inputs: {dy: "grad(y)", x: x, s: s, ds: "grad(s)"}
    grads: {x: dx}

SquareSumBwdOp:
  family: test
  status: implemented
  signature:
    forall: {M: Dim, N: Dim, T: "DType[float32 | float64]"}
    inputs:
      dy: {dtype: T, shape: "[M, N]"}
      x: {dtype: T, shape: "[M, N]"}
      s: {dtype: T, shape: "[M]"}
      ds: {dtype: T, shape: "[M]", optional: true}
    outputs:
      dx: {dtype: T, shape: "[M, N]"}
"""


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("spec")) / "returned.yaml"
    path.write_text(SPEC)
    specs = SpecSet.load(path)
    saved = []

    class SquareSumOp(Op, specs=specs):
        def reference(self, call, x):
            y = x * x
            return y, y.sum(-1)

    class SquareSumBwdOp(Op, specs=specs):
        def reference(self, call, dy, x, s, ds):
            saved.append(s)  # the backward sees the forward's s, returned or not
            dx = 2 * x * dy
            return (dx if ds is None else dx + 2 * x * ds[:, None],)

    return SquareSumOp, saved


def test_the_result_leaves_out_what_the_construction_does_not_return(ops) -> None:
    cls, _ = ops
    x = torch.randn(3, 4)
    op = cls()
    assert op.returned_outputs == ("y",)
    for _ in range(3):  # the general call, then the fused one
        y = op(x)
        assert isinstance(y, torch.Tensor)
        torch.testing.assert_close(y, x * x)
    assert op._fast is not None
    both = cls(return_sum=True)
    assert both.returned_outputs == ("y", "s")
    for _ in range(2):
        y, s = both(x)
        torch.testing.assert_close(s, (x * x).sum(-1))
    y = op(x=x)  # a keyword call takes the general path
    assert isinstance(y, torch.Tensor)


def test_fp64_reference_returns_what_a_call_returns(ops) -> None:
    cls, _ = ops
    x = torch.randn(2, 5)
    (y,) = cls().fp64_reference(x)
    assert y.dtype == torch.float64
    y, s = cls(return_sum=True).fp64_reference(x)
    torch.testing.assert_close(s, (x.double() ** 2).sum(-1))


def test_the_gradient_saves_the_output_left_out(ops) -> None:
    cls, saved = ops
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    saved.clear()
    y = cls()(x)
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())
    torch.testing.assert_close(saved[-1], (x.detach() ** 2).sum(-1))
    x.grad = None
    y, s = cls(return_sum=True)(x)
    (y.sum() + 3 * s.sum()).backward()
    torch.testing.assert_close(x.grad, 2 * x.detach() + 6 * x.detach())
    assert torch.autograd.gradcheck(lambda t: cls()(t), (x.detach().requires_grad_(),))


def test_a_compiled_call_returns_what_an_eager_one_does(ops) -> None:
    cls, _ = ops
    op, both = cls(), cls(return_sum=True)
    x = torch.randn(3, 4)
    y = torch.compile(lambda t: op(t) * 2, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(y, 2 * x * x)
    y, s = torch.compile(lambda t: both(t), fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(s, (x * x).sum(-1))
    xg = torch.randn(3, 4, requires_grad=True)
    torch.compile(lambda t: op(t).sum(), fullgraph=True, backend="aot_eager")(xg).backward()
    torch.testing.assert_close(xg.grad, 2 * xg.detach())
