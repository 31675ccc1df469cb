"""On a CUDA GPU (marked ``cuda``; skipped where there is none): every workload of every op at
full size, through the op's default target on CUDA (the in-tree kernels), against float64
with the spec's effects; and CUDA graph capture after a warm-up call, replayed on new values.

A workload in a wide dtype the in-tree kernels leave to the reference target (float32 or
float64 rows a spec keeps for its CPU checks, where the family's kernels serve 16-bit types)
must be refused with the op's dtype refusal, naming the op, the dtype and the target that
serves it; the reference target on CUDA then answers it against float64. A 16-bit dtype is
never refused.
"""

import gc

import pytest

torch = pytest.importorskip("torch")

from tileops.ops import UnservedDtypeError  # noqa: E402
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


#: the dtypes a family's in-tree kernels may leave to the reference target
_MAY_REFUSE = frozenset({"float32", "float64"})


@pytest.fixture(autouse=True)
def _release_memory():
    """Each case's tensors and graphs freed before the next case allocates: the largest
    workloads (DeepSeek-V3's expert bank, 15 GB, beside a copy and its reference) need most
    of the GPU."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _expected(case):
    return spec_outputs(OPS[case.op]._signature, case.values, presence(case))


def _refused(case, exc: TypeError) -> bool:
    """Whether ``exc`` is the op's refusal of a wide dtype of ``case`` (asserted whole: the
    op's name, a dtype of the case that the served list lacks, the target that serves it);
    False for any other TypeError."""
    if not isinstance(exc, UnservedDtypeError):
        return False
    assert exc.op == case.op and exc.dtype in _MAY_REFUSE, str(exc)
    assert exc.dtype in case.dtypes.values() and exc.dtype not in exc.served, str(exc)
    assert str(exc).endswith(f"construct the op with target='reference' for {exc.dtype}")
    return True


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_in_tree_kernels_match_float64(case):
    op = OPS[case.op](**case.params)
    inputs = make_inputs(case, "cuda")
    before = clone_inputs(inputs)
    refs = op.fp64_reference(*inputs)
    try:
        outs = as_outputs(op(*inputs))
        want = targets.IN_TREE
    except TypeError as exc:
        if not _refused(case, exc):
            raise
        op = OPS[case.op](**case.params, target=targets.REFERENCE)
        outs = as_outputs(op(*inputs))
        want = targets.REFERENCE
    torch.cuda.synchronize()
    assert op.serving_target == want
    check_outputs(op, inputs, before, outs, refs, _expected(case))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_graph_replays_on_new_values(case):
    op = OPS[case.op](**case.params)
    static = make_inputs(case, "cuda")
    try:
        op(*clone_inputs(static))  # the warm-up call builds what the calls of this shape need
    except TypeError as exc:  # no in-tree kernel to capture: the refusal is the check
        if not _refused(case, exc):
            raise
        return
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
