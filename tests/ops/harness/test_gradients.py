"""Compiled gradients of every op whose entry declares a backward, on its base cases (each
presence of the optional inputs and each layout or effect param a workload has).

The contract: ``torch.compile(fullgraph=True)`` of a call with every differentiable input
requiring grad traces one frame whose forward graph holds the op's custom op and whose
backward graph holds the backward op's custom op and no forward op; nothing is bound or run
while tracing; the gradients equal the eager call's (the same kernels: bit for bit on the
reference target up to the dtype's tolerance). A case whose branch writes its inputs is
refused by name, as torch.library cannot differentiate a mutating custom op.
"""

import pytest

torch = pytest.importorskip("torch")

from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

from tileops.ops.workloads import make_inputs  # noqa: E402

from ._harness import OPS, base_cases, case_id, tolerance  # noqa: E402

CASES = [c for cls in OPS.values() if cls._gradient is not None for c in base_cases(cls)]


def _leaves(op, inputs):
    """The case's inputs in float64, the differentiable ones requiring grad; a bool input (a
    mask, a condition), one the entry declares integral (class indices, positions) and one of
    a named floating dtype without a gradient stay as they are (an integer case of a dtype index, a binary op's int32, is differentiated in
    float64 like the rest)."""
    diff = op._gradient.differentiable
    decls = op._signature.entry.signature.inputs
    # an integral input, and one of a named floating dtype that gets no gradient (a float32
    # bias), keep their declared dtype: the signature admits no other
    fixed = {i for i, n in enumerate(op._signature.input_names)
             if decls[n].dtype.text in ("uint8", "int8", "int16", "int32", "int64")
             or (decls[n].dtype.text in ("float16", "bfloat16", "float32") and i not in diff)}
    return [None if t is None else t if t.dtype is torch.bool or i in fixed else
            t.double().requires_grad_(i in diff)
            for i, t in enumerate(inputs)]


def _loss(outs):
    outs = outs if isinstance(outs, tuple) else (outs,)
    # a fixed random weighting per output, so every element's gradient is distinct
    total = 0
    for k, o in enumerate(outs):
        if o is not None and o.is_floating_point():
            g = torch.Generator().manual_seed(k)
            total = total + (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
    return total


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_compiled_gradients_match_eager(case):
    torch._dynamo.reset()
    cls = OPS[case.op]
    inputs = make_inputs(case, "cpu")
    eager_op = cls(**case.params)
    written = eager_op._boundary.written if eager_op._boundary else ()
    op = cls(**case.params)
    graphs, state = [], []

    def record(gm, example_inputs):
        state.append(op.serving_target)
        # a custom op that writes an input (a gradient written over the saved logits) is
        # traced as auto_functionalized(op, ...): its name is the node's first argument
        graphs.append([str(n.args[0]) if "auto_functionalized" in str(n.target) and n.args
                       else str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    f = torch.compile(lambda *xs: op(*xs), fullgraph=True,
                      backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    leaves = _leaves(op, inputs)
    if written:
        with pytest.raises(Exception, match=r"writes .* in place, and torch.compile cannot "
                                            r"differentiate a custom op that writes"):
            f(*[None if t is None else t.clone() for t in leaves])
        return
    wrt = [t for t in leaves if t is not None and t.requires_grad]
    got = torch.autograd.grad(_loss(f(*leaves)), wrt)
    assert state[0] is None, "tracing bound a target"
    fwd_names = {q.split("::", 1)[1] for q in cls.compile_op_names}
    bwd_cls = cls._gradient.resolved()[0]
    bwd_names = {q.split("::", 1)[1] for q in bwd_cls.compile_op_names}
    assert len(graphs) == 2, graphs
    assert any(any(n in s for n in fwd_names) for s in graphs[0]), graphs[0]
    assert any(any(n in s for n in bwd_names) for s in graphs[1]), graphs[1]
    assert not any(any(s.endswith(f"{n}.default") for n in fwd_names) for s in graphs[1])
    eager_leaves = _leaves(eager_op, inputs)
    expected = torch.autograd.grad(_loss(eager_op(*eager_leaves)),
                                   [t for t in eager_leaves if t is not None and t.requires_grad])
    tol = tolerance([torch.float64])
    for g, e in zip(got, expected, strict=True):
        # NaN where the eager call's is (a power of a negative base): the same kernels agree
        torch.testing.assert_close(g, e, rtol=tol, atol=tol, equal_nan=True)
