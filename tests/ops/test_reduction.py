"""The reduction family on the CPU: the ``(outer, R, inner)`` view of any dim set (hypothesis
against torch's own reductions), the family's forward through a torch stand-in for the
``reduction`` slot (middle dims, non-adjacent dims, strided inputs, keepdim, every kind)
against the reference target, the plans' invariants, the refusals' exact text, and an op
called on several row counts building one entry and one program. The generic harness covers
the spec workloads; the kernels' numerics are the GPU tests'."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import reduction as K
from tileops.kernels.reduction import ReduceKind
from tileops.runtime import Kernel
from tileops.signature import SignatureCallError

torch = pytest.importorskip("torch")

from tileops.ops import reduction as R  # noqa: E402

OPS = [R.SumFwdOp, R.MeanFwdOp, R.ProdFwdOp, R.AmaxFwdOp, R.AminFwdOp, R.VarFwdOp,
       R.StdFwdOp, R.VarMeanFwdOp, R.L2NormFwdOp, R.AllFwdOp, R.AnyFwdOp]
ARG_OPS = [R.ArgmaxFwdOp, R.ArgminFwdOp]


# --- the view ------------------------------------------------------------------------------------


@st.composite
def shapes_and_axes(draw):
    rank = draw(st.integers(0, 5))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank)))
    axes = draw(st.sets(st.integers(0, max(rank - 1, 0)), max_size=rank)) if rank else set()
    return shape, tuple(sorted(axes))


@settings(max_examples=300, deadline=None)
@given(shapes_and_axes())
def test_the_view_reduces_the_axes_torch_reduces(case) -> None:
    shape, axes = case
    x = torch.randn(shape, dtype=torch.float64)
    perm, outer, r, inner = R.view_plan(shape, axes or tuple(range(len(shape))))
    laid = x.permute(perm).contiguous() if perm is not None else x
    got = laid.reshape(outer, r, inner).sum(1).reshape(-1)
    want = torch.sum(x, axes or tuple(range(len(shape)))).reshape(-1)
    assert torch.allclose(got, want)
    if perm is not None:  # a permute only where the reduced axes are not one run
        kept = [i for i in range(len(shape)) if i not in axes and shape[i] != 1]
        red = [i for i in axes if shape[i] != 1]
        assert any(k > red[0] and k < red[-1] for k in kept)
        assert inner == 1


@pytest.mark.parametrize(("shape", "axes", "plan"), [
    pytest.param((32768, 8192), (1,), (None, 32768, 8192, 1), id="last-dim-rows"),
    pytest.param((32768, 8192), (0,), (None, 1, 32768, 8192), id="leading-dim-columns"),
    pytest.param((4, 5, 6, 7), (1, 2), (None, 4, 30, 7), id="adjacent-dims-merge"),
    pytest.param((4, 1, 6), (0, 2), (None, 1, 24, 1), id="size-one-axis-between"),
    pytest.param((4, 5, 6), (0, 2), ((1, 0, 2), 5, 24, 1), id="non-adjacent-permute"),
    pytest.param((3, 1), (1,), (None, 1, 1, 3), id="only-size-one-reduced"),
    pytest.param((), (), (None, 1, 1, 1), id="zero-dim"),
])
def test_view_plans(shape, axes, plan) -> None:
    assert R.view_plan(shape, axes) == plan


# --- the forward, through a torch stand-in for the slot -------------------------------------------


launched: list[tuple] = []


def _fold(kind: ReduceKind, v, correction: float):
    """``kind`` of the (outer, r, inner) float64 or integer view ``v`` over dim 1."""
    if kind in (ReduceKind.SUM,):
        return (v.sum(1),)
    if kind is ReduceKind.MEAN:
        return (v.mean(1),)
    if kind is ReduceKind.PROD:
        return (v.prod(1),)
    if kind is ReduceKind.AMAX:
        return (v.amax(1),)
    if kind is ReduceKind.AMIN:
        return (v.amin(1),)
    if kind is ReduceKind.VAR:
        return (v.var(1, correction=correction),)
    if kind is ReduceKind.STD:
        return (v.std(1, correction=correction),)
    if kind is ReduceKind.VAR_MEAN:
        return torch.var_mean(v, 1, correction=correction)
    if kind is ReduceKind.L2NORM:
        return (torch.linalg.vector_norm(v, 2, 1),)
    if kind is ReduceKind.ALL:
        return (v.all(1),)
    if kind is ReduceKind.ANY:
        return (v.any(1),)
    if kind is ReduceKind.ARGMAX:
        return (v.argmax(1),)
    return (v.argmin(1),)


class TorchSlot(Kernel, K.ReductionInterface):
    """The slot on the CPU: the call's kind by torch over the view the op handed over, checked
    to be the spec's (contiguous, ``(outer, r, inner)``), written into the flat outputs."""

    devices = ("cpu",)
    general = True

    @classmethod
    def entry_for(cls, spec, op):
        def run(x, out, out2):
            launched.append((spec.outer, spec.r, spec.inner))
            assert tuple(x.shape) == (spec.outer, spec.r, spec.inner) and x.is_contiguous()
            v = x.double() if x.is_floating_point() else x
            got = _fold(spec.kind, v, spec.correction)
            out.copy_(got[0].reshape(-1))
            if out2 is not None:
                out2.copy_(got[1].reshape(-1))

        return run


def _pair(cls, **params):
    return cls(kernel_map={"reduction": TorchSlot}, **params), cls(target="reference", **params)


def _same(got, want) -> None:
    assert launched, "the call did not run through the reduction slot"
    launched.clear()
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.is_floating_point():
            # float32 sums of the same elements in another order (the slot's view against
            # torch's own reduction): a few ulp of the partial sums (about 6 for 33 normal
            # draws) apart
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
        else:
            assert torch.equal(g, w)


CASES = [
    pytest.param((16, 33, 8), 1, False, id="middle-dim"),
    pytest.param((4, 5, 6), (0, 2), False, id="dims-0-2-permuted"),
    pytest.param((4, 5, 6), (-1, 0), True, id="dims-0-2-keepdim"),
    pytest.param((4, 5, 6), None, False, id="every-dim"),
    pytest.param((4, 5, 6), None, True, id="every-dim-keepdim"),
    pytest.param((7, 3), 0, True, id="leading-keepdim"),
    pytest.param((2, 1, 9), 1, False, id="size-one-dim"),
    pytest.param((4, 5), (), False, id="empty-tuple-every-dim"),
]


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")  # size-one-dim: a NaN variance
@pytest.mark.parametrize("cls", OPS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("shape", "dim", "keepdim"), CASES)
def test_forward_matches_the_reference(cls, shape, dim, keepdim) -> None:
    if dim == () and cls in (R.AllFwdOp, R.AnyFwdOp):  # torch reads () as no axis there
        with pytest.raises(Exception, match=rf"^{cls.__name__}: construction param dim"):
            cls(dim=dim, keepdim=keepdim)
        return
    op, ref = _pair(cls, dim=dim, keepdim=keepdim)
    gen = torch.Generator().manual_seed(0)  # the same draws whatever ran before
    x = torch.randn(shape, dtype=torch.float32, generator=gen)
    _same(op(x), ref(x))
    xt = torch.randn(tuple(reversed(shape)), generator=gen).transpose(0, -1)  # strided: copied
    _same(op(xt), ref(xt))


@pytest.mark.parametrize("cls", ARG_OPS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("shape", "dim", "keepdim"), [
    pytest.param((16, 33, 8), 1, False, id="middle-dim"),
    pytest.param((4, 5, 6), None, True, id="every-dim-keepdim"),
    pytest.param((4, 5, 6), 0, False, id="leading"),
])
def test_arg_forward_matches_the_reference(cls, shape, dim, keepdim) -> None:
    op, ref = _pair(cls, dim=dim, keepdim=keepdim)
    x = torch.randint(-3, 3, shape).float()  # ties: the first index
    x.view(-1)[5] = float("nan")
    _same(op(x), ref(x))


@pytest.mark.parametrize(("cls", "dtype", "out"), [
    (R.SumFwdOp, torch.int32, torch.int64),
    (R.SumFwdOp, torch.bool, torch.int64),
    (R.ProdFwdOp, torch.int32, torch.int64),
    (R.AmaxFwdOp, torch.int32, torch.int32),
    (R.AllFwdOp, torch.bfloat16, torch.bool),
    (R.AnyFwdOp, torch.bool, torch.bool),
    (R.ArgmaxFwdOp, torch.bfloat16, torch.int64),
    (R.MeanFwdOp, torch.bfloat16, torch.bfloat16),
])
def test_output_dtypes_are_torchs(cls, dtype, out) -> None:
    op, ref = _pair(cls, dim=1)
    x = torch.randint(0, 3, (4, 6)).to(dtype)
    got = op(x)
    assert got.dtype == out == getattr(torch, cls.__name__[:-5].lower())(x, 1).dtype
    _same(got, ref(x))


# --- refusals --------------------------------------------------------------------------------------


def test_an_axis_out_of_range_is_refused_by_name() -> None:
    with pytest.raises(SignatureCallError) as info:
        R.SumFwdOp(dim=2, target="reference")(torch.zeros(2, 3))
    assert "dim 2 is out of range for a tensor of rank 2 (expected an axis in [-2, 1])" in \
        str(info.value)


def test_a_repeated_axis_is_refused_by_name() -> None:
    with pytest.raises(SignatureCallError) as info:
        R.SumFwdOp(dim=(0, -2), target="reference")(torch.zeros(2, 3))
    assert "dim 0 appears more than once in the dims (0, -2)" in str(info.value)


def test_mean_of_integers_is_refused() -> None:
    with pytest.raises(SignatureCallError) as info:
        R.MeanFwdOp(dim=0, target="reference")(torch.zeros(2, 3, dtype=torch.int32))
    assert "int32" in str(info.value) and "x" in str(info.value)


def test_the_in_tree_kernels_refuse_float64_naming_the_reference_target() -> None:
    op = R.SumFwdOp(dim=0, kernel_map={"reduction": TorchSlot})
    with pytest.raises(TypeError) as info:
        op(torch.zeros(2, 3, dtype=torch.float64))
    assert str(info.value) == (
        "SumFwdOp: the in-tree reduction kernels serve bfloat16, bool, float16, float32, "
        "int16, int32, int64, int8, uint8, not float64; construct the op with "
        "target='reference' for float64")


def test_the_call_spec_refuses_what_no_kernel_computes() -> None:
    dev = torch.device("cpu")
    with pytest.raises(ValueError) as info:
        K.ReductionSpec(device=dev, kind=ReduceKind.MEAN, outer=1, r=4, inner=1,
                        dtype="int32")
    assert str(info.value) == "ReductionSpec: mean needs a floating dtype, got int32"
    with pytest.raises(ValueError) as info:
        K.ReductionSpec(device=dev, kind=ReduceKind.AMAX, outer=1, r=0, inner=1,
                        dtype="float32")
    assert str(info.value) == "ReductionSpec: amax of an empty run (r = 0) has no value"
    with pytest.raises(ValueError) as info:
        K.ReductionSpec(device=dev, kind=ReduceKind.SUM, outer=1, r=4, inner=1,
                        dtype="float32", correction=1.0)
    assert str(info.value) == ("ReductionSpec: only the variance kinds take a correction, "
                               "not sum")
    with pytest.raises(TypeError) as info:
        K.ReductionSpec(device=dev, kind="sum", outer=1, r=4, inner=1, dtype="float32")
    assert str(info.value) == "ReductionSpec.kind must be a ReduceKind, got 'sum'"


def test_amax_of_an_empty_input_is_refused_by_its_rule() -> None:
    with pytest.raises(SignatureCallError) as info:
        R.AmaxFwdOp(dim=0, target="reference")(torch.zeros(0, 3))
    assert "prod(reduced_sizes(S, dim)) > 0" in str(info.value)


# --- the plans ---------------------------------------------------------------------------------


DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32"]


@settings(max_examples=300, deadline=None)
@given(m=st.integers(1, 1 << 16), n=st.integers(1, 1 << 28), dtype=st.sampled_from(DTYPES))
def test_row_plan_covers_the_row(m, n, dtype) -> None:
    tpr, rpc, vec, per, splits = K.row_plan(m, n, dtype)
    item = 1 if dtype == "bool" else K._ITEMSIZE[dtype]
    assert n % vec == 0 and vec * item <= 16 and (vec * item == 16 or vec == 1 or n % (2 * vec))
    assert tpr % 32 == 0 and tpr * rpc <= 256
    assert 1 <= splits <= K._MAX_SPLITS and (splits == 1 or rpc == 1)
    if splits > 1:  # each split keeps a pass of accesses for every thread
        assert -(-n // vec) // splits >= tpr * K._MIN_SPLIT_ACCESSES


@settings(max_examples=300, deadline=None)
@given(outer=st.integers(1, 4096), r=st.integers(1, 1 << 20), inner=st.integers(2, 1 << 16),
       dtype=st.sampled_from(DTYPES))
def test_column_plan_covers_the_columns(outer, r, inner, dtype) -> None:
    tcols, ty, vec, per, splits = K.column_plan(outer, r, inner, dtype)
    assert inner % vec == 0 and tcols * ty == 256
    assert tcols * vec >= min(inner, 32 * vec)  # a warp spans the row's vectors where it can
    assert 1 <= splits <= K._MAX_SPLITS
    if splits > 1:
        assert r // splits >= ty * per


def test_the_bars_get_split_plans() -> None:
    # 32768 rows of 8192 bf16: a CTA a row of 128 threads x 8 16-byte accesses, no split
    assert K.row_plan(32768, 8192, "bfloat16") == (128, 1, 8, 8, 1)
    # dim=0 of 32768 x 8192: 32 column blocks, R split 64 ways of 512 rows (2048 CTAs,
    # about 16 an SM; whole steps of 64 rows, no row predicate)
    assert K.column_plan(1, 32768, 8192, "bfloat16") == (32, 8, 8, 8, 64)
    # dim=None: one row split across the GPU, as far as the finish takes
    assert K.row_plan(1, 4096 * 4096, "bfloat16")[-1] == K._MAX_SPLITS


def test_a_view_past_int32_indexing_is_refused_by_every_kernel() -> None:
    spec = K.ReductionSpec(device=torch.device("cuda"), kind=ReduceKind.SUM, outer=1,
                           r=1 << 31, inner=1, dtype="bfloat16")
    why = "indexes in int32: 1 x 2147483648 x 1 elements is 2^31 or more"
    assert K.ReductionRowKernel.region_refusal(spec) == why
    assert K.ReductionColumnKernel.region_refusal(spec) == why
    ok = K.ReductionSpec(device=torch.device("cuda"), kind=ReduceKind.SUM, outer=32768,
                         r=8192, inner=1, dtype="bfloat16")
    assert K.ReductionRowKernel.region_refusal(ok) is None
    assert K.ReductionColumnKernel.region_refusal(ok) is None


def test_calls_differing_in_outer_share_one_entry_and_program(monkeypatch) -> None:
    """A model calling an op on new batch sizes builds no new program: the first call's entry
    serves the others (stand-ins for the compiled programs record the row counts launched)."""
    built: list = []

    class Program:
        def __init__(self, prim) -> None:
            self.rows: list[int] = []
            built.append(self)

        def __call__(self, x, y) -> None:
            self.rows.append(x.shape[0])

    class CpuRows(K.ReductionRowKernel):
        devices = ("cpu",)

    monkeypatch.setattr(K, "compile_program", lambda prim, target=None: Program(prim))
    K.build_row_kernel.cache_clear()
    try:
        op = R.SumFwdOp(dim=-1, kernel_map={"reduction": CpuRows})
        for rows in (3, 17, 300):
            op(torch.zeros(rows, 8192, dtype=torch.bfloat16))
    finally:
        K.build_row_kernel.cache_clear()
    assert len(built) == 1 and built[0].rows == [3, 17, 300]
    assert len(list(op.iter_kernels())) == 1


# --- empty inputs and dim=() ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", [R.AmaxFwdOp, R.AminFwdOp, R.ArgmaxFwdOp, R.ArgminFwdOp])
def test_an_empty_input_is_served_where_the_reduced_axes_are_not_empty(cls):
    fn = getattr(torch, cls.__name__.removesuffix("FwdOp").lower())
    for shape, dim in (((3, 0), 0), ((0, 4), 1), ((2, 0, 3), (0, 2))):
        if cls in ARG_OPS and not isinstance(dim, int):
            continue  # torch's argmax takes one dim
        x = torch.empty(shape)
        got = cls(dim=dim)(x)
        want = fn(x, dim)
        assert got.shape == want.shape and got.dtype == want.dtype
    # the run each output element reduces is empty: no value, refused as torch refuses it
    for shape, dim in (((0, 4), 0), ((0, 0), 1), ((3, 0), None)):
        with pytest.raises((RuntimeError, IndexError)):
            fn(torch.empty(shape), dim) if dim is not None else fn(torch.empty(shape))
        with pytest.raises(SignatureCallError) as exc:
            cls(dim=dim)(torch.empty(shape))
        text = str(exc.value)
        assert text.startswith(f"{cls.__name__}: argument x does not match the signature")
        assert "refinement 'prod(reduced_sizes(S, dim)) > 0' does not hold" in text


def test_the_in_tree_forward_launches_nothing_for_an_empty_output():
    class Never(Kernel, K.ReductionInterface):
        devices = ("cpu",)
        general = True

        @classmethod
        def entry_for(cls, spec, op):
            raise AssertionError("an empty output built an entry")

    op = R.AmaxFwdOp(dim=0, kernel_map={"reduction": Never})
    assert op(torch.empty(3, 0)).shape == (0,)


@pytest.mark.parametrize("cls", [R.AllFwdOp, R.AnyFwdOp])
def test_all_and_any_refuse_an_empty_dim_tuple_torch_reads_as_no_axis(cls):
    x = torch.randn(3, 4)
    # torch: every other reduction reads () as every axis, all and any as no axis
    assert getattr(torch, cls.__name__[:3].lower())(x, ()).shape == (3, 4)
    assert torch.sum(x, ()).shape == ()
    with pytest.raises(Exception) as exc:
        cls(dim=())
    text = str(exc.value)
    assert text.startswith(f"{cls.__name__}: construction param dim does not match")
    assert "refinement 'not present(dim) or naxes(dim) > 0' does not hold" in text
    assert cls(dim=None)(x).shape == () and cls(dim=(0, 1))(x).shape == ()


@pytest.mark.parametrize("cls", [R.VarFwdOp, R.StdFwdOp, R.VarMeanFwdOp])
def test_correction_none_is_torchs_one(cls):
    x = torch.randn(6, 5, dtype=torch.float64)
    want = cls(dim=0, correction=1.0)(x)
    got = cls(dim=0, correction=None)(x)
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,), strict=True):
        torch.testing.assert_close(g, w)
    # and through the in-tree path, whose slot computes with the spec's correction
    mine, _ = _pair(cls, dim=0, correction=None)
    got = mine(x.float())
    launched.clear()
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,), strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: (R.SumFwdOp(dim=5), torch.sum),
    lambda: (R.AmaxFwdOp(dim=-3), torch.amax),
    lambda: (R.ArgmaxFwdOp(dim=2), torch.argmax),
])
def test_a_dim_out_of_range_is_an_index_error_as_torchs(make):
    """A dim outside the rank is refused as torch refuses it, an IndexError (the signature's
    error is a ValueError too), naming the dim, the rank and the range."""
    from tileops.signature import SignatureIndexError

    op, fn = make()
    x = torch.randn(2, 3)
    with pytest.raises(IndexError):
        fn(x, dim=op.dim)
    with pytest.raises(SignatureIndexError, match=r"out of range for a tensor of rank 2 "
                                                  r"\(expected an axis in \[-2, 1\]\)"):
        op(x)


@pytest.mark.parametrize("name", ["AllFwdOp", "AnyFwdOp"])
def test_all_and_any_take_int64_as_their_siblings_do(name):
    """all and any of an int64 tensor (torch's are served; these took int32 but not int64,
    which sum, prod and the extrema take)."""
    x = torch.tensor([[0, 3, -2], [1, 1, 1], [0, 0, 0]], dtype=torch.int64)
    fn = torch.all if name == "AllFwdOp" else torch.any
    for dim in (None, 0, 1):
        op = getattr(R, name)(dim=dim)
        want = fn(x) if dim is None else fn(x, dim)
        got = op(x)
        assert got.dtype == torch.bool and torch.equal(got, want)
