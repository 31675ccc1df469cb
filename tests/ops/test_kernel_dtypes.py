"""The in-tree kernels state the dtypes they serve: a call in another dtype the entry admits
(float64, for gradient checks; float32 for the GEMM) is refused by name when the in-tree
target serves the op, pointing at the target that serves it, and nothing is kept."""

import pickle

import pytest
import torch

from tileops.ops import GemmBwdOp, GemmFwdOp, LayerNormBwdOp, RMSNormFwdOp, UnservedDtypeError

NORM = ("the in-tree row-norm kernels serve bfloat16, float16, float32, not float64; "
        "construct the op with target='reference' for float64")


@pytest.mark.parametrize(("make", "args", "message"), [
    (lambda: RMSNormFwdOp(normalized_shape=(8,), target="tileops"),
     lambda: (torch.randn(2, 8, dtype=torch.float64),), f"RMSNormFwdOp: {NORM}"),
    (lambda: LayerNormBwdOp(normalized_shape=(8,), target="tileops"),
     lambda: (torch.randn(2, 8, dtype=torch.float64),) * 2, f"LayerNormBwdOp: {NORM}"),
    (lambda: GemmFwdOp(target="tileops"), lambda: (torch.randn(2, 3), torch.randn(3, 4)),
     "GemmFwdOp: the in-tree GEMM kernels serve bfloat16, float16, not float32; construct "
     "the op with target='reference' for float32"),
    (lambda: GemmBwdOp(target="tileops"),
     lambda: tuple(torch.randn(*s, dtype=torch.float64) for s in ((2, 4), (2, 3), (3, 4))),
     "GemmBwdOp: the in-tree GEMM kernels serve bfloat16, float16, not float64; construct "
     "the op with target='reference' for float64"),
])
def test_a_dtype_no_in_tree_kernel_serves_is_refused_by_name(make, args, message):
    op = make()
    with pytest.raises(UnservedDtypeError) as err:
        op(*args())
    assert str(err.value) == message
    # what a caller (a test harness, a fallback) reads without parsing the message, and a
    # copy through pickle (a process pool's report) the same
    e = err.value
    assert isinstance(e, TypeError) and message.startswith(f"{e.op}: the in-tree {e.kernels} ")
    assert f"serve {', '.join(e.served)}, not {e.dtype};" in message
    again = pickle.loads(pickle.dumps(e))
    assert (type(again), str(again), again.served) == (UnservedDtypeError, message, e.served)
    assert op.last_call is None and op.serving_target is None  # the binding was undone


def test_the_reference_target_serves_those_dtypes():
    a, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(GemmFwdOp(target="reference")(a, b), a @ b)
    x = torch.randn(2, 3)
    torch.testing.assert_close(GemmFwdOp(target="reference")(x, x.T.contiguous()), x @ x.T)
