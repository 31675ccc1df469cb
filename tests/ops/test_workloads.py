"""``tileops.ops.workloads``: spec workloads as cases, their inputs, and output comparison.

The cases are generic over the signature (no op is named in the module), so they are tested on
the shipped entries and on a small entry written here; the comparison helpers against values
worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.ops import FusedAddRMSNormFwdOp, GemmFwdOp, RMSNormFwdOp
from tileops.ops.workloads import (
    TOLERANCE,
    Case,
    InputSpec,
    as_outputs,
    cases,
    cases_of,
    clone_inputs,
    compare,
    make_inputs,
    rel_l2,
)
from tileops.runtime import Op, default_specs
from tileops.spec import DTYPES

SHIPPED = (RMSNormFwdOp, FusedAddRMSNormFwdOp, GemmFwdOp)


# --- cases ------------------------------------------------------------------------------------


def test_scaling_is_generic_over_the_signature() -> None:
    entry = default_specs().find("FusedAddRMSNormFwdOp")[0]
    full = cases("FusedAddRMSNormFwdOp", entry, {}, labels=["m32768-n8192"])
    small = cases("FusedAddRMSNormFwdOp", entry, {}, labels=["m32768-n8192"],
                  max_elements=1 << 20)
    assert [c.dtype for c in full] == ["bfloat16", "float16"]
    assert full[0].shape == (32768, 8192) and small[0].shape == (128, 8192)
    assert small[0].scaled == {"B": ((32768,), (128,))}
    assert [(i.name, i.shape) for i in small[0].inputs] == [
        ("x", (128, 8192)), ("residual", (128, 8192)), ("weight", (8192,))]
    assert small[0].params == {}
    inplace = cases("FusedAddRMSNormFwdOp", entry, {}, labels=["inplace-decode"])
    assert inplace[0].params == {"inplace": True}
    no_weight = cases("RMSNormFwdOp", default_specs().find("RMSNormFwdOp")[0], {},
                      labels=["no-weight"])
    assert [i.shape for i in no_weight[0].inputs] == [(2048, 4096), None]


def test_cases_of_reads_the_class_entry() -> None:
    plan = RMSNormFwdOp._signature
    assert cases_of(RMSNormFwdOp, labels=["tiny-*"]) == cases(
        plan.name, plan.entry, plan.adts, labels=["tiny-*"])
    assert {c.label for c in cases_of(RMSNormFwdOp, labels=["tiny-*"])} == {"tiny-n7"}
    every = cases_of(RMSNormFwdOp)
    assert {c.label for c in every} == {w.label for w in plan.entry.workloads}


def test_cases_of_a_class_without_an_entry() -> None:
    with pytest.raises(TypeError, match="^Op has no spec entry, so it has no workloads$"):
        cases_of(Op)


def test_the_dtype_filter_replaces_the_dtype_cases() -> None:
    fp32 = cases_of(RMSNormFwdOp, dtypes=["float32"], labels=["m1-n4096"])
    assert [(c.dtype, c.dtypes) for c in fp32] == [("float32", {"T": "float32", "W": "float32"})]
    assert cases_of(RMSNormFwdOp, dtypes=["int8"]) == []  # no DType index admits it


@settings(max_examples=25, deadline=None)
@given(cap=st.integers(min_value=1, max_value=1 << 22))
def test_scaled_cases_fit_the_cap_or_cannot_shrink(cap: int) -> None:
    for cls in SHIPPED:
        for full, small in zip(cases_of(cls), cases_of(cls, max_elements=cap), strict=True):
            assert (full.label, full.dtypes, full.params) == (small.label, small.dtypes,
                                                               small.params)
            biggest = max(i.numel for i in small.inputs)
            if small.scaled:
                assert biggest <= max(i.numel for i in full.inputs)
                for was, now in small.scaled.values():  # indices only ever shrink
                    assert (now < was) if isinstance(was, int) else (
                        all(n <= w for n, w in zip(now, was, strict=True)))
            else:
                assert small.inputs == full.inputs
            # a row that still exceeds the cap was shrunk as far as its shapes allow: the
            # leading index of its largest input is down to one (or its row is kept whole)
            if biggest > cap and small.scaled:
                largest = max(small.inputs, key=lambda i: i.numel)
                assert largest.shape[0] == 1 or math.prod(largest.shape[1:]) > cap


# --- inputs -----------------------------------------------------------------------------------


def _case(*inputs: InputSpec) -> Case:
    return Case("TestOp", "row", {}, {}, list(inputs), {})


def test_make_inputs_draws_every_kind_of_input() -> None:
    case = _case(InputSpec("x", (4, 5), "bfloat16"), InputSpec("mask", (3,), "bool"),
                 InputSpec("idx", (2, 3), "int32"), InputSpec("lens", (3,), "int64", (0, 2, 5)),
                 InputSpec("f8", (6,), "float8_e4m3fn"), InputSpec("absent", None, None))
    x, mask, idx, lens, f8, absent = make_inputs(case, "cpu", seed=3)
    assert x.shape == (4, 5) and x.dtype == torch.bfloat16
    assert mask.dtype == torch.bool and mask.shape == (3,)
    assert idx.dtype == torch.int32 and bool(((idx >= 0) & (idx < 8)).all())
    assert lens.tolist() == [0, 2, 5] and lens.dtype == torch.int64
    assert f8.dtype == torch.float8_e4m3fn
    assert absent is None


def test_make_inputs_is_seeded() -> None:
    (case,) = cases_of(RMSNormFwdOp, labels=["tiny-n7"], dtypes=["float32"])
    a, b = make_inputs(case, torch.device("cpu")), make_inputs(case, "cpu", seed=0)
    c = make_inputs(case, "cpu", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    assert [t.shape for t in a] == [(3, 7), (7,)]


def test_clone_inputs_copies_and_keeps_absent_inputs() -> None:
    x = torch.ones(3)
    (y, none) = clone_inputs([x, None])
    y.add_(1)
    assert none is None and x.tolist() == [1.0, 1.0, 1.0] and y.tolist() == [2.0, 2.0, 2.0]


def test_as_outputs() -> None:
    t = torch.zeros(1)
    assert as_outputs(t) == (t,) and as_outputs((t, None)) == (t, None)


# --- comparison ------------------------------------------------------------------------------


def test_rel_l2_by_hand() -> None:
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)  # norm 5
    assert rel_l2(ref.clone(), ref) == 0.0
    assert rel_l2(torch.tensor([3.0, 5.0]), ref) == pytest.approx(0.2)
    assert rel_l2(torch.tensor([3.0, 4.0], dtype=torch.bfloat16), ref) == 0.0
    # a zero reference: the absolute error
    assert rel_l2(torch.tensor([0.0, 2.0]), torch.zeros(2)) == pytest.approx(2.0)


def test_rel_l2_never_passes_a_broken_output() -> None:
    ref = torch.ones(2, 2)
    assert rel_l2(torch.ones(4), ref) == math.inf
    assert rel_l2(torch.tensor([[1.0, float("nan")], [1.0, 1.0]]), ref) == math.inf
    assert rel_l2(torch.tensor([[1.0, float("inf")], [1.0, 1.0]]), ref) == math.inf


def test_rel_l2_holds_non_finite_references_to_the_same_value() -> None:
    nan, inf = float("nan"), float("inf")
    ref = torch.tensor([nan, inf, -inf, 2.0], dtype=torch.float64)
    assert rel_l2(torch.tensor([nan, inf, -inf, 2.0]), ref) == 0.0
    assert rel_l2(torch.tensor([nan, inf, -inf, 2.2]), ref) == pytest.approx(0.1)
    for wrong in ([1.0, inf, -inf, 2.0], [nan, -inf, -inf, 2.0], [nan, nan, -inf, 2.0],
                  [nan, inf, -inf, nan]):
        assert rel_l2(torch.tensor(wrong), ref) == math.inf, wrong
    # a reference value the output's dtype cannot hold: the output must overflow as it does
    big = torch.tensor([1e6, -1e6, 1.0], dtype=torch.float64)
    assert rel_l2(torch.tensor([inf, -inf, 1.0], dtype=torch.float16), big) == 0.0
    assert rel_l2(torch.tensor([65504.0, -inf, 1.0], dtype=torch.float16), big) == math.inf


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 40), cut=st.integers(1, 9), odd=st.sampled_from(
    ["none", "nan-same", "inf-same", "nan-missing", "inf-wrong"]), seed=st.integers(0, 2**16))
def test_rel_l2_in_slices_is_the_whole_tensor_s(size: int, cut: int, odd: str,
                                                seed: int) -> None:
    """Slices of any size (the widening a slice at a time) give the whole tensors' answer, on
    permuted (non-contiguous) operands and with non-finite elements in any slice."""
    import tileops.ops.workloads as W

    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(3, size, generator=g, dtype=torch.float64).T  # [size, 3], permuted
    out = (ref + 1e-3 * torch.randn(ref.shape, generator=g, dtype=torch.float64)).float()
    at = int(torch.randint(0, ref.numel(), (), generator=g))
    i, j = divmod(at, 3)
    if odd != "none":
        ref[i, j] = float("nan") if odd.startswith("nan") else float("inf")
        out[i, j] = {"nan-same": float("nan"), "inf-same": float("inf"),
                     "nan-missing": 1.0, "inf-wrong": float("-inf")}[odd]
    whole, saved = rel_l2(out, ref), W._REL_L2_SLICE
    try:
        W._REL_L2_SLICE = cut
        sliced = rel_l2(out, ref)
    finally:
        W._REL_L2_SLICE = saved
    if odd in ("nan-missing", "inf-wrong"):
        assert whole == sliced == math.inf
    else:
        assert sliced == pytest.approx(whole, rel=1e-12, abs=1e-300)


@settings(max_examples=50, deadline=None)
@given(scale=st.floats(min_value=1e-3, max_value=1e3), seed=st.integers(0, 2**16))
def test_rel_l2_is_scale_invariant(scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(16, generator=g, dtype=torch.float64)
    out = ref + 1e-3 * torch.randn(16, generator=g, dtype=torch.float64)
    assert rel_l2(out * scale, ref * scale) == pytest.approx(rel_l2(out, ref), rel=1e-9)


def test_compare_takes_the_worst_output_present_in_both() -> None:
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    good, bad = ref.clone(), torch.tensor([3.0, 5.0])
    assert compare((good, bad), (ref, ref)) == pytest.approx(0.2)
    assert compare((good, None), (ref, ref)) == 0.0  # an absent output is not compared
    assert compare((bad,), (None,)) == 0.0
    assert compare((), ()) == 0.0


def test_every_tolerance_names_a_dtype() -> None:
    assert set(TOLERANCE) <= set(DTYPES)
    assert TOLERANCE["float32"] < TOLERANCE["float16"] < TOLERANCE["bfloat16"]


def test_compare_refuses_a_call_that_returned_nothing_to_compare():
    import torch

    from tileops.ops.workloads import compare

    ref = (torch.ones(3, dtype=torch.float64),)
    assert compare((torch.ones(3),), ref) == 0.0
    with pytest.raises(ValueError, match="returned none of the outputs to compare"):
        compare((None,), ref)  # e.g. a contender that does not apply and returns None
    assert compare((None,), (None,)) == 0.0  # nothing expected, nothing returned


def test_broadcast_operands_shrink_together_and_stay_broadcastable() -> None:
    # the output's shape is a let (broadcast(SA, SB)): the inputs are shrunk, axis by axis
    # together where they must broadcast, so no workload is kept whole at full size
    from tileops.ops import AddFwdOp, WhereFwdOp

    for cls in (AddFwdOp, WhereFwdOp):
        for case in cases_of(cls, max_elements=2**14):
            shapes = [tuple(i.shape) for i in case.inputs]
            assert max(math.prod(s) for s in shapes) <= 2**14, (case.label, shapes)
            out = torch.broadcast_shapes(*shapes)
            assert math.prod(out) <= 2**14, (case.label, shapes)
