"""The generated torch.compile boundary, on CPU through a target written here.

The contract: a traced call is one node of the op's own custom op; tracing builds nothing (no
target builder, no kernel entry); a cold fullgraph compile passes; dynamic shapes compile once;
eager calls never go through torch.library; instances are found by a string key in a weak
registry, freed when the instance is collected.
"""

import gc
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tileops.runtime import Op, SpecSet, register_builder, register_target  # noqa: E402
from tileops.runtime.registry import _instances, instance_for_key  # noqa: E402

SPEC = """
BoundaryScaleOp:
  family: test
  status: implemented
  signature:
    forall: {B: Shape, N: Dim, T: "DType[float32 | bfloat16]"}
    params:
      alpha: {type: float, default: 2.0}
      inplace: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[*B, N]", mutated: inplace}
      bias: {dtype: T, shape: "[N]", optional: true}
    outputs:
      y: {dtype: T, shape: "[*B, N]", alias: x}
      total: {dtype: float32, shape: "[N]"}
  roofline:
    flops: "prod(B) * N"
"""

BUILDS: list[str] = []


@pytest.fixture(scope="module")
def op_cls(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("spec")) / "boundary.yaml"
    path.write_text(SPEC)
    specs = SpecSet.load(path)

    class BoundaryScaleOp(Op, specs=specs):
        def __init__(self, *, alpha=2.0, inplace=False, **kw):
            super().__init__(alpha=alpha, inplace=inplace, **kw)

    register_target("boundary-test", None)

    def builder(op, call):
        assert not torch.compiler.is_dynamo_compiling(), "a builder ran while tracing"
        BUILDS.append(call.compact())

        def kernel(x, bias, y, total):
            out = x * op.alpha + (bias if bias is not None else 0)
            total.copy_(out.float().reshape(-1, out.shape[-1]).sum(0))
            y.copy_(out)

        return kernel

    register_builder("boundary-test", BoundaryScaleOp, builder)
    return BoundaryScaleOp


def _capture():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def _targets(gm):
    """The graph's calls, less the getitem nodes that unpack a tuple result."""
    import operator

    return [n.target for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem]


def test_graph_holds_only_the_ops_own_node_and_builds_nothing(op_cls):
    torch._dynamo.reset()
    op = op_cls(alpha=3.0, target="boundary-test")
    BUILDS.clear()
    graphs, backend = _capture()
    f = torch.compile(lambda x, b: op(x, b), backend=backend, fullgraph=True)
    x, b = torch.randn(4, 8), torch.randn(8)
    y, total = f(x, b)
    assert len(graphs) == 1
    assert _targets(graphs[0]) == [torch.ops.tileops.test_boundary_scale.default]
    assert [str(t) for t in _targets(graphs[0])] == [
        n.replace("tileops::", "tileops.") + ".default" for n in op_cls.compile_op_names
        if "writes" not in n]
    # the only build happened when the compiled graph ran, not while tracing
    assert BUILDS == ["x: f32[4, 8], bias: f32[8]"]
    torch.testing.assert_close(y, x * 3.0 + b)
    torch.testing.assert_close(total, (x * 3.0 + b).sum(0))


def test_cold_compile_of_a_fresh_instance_passes(op_cls):
    torch._dynamo.reset()
    BUILDS.clear()
    op = op_cls(target="boundary-test")  # nothing built, nothing bound
    assert op.serving_target is None and not op._target_kernels
    out = torch.compile(lambda x: op(x)[0] * 2, fullgraph=True)(torch.ones(2, 3))
    torch.testing.assert_close(out, torch.full((2, 3), 4.0))
    assert len(BUILDS) == 1


def test_dynamic_shapes_compile_once(op_cls):
    torch._dynamo.reset()
    op = op_cls(target="boundary-test")
    graphs, backend = _capture()
    f = torch.compile(lambda x: op(x)[0], backend=backend, fullgraph=True)
    for m in (3, 5, 9, 17):
        x = torch.randn(m, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(f(x), x * 2.0)
    assert len(graphs) == 1


def test_inplace_branch_is_its_own_custom_op_and_returns_the_input(op_cls):
    torch._dynamo.reset()
    op = op_cls(inplace=True, target="boundary-test")
    assert set(op_cls.compile_op_names) == {"tileops::test_boundary_scale",
                                            "tileops::test_boundary_scale__writes_x"}
    graphs, backend = _capture()

    def f(x):
        y, total = op(x)
        return y, total

    x = torch.randn(3, 4)
    expected = x * 2.0
    y, _ = torch.compile(f, backend=backend, fullgraph=True)(x)
    assert _targets(graphs[0]) == [torch.ops.tileops.test_boundary_scale__writes_x.default]
    torch.testing.assert_close(x, expected)  # written in place
    torch.testing.assert_close(y, expected)


def test_eager_calls_do_not_dispatch_through_torch_library(op_cls, monkeypatch):
    op = op_cls(target="boundary-test")
    op(torch.randn(2, 2))

    def boom(*a, **k):
        raise AssertionError("eager call went through the custom op")

    monkeypatch.setattr(op._boundary, "call", boom)
    op(torch.randn(2, 2))  # does not raise


def test_registry_frees_collected_instances_and_new_ones_never_resolve_stale(op_cls):
    torch._dynamo.reset()
    op = op_cls(alpha=5.0, target="boundary-test")
    key = op._instance_key
    f = torch.compile(lambda x, op=op: op(x)[0], fullgraph=True)
    torch.testing.assert_close(f(torch.ones(2, 2)), torch.full((2, 2), 5.0))
    del op, f
    torch._dynamo.reset()
    gc.collect()
    assert key not in _instances
    with pytest.raises(LookupError, match="no live TileOPs op instance"):
        instance_for_key(key)
    new = op_cls(alpha=7.0, target="boundary-test")
    assert new._instance_key != key
    g = torch.compile(lambda x: new(x)[0], fullgraph=True)
    torch.testing.assert_close(g(torch.ones(2, 2)), torch.full((2, 2), 7.0))


def test_forward_only_ops_refuse_inputs_that_require_grad(op_cls):
    op = op_cls(target="boundary-test")
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"forward-only .* x requires grad; call it under "
                                           r"torch.no_grad\(\)"):
        op(x)
    with torch.no_grad():
        op(x)  # fine without grad mode
    assert op.last_call is not None


def test_fake_tensor_output_inference_matches_eager(op_cls):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = op_cls(target="boundary-test")
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(6, 5, dtype=torch.bfloat16))
        y, total = torch.ops.tileops.test_boundary_scale(x, None, op._instance_key)
    assert y.shape == (6, 5) and y.dtype == torch.bfloat16
    assert total.shape == (5,) and total.dtype == torch.float32


def test_a_class_first_used_inside_torch_compile_is_refused_by_name(tmp_path):
    """An op class builds its members at its first use (generated code, under a lock): a
    compiled function cannot be that first use, and says which class to construct before."""
    from tileops.runtime.lazy import is_deferred

    path = tmp_path / "fresh.yaml"
    path.write_text(SPEC.replace("BoundaryScaleOp", "FreshScaleOp"))

    class FreshScaleOp(Op, specs=SpecSet.load(path)):
        pass

    assert is_deferred(FreshScaleOp, "__init__")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="FreshScaleOp: an op class is built at its first use, "
                                        "which cannot happen inside torch.compile"):
        torch.compile(lambda a: FreshScaleOp()(a), fullgraph=True)(torch.ones(2, 3))
    assert is_deferred(FreshScaleOp, "__init__")  # nothing half-built
    FreshScaleOp()  # built outside
    with pytest.raises(Exception, match="FreshScaleOp: an op cannot be constructed inside "
                                        "torch.compile"):
        torch.compile(lambda a: FreshScaleOp()(a), fullgraph=True)(torch.ones(2, 3))
