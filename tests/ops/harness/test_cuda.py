"""On a CUDA GPU (marked ``cuda``; skipped where there is none): every workload of every op at
full size, through the op's default target on CUDA (the in-tree kernels), against float64
with the spec's effects; and CUDA graph capture after a warm-up call, replayed on new values.
"""

import pytest

torch = pytest.importorskip("torch")

from tileops.ops.workloads import as_outputs, cases_of, clone_inputs, make_inputs  # noqa: E402
from tileops.runtime import targets  # noqa: E402

from ._harness import (  # noqa: E402
    OPS,
    case_id,
    check_outputs,
    presence,
    spec_outputs,
)

pytestmark = pytest.mark.cuda

CASES = [c for cls in OPS.values() for c in cases_of(cls)]


def _expected(case):
    return spec_outputs(OPS[case.op]._signature, case.values, presence(case))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_in_tree_kernels_match_float64(case):
    op = OPS[case.op](**case.params)
    inputs = make_inputs(case, "cuda")
    before = clone_inputs(inputs)
    refs = op.fp64_reference(*inputs)
    outs = as_outputs(op(*inputs))
    torch.cuda.synchronize()
    assert op.serving_target == targets.IN_TREE
    check_outputs(op, inputs, before, outs, refs, _expected(case))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_graph_replays_on_new_values(case):
    op = OPS[case.op](**case.params)
    static = make_inputs(case, "cuda")
    op(*clone_inputs(static))  # the warm-up call builds what the calls of this shape need
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = as_outputs(op(*static))
    assert op.serving_target == targets.IN_TREE
    fresh = make_inputs(case, "cuda", seed=1)
    for s, f in zip(static, fresh, strict=True):
        if s is not None:
            s.copy_(f)
    refs = op.fp64_reference(*fresh)
    graph.replay()
    torch.cuda.synchronize()
    check_outputs(op, static, fresh, outs, refs, _expected(case))
