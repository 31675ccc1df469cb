"""The GEMM walk-through of the design documents (concepts, section 7, table 4), as a test.

    declared:  a: Tensor[T, [M, K]]        b: Tensor[T, [K, N]]
    actual:    a: bfloat16, (128, 4096)    b: bfloat16, (4096, 512)

    1  a's dtype   ~ T     T := bfloat16
    2  a's axis 1  ~ M     M := 128
    3  a's axis 2  ~ K     K := 4096
    4  b's dtype   ~ T     checked equal to T
    5  b's axis 1  ~ K     checked equal to K
    6  b's axis 2  ~ N     N := 512

    output: Tensor[T, [M, N]] = bfloat16, (128, 512)

Reproduced for all four (trans_a, trans_b): Mat[t, R, C] is [C, R] when t is true, so the
transposed layouts are fed the transposed actual shapes and bind the same indices.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from tileops.signature import SignatureCallError  # noqa: E402

TRANS = [(False, False), (False, True), (True, False), (True, True)]


def _a(trans_a: bool, m: int = 128, k: int = 4096, dtype=torch.bfloat16):
    return torch.empty((k, m) if trans_a else (m, k), dtype=dtype)


def _b(trans_b: bool, k: int = 4096, n: int = 512, dtype=torch.bfloat16):
    return torch.empty((n, k) if trans_b else (k, n), dtype=dtype)


@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS)
def test_table_4_bindings_and_output(example_plan, trans_a: bool, trans_b: bool) -> None:
    point = example_plan("GemmFwdOp").construct(trans_a=trans_a, trans_b=trans_b)
    call = point.check(_a(trans_a), _b(trans_b))
    assert call.indices == {"trans_a": trans_a, "trans_b": trans_b,
                            "M": 128, "K": 4096, "N": 512, "T": "bfloat16"}
    assert call.tensors["c"] == ((128, 512), "bfloat16")
    assert call.output_dtypes == (torch.bfloat16,)
    assert call.tensors["a"] == (tuple(_a(trans_a).shape), "bfloat16")
    assert call.tensors["b"] == (tuple(_b(trans_b).shape), "bfloat16")


@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS)
def test_table_4_rows_4_and_5_check_against_the_bindings(example_plan, trans_a: bool,
                                                         trans_b: bool) -> None:
    point = example_plan("GemmFwdOp").construct(trans_a=trans_a, trans_b=trans_b)
    a_k = "a.shape[0]" if trans_a else "a.shape[1]"
    b_k = "b.shape[1]" if trans_b else "b.shape[0]"
    # row 5: b's K axis is checked against the K bound from a
    with pytest.raises(SignatureCallError) as info:
        point.check(_a(trans_a), _b(trans_b, k=2048))
    assert info.value.because == f"K bound to 4096 by {a_k}, but {b_k} is 2048"
    # rows 1-3 bound T, M, K in that order (K first when a is transposed) before b was read;
    # a transposed b binds N on its first axis before its K axis is checked
    bound_by_a = [("T", "bfloat16"), *([("K", 4096), ("M", 128)] if trans_a
                                        else [("M", 128), ("K", 4096)])]
    assert list(info.value.bound.items()) == bound_by_a + ([("N", 512)] if trans_b else [])
    # row 4: b's dtype is checked against the T bound from a's dtype
    with pytest.raises(SignatureCallError) as info:
        point.check(_a(trans_a), _b(trans_b, dtype=torch.float16))
    assert info.value.because == "T bound to bfloat16 by a.dtype, but b.dtype is float16"


def test_table_4_order_in_the_generated_check(example_plan) -> None:
    # The generated call check performs the six rows of table 4 in order (check_exact: every
    # check with its error; the hot-path check makes the same comparisons in the same order
    # and hands a miss to it), b's device compared with a's before b's dtype; derive infers
    # c's shape (M, N) from the record.
    source = example_plan("GemmFwdOp").construct().source()
    body = source.split("def check_exact(")[1].split("def check(")[0]
    rows = ["dev_a = t_a.device", "i_T = d_a", "i_M = s_a[0]", "i_K = s_a[1]",
            "t_b.device == dev_a", "d_b == i_T", "s_b[0] == i_K", "i_N = s_b[1]"]
    at = [body.index(r) for r in rows]
    assert at == sorted(at), rows
    assert re.search(r"return _R\(dev_a, _BR\d+, s_a, d_a, s_b, d_b\)", body)
    fast = source.split("def check(")[1].split("def check_symbolic(")[0]
    at = [fast.index(r) for r in ["i_T = d_a", "i_K = s_a[1]", "t_b.device == dev_a",
                                  "d_b == i_T", "s_b[0] == i_K"]]
    assert at == sorted(at)
    assert "return check_exact(t_a, t_b)" in fast
    derive = source.split("def derive(")[1].split("def traffic(")[0]
    assert re.search(r"return \(i_M, i_N, i_K, i_T\), \(\(i_M, i_N\),\), \(i_T,\)", derive)


def test_transposed_point_has_its_own_code(example_plan) -> None:
    plan = example_plan("GemmFwdOp")
    src = plan.construct(trans_a=True, trans_b=True).source()
    assert "i_K = s_a[0]" in src and "i_M = s_a[1]" in src
    assert "i_N = s_b[0]" in src and "s_b[1] == i_K" in src
    # an untransposed call does not fit the transposed point
    with pytest.raises(SignatureCallError):
        plan.construct(trans_a=True, trans_b=True).check(_a(False), _b(False))
