"""Dtype coverage of the reductions, the scans, top-k and clamp against torch on the CPU: for
every op and every dtype of bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32
and float64, where torch's function takes the dtype the op takes it too and gives torch's
result dtype and values (on the CPU the ``reference`` target serves every op); where torch
refuses it the op refuses it too, by name (the op, the argument, what was expected and what
was seen), not with an error of torch's. Shapes and dims are drawn by hypothesis.

On CUDA the in-tree kernels serve most of those dtypes; a dtype a family's kernels lack is
refused by name, pointing at the ``reference`` target that serves it. Which ones those are is
stated here (:data:`UNSERVED`) and checked through stand-ins of the kernels' slots, which run
the ops' in-tree path on the CPU.

Clamp's result dtype is torch's promotion of x, the tensor bounds and the Python numbers (an
int bound keeps an integer x's dtype, a float one makes it the default float); in place it is
x's, a bound of a higher category refused as torch refuses it. One refusal is the op's own:
a negative number bound beside a uint8 x, which torch wraps (-1 is 255), is refused naming
the number to pass."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tileops.kernels import elementwise as EK
from tileops.kernels import reduction as RK
from tileops.kernels import scan as SK
from tileops.kernels import topk as TK
from tileops.ops import (
    AllFwdOp,
    AmaxFwdOp,
    AminFwdOp,
    AnyFwdOp,
    ArgmaxFwdOp,
    ArgminFwdOp,
    ClampFwdOp,
    CumprodFwdOp,
    CumsumFwdOp,
    L2NormFwdOp,
    MeanFwdOp,
    ProdFwdOp,
    StdFwdOp,
    SumFwdOp,
    TopkFwdOp,
    UnservedDtypeError,
    VarFwdOp,
    VarMeanFwdOp,
)
from tileops.runtime import Kernel
from tileops.signature import SignatureCallError

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dims_all(x: torch.Tensor, dim):
    """``dim`` as torch's functions without a None of their own take it."""
    return tuple(range(x.dim())) if dim is None else dim


def _prod(x: torch.Tensor, dim, keepdim: bool) -> torch.Tensor:
    """torch.prod, which takes one dim or none (every axis, without keepdim)."""
    if dim is not None:
        return torch.prod(x, dim, keepdim=keepdim)
    y = torch.prod(x)
    return y.reshape((1,) * x.dim()) if keepdim else y


#: op -> (its class, torch's function of (x, dim, keepdim), whether its dim is one axis)
REDUCTIONS = {
    "Sum": (SumFwdOp, lambda x, d, k: torch.sum(x, _dims_all(x, d), keepdim=k), False),
    "Mean": (MeanFwdOp, lambda x, d, k: torch.mean(x, _dims_all(x, d), keepdim=k), False),
    "Prod": (ProdFwdOp, lambda x, d, k: _prod(x, d, k), True),
    "Amax": (AmaxFwdOp, lambda x, d, k: torch.amax(x, _dims_all(x, d), keepdim=k), False),
    "Amin": (AminFwdOp, lambda x, d, k: torch.amin(x, _dims_all(x, d), keepdim=k), False),
    "Var": (VarFwdOp, lambda x, d, k: torch.var(x, _dims_all(x, d), keepdim=k), False),
    "Std": (StdFwdOp, lambda x, d, k: torch.std(x, _dims_all(x, d), keepdim=k), False),
    "VarMean": (VarMeanFwdOp, lambda x, d, k: torch.var_mean(x, _dims_all(x, d), keepdim=k),
                False),
    "L2Norm": (L2NormFwdOp, lambda x, d, k: torch.linalg.vector_norm(x, 2, d, keepdim=k),
               False),
    "All": (AllFwdOp, lambda x, d, k: torch.all(x, _dims_all(x, d), keepdim=k), False),
    "Any": (AnyFwdOp, lambda x, d, k: torch.any(x, _dims_all(x, d), keepdim=k), False),
    "Argmax": (ArgmaxFwdOp, lambda x, d, k: torch.argmax(x, d, keepdim=k), True),
    "Argmin": (ArgminFwdOp, lambda x, d, k: torch.argmin(x, d, keepdim=k), True),
}

#: the dtypes torch's function refuses, by op (the test finds them; this states them)
REFUSED = {
    **{op: {"bool", "uint8", "int8", "int16", "int32", "int64"}
       for op in ("Mean", "Var", "Std", "VarMean", "L2Norm")},
    "Argmax": {"bool"}, "Argmin": {"bool"}, "Topk": {"bool"},
}

#: the dtypes each family's in-tree kernels leave to the reference target (refused by name
#: on CUDA): float64 everywhere but the elementwise kernels, and top-k's integers (its radix
#: keys are written for floats)
UNSERVED = {
    **{op: {"float64"} for op in REDUCTIONS},
    "Cumsum": {"float64"}, "Cumprod": {"float64"},
    "Topk": {"uint8", "int8", "int16", "int32", "int64", "float64"},
    "Clamp": set(),
}


def _input(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """Values with ties, zeros and negatives (uint8 from 0), exact in every dtype."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) < 0.6
    lo = 0 if dtype is torch.uint8 else -4
    x = torch.randint(lo, 5, shape, generator=g)
    if dtype.is_floating_point:
        return (x + torch.rand(shape, generator=g).round(decimals=2)).to(dtype)
    return x.to(dtype)


def _torch(fn, *args):
    """torch's outputs as a tuple, or the exception it raises."""
    try:
        out = fn(*args)
    except (RuntimeError, TypeError, IndexError, ValueError) as exc:
        return exc
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _tolerance(dtype: torch.dtype) -> dict:
    """The tolerance of a floating result: the reference computes a 16-bit input in float32
    and rounds once, where torch's CPU kernels may round partial sums."""
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 1.6e-2, "atol": 1e-2}
    return {"rtol": 1e-5, "atol": 1e-6}


def _same(got, want) -> None:
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert g.shape == w.shape, (g.shape, w.shape)
        if w.dtype.is_floating_point:
            torch.testing.assert_close(g, w, equal_nan=True, **_tolerance(w.dtype))
        else:
            assert torch.equal(g, w), (g, w)


def _refused_by_name(exc: BaseException, op: str, dtype: str) -> None:
    """A dtype refusal by name: the op, the argument, what it expected and what it saw."""
    text = str(exc)
    assert isinstance(exc, SignatureCallError), (type(exc), text)
    lines = text.splitlines()
    assert lines[0] == f"{op}: argument x does not match the signature", text
    assert lines[1].startswith("  expected: x: Tensor[T, ")
    assert lines[2].startswith("  seen:     x: ")
    assert f"x.dtype is {dtype}, but T must be one of " in lines[3]


@st.composite
def _reduction_calls(draw, one_axis: bool):
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    if one_axis or not rank:
        dim = draw(st.one_of(st.none(), st.integers(-max(rank, 1), max(rank, 1) - 1)))
    else:
        axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        dim = draw(st.one_of(st.none(), st.just(axes[0] - rank), st.just(tuple(axes))))
    return shape, dim, draw(st.booleans()), draw(st.integers(0, 1 << 16))


_FAST = settings(max_examples=12, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")  # one element: torch's NaN
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_a_reduction_takes_what_torch_takes_and_gives_its_dtype_and_values(op, dtype):
    cls, fn, one_axis = REDUCTIONS[op]
    name = _name(dtype)

    @_FAST
    @given(_reduction_calls(one_axis))
    def check(call):
        shape, dim, keepdim, seed = call
        x = _input(dtype, shape, seed)
        want = _torch(fn, x, dim, keepdim)
        if isinstance(want, BaseException):
            assert name in REFUSED.get(op, ()), f"torch refused {op} of {name}: {want}"
            with pytest.raises(SignatureCallError) as exc:
                cls(dim=dim, keepdim=keepdim)(x)
            _refused_by_name(exc.value, f"{op}FwdOp", name)
            return
        assert name not in REFUSED.get(op, ())
        _same(cls(dim=dim, keepdim=keepdim)(x), want)

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("op", ["Cumsum", "Cumprod"])
def test_a_scan_takes_what_torch_takes_and_gives_its_dtype_and_values(op, dtype):
    cls, fn = (CumsumFwdOp, torch.cumsum) if op == "Cumsum" else (CumprodFwdOp, torch.cumprod)

    @_FAST
    @given(st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), st.data())
    def check(shape, data):
        dim = data.draw(st.integers(-len(shape), len(shape) - 1))
        x = _input(dtype, shape, data.draw(st.integers(0, 1 << 16)))
        _same(cls(dim=dim)(x), _torch(fn, x, dim))

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_topk_takes_what_torch_takes_and_gives_its_values_and_valid_indices(dtype):
    name = _name(dtype)

    @_FAST
    @given(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), st.data())
    def check(shape, data):
        dim = data.draw(st.integers(-len(shape), len(shape) - 1))
        k = data.draw(st.integers(0, shape[dim]))
        largest = data.draw(st.booleans())
        x = _input(dtype, shape, data.draw(st.integers(0, 1 << 16)))
        want = _torch(lambda: torch.topk(x, k, dim, largest=largest))
        op = TopkFwdOp(k=k, dim=dim, largest=largest)
        if isinstance(want, BaseException):
            assert name in REFUSED["Topk"], f"torch refused top-k of {name}: {want}"
            with pytest.raises(SignatureCallError) as exc:
                op(x)
            _refused_by_name(exc.value, "TopkFwdOp", name)
            return
        values, indices = op(x)
        _same((values,), (want[0],))  # equal values: which of them torch keeps is open
        assert indices.dtype == torch.int64
        assert torch.equal(x.gather(dim, indices), values)

    check()


# --- clamp ------------------------------------------------------------------------------------


#: number bounds: ints, floats, one of each, one bound alone
NUMBERS = [(0, 2), (-1.5, 2.5), (1, 2.5), (None, 3), (0.5, None)]


@pytest.mark.parametrize("bounds", NUMBERS, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_clamp_by_numbers_promotes_as_torch(dtype, bounds):
    lo, hi = bounds
    if dtype is torch.uint8 and isinstance(lo, int) and lo < 0:
        lo = 0  # (torch wraps a negative number into uint8: refused here, see below)
    x = _input(dtype, (3, 5), 0)
    want = _torch(torch.clamp, x, lo, hi)
    op = ClampFwdOp(min=lo, max=hi)
    if isinstance(want, BaseException):  # torch's clamp has no bool kernel
        assert dtype is torch.bool and {type(lo), type(hi)} <= {bool, type(None)}
        pytest.fail("unreachable: a number bound is never a bool here")
    _same(op(x), want)
    # in place: x's dtype, or refused where the result would be of a higher category
    mine, theirs = x.clone(), x.clone()
    want = _torch(torch.clamp_, theirs, lo, hi)
    if isinstance(want, BaseException):
        assert "can't be cast to the desired output type" in str(want)
        with pytest.raises(SignatureCallError) as exc:
            ClampFwdOp(min=lo, max=hi, inplace=True)(mine)
        assert "refinement 'not inplace or result_type(T, 1, R, 0) == T' does not hold" in \
            str(exc.value)
        assert torch.equal(mine, x)  # nothing written
        return
    assert ClampFwdOp(min=lo, max=hi, inplace=True)(mine) is mine
    _same(mine, (theirs,))


@pytest.mark.parametrize("bound", DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_clamp_by_tensors_promotes_across_x_and_the_bounds_as_torch(dtype, bound):
    x = _input(dtype, (4, 6), 1)
    lo, hi = _input(bound, (6,), 2), _input(bound, (4, 1), 3)
    want = _torch(torch.clamp, x, lo, hi)
    if isinstance(want, BaseException):  # a bool result: torch has no bool clamp
        assert torch.result_type(x, lo) is torch.bool
        with pytest.raises(SignatureCallError) as exc:
            ClampFwdOp()(x, lo, hi)
        assert str(exc.value).splitlines()[:2] == [
            "ClampFwdOp: argument x does not match the signature", "  expected: R != bool"]
        return
    _same(ClampFwdOp()(x, lo, hi), want)
    _same(ClampFwdOp()(x, None, hi), _torch(torch.clamp, x, None, hi))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.sampled_from(DTYPES),
       st.sampled_from([(), (1,), (5,), (3, 5)]), st.sampled_from([(), (1,), (5,), (3, 1)]),
       st.booleans(), st.integers(0, 1 << 16))
# in place, computed in int16 and cast into the uint8 x (a bound of -4 is 252 there)
@example(torch.uint8, torch.bool, torch.int8, (), (1,), True, 0)
def test_clamp_by_tensors_of_any_dtypes_and_ranks_is_torchs(tx, tm, tn, sm, sn, inplace, seed):
    """x, min_bound and max_bound each of any dtype, a bound 0-dim or not (a 0-dim one takes
    part in the promotion only with a higher category), out of place and in place (computed
    in the promoted dtype and cast into x, as torch does)."""
    x = _input(tx, (3, 5), seed)
    lo, hi = _input(tm, sm, seed + 1), _input(tn, sn, seed + 2)
    theirs = x.clone()
    want = _torch(torch.clamp_ if inplace else torch.clamp, theirs, lo, hi)
    op = ClampFwdOp(inplace=inplace)
    mine = x.clone()
    if isinstance(want, BaseException):
        with pytest.raises(SignatureCallError) as exc:
            op(mine, lo, hi)
        assert str(exc.value).startswith("ClampFwdOp: argument x does not match the signature")
        assert torch.equal(mine, x)
        return
    got = op(mine, lo, hi)
    _same(got, (theirs if inplace else want[0],))
    assert (got is mine) == inplace


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.sampled_from([(), (5,), (3, 1)]),
       st.sampled_from([0, 2, 1.5, -0.25]), st.booleans(), st.integers(0, 1 << 16))
def test_clamp_by_a_number_and_a_tensor_promotes_all_three(tx, tn, sn, number, low, seed):
    """A bound of each spelling (torch.clamp takes two numbers or two tensors): y's dtype is
    torch's promotion of x, the tensor and the number (a wrapped number), the number taken as
    a 0-dim tensor of it, as the eager function states it."""
    x = _input(tx, (3, 5), seed)
    t = _input(tn, sn, seed + 1)
    params, bounds = (({"min": number}, (None, t)) if low else ({"max": number}, (t, None)))
    op = ClampFwdOp(**params)
    try:
        want = op.eager()(x, *bounds)
    except RuntimeError:  # a bool result, or a number y's dtype cannot hold
        with pytest.raises((SignatureCallError, RuntimeError)) as exc:
            op(x, *bounds)
        assert str(exc.value).startswith("ClampFwdOp: ")
        return
    _same(op(x, *bounds), (want,))


def test_clamp_reads_torchs_default_dtype_for_a_float_bound():
    x = torch.arange(-3, 4, dtype=torch.int32)
    try:
        torch.set_default_dtype(torch.float64)
        got, want = ClampFwdOp(min=-0.5)(x), torch.clamp(x, -0.5)
    finally:
        torch.set_default_dtype(torch.float32)
    assert got.dtype is want.dtype is torch.float64 and torch.equal(got, want)
    assert ClampFwdOp(min=-0.5)(x).dtype is torch.float32


def test_clamp_refuses_a_negative_number_beside_uint8_naming_what_torch_makes_of_it():
    """torch converts -1 into uint8 as 255 (so clamp(x, -1, 100) is 100 everywhere); the op
    refuses the number by name rather than taking a bound other than the one written."""
    x = torch.tensor([0, 5, 200], dtype=torch.uint8)
    assert torch.equal(torch.clamp(x, -1, 100), torch.full((3,), 100, dtype=torch.uint8))
    with pytest.raises(RuntimeError) as exc:
        ClampFwdOp(min=-1, max=100)(x)
    assert str(exc.value) == (
        "ClampFwdOp: param min is -1 beside uint8, which torch wraps to 255; pass 255 (a "
        "negative number is not taken into an unsigned dtype here)")
    assert torch.equal(ClampFwdOp(min=255, max=100)(x), torch.clamp(x, -1, 100))


# --- the in-tree kernels: served, or refused by name ------------------------------------------


def _stand_in(interface):
    """A CPU stand-in of a slot's kernels: it takes every call the op hands over and writes
    nothing (what the op's own checks and refusals do before it is the point)."""

    class StandIn(Kernel, interface):
        devices = ("cpu",)
        general = True

        @classmethod
        def entry_for(cls, spec, op):
            return lambda *tensors: None

    return StandIn


_IN_TREE = {
    **{op: (lambda cls=cls: cls(dim=0, kernel_map={"reduction": _stand_in(
        RK.ReductionInterface)})) for op, (cls, _, _) in REDUCTIONS.items()},
    "Cumsum": lambda: CumsumFwdOp(dim=0, kernel_map={"scan_fwd": _stand_in(SK.ScanInterface)}),
    "Cumprod": lambda: CumprodFwdOp(dim=0,
                                    kernel_map={"scan_fwd": _stand_in(SK.ScanInterface)}),
    "Topk": lambda: TopkFwdOp(k=2, kernel_map={"topk_fwd": _stand_in(TK.TopkInterface)}),
    "Clamp": lambda: ClampFwdOp(min=0, max=2.5,
                                kernel_map={"elementwise": _stand_in(EK.ElementwiseInterface)}),
}


@pytest.mark.parametrize("op", list(_IN_TREE))
def test_the_in_tree_kernels_serve_a_dtype_or_refuse_it_by_name(op):
    """Every dtype the op takes reaches the in-tree kernels' slot or is refused by name
    before anything runs, pointing at the reference target; the refused ones are
    :data:`UNSERVED`'s."""
    refused = set()
    for dtype in DTYPES:
        name = _name(dtype)
        if name in REFUSED.get(op, ()):
            continue
        x = _input(dtype, (4, 6), 0)
        try:
            _IN_TREE[op]()(x)
        except UnservedDtypeError as exc:
            refused.add(name)
            assert exc.op == f"{op}FwdOp" and exc.dtype == name and name not in exc.served
            assert str(exc).endswith(f"construct the op with target='reference' for {name}")
    assert refused == UNSERVED[op]
