"""The elementwise kernels without a GPU: the call spec's refusals (exact text), the collapse
and launch plan over the space of shapes, strides and alignments (hypothesis, pure Python),
every scalar function's program built, one program of each layout class lowered and
compiled for sm_90 (each compiled case says which path it stands for), and the programs of
every layout class run on the host, thread by thread, for their indexing (``_host_run``)."""

import dataclasses
import itertools
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import elementwise as E
from tileops.runtime import select
from tileops.spec import DTYPES

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


def contiguous(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def spec(fn="add", params=(1,), in_shapes=((4, 8), (4, 8)), in_strides=None,
         in_dtypes=None, out_dtypes=None, compute="float32", out_shape=(4, 8), in_align=None,
         out_strides=None, out_align=None, device=None):
    f = E.SCALAR_FNS.get(fn)
    n_out = f.outputs if f else 1
    return E.ElementwiseSpec(
        device=device, fn=fn, params=params,
        in_dtypes=in_dtypes or ("float32",) * len(in_shapes),
        out_dtypes=out_dtypes or ("float32",) * n_out, compute=compute,
        out_shape=out_shape, in_shapes=in_shapes,
        in_strides=in_strides or tuple(contiguous(s) for s in in_shapes),
        in_align=in_align or (16,) * len(in_shapes),
        out_strides=out_strides or (contiguous(out_shape),) * n_out,
        out_align=out_align or (16,) * n_out)


# --- the registry ------------------------------------------------------------------------------

#: the family's functions: (arity, outputs, constants)
CONTRACT = {
    **{n: (1, 1, ()) for n in ["abs", "neg", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid", "erf", "floor", "ceil", "round", "trunc", "sign", "isnan", "isinf", "isfinite", "relu", "gelu", "gelu_tanh", "silu", "mish", "selu", "hardswish", "hardsigmoid"]},
    "softplus": (1, 1, ("beta", "threshold")), "leaky_relu": (1, 1, ("negative_slope",)),
    "elu": (1, 1, ("alpha",)), "hardtanh": (1, 1, ("min_val", "max_val")),
    "clamp": (1, 1, ("min", "max", "has_min", "has_max")),
    "add": (2, 1, ("alpha",)), "sub": (2, 1, ("alpha",)),
    **{n: (2, 1, ()) for n in ["mul", "div", "div_trunc", "div_floor", "pow", "maximum", "minimum", "remainder", "eq", "ne", "lt", "le", "gt", "ge", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "relu_bwd", "sigmoid_bwd", "tanh_bwd", "gelu_bwd", "gelu_tanh_bwd", "silu_bwd", "mish_bwd", "selu_bwd", "hardswish_bwd", "hardsigmoid_bwd"]},
    "clamp_tensor": (3, 1, ("has_lo", "has_hi")), "where": (3, 1, ()),
    "masked_fill": (2, 1, ("value",)), "lerp": (3, 1, ()), "lerp_scalar": (2, 1, ("weight",)),
    "softplus_bwd": (2, 1, ("beta", "threshold")), "leaky_relu_bwd": (2, 1, ("negative_slope",)),
    "elu_bwd": (2, 1, ("alpha",)), "hardtanh_bwd": (2, 1, ("min_val", "max_val")),
    **{f"{g}_and_mul_bwd": (3, 2, ()) for g in ("silu", "gelu", "gelu_tanh")},
    "div_bwd_b": (3, 1, ()), "pow_bwd_a": (3, 1, ()), "pow_bwd_b": (3, 1, ()),
    "remainder_bwd_b": (3, 1, ()),
    **{f"{n}_bwd": (2, 1, ()) for n in ["expm1", "sqrt", "rsqrt", "reciprocal", "log1p", "sin",
                                         "cos", "erf", "abs"]},
}


def test_registry_holds_the_family_with_its_arities_outputs_and_constants():
    got = {n: (f.arity, f.outputs, f.params) for n, f in E.SCALAR_FNS.items()}
    assert got == CONTRACT
    assert {n for n, f in E.SCALAR_FNS.items() if f.bool_out} == {
        "isnan", "isinf", "isfinite", "eq", "ne", "lt", "le", "gt", "ge"}
    assert E.SCALAR_FNS["where"].keep == (0,) and E.SCALAR_FNS["masked_fill"].keep == (1,)


def test_every_scalar_function_builds_its_program():
    """Each builder, run on float32 inputs (bool conditions), makes a well-formed prim_func."""
    for name, f in E.SCALAR_FNS.items():
        dts = tuple("bool" if k in f.keep else "float32" for k in range(f.arity))
        ops = f.outputs + f.arity
        p = E.Plan("flat", ((0,),), ((1,),) * ops, ((False,),) * f.arity, 4, 128, 1, 128, False)
        prog = E.build_program(name, tuple(0.5 for _ in f.params), dts,
                               ("float32",) * f.outputs, "float32", 1, p)
        assert len(prog.params) == ops, name  # exactly the tensors, no placeholders


def test_exact_functions_build_in_half_compute_dtypes():
    """Exact functions computed in bfloat16 go through float32 where TileLang needs it."""
    for name, f in E.SCALAR_FNS.items():
        if not f.exact:
            continue
        dts = tuple("bool" if k in f.keep else "bfloat16" for k in range(f.arity))
        out = ("bool",) if f.bool_out else ("bfloat16",)
        ops = 1 + f.arity
        p = E.Plan("flat", ((0,),), ((1,),) * ops, ((False,),) * f.arity, 8, 128, 1, 128, False)
        prog = E.build_program(name, tuple(1 for _ in f.params), dts, out, "bfloat16", 1, p)
        assert len(prog.params) == ops, name


# --- the call spec ------------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "message"), [
    ({"fn": "gelu_fast"},
     "ElementwiseSpec.fn must name a scalar function of SCALAR_FNS, got 'gelu_fast'"),
    ({"params": ()},
     "ElementwiseSpec.params: add takes 1 constants (alpha) as bools, ints or floats, got ()"),
    ({"params": ("1",)},
     "ElementwiseSpec.params: add takes 1 constants (alpha) as bools, ints or floats, "
     "got ('1',)"),
    ({"in_shapes": ((4, 8),)}, "ElementwiseSpec.in_dtypes: add has 2 inputs, got 1 entries"),
    ({"in_dtypes": ("float32", "complex64")},
     "ElementwiseSpec.in_dtypes[1] must be one of bfloat16, bool, float16, float32, float64, "
     "int16, int32, int64, int8, uint8, got 'complex64'"),
    ({"out_dtypes": ("float32", "float32")},
     "ElementwiseSpec.out_dtypes: add has 1 outputs, got 2 entries"),
    ({"compute": "float8_e4m3fn"},
     "ElementwiseSpec.compute must be one of bfloat16, bool, float16, float32, float64, int16, "
     "int32, int64, int8, uint8, got 'float8_e4m3fn'"),
    ({"fn": "div", "params": (), "compute": "int32"},
     "ElementwiseSpec.compute: div computes in a floating dtype, got int32"),
    ({"fn": "exp", "params": (), "in_shapes": ((4, 8),), "compute": "bfloat16"},
     "ElementwiseSpec.compute: exp is not exact in bfloat16; compute it in float32"),
    ({"in_shapes": ((4, 8), (3, 8))},
     "ElementwiseSpec.in_shapes[1]: [3, 8] does not broadcast to out_shape [4, 8]"),
    ({"in_shapes": ((4, 8), (2, 4, 8))},
     "ElementwiseSpec.in_shapes[1]: [2, 4, 8] does not broadcast to out_shape [4, 8]"),
    ({"out_shape": (4, -8)},
     "ElementwiseSpec.out_shape must be a tuple of sizes (ints >= 0), got (4, -8)"),
    ({"in_strides": ((8, 1), (1,))},
     "ElementwiseSpec.in_strides[1] must be 2 element strides (ints >= 0), got (1,)"),
    ({"out_strides": ((8, True),)},
     "ElementwiseSpec.out_strides[0] must be 2 element strides (ints >= 0), got (8, True)"),
    ({"in_align": (16, 3)},
     "ElementwiseSpec.in_align[1] must be 1, 2, 4, 8 or 16 (bytes), got 3"),
    ({"out_align": (32,)},
     "ElementwiseSpec.out_align[0] must be 1, 2, 4, 8 or 16 (bytes), got 32"),
])
def test_spec_refuses_naming_the_field(kw, message):
    with pytest.raises(ValueError) as err:
        spec(**kw)
    assert str(err.value) == message


def test_spec_admits_broadcast_scalars_and_exact_half_compute():
    spec(in_shapes=((4, 8), ()), compute="float32")
    spec(fn="maximum", params=(), in_dtypes=("bfloat16",) * 2, out_dtypes=("bfloat16",),
         compute="bfloat16")
    spec(fn="lt", params=(), in_dtypes=("int32",) * 2, out_dtypes=("bool",), compute="int32")


# --- collapse and plan --------------------------------------------------------------------------


@st.composite
def calls(draw):
    """A call: an output shape, inputs broadcast to it (missing leading dims, extent-1 dims,
    expanded stride-0 dims), each operand dense in some dim order or a slice of a larger
    tensor (strided rows, a gated half), with arbitrary alignments."""
    rank = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 8, 16]), min_size=rank,
                                max_size=rank)))

    def strides_for(sh):
        order = draw(st.permutations(range(len(sh))))
        pad = draw(st.lists(st.sampled_from([0, 0, 1, 8]), min_size=len(sh), max_size=len(sh)))
        st_, acc = [0] * len(sh), 1
        for d in reversed(order):
            st_[d] = acc
            acc *= sh[d] + pad[d]
        return tuple(0 if draw(st.integers(0, 5)) == 0 else s for s in st_)

    n_in = draw(st.integers(1, 3))
    ins = []
    for _ in range(n_in):
        keep = draw(st.integers(0, rank))
        ish = tuple(1 if draw(st.integers(0, 3)) == 0 else n for n in shape[rank - keep:])
        ins.append(ish)
    return spec(
        fn={1: "exp", 2: "mul", 3: "lerp"}[n_in], params=(), in_shapes=tuple(ins),
        in_strides=tuple(strides_for(s) for s in ins), out_shape=shape,
        in_dtypes=tuple(draw(st.sampled_from(["float32", "bfloat16"])) for _ in ins),
        out_dtypes=(draw(st.sampled_from(["float32", "float16"])),),
        out_strides=(strides_for(shape),),
        in_align=tuple(draw(st.sampled_from([1, 2, 4, 8, 16])) for _ in ins),
        out_align=(draw(st.sampled_from([2, 4, 8, 16])),))


def _operands(s):
    """(shape aligned to the output, strides aligned, dtype, alignment) of each operand,
    outputs first."""
    rank = len(s.out_shape)
    ops = [(s.out_shape, st_, dt, a) for st_, dt, a in
           zip(s.out_strides, s.out_dtypes, s.out_align, strict=True)]
    for sh, st_, dt, a in zip(s.in_shapes, s.in_strides, s.in_dtypes, s.in_align, strict=True):
        pad = rank - len(sh)
        ops.append(((1,) * pad + sh, (0,) * pad + st_, dt, a))
    return ops


@settings(max_examples=300, deadline=None)
@given(s=calls())
def test_collapsed_layout_addresses_every_element_as_the_original(s):
    p = E.plan(s)
    ops = _operands(s)
    if p.kind == "empty":
        assert math.prod(s.out_shape) == 0
        return
    ext = [math.prod(s.out_shape[d] for d in g) for g in p.groups]
    # every operand's offset of every element, by its own strides and by the collapsed ones
    for idx in itertools.product(*(range(n) for n in s.out_shape)):
        flat = [0] * len(p.groups)
        for g, dims in enumerate(p.groups):
            for d in dims:
                flat[g] = flat[g] * s.out_shape[d] + idx[d]
        for k, (sh, st_, _, _) in enumerate(ops):
            own = sum(i * (0 if n == 1 else t) for i, n, t in zip(idx, sh, st_, strict=True))
            if p.codes[k] == (3,):  # a row broadcast read at the flat index modulo the row
                assert p.kind == "flat" and own == flat[0] % math.prod(
                    s.out_shape[d] for d in p.row)
                continue
            inner = [st_[dims[-1]] if sh[dims[-1]] != 1 else 0 for dims in p.groups]
            code_ok = all(c == (0 if t == 0 else 1 if t == 1 else 2)
                          for c, t in zip(p.codes[k], inner, strict=True))
            assert code_ok
            assert own == sum(f * t for f, t in zip(flat, inner, strict=True))
    # no two adjacent groups could merge for every operand
    for g in range(len(p.groups) - 1):
        assert not all(
            (st_[p.groups[g][-1]] if sh[p.groups[g][-1]] != 1 else 0)
            == (st_[p.groups[g + 1][-1]] if sh[p.groups[g + 1][-1]] != 1 else 0) * ext[g + 1]
            for sh, st_, _, _ in ops)


@settings(max_examples=300, deadline=None)
@given(s=calls())
def test_plan_kind_and_vector_width_follow_the_layout(s):
    p = E.plan(s)
    if p.kind == "empty":
        return
    inner_unit = all(c[-1] in (0, 1, 3) for c in p.codes) if p.groups else True
    assert p.kind == ("flat" if len(p.groups) <= 1 and inner_unit else
                      "rows" if len(p.groups) == 2 and inner_unit else "strided")
    ops = _operands(s)
    # the width comes from the operands read along the vector (a broadcast one is read once)
    along = [DTYPES[dt] for k, (_, _, dt, _) in enumerate(ops)
             if p.codes[k] and p.codes[k][-1] == 1]
    widest = max(along or [DTYPES[dt] for _, _, dt, _ in ops])
    assert p.vec * widest <= 16 and p.vec & (p.vec - 1) == 0
    if not inner_unit:
        assert p.vec == 1
    ncols = math.prod(s.out_shape[d] for d in p.groups[-1]) if p.groups else 1
    for k, (_, _, dt, align) in enumerate(ops):
        if p.codes[k] and p.codes[k][-1] == 1 and p.vec > 1:
            assert align >= p.vec * DTYPES[dt]  # a vector never straddles the alignment
    if p.kind != "flat":
        assert ncols % p.vec == 0
        strides = [[st_[g[-1]] if sh[g[-1]] != 1 else 0 for g in p.groups]
                   for sh, st_, _, _ in ops]
        assert all(t % p.vec == 0 for row in strides for t in row if t > 1)
        assert p.tcols <= p.threads and p.threads % p.tcols == 0


@settings(max_examples=300, deadline=None)
@given(s=calls())
def test_plan_form_cap_and_grid_follow_the_call(s):
    """The 16-bit form only where the function has one and the outputs are 16-bit (by default
    on the flat kind, one access a thread, or under a register cap); a cap only with a
    function's declared rows launch; row blocks on the grid's y exactly when they fit in it;
    a small flat run reads single elements, one a thread."""
    p = E.plan(s)
    if p.kind == "empty":
        return
    f = E.SCALAR_FNS[s.fn]
    has_half = (f.half_build is not None and s.compute == "float32"
                and set(s.out_dtypes) <= {"float16", "bfloat16"})
    assert p.half == (has_half and (p.kind == "flat" or p.per == 1 or p.resident > 0))
    assert p.resident == 0 or (f.rows_launch is not None and p.kind == "rows"
                               and p.resident == f.rows_launch[2])
    numel = math.prod(s.out_shape)
    if p.kind == "flat":
        assert not p.grid_y
        if numel <= 128 * 132:
            assert (p.vec, p.threads, p.per) == (1, 128, 1)
    else:
        ncols = math.prod(s.out_shape[d] for d in p.groups[-1])
        blocks = -(-(numel // ncols) // (p.threads // p.tcols * p.per))
        assert p.grid_y == (blocks <= 65535)


@pytest.mark.parametrize(("out_shape", "in_shapes", "in_strides", "kind", "vec", "groups"), [
    pytest.param((32768, 8192), ((32768, 8192),), None, "flat", 8, ((0, 1),), id="contiguous"),
    pytest.param((33, 4097), ((33, 4097),), None, "flat", 8, ((0, 1),), id="odd-columns-flat"),
    pytest.param((3, 4097), ((3, 4097),), None, "flat", 1, ((0, 1),), id="small-flat-single"),
    pytest.param((64, 4097), ((64, 4097), (4097,)), None, "flat", 8, ((0, 1),),
                 id="odd-row-bias-flat-modular"),
    pytest.param((64, 4097), ((64, 4097), (64, 1)), None, "rows", 1, ((0,), (1,)),
                 id="odd-column-broadcast-scalar-access"),
    pytest.param((64, 4096), ((64, 4096), ()), None, "flat", 8, ((0, 1),), id="0-dim-scalar"),
    pytest.param((16, 14336), ((16, 14336), (16, 14336)), ((28672, 1), (28672, 1)), "rows", 8,
                 ((0,), (1,)), id="gated-halves"),
    pytest.param((8, 16, 32), ((8, 16, 32),), ((512, 1, 16),), "strided", 1,
                 ((0,), (1,), (2,)), id="transposed-last-two"),
    pytest.param((8, 16, 32), ((8, 16, 32),), ((1024, 64, 2),), "strided", 1, ((0, 1, 2),),
                 id="every-other-element"),
    pytest.param((2, 0, 3), ((2, 0, 3),), None, "empty", 1, (), id="no-elements"),
])
def test_plan_of_the_shapes_the_family_serves(out_shape, in_shapes, in_strides, kind, vec,
                                              groups):
    s = spec(fn={1: "exp", 2: "mul"}[len(in_shapes)], params=(), in_shapes=in_shapes,
             in_strides=in_strides, out_shape=out_shape,
             in_dtypes=("bfloat16",) * len(in_shapes), out_dtypes=("bfloat16",))
    p = E.plan(s)
    assert (p.kind, p.vec, p.groups) == (kind, vec, groups)
    chosen = select(E.ElementwiseInterface, (E.ElementwiseFlatKernel, E.ElementwiseRowsKernel,
                                             E.ElementwiseStridedKernel), s)
    assert chosen is {"flat": E.ElementwiseFlatKernel, "empty": E.ElementwiseFlatKernel,
                      "rows": E.ElementwiseRowsKernel,
                      "strided": E.ElementwiseStridedKernel}[kind]


@pytest.mark.parametrize("numel", [1, 3, 4096, 16896])
def test_a_small_flat_call_reads_one_element_a_thread_in_one_wave(numel):
    """Up to one element a thread of 132 CTAs of 128 (16896 elements): single accesses, one a
    thread, 128 threads, the 16-bit form; one element more and the 16-byte accesses return."""
    bf16 = {"in_dtypes": ("bfloat16",), "out_dtypes": ("bfloat16",)}
    p = E.plan(spec(fn="silu", params=(), in_shapes=((numel,),), out_shape=(numel,), **bf16))
    assert (p.kind, p.vec, p.threads, p.per, p.half) == ("flat", 1, 128, 1, True)
    p = E.plan(spec(fn="silu", params=(), in_shapes=((16897,),), out_shape=(16897,), **bf16))
    assert p.vec == 8
    # a float32 call has no 16-bit form; an asked width stays
    p = E.plan(spec(fn="silu", params=(), in_shapes=((3,),), out_shape=(3,),
                    in_dtypes=("float32",), out_dtypes=("float32",)))
    assert (p.vec, p.half) == (1, False)
    assert E.plan(spec(fn="silu", params=(), in_shapes=((3,),), out_shape=(3,), **bf16),
                  vec=8).vec == 8


def test_gated_rows_take_one_access_a_thread_with_the_half_form_and_rows_on_the_grid_y():
    halves = {"fn": "silu_and_mul", "params": (), "in_dtypes": ("bfloat16",) * 2,
              "out_dtypes": ("bfloat16",), "in_strides": ((28672, 1), (28672, 1))}
    p = E.plan(spec(in_shapes=((16384, 14336),) * 2, out_shape=(16384, 14336), **halves))
    assert (p.kind, p.vec, p.threads, p.per, p.half, p.grid_y) == ("rows", 8, 128, 1, True,
                                                                   True)
    # more row blocks than the grid's y holds: one flat grid, its blocks divided out
    p = E.plan(spec(in_shapes=((65536 * 2, 14336),) * 2, out_shape=(65536 * 2, 14336),
                    **halves))
    assert (p.kind, p.grid_y) == ("rows", False)
    # gelu's gated form declares its rows launch: two accesses under a cap of 8 CTAs an SM,
    # the half form with them; a small call still takes one access, uncapped
    p = E.plan(spec(in_shapes=((16384, 14336),) * 2, out_shape=(16384, 14336),
                    **{**halves, "fn": "gelu_and_mul"}))
    assert (p.threads, p.per, p.resident, p.half) == (128, 2, 8, True)
    p = E.plan(spec(in_shapes=((5, 4097),) * 2, out_shape=(5, 4097),
                    **{**halves, "fn": "gelu_and_mul", "in_strides": ((8194, 1),) * 2}))
    assert (p.threads, p.per, p.resident, p.half) == (128, 1, 0, True)
    assert E.plan(spec(in_shapes=((16384, 14336),) * 2, out_shape=(16384, 14336),
                       **{**halves, "fn": "gelu_and_mul"}), threads=256, per=4).resident == 0
    # more accesses a thread keep the float32 form unless asked (registers)
    p = E.plan(spec(in_shapes=((16384, 14336),) * 2, out_shape=(16384, 14336), **halves),
               threads=256, per=4)
    assert not p.half
    assert E.plan(spec(in_shapes=((16384, 14336),) * 2, out_shape=(16384, 14336), **halves),
                  threads=256, per=4, half=True, resident=4).resident == 4


def test_the_plan_s_register_cap_and_grid_reach_the_program():
    halves = {"fn": "silu_and_mul", "params": (), "in_dtypes": ("bfloat16",) * 2,
              "out_dtypes": ("bfloat16",), "in_strides": ((28672, 1), (28672, 1))}
    s = spec(in_shapes=((16384, 14336),) * 2, out_shape=(16384, 14336), **halves)
    for p, bounds, grid in [
            (E.plan(s, threads=256, per=4, half=True, resident=4), "__launch_bounds__(256, 4)",
             "blockIdx.y"),
            (E.plan(s, grid_y=False), "__launch_bounds__(128, 1)", "blockIdx.x) %")]:
        src = E.build_kernel(s.fn, s.params, s.in_dtypes, s.out_dtypes, s.compute, 2, p,
                             target="sm_90").get_kernel_source()
        assert bounds in src and grid in src
        assert ("exp2f" in src) == p.half


def test_an_odd_row_bias_is_a_flat_run_with_the_row_read_modulo_its_length():
    bf16 = {"in_dtypes": ("bfloat16",) * 2, "out_dtypes": ("bfloat16",)}
    p = E.plan(spec(in_shapes=((3, 5, 4097), (4097,)), out_shape=(3, 5, 4097), **bf16))
    assert (p.kind, p.vec, p.row, p.codes) == ("flat", 8, (2,), ((1,), (1,), (3,)))
    # the sweep's launches apply to it
    big = spec(in_shapes=((16384, 4097), (4097,)), out_shape=(16384, 4097), **bf16)
    assert (E.plan(big).threads, E.plan(big).per) == (128, 1)
    p = E.plan(big, threads=256, per=2)
    assert (p.kind, p.row, p.threads, p.per) == ("flat", (1,), 256, 2)
    assert E.plan(spec(in_shapes=((64, 4097), (4097,)), out_shape=(64, 4097))).vec == 4
    # a [4097] bias with a 0-dim scalar beside it, and a bias over two merged row dims
    p = E.plan(spec(fn="where", params=(), in_shapes=((64, 4097), (4097,), ()),
                    in_dtypes=("bool", "bfloat16", "bfloat16"), out_dtypes=("bfloat16",),
                    out_shape=(64, 4097)))
    assert (p.kind, p.vec, p.codes) == ("flat", 8, ((1,), (1,), (3,), (0,)))
    p = E.plan(spec(in_shapes=((6, 3, 1365), (3, 1365)), out_shape=(6, 3, 1365)))
    assert (p.kind, p.row) == ("flat", (1, 2))
    # not of that form: a strided operand, a row shorter than a vector, a misaligned run
    assert E.plan(spec(in_shapes=((64, 4097), (4097,)), in_strides=((4100, 1), (1,)),
                       out_shape=(64, 4097))).kind == "rows"
    assert E.plan(spec(in_shapes=((64, 3), (3,)), out_shape=(64, 3))).kind == "rows"
    assert E.plan(spec(in_shapes=((64, 4097), (4097,)), in_align=(2, 16),
                       out_shape=(64, 4097))).kind == "rows"


@needs_nvcc
def test_an_odd_row_bias_reads_its_columns_in_32_bit_indices():
    """The modular run binds each vector's start (one modulo) and each element's wrapped
    column in the plan's index type: written into each access they were promoted to 64 bits
    with the address (a 64-bit division and eight 64-bit compare-and-selects a vector)."""
    bf16 = {"in_dtypes": ("bfloat16",) * 2, "out_dtypes": ("bfloat16",)}
    s = spec(in_shapes=((16384, 4097), (4097,)), out_shape=(16384, 4097), **bf16)
    p = E.plan(s)
    assert (p.kind, p.row, p.wide) == ("flat", (1,), False)
    src = E.build_kernel(s.fn, s.params, s.in_dtypes, s.out_dtypes, s.compute, 2, p,
                         "sm_90").get_kernel_source()
    body = src.split("main_kernel(")[-1]
    assert "int start = 0;" in body and "int at[8];" in body and "B[at[" in body
    assert "(int64_t)start" not in body
    assert body.count("% ((int64_t)n1)") <= 1  # only the run's last elements, one a thread


def test_identity_ignores_sizes_within_a_layout_class():
    a = spec(in_shapes=((1024, 4096), (4096,)), out_shape=(1024, 4096))
    b = spec(in_shapes=((1000, 8192), (8192,)), out_shape=(1000, 8192))
    c = spec(in_shapes=((1024, 4096), (1024, 1)), out_shape=(1024, 4096))  # a column instead
    d = spec(in_shapes=((1024, 64), (64,)), out_shape=(1024, 64))  # rows narrower than a CTA
    small = spec(in_shapes=((4, 4096), (4096,)), out_shape=(4, 4096))  # one access a thread
    k = E.ElementwiseRowsKernel
    assert k.identity(a) == k.identity(b)
    assert k.identity(c) != k.identity(a) != k.identity(d)
    assert k.identity(small) != k.identity(a)


def test_wide_calls_index_in_64_bits_and_too_many_dims_are_refused():
    assert E.plan(spec(fn="exp", params=(), in_shapes=((1 << 16, 1 << 15),),
                       out_shape=(1 << 16, 1 << 15))).wide
    shape = (2,) * 10
    strides = tuple(2 ** (2 * (9 - d)) for d in range(10))  # every dim padded: none merge
    s = spec(fn="exp", params=(), in_shapes=(shape,), in_strides=(strides,), out_shape=shape)
    assert E.ElementwiseStridedKernel.region_refusal(s) == (
        "indexes up to 8 collapsed dims, the call has 10 (copy an operand contiguous)")


# --- programs compiled for sm_90 ----------------------------------------------------------------

CASES = [
    # unary bf16 over a contiguous run of 4097-column rows: 16-byte vectors and a masked tail
    pytest.param("silu", (), ((64, 4097),), None, ("bfloat16",), ("bfloat16",), "float32",
                 (64, 4097), True, id="flat-unary-bf16"),
    # binary fp16 with a row bias: rows of unit-stride vectors, the bias re-read each row
    pytest.param("add", (2.0,), ((64, 4096), (4096,)), None, ("float16",) * 2, ("float16",),
                 "float32", (64, 4096), True, id="rows-row-bias-fp16"),
    # binary bf16 with a bias of 4097: one flat run in vectors, the bias read modulo its row
    pytest.param("add", (1.0,), ((64, 4097), (4097,)), None, ("bfloat16",) * 2,
                 ("bfloat16",), "float32", (64, 4097), True, id="flat-odd-row-bias-bf16"),
    # gated bf16 over the halves of [B, 2N]: strided rows read in vectors
    pytest.param("silu_and_mul", (), ((16, 14336),) * 2, ((28672, 1),) * 2, ("bfloat16",) * 2,
                 ("bfloat16",), "float32", (16, 14336), True, id="rows-gated-halves"),
    # two outputs from three inputs, fp16
    pytest.param("gelu_tanh_and_mul_bwd", (), ((64, 512),) * 3, None, ("float16",) * 3,
                 ("float16",) * 2, "float32", (64, 512), True, id="flat-two-outputs"),
    # fp32 elu (expm1f) on a transposed input: the general path, single elements
    pytest.param("elu", (1.0,), ((32, 64),), ((1, 32),), ("float32",), ("float32",), "float32",
                 (32, 64), False, id="strided-transposed-fp32"),
    # int64 where with a bool condition and a 0-dim other: exact, no casts of the condition
    pytest.param("where", (), ((64, 512), (64, 512), ()), None, ("bool", "int64", "int64"),
                 ("int64",), "int64", (64, 512), True, id="flat-where-int64-bool"),
    # int32 comparison with a column broadcast, to bool
    pytest.param("lt", (), ((8, 128), (8, 1)), None, ("int32",) * 2, ("bool",), "int32",
                 (8, 128), True, id="rows-compare-int32-bool"),
    # bool storage at 8 and 16 elements a vector: declared uint8 (TileLang has no boolx8)
    pytest.param("isnan", (), ((64, 4096),), None, ("bfloat16",), ("bool",), "bfloat16",
                 (64, 4096), True, id="flat-isnan-bf16-to-bool-x8"),
    pytest.param("eq", (), ((64, 4096),) * 2, None, ("bool",) * 2, ("bool",), "bool",
                 (64, 4096), True, id="flat-eq-bool-x16"),
    pytest.param("mul", (), ((64, 4096), (4096,)), None, ("bool",) * 2, ("bool",), "bool",
                 (64, 4096), True, id="rows-mul-bool-x16"),
    pytest.param("masked_fill", (-7.0,), ((64, 4096), (64, 4096)), None, ("bfloat16", "bool"),
                 ("bfloat16",), "bfloat16", (64, 4096), True, id="flat-masked-fill-bool-mask"),
    # remainder of a bool operand beside an integer or a float (torch promotes it; two bools
    # are refused by the spec's refinement): the bool bytes converted to the compute dtype
    pytest.param("remainder", (), ((64, 4096), (4096,)), None, ("bool", "int32"), ("int32",),
                 "int32", (64, 4096), True, id="rows-remainder-bool-by-int32"),
    pytest.param("remainder", (), ((64, 4096), ()), None, ("float16", "bool"), ("float16",),
                 "float32", (64, 4096), True, id="flat-remainder-fp16-by-0-dim-bool"),
    pytest.param("remainder", (), ((64, 4096), (64, 4096)), None, ("int64", "bool"),
                 ("int64",), "int64", (64, 4096), True, id="flat-remainder-int64-by-bool"),
    pytest.param("where", (), ((64, 4096), (64, 4096), (64, 4096)), ((8192, 1),) * 3,
                 ("bool", "float16", "float16"), ("float16",), "float16", (64, 4096), True,
                 id="rows-where-bool-condition"),
    pytest.param("sign", (), ((64, 4096),), None, ("bool",), ("bool",), "bool", (64, 4096),
                 True, id="flat-sign-bool"),
    # the integer activations torch serves: relu of uint8, hardtanh of int8 and int32
    pytest.param("relu", (), ((64, 4096),), None, ("uint8",), ("uint8",), "uint8", (64, 4096),
                 True, id="flat-relu-uint8"),
    pytest.param("hardtanh", (-2.5, 3.5), ((64, 4096),), None, ("int8",), ("int8",), "int8",
                 (64, 4096), True, id="flat-hardtanh-int8"),
    pytest.param("hardtanh", (-2.5, 3.5), ((33, 4097),), None, ("int32",), ("int32",),
                 "int32", (33, 4097), True, id="flat-hardtanh-int32-odd"),
    # clamp's promoted result: operands of other dtypes cast on load (a bfloat16 x between a
    # float32 and a bfloat16 bound is clamped in float32; an int32 x by a float number is a
    # float32 result; a bool x by int numbers an int64 one)
    pytest.param("clamp_tensor", (True, True), ((64, 4096), (4096,), (64, 1)), None,
                 ("bfloat16", "float32", "bfloat16"), ("float32",), "float32", (64, 4096), True,
                 id="rows-clamp-mixed-bounds"),
    pytest.param("clamp", (-0.5, 0.0, True, False), ((64, 4096),), None, ("int32",),
                 ("float32",), "float32", (64, 4096), True, id="flat-clamp-int32-by-float"),
    pytest.param("clamp", (0.0, 1.0, True, True), ((64, 4096),), None, ("bool",), ("int64",),
                 "int64", (64, 4096), True, id="flat-clamp-bool-by-ints"),
]


@needs_nvcc
@pytest.mark.parametrize(("fn", "params", "in_shapes", "in_strides", "in_dtypes", "out_dtypes",
                          "compute", "out_shape", "vectors"), CASES)
def test_program_compiles_for_sm90(fn, params, in_shapes, in_strides, in_dtypes, out_dtypes,
                                   compute, out_shape, vectors):
    s = spec(fn=fn, params=params, in_shapes=in_shapes, in_strides=in_strides,
             in_dtypes=in_dtypes, out_dtypes=out_dtypes, compute=compute, out_shape=out_shape)
    p = E.plan(s)
    kernel = E.build_kernel(fn, params, in_dtypes, out_dtypes, compute, len(out_shape), p,
                            "sm_90")
    src = kernel.get_kernel_source()
    assert f"__launch_bounds__({p.threads}" in src
    wide = ("uint4*)", "int4*)", "float4*)", "longlong2*)", "double2*)")
    assert any(w in src for w in wide) == vectors  # 16-byte accesses where the plan has them
    if p.kind == "flat" and vectors:
        assert "} else {" in src  # the masked last CTA


@needs_nvcc
def test_integer_hardtanh_truncates_its_bounds_toward_zero():
    """torch's hardtanh of an integer tensor clamps to the bounds truncated toward zero
    (-2.5 and 3.5 clamp int32 to [-2, 3]): the program's constants are those integers."""
    s = spec(fn="hardtanh", params=(-2.5, 3.5), in_shapes=((64, 256),), in_strides=None,
             in_dtypes=("int32",), out_dtypes=("int32",), compute="int32", out_shape=(64, 256))
    src = E.build_kernel("hardtanh", (-2.5, 3.5), ("int32",), ("int32",), "int32", 2,
                         E.plan(s), "sm_90").get_kernel_source()
    consts = set(re.findall(r"[<>]=? (-?[0-9.]+)\)", src)) | set(
        re.findall(r"\((-?[0-9.]+) [<>]", src))
    assert {"-2", "3"} <= consts and not consts & {"-2.5", "3.5", "-3", "4"}, consts


@needs_nvcc
def test_wide_program_compiles_with_64_bit_extents():
    p = E.Plan("rows", ((0,), (1,)), ((2, 1), (2, 1)), ((False, False),), 4, 128, 2, 128, True)
    src = E.build_kernel("neg", (), ("float32",), ("float32",), "float32", 2, p,
                         "sm_90").get_kernel_source()
    assert "int64_t n0" in src and "int64_t n1" in src


# --- bool operands -------------------------------------------------------------------------------


def test_bool_operands_are_declared_uint8():
    """TileLang cannot vectorize bool, so the program holds bool tensors as their bytes."""
    p = E.Plan("flat", ((0,),), ((1,),) * 3, ((False,),) * 2, 16, 128, 1, 128, False)
    prog = E.build_program("eq", (), ("bool", "bool"), ("bool",), "bool", 1, p)
    assert [str(prog.buffer_map[v].dtype) for v in prog.params] == ["uint8"] * 3


def test_entry_passes_bool_tensors_as_uint8_views(monkeypatch):
    torch = pytest.importorskip("torch")
    seen = []
    monkeypatch.setattr(E, "build_kernel", lambda *a, **k: lambda *ts: seen.append(ts))
    s = spec(fn="where", params=(), in_shapes=((4, 8),) * 3, in_dtypes=("bool", "int64", "int64"),
             out_dtypes=("int64",), compute="int64")
    entry = E.ElementwiseFlatKernel.entry_for(s, None)
    cond, a, b, y = (torch.rand(4, 8) < 0.5, torch.ones(4, 8, dtype=torch.int64),
                     torch.zeros(4, 8, dtype=torch.int64), torch.empty(4, 8, dtype=torch.int64))
    entry(cond, a, b, y)
    got = seen[-1]
    assert got[0].dtype == torch.uint8 and got[0].data_ptr() == cond.data_ptr()
    assert torch.equal(got[0].bool(), cond) and got[1:] == (a, b, y)
    # no bool operand: the kernel itself is the entry, the tensors pass untouched
    plain = E.ElementwiseFlatKernel.entry_for(spec(), None)
    assert isinstance(plain, E.ElementwiseFlatKernel)
    plain(a, b, y)
    assert seen[-1] == (a, b, y)


@pytest.mark.parametrize(("fn", "in_shapes", "in_strides", "out_shape", "launch"), [
    pytest.param("sqrt", ((32768, 8192),), None, (32768, 8192), ("flat", 128, 1), id="flat-1"),
    pytest.param("tanh", ((32768, 8192),), None, (32768, 8192), ("flat", 128, 2),
                 id="flat-1-tanh"),
    # a call whose traffic fits in L2 (50 MB) takes two accesses a thread where the default
    # takes one: 2048 x 4096 bf16 moves 32 MB, 4096 x 4096 64 MB; two inputs 48 MB
    pytest.param("exp", ((2048, 4096),), None, (2048, 4096), ("flat", 128, 2),
                 id="flat-1-in-l2"),
    pytest.param("exp", ((4096, 4096),), None, (4096, 4096), ("flat", 128, 1),
                 id="flat-1-past-l2"),
    pytest.param("mul", ((2048, 4096),) * 2, None, (2048, 4096), ("flat", 128, 2),
                 id="flat-2-in-l2"),
    pytest.param("tanh", ((2048, 4096),), None, (2048, 4096), ("flat", 128, 2),
                 id="flat-1-in-l2-declared"),
    pytest.param("erf", ((2048, 4096),), None, (2048, 4096), ("flat", 64, 4),
                 id="flat-1-in-l2-declared-4"),
    pytest.param("erf", ((32768, 8192),), None, (32768, 8192), ("flat", 64, 4),
                 id="flat-1-erf"),
    pytest.param("silu", ((32768, 8192),), None, (32768, 8192), ("flat", 64, 2),
                 id="flat-1-silu"),
    pytest.param("gelu", ((32768, 8192),), None, (32768, 8192), ("flat", 64, 4),
                 id="flat-1-gelu"),
    pytest.param("mish", ((32768, 8192),), None, (32768, 8192), ("flat", 64, 2),
                 id="flat-1-mish"),
    pytest.param("gelu", ((64, 4097),), ((4100, 1),), (64, 4097), ("rows", 128, 1),
                 id="rows-gelu-padded"),  # the flat functions' plans are the flat kind's only
    pytest.param("add", ((32768, 8192), ()), None, (32768, 8192), ("flat", 128, 1),
                 id="flat-2-scalar"),
    pytest.param("mul", ((4096, 4096),) * 2, None, (4096, 4096), ("flat", 128, 1),
                 id="flat-2"),
    # too few vectors for an SM each at the default: one access a thread, 128 threads a CTA
    pytest.param("mish", ((1, 4096),), None, (1, 4096), ("flat", 128, 1), id="flat-1-one-row"),
    pytest.param("gelu", ((3,),), None, (3,), ("flat", 128, 1), id="flat-1-three"),
    pytest.param("silu", ((132, 1024),), None, (132, 1024), ("flat", 64, 2),
                 id="flat-1-an-sm-each"),
    pytest.param("silu", ((131, 1024),), None, (131, 1024), ("flat", 128, 1),
                 id="flat-1-fewer"),
    pytest.param("add", ((32768, 8192), (8192,)), None, (32768, 8192), ("rows", 256, 2),
                 id="rows-row-bias"),
    pytest.param("add", ((32768, 96), (32768, 1)), None, (32768, 96), ("rows", 256, 2),
                 id="rows-column"),
    pytest.param("add", ((64, 96), (64, 1)), None, (64, 96), ("rows", 128, 1),
                 id="rows-column-small"),
    # a gated op's halves at odd offsets (single elements), five rows: one access a thread
    pytest.param("silu_and_mul", ((5, 4097),) * 2, ((8194, 1),) * 2, (5, 4097),
                 ("rows", 128, 1), id="rows-gated-odd-small"),
    pytest.param("silu_and_mul", ((16384, 14336),) * 2, ((28672, 1),) * 2, (16384, 14336),
                 ("rows", 128, 1), id="rows-gated-halves"),
    pytest.param("exp", ((8, 16, 32),), ((512, 1, 16),), (8, 16, 32), ("strided", 128, 4),
                 id="strided"),
])
def test_default_launch_by_layout_and_inputs(fn, in_shapes, in_strides, out_shape, launch):
    """The measured defaults (_default_launch's docstring has the sweep's figures)."""
    params = (1,) if fn == "add" else ()
    s = spec(fn=fn, params=params, in_shapes=in_shapes, in_strides=in_strides,
             out_shape=out_shape, in_dtypes=("bfloat16",) * len(in_shapes),
             out_dtypes=("bfloat16",))
    p = E.plan(s)
    assert (p.kind, p.threads, p.per) == launch
    assert (E.plan(s, threads=256, per=1).threads, E.plan(s, threads=256, per=1).per) == (256, 1)


# --- the float32 normal CDF of gelu's half-precision form ------------------------------------


def _exp32_numpy(a):
    """E._exp32 in numpy float32: exp2 of the float32 product with log2(e) (CUDA's exp2f is
    within 2 ulp of the exact exp2 of that product)."""
    np = pytest.importorskip("numpy")
    f = np.float32
    return np.exp2((np.asarray(a, dtype=f) * f(E._LOG2E)).astype(f)).astype(f)


def _half_erfc32_numpy(x):
    """E._half_erfc32 step by step in numpy float32 (the reciprocal correctly rounded here;
    CUDA's rcp.approx.ftz is within 1 ulp of it; exp2 exact before rounding, as ex2.approx is
    within 2 ulp)."""
    np = pytest.importorskip("numpy")
    f = np.float32
    x = np.asarray(x, dtype=f)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        t = f(1) / (np.abs(x) * f(0.5 * math.sqrt(0.5)) + f(1))
        acc = np.full_like(x, f(E.HALF_ERFC_COEFFS[-1]))
        for c in reversed(E.HALF_ERFC_COEFFS[:-1]):
            acc = acc * t + f(c)
        return t * np.exp2((x * x) * f(-0.5 * E._LOG2E) + acc).astype(f)


def test_half_erfc32_relative_over_a_dense_grid():
    """erfc(|x| / sqrt(2)) / 2 from the degree-5 fit: relative error below 2e-5 wherever the
    result is a normal float32 (the fit's own 7.6e-6 and float32's rounding of the
    exponent, up to 131 there), below float32's smallest normal past that, 0 at infinity."""
    np = pytest.importorskip("numpy")
    x = np.concatenate([np.linspace(0, 3, 300_001), np.linspace(3, 14.5, 460_001),
                        [1e-30, 1e-7]]).astype(np.float32)
    got = _half_erfc32_numpy(x).astype(np.float64)
    ref = np.array([0.5 * math.erfc(float(v) / math.sqrt(2)) for v in x])
    normal = ref >= np.finfo(np.float32).tiny
    rel = (np.abs(got - ref) / ref)[normal]
    assert rel.max() <= 2e-5  # measured 1.8e-5 at x = -12.2
    assert rel[x[normal] < 3].max() <= 1e-5
    assert np.all(got[~normal] <= 2 * np.finfo(np.float32).tiny)  # underflows, never grows
    far = _half_erfc32_numpy([20.0, 40.0, 1e20, np.inf, np.nan])
    assert np.all(far[:4] == 0) and np.isnan(far[4])
    assert abs(_half_erfc32_numpy([0.0])[0] - 0.5) <= 1e-5


def test_gelu_half_form_within_bf16_precision_in_both_tails():
    """gelu(x) = x * Phi(x), Phi from one erfc: relative error below 2.5e-5 wherever the result is
    a normal float32, far inside bf16's (7.8e-3) and float16's (9.8e-4) ulp; the erf form
    cancels for x < -4 and misses bf16's 2 ulp there. Infinities as torch's CUDA kernel: +inf
    stays, -inf gives NaN (-inf * 0)."""
    np = pytest.importorskip("numpy")
    f = np.float32
    x = np.concatenate([np.linspace(-14, 14, 560_001), [np.inf, -np.inf, np.nan]]).astype(f)
    half = _half_erfc32_numpy(x)
    with np.errstate(invalid="ignore"):
        got = (x * np.where(x < 0, half, f(1) - half)).astype(np.float64)
    ref = np.array([0.5 * float(v) * math.erfc(-float(v) / math.sqrt(2)) for v in x[:-3]])
    assert got[-3] == np.inf and np.isnan(got[-2]) and np.isnan(got[-1])
    got = got[:-3]
    normal = np.abs(ref) >= np.finfo(f).tiny
    rel = np.abs(got - ref)[normal] / np.abs(ref[normal])
    assert rel.max() <= 2.5e-5  # measured 1.8e-5 at x = -12.2
    assert np.abs(got - ref)[~normal].max() <= 2 * np.finfo(f).tiny


def test_gelu_tanh_half_form_keeps_the_left_tail_relative():
    """gelu_tanh(x) = x / (1 + exp(-2u)) as ``x r`` or ``x e r`` from e = exp(-2|u|) (E.
    _gelu_tanh_half) in numpy float32: relative error below 1e-5 wherever e is a normal float32
    (x > -10.0), where torch's tanhf form rounds 1 + tanh(u) to 0 from x = -5.4 on; below,
    within that plus |x| times float32's smallest subnormal; +-inf give +inf and NaN as
    torch's, NaN stays."""
    np = pytest.importorskip("numpy")
    f = np.float32
    a = -2.0 * E._LOG2E * E._K_BETA
    x = np.concatenate([np.linspace(-12, 12, 480_001), [np.inf, -np.inf, np.nan]]).astype(f)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        e = np.exp2(np.abs(x) * ((x * x) * f(a * E._K_KAPPA) + f(a))).astype(f)
        r = f(1) / (f(1) + e)
        got = (x * r * np.where(x < 0, e, f(1))).astype(np.float64)
    assert got[-3] == np.inf and np.isnan(got[-2]) and np.isnan(got[-1])
    xd = x[:-3].astype(np.float64)
    u = math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)
    ref = xd / (1 + np.exp(-2 * u))
    got = got[:-3]
    ok = (xd >= 0) | (np.exp(-2 * np.abs(u)) >= np.finfo(f).tiny)
    assert ok[np.argmin(np.abs(xd + 9.99))] and not ok[np.argmin(np.abs(xd + 10.01))]
    rel = np.abs(got - ref)[ok] / np.abs(ref[ok]).clip(min=1e-300)
    rel[ref[ok] == 0] = 0
    assert rel.max() <= 1e-5  # measured 8.5e-6 (float32 rounds the exponent, up to 126)
    assert rel[xd[ok] > -3].max() <= 1e-6
    tiny = np.finfo(f).smallest_subnormal
    assert np.all(np.abs(got - ref)[~ok] <= 1e-5 * np.abs(ref[~ok]) + np.abs(xd[~ok]) * 2 * tiny)


def _sigmoid_terms_numpy(x):
    """E._sigmoid_terms32 step by step in numpy float32: (sigmoid(x), 1 - sigmoid(x))."""
    np = pytest.importorskip("numpy")
    f = np.float32
    x = np.asarray(x, dtype=f)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        e = _exp32_numpy(-np.abs(x))
        r = (f(1) / (f(1) + e)).astype(f)
        return (r * np.where(x < 0, e, f(1))).astype(f), (r * np.where(x < 0, f(1), e)).astype(f)


def test_silu_half_form_and_its_gradient_keep_both_tails_relative():
    """silu(x) = x sigmoid(x) and its gradient s (1 + x (1 - s)) from e = exp(-|x|), r = 1 /
    (1 + e) (E._silu_half, E._silu_grad_half) in numpy float32 over [-80, 80]: silu within 5e-6
    relative (the exponent's rounding, |x| 2^-24), the gradient within 40 float32 eps of its
    terms (it crosses 0 at x = -1.28; 1 - s comes from e, so nothing cancels as s nears 1);
    NaN stays NaN, +inf gives +inf, -inf NaN (as torch's)."""
    np = pytest.importorskip("numpy")
    f = np.float32
    x = np.concatenate([np.linspace(-80, 80, 1_600_001), [np.inf, -np.inf, np.nan]]).astype(f)
    s, c = _sigmoid_terms_numpy(x)
    with np.errstate(invalid="ignore"):
        silu = (x * s).astype(np.float64)
        grad = (s * (f(1) + x * c)).astype(np.float64)
    assert silu[-3] == np.inf and np.isnan(silu[-2]) and np.isnan(silu[-1])
    xd = x[:-3].astype(np.float64)
    sd = 1.0 / (1.0 + np.exp(-xd))
    cd = 1.0 / (1.0 + np.exp(xd))  # 1 - sigmoid without cancellation
    ref, gref = xd * sd, sd * (1.0 + xd * cd)
    nz = ref != 0
    rel = np.abs(silu[:-3] - ref)[nz] / np.abs(ref[nz])
    assert rel.max() <= 5e-6  # measured 3.8e-6 at x = -80 (|x| 2^-24 from the exponent)
    assert rel[np.abs(xd[nz]) < 8].max() <= 1e-6  # measured 5.7e-7
    # the gradient crosses 0 at x = -1.2785, where 1 + x (1 - s) cancels: its error is held
    # to float32's rounding of the terms, s + |x| s (1 - s), in units of float32's eps
    terms = sd + np.abs(xd) * sd * cd
    err = np.abs(grad[:-3] - gref) / (terms * np.finfo(f).eps)
    assert err.max() <= 40  # measured 30.9 (the exponent's rounding at |x| near 80)
    assert err[np.abs(xd) < 8].max() <= 6  # measured 4.4; a 16-bit ulp is 8192 eps or more


def test_mish_half_form_within_float32_precision():
    """mish(x) = x * n / (n + 2), n = e (e + 2), e = exp(x), in numpy float32 step by step
    (the reciprocal correctly rounded; CUDA's rcp.approx.ftz is within 1 ulp of it; exp as
    E._exp32): relative error below 5e-6 down to x = -80 and 1.5e-5 wherever the result is a
    normal float32 (e subnormal past x = -87), far inside bf16's and float16's ulp; x itself
    past 20 (n / (n + 2) rounds to 1); NaN stays NaN, -inf gives NaN."""
    np = pytest.importorskip("numpy")
    f = np.float32
    x = np.concatenate([np.linspace(-110, 30, 1_400_001), [20.0, 20.001, -np.inf, np.inf,
                                                           np.nan]])
    x = x.astype(f)
    with np.errstate(over="ignore", invalid="ignore"):
        e = _exp32_numpy(np.fmin(x, f(20)))  # CUDA's fminf: the number where one is NaN
        n = e * (e + f(2))
        got = (x * (n * (f(1) / (n + f(2))))).astype(np.float64)
        xd = x.astype(np.float64)
        ref = xd * np.tanh(np.log1p(np.exp(xd)))
    finite = np.isfinite(x)
    normal = finite & (np.abs(ref) >= np.finfo(f).tiny)
    err = np.abs(got[finite] - ref[finite])
    normal_f = normal[finite]
    rel = err[normal_f] / np.abs(ref[normal])
    assert rel.max() <= 1.5e-5  # measured 1.1e-5 at x = -91.8
    assert rel[x[normal] > -80].max() <= 5e-6  # measured 3.8e-6 (the exponent's rounding)
    assert err[~normal_f].max() <= 2 * np.finfo(f).tiny
    big = (x >= 20) & finite
    assert np.all(np.abs(got[big] - x[big]) <= 2.4e-7 * x[big])
    assert np.all(got[big].astype(np.float16) == x[big].astype(np.float16))
    assert np.isnan(got[-3]) and got[-2] == np.inf and np.isnan(got[-1])


def _log1p_half_numpy(v):
    """E._log1p_half in numpy float32 (the log exact here: __logf's lg2.approx adds an
    absolute 2^-22 of log2, 5.4e-6 of a result of at least log(1 + 2^-5))."""
    np = pytest.importorskip("numpy")
    f = np.float32
    series = v * (f(1) - v * (f(0.5) - v * (f(1 / 3) - v * f(0.25))))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.abs(v) < f(E._SERIES_BELOW), series,
                        np.log((f(1) + v).astype(f)).astype(f)).astype(f)


@pytest.mark.parametrize(("beta", "threshold", "bound"), [
    (1.0, 20.0, 5e-6), (1.5, 4.0, 1e-5), (0.5, 20.0, 5e-6), (-1.0, 20.0, 5e-6)])
def test_softplus_half_form_within_float32_precision(beta, threshold, bound):
    """softplus(x) = (max(t, 0) + log1p(exp(-|t|))) / beta, t = beta x, in numpy float32 step
    by step: relative error within ``bound`` wherever the result is a normal float32 (measured
    3.9e-6, 7.7e-6 (beta 1.5: the exp's underflow at t = -86.8), 3.5e-6, 2.1e-6), x itself past
    the threshold, far inside bf16's and float16's ulp; NaN stays NaN, -inf gives 0."""
    np = pytest.importorskip("numpy")
    f = np.float32
    x = np.concatenate([np.linspace(-120, 40, 1_600_001), [-np.inf, np.inf, np.nan]]).astype(f)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        t = (x * f(beta)).astype(f)
        e = _exp32_numpy(-np.abs(t))
        r = (np.maximum(t, f(0)) + _log1p_half_numpy(e)).astype(f)
        if beta != 1.0:
            r = (r * f(1 / beta)).astype(f)
        got = np.where(t > f(threshold), x, r).astype(np.float64)
        xd = x.astype(np.float64)
        ref = np.where(t > f(threshold), xd, np.logaddexp(0, xd * beta) / beta)
    finite = np.isfinite(x)
    normal = finite & (np.abs(ref) >= np.finfo(f).tiny)
    err = np.abs(got[finite] - ref[finite])
    rel = err[normal[finite]] / np.abs(ref[normal])
    assert rel.max() <= bound
    assert err[~normal[finite]].max(initial=0) <= 2 * np.finfo(f).tiny
    tail = got[-3:]
    assert (tail[0] == 0 if beta > 0 else np.isinf(tail[0])) and np.isnan(tail[2])


def test_expm1_half_form_within_float32_precision():
    """E._expm1_half in numpy float32 (exp2 exact here; ex2.approx adds 2 ulp of exp, 7.7e-6
    of an expm1 of at least 0.03 in magnitude): within 1e-6 relative on [-100, 0] (measured
    9.9e-7 at x = -0.034, just past the series), the series exact to float32 near 0."""
    np = pytest.importorskip("numpy")
    f = np.float32
    x = np.concatenate([np.linspace(-100, 0, 1_000_001), [-1e-30, -1e-10, -0.03]]).astype(f)
    series = x * (f(1) + x * (f(0.5) + x * (f(1 / 6) + x * f(1 / 24))))
    got = np.where(np.abs(x) < f(E._SERIES_BELOW), series,
                   (_exp32_numpy(x) - f(1)).astype(f)).astype(np.float64)
    ref = np.expm1(x.astype(np.float64))
    nz = ref != 0
    assert (np.abs(got - ref)[nz] / np.abs(ref[nz])).max() <= 1e-6
    assert got[-3] == x[-3]


def test_log1p_half_form_within_float32_precision():
    """E._log1p_half in numpy float32 (the log exact here; __logf's lg2.approx adds an absolute
    2^-22 of log2, 5.4e-6 of a result of at least 0.03): within 2.5e-6 relative on (-1, 1e4]
    and over 30 decades either side of 0 (measured 1.9e-6 at x = 0.0326, the rounding of
    1 + x); -1 gives -inf, below it NaN, +-0 itself."""
    np = pytest.importorskip("numpy")
    f = np.float32
    x = np.concatenate([np.linspace(-0.999999, 1e4, 1_000_001), np.geomspace(1e-30, 1, 30001),
                        -np.geomspace(1e-30, 0.999, 30001)]).astype(f)
    special = np.array([-1, -2, np.inf, np.nan, 0, -0.0], dtype=f)
    got = _log1p_half_numpy(x).astype(np.float64)
    ref = np.log1p(x.astype(np.float64))
    nz = ref != 0
    assert (np.abs(got - ref)[nz] / np.abs(ref[nz])).max() <= 2.5e-6
    out = _log1p_half_numpy(special)
    assert out[0] == -np.inf and np.isnan(out[1]) and out[2] == np.inf and np.isnan(out[3])
    assert out[4] == 0 and np.signbit(out[5])


# --- 16-bit forms over every 16-bit input ------------------------------------------------------


def _every_16_bit(np, dtype):
    """Every finite value of ``dtype`` ("bfloat16" or "float16") as float32 (exact), and the
    value rounding of float32 (or float64) into that dtype, nearest-even, as float32."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    if dtype == "bfloat16":
        x = (bits << 16).view(np.float32)
    else:
        x = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return x[np.isfinite(x)]


def _round16(np, v, dtype):
    v = np.asarray(v, dtype=np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return v.astype(np.float16).astype(np.float32)
    # bfloat16: float64 -> float32 rounds first, which can double-round; go by the float64
    # value's distance to the two bf16 neighbours of its truncation instead
    with np.errstate(invalid="ignore", over="ignore"):
        f = v.astype(np.float32)
        b = f.view(np.uint32) & np.uint32(0xFFFF0000)
        lo = b.view(np.float32).astype(np.float64)
        hi = (b + np.uint32(0x10000)).view(np.float32).astype(np.float64)
        up = np.abs(hi - v) < np.abs(v - lo)
        tie = np.abs(hi - v) == np.abs(v - lo)
        even = (b >> np.uint32(16)) & np.uint32(1)
        pick = np.where(up | (tie & (even == 1)), hi, lo)
    return np.where(np.isfinite(v), pick, v).astype(np.float32)


def _ulps16(np, a, b, dtype):
    """How many ``dtype`` values apart the 16-bit values ``a`` and ``b`` (float32) are."""
    def order(v):
        if dtype == "float16":
            i = v.astype(np.float16).view(np.uint16).astype(np.int64)
            return np.where(i & 0x8000, 0x8000 - (i & 0x7FFF), i + 0x8000)
        i = (v.view(np.uint32) >> np.uint32(16)).astype(np.int64)
        return np.where(i & 0x8000, 0x8000 - (i & 0x7FFF), i + 0x8000)
    return np.abs(order(a) - order(b))


def _tanh_half_numpy(np, x):
    f = np.float32
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        e = np.exp2((np.abs(x) * f(-2 * E._LOG2E)).astype(f)).astype(f)
        e = np.where(e < np.finfo(f).tiny, f(0), e)  # ex2.approx.ftz
        far = np.copysign(((f(1) - e) * (f(1) / (f(1) + e))).astype(f), x)
        near = (x * (f(1) - (x * x) * f(1 / 3))).astype(f)
        return np.where(np.abs(x) < f(E._TANH_SERIES_BELOW), near, far).astype(f)


def _erf_half_numpy(np, x):
    f = np.float32
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        x2 = (x * x).astype(f)
        t = (f(1) / (np.abs(x) * f(E.ERF_AS_P) + f(1))).astype(f)
        acc = np.full_like(x, f(E.ERF_AS_COEFFS[-1]))
        for c in reversed(E.ERF_AS_COEFFS[:-1]):
            acc = (acc * t + f(c)).astype(f)
        e = np.exp2((x2 * f(-E._LOG2E)).astype(f)).astype(f)
        e = np.where(e < np.finfo(f).tiny, f(0), e)
        far = np.copysign((f(1) - acc * t * e).astype(f), x)
        sp = math.sqrt(math.pi)
        near = (x * (f(2 / sp) + x2 * (f(-2 / (3 * sp)) + x2 * f(1 / (5 * sp))))).astype(f)
        return np.where(np.abs(x) < f(E._ERF_SERIES_BELOW), near, far).astype(f)


def _log_half_numpy(np, x):
    f = np.float32
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = (x - f(1)).astype(f)
        near = (d * (f(1) - d * (f(0.5) - d * (f(1 / 3) - d * f(0.25))))).astype(f)
        return np.where(np.abs(d) < f(E._SERIES_BELOW), near,
                        np.log(x.astype(np.float64)).astype(f)).astype(f)


def _sincos_half_numpy(np, x, cos):
    f = np.float32
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.abs(x)
        j = (a * f(2 / math.pi) + f(E._ROUND_MAGIC)).astype(f)
        k = (j - f(E._ROUND_MAGIC)).astype(f)
        # each step an fma: one rounding of the exact value
        r = (a.astype(np.float64) - k.astype(np.float64) * float(f(E.PIO2_PARTS[0]))).astype(f)
        r = (r.astype(np.float64) - k.astype(np.float64) * float(f(E.PIO2_PARTS[1]))).astype(f)
        r2 = (r * r).astype(f)
        s = (r * (f(1) + r2 * (f(E.SIN_COEFFS[0]) + r2 * f(E.SIN_COEFFS[1])))).astype(f)
        c = (f(1) + r2 * (f(E.COS_COEFFS[0]) + r2 * (f(E.COS_COEFFS[1])
                                                     + r2 * f(E.COS_COEFFS[2])))).astype(f)
        q = j.view(np.int32) + (1 if cos else 0)
        v = np.where(q & 1, c, s)
        v = np.where(q & 2, -v, v).astype(f)
        if not cos:
            v = np.where(np.signbit(x), -v, v).astype(f)
        exact = (np.cos if cos else np.sin)(x.astype(np.float64)).astype(f)
        return np.where(np.abs(x) < f(E._TRIG_FAST_BELOW), v, exact)


def _hard_numpy(np, x, swish):
    f = np.float32
    with np.errstate(invalid="ignore", over="ignore"):
        g = np.minimum(np.maximum((x + f(3)).astype(f), f(0)), f(6))
        g = np.where(np.isnan(x), x, g)  # std::max / std::min keep the NaN
        g = (g * f(1 / 6)).astype(f)
        return (x * g).astype(f) if swish else g


_HALF_FORMS = {"tanh": (_tanh_half_numpy, "tanh"), "erf": (_erf_half_numpy, "erf"),
               "log": (_log_half_numpy, "log"),
               "sigmoid": (lambda np, x: _sigmoid_terms_numpy(x)[0], "sigmoid"),
               "hardswish": (lambda np, x: _hard_numpy(np, x, True), "hardswish"),
               "hardsigmoid": (lambda np, x: _hard_numpy(np, x, False), "hardsigmoid"),
               # the approximate instructions, exact here (within a float32 ulp or two)
               "sqrt": (lambda np, x: np.sqrt(x.astype(np.float64)).astype(np.float32),
                        "sqrt"),
               "rsqrt": (lambda np, x: (1 / np.sqrt(x.astype(np.float64))).astype(np.float32),
                         "rsqrt"),
               "reciprocal": (lambda np, x: (1 / x.astype(np.float64)).astype(np.float32),
                              "reciprocal"),
               "sin": (lambda np, x: _sincos_half_numpy(np, x, False), "sin"),
               "cos": (lambda np, x: _sincos_half_numpy(np, x, True), "cos")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fn", sorted(_HALF_FORMS))
def test_half_forms_within_one_ulp_over_every_16_bit_input(fn, dtype):
    """The 16-bit forms of tanh, erf, log, sin, cos, sigmoid, hardswish and hardsigmoid, step
    by step in numpy float32 (the
    approximate exp2, log and reciprocal exact here: their 2^-22 is far below what is
    allowed), over every finite bfloat16 and float16 input: the result rounded to the dtype
    is the float64 result correctly rounded or its neighbour, and the neighbour in few cases
    (a float32 result within a few float32 ulp of a 16-bit rounding boundary rounds either
    way: torch's libm results do too)."""
    np = pytest.importorskip("numpy")
    form, name = _HALF_FORMS[fn]
    x = _every_16_bit(np, dtype)
    if fn in ("log", "sqrt", "rsqrt"):
        x = x[x >= 0]
    got = _round16(np, form(np, x), dtype)
    xd = x.astype(np.float64)
    with np.errstate(divide="ignore", over="ignore"):
        ref = {"tanh": np.tanh, "log": np.log, "sin": np.sin, "cos": np.cos,
               "erf": np.vectorize(math.erf),
               "sigmoid": lambda v: 1 / (1 + np.exp(-v)),
               "hardswish": lambda v: v * np.clip(v + 3, 0, 6) / 6,
               "hardsigmoid": lambda v: np.clip(v + 3, 0, 6) / 6,
               "sqrt": np.sqrt, "rsqrt": lambda v: 1 / np.sqrt(v),
               "reciprocal": lambda v: 1 / v}[name](xd)
    want = _round16(np, ref, dtype)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    finite = np.isfinite(want) & np.isfinite(got)
    assert np.array_equal(np.isfinite(got), np.isfinite(want)), x[np.isfinite(got) != np.isfinite(want)][:8]
    assert np.all(same[~finite]), (x[~finite & ~same][:8], got[~finite & ~same][:8])
    off = _ulps16(np, got[finite], want[finite], dtype)
    assert off.max() <= 1, (x[finite][off > 1][:8], got[finite][off > 1][:8], want[finite][off > 1][:8])
    assert (off == 1).mean() <= 0.001, (off == 1).mean()  # measured 0.057% at most (sin, float16)
    # the signs of zero as torch's: sin, tanh and erf keep -0
    if fn in ("sin", "tanh", "erf"):
        z = form(np, np.array([-0.0], dtype=np.float32))
        assert z[0] == 0 and np.signbit(z[0])


@needs_nvcc
@pytest.mark.parametrize(("fn", "gone", "kept"), [
    ("tanh", ("tanhf",), ("tileops_ex2_ftz(", "tl::fast_rcp(")),
    ("erf", ("erff",), ("tileops_ex2_ftz(", "tl::fast_rcp(")),
    ("log", ("logf(",), ("__logf(",)),
    ("sin", (), ("sinf(", "0x1.8p+23f")),
    ("cos", (), ("cosf(", "0x1.8p+23f")),
    ("sqrt", ("sqrtf(",), ("tileops_sqrt(",)),
    ("rsqrt", ("sqrtf(",), ("rsqrtf(",)),
    ("reciprocal", (), ("tileops_rcp(",))])
def test_math_takes_its_half_form_for_half_outputs_only(fn, gone, kept):
    """bf16 tanh, erf and log lower to their 16-bit forms (libdevice's call gone; sin and cos
    keep theirs as the far arm), with the prelude's ex2 where they call it; float32 keeps
    libdevice's and no prelude."""
    p = E.Plan("flat", ((0,),), ((1,),) * 2, ((False,),), 8, 128, 2, 128, False)
    src = E.build_kernel(fn, (), ("bfloat16",), ("bfloat16",), "float32", 1, p,
                         "sm_90").get_kernel_source()
    plain = src.replace("__logf(", "").replace("rsqrtf(", "")
    assert not any(g in plain for g in gone) and all(k in src for k in kept), fn
    # the prelude (all its helpers) in the programs of the forms that call one
    assert ("asm(" in src) == (fn in ("tanh", "erf", "sqrt", "reciprocal"))
    p4 = dataclasses.replace(p, vec=4)
    full = E.build_kernel(fn, (), ("float32",), ("float32",), "float32", 1, p4,
                          "sm_90").get_kernel_source()
    assert "tileops_ex2_ftz" not in full and "asm" not in full
    assert {"tanh": "tanhf", "erf": "erff", "log": "logf", "sin": "sinf", "cos": "cosf",
            "sqrt": "sqrtf", "rsqrt": "sqrtf", "reciprocal": "/"}[fn] in full


@needs_nvcc
@pytest.mark.parametrize(("fn", "params", "gone", "kept"), [
    ("softplus", (1.0, 20.0), ("log1pf", "expf("), ("__logf(", "exp2f(")),
    ("softplus", (1.5, 4.0), ("log1pf", "expf("), ("__logf(", "exp2f(")),
    ("elu", (1.3,), ("expm1f",), ("exp2f(",)),
    ("selu", (), ("expm1f",), ("exp2f(",)),
    ("expm1", (), ("expm1f",), ("exp2f(",)),
    ("log1p", (), ("log1pf",), ("__logf(",))])
def test_softplus_and_elu_take_their_half_forms_for_half_outputs_only(fn, params, gone, kept):
    p = E.Plan("flat", ((0,),), ((1,),) * 2, ((False,),), 8, 128, 2, 128, False)
    src = E.build_kernel(fn, params, ("bfloat16",), ("bfloat16",), "float32", 1, p,
                         "sm_90").get_kernel_source()
    plain = src.replace("exp2f(", "")
    assert not any(g in plain for g in gone) and all(k in src for k in kept)
    p4 = dataclasses.replace(p, vec=4)
    full = E.build_kernel(fn, params, ("float32",), ("float32",), "float32", 1, p4,
                          "sm_90").get_kernel_source()
    assert gone[0] in full


@needs_nvcc
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_softplus_with_beta_zero_builds_as_torch_computes_it(dtype):
    """beta = 0: log(2) / 0 = inf for a finite x (x where 0 > threshold), NaN otherwise; a
    constant division by zero does not build, so the form is written out."""
    p = E.Plan("flat", ((0,),), ((1,),) * 2, ((False,),), 16 // E.DTYPES[dtype], 128, 2, 128,
               False)
    for threshold, value in ((20.0, "CUDART_INF_F"), (-1.0, "isfinite")):
        src = E.build_kernel("softplus", (0.0, threshold), (dtype,), (dtype,), "float32", 1, p,
                             "sm_90").get_kernel_source()
        assert "isfinite" in src and value in src and "CUDART_NAN_F" in src


@needs_nvcc
def test_mish_uses_one_exp_for_half_outputs_only():
    """bf16 mish lowers to the one-exp form (no log1pf, no tanhf); float32 keeps torch's."""
    p = E.Plan("flat", ((0,),), ((1,),) * 2, ((False,),), 8, 128, 2, 128, False)
    half = E.build_kernel("mish", (), ("bfloat16",), ("bfloat16",), "float32", 1, p, "sm_90")
    src = half.get_kernel_source()
    assert "log1pf" not in src and "tanhf" not in src and "tl::fast_rcp(" in src
    assert "exp2f(" in src and "expf(" not in src.replace("exp2f(", "")  # E._exp32
    p4 = dataclasses.replace(p, vec=4)
    full = E.build_kernel("mish", (), ("float32",), ("float32",), "float32", 1, p4, "sm_90")
    assert "log1pf" in full.get_kernel_source() and "tanhf" in full.get_kernel_source()


@needs_nvcc
def test_gelu_uses_the_erfc_form_for_half_outputs_only():
    """bf16 gelu lowers to the erfc form (no libdevice erff); float32 keeps torch's erf form."""
    p = E.Plan("flat", ((0,),), ((1,),) * 2, ((False,),), 8, 128, 2, 128, False)
    half = E.build_kernel("gelu", (), ("bfloat16",), ("bfloat16",), "float32", 1, p, "sm_90")
    assert "erff" not in half.get_kernel_source() and "tl::fast_rcp(" in half.get_kernel_source()
    src = half.get_kernel_source()
    assert "exp2f(" in src and "expf(" not in src.replace("exp2f(", "")  # E._exp32
    p4 = dataclasses.replace(p, vec=4)
    full = E.build_kernel("gelu", (), ("float32",), ("float32",), "float32", 1, p4, "sm_90")
    assert "erff" in full.get_kernel_source()


@needs_nvcc
@pytest.mark.parametrize("fn", ["gelu_bwd", "gelu_and_mul_bwd"])
def test_gelu_gradient_takes_phi_from_erfcf(fn):
    """The gradient ``Phi(x) + x phi(x)`` cancels to 0 at x = -0.75, where the forward's
    degree-5 fit (7.6e-6 of Phi) would miss float16's ulp: its 16-bit form takes Phi from
    libdevice's erfcf (and no erff, whose left tail cancels)."""
    arity = E.SCALAR_FNS[fn].arity
    s = spec(fn=fn, params=(), in_shapes=((8, 128),) * arity, in_dtypes=("float16",) * arity,
             out_dtypes=("float16",) * E.SCALAR_FNS[fn].outputs, compute="float32",
             out_shape=(8, 128))
    src = E.build_kernel(fn, (), s.in_dtypes, s.out_dtypes, "float32", 2, E.plan(s),
                         "sm_90").get_kernel_source()
    assert "erfcf(" in src and "erff(" not in src


@needs_nvcc
@pytest.mark.parametrize(("fn", "params", "dtype", "out", "tests"), [
    ("isnan", (), "bfloat16", "bool", 1), ("isnan", (), "float32", "bool", 1),
    ("maximum", (), "bfloat16", "bfloat16", 2), ("minimum", (), "float16", "float16", 2),
    ("clamp_tensor", (True, True), "bfloat16", "bfloat16", 4)])
def test_nan_tests_survive_to_the_cuda_source(fn, params, dtype, out, tests):
    """Every NaN test reaches the CUDA source as an ``isnan`` call (``x != x`` is folded to
    False by TVM's simplifier, which made isnan false and maximum drop NaN): ``tests`` calls an
    element (on every input read), in the unmasked body and in the masked tail."""
    arity = E.SCALAR_FNS[fn].arity
    s = spec(fn=fn, params=params, in_shapes=((8, 128),) * arity, in_dtypes=(dtype,) * arity,
             out_dtypes=(out,), compute=dtype, out_shape=(8, 128))
    p = E.plan(s)
    src = E.build_kernel(fn, params, s.in_dtypes, s.out_dtypes, dtype, 2, p,
                         "sm_90").get_kernel_source()
    assert src.count("isnan(") >= 2 * tests, src
    assert "!= ((float)" not in src


@needs_nvcc
def test_clamp_with_tensor_bounds_computes_each_bound_once():
    """The lower bound's NaN-propagating maximum is bound once and the upper bound's minimum
    reads it: one max and one min an element in the unmasked body and in the masked tail (the
    nested selects of a NaN operand copied the maximum into every arm of the minimum, 696
    SASS instructions a program against 344)."""
    s = spec(fn="clamp_tensor", params=(True, True), in_shapes=((8, 128),) * 3,
             in_dtypes=("bfloat16",) * 3, out_dtypes=("bfloat16",), compute="float32",
             out_shape=(8, 128))
    src = E.build_kernel("clamp_tensor", (True, True), s.in_dtypes, s.out_dtypes, "float32", 2,
                         E.plan(s), "sm_90").get_kernel_source()
    assert (src.count("max("), src.count("min(")) == (2, 2), src


@needs_nvcc
def test_hardswish_gradient_has_torchs_boundaries():
    """torch's hardswish gradient is 0 at x <= -3 and dy at x >= 3 (its documented formula;
    x = +-3 are common bfloat16 values, where the other closure is 0.5 dy off)."""
    s = spec(fn="hardswish_bwd", params=(), in_shapes=((8, 128),) * 2,
             in_dtypes=("bfloat16",) * 2, out_dtypes=("bfloat16",), compute="float32",
             out_shape=(8, 128))
    src = E.build_kernel("hardswish_bwd", (), s.in_dtypes, s.out_dtypes, "float32", 2,
                         E.plan(s), "sm_90").get_kernel_source()
    assert "<= -0x1.8p+1f" in src and "< 0x1.8p+1f" in src, src
    assert "< -0x1.8p+1f" not in src.replace("<= -0x1.8p+1f", "")
    assert "<= 0x1.8p+1f" not in src


def test_gelu_tanh_half_gradient_keeps_the_tails_relative():
    """The half form of gelu_tanh's gradient (``E._tanh_terms32``: 1 + tanh and sech^2 from
    one exp(-2|u|)) in numpy float32: relative error below 2e-5 past |x| = 2 wherever the result
    exceeds 1e-30 (measured 1.2e-5), where torch's tanhf form is off by 1300% at x = -5.4."""
    np = pytest.importorskip("numpy")
    f = np.float32
    beta, kappa = f(math.sqrt(2 / math.pi)), f(0.044715)
    x = np.linspace(-12, 12, 240_001).astype(f)
    x_sq = x * x
    inner = beta * (x + kappa * (x_sq * x))
    e = _exp32_numpy(f(-2) * np.abs(inner))
    r = f(1) / (f(1) + e)
    one_plus, sech2 = f(2) * r * np.where(inner < 0, e, f(1)), f(4) * e * r * r
    got = (f(0.5) * one_plus + f(0.5) * x * sech2 * beta * (f(1) + f(3 * 0.044715) * x_sq))
    xd = x.astype(np.float64)
    u = math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)
    ref = (1 / (1 + np.exp(-2 * u)) + 0.5 * xd / np.cosh(u) ** 2 * math.sqrt(2 / math.pi)
           * (1 + 3 * 0.044715 * xd ** 2))
    err = np.abs(got.astype(np.float64) - ref)
    tail = (np.abs(x) > 2) & (np.abs(ref) > 1e-30)
    assert (err[tail] / np.abs(ref[tail])).max() <= 2e-5
    assert err[np.abs(x) <= 2].max() <= 4e-7  # measured 1.9e-7 (float32 rounding)


def test_a_float32_0dim_scalar_keeps_the_bf16_vector():
    """bf16 [32768, 8192] + a 0-dim float32 scalar: the scalar is read once, so the bf16
    tensors keep 8 elements (16 bytes) a vector (the scalar's itemsize halved it to 4, 3.34
    TB/s against 4.23 for the bf16 scalar)."""
    s = spec(fn="add", params=(1,), in_shapes=((32768, 8192), ()), out_shape=(32768, 8192),
             in_dtypes=("bfloat16", "float32"), out_dtypes=("bfloat16",))
    assert (E.plan(s).kind, E.plan(s).vec) == ("flat", 8)


@needs_nvcc
@pytest.mark.parametrize("fn", ["silu", "silu_and_mul", "silu_bwd", "gelu_tanh_bwd"])
def test_sigmoid_forms_bind_each_value_once(fn):
    """The 16-bit forms of silu (its gated and gradient forms too) and gelu_tanh's gradient
    compute one exp2 and one fast reciprocal an element: the values used twice are bound
    once as locals (an ``asm volatile`` reciprocal is never merged by nvcc), so each of the
    program's two paths (unmasked and masked tail) holds one of each; float32 keeps torch's
    ``expf`` and IEEE division."""
    f = E.SCALAR_FNS[fn]
    s = spec(fn=fn, params=(), in_shapes=((8, 128),) * f.arity, in_dtypes=("bfloat16",) * f.arity,
             out_dtypes=("bfloat16",) * f.outputs, compute="float32", out_shape=(8, 128))
    src = E.build_kernel(fn, (), s.in_dtypes, s.out_dtypes, "float32", 2, E.plan(s),
                         "sm_90").get_kernel_source()
    assert src.count("tl::fast_rcp(") == 2 and src.count("exp2f(") == 2, src
    assert "expf(" not in src.replace("exp2f(", "")
    s32 = spec(fn=fn, params=(), in_shapes=((8, 128),) * f.arity, in_dtypes=("float32",) * f.arity,
               out_dtypes=("float32",) * f.outputs, compute="float32", out_shape=(8, 128))
    src32 = E.build_kernel(fn, (), s32.in_dtypes, s32.out_dtypes, "float32", 2, E.plan(s32),
                           "sm_90").get_kernel_source()
    assert "fast_rcp" not in src32


@needs_nvcc
def test_rows_programs_of_several_accesses_keep_the_float32_forms():
    """A gated op's strided halves (the rows kind) at more than one access a thread compute in
    torch's float32 form: the half forms' straight-line math kept every element live (125
    registers against 54 at 256/4, 3.25 TB/s against 4.35 on the H200); the flat kind and the
    rows kind's default of one access a thread take the half form."""
    f = E.SCALAR_FNS["silu_and_mul"]
    rows = spec(fn="silu_and_mul", params=(), in_shapes=((64, 512),) * 2,
                in_strides=((1024, 1),) * 2, in_dtypes=("bfloat16",) * 2,
                out_dtypes=("bfloat16",), compute="float32", out_shape=(64, 512))
    flat = spec(fn="silu_and_mul", params=(), in_shapes=((64, 512),) * 2,
                in_dtypes=("bfloat16",) * 2, out_dtypes=("bfloat16",), compute="float32",
                out_shape=(64, 512))
    assert f.half_build is not None
    srcs = {}
    for name, s, launch in (("rows", rows, {"threads": 256, "per": 4}), ("flat", flat, {}),
                            ("rows-default", rows, {})):
        p = E.plan(s, **launch)
        assert p.kind == name.split("-")[0]
        srcs[name] = E.build_kernel(s.fn, (), s.in_dtypes, s.out_dtypes, "float32", 2, p,
                                    "sm_90").get_kernel_source()
    assert "fast_rcp" not in srcs["rows"] and "expf(" in srcs["rows"].replace("exp2f(", "")
    assert "tl::fast_rcp(" in srcs["flat"] and "tl::fast_rcp(" in srcs["rows-default"]


# --- the programs' indexing, run on the host ----------------------------------------------------

#: guard elements before and after an output, which no program may write
_GUARD = 64


def _align(a) -> int:
    """The data pointer's alignment in bytes (a power of two, at most 16), as the op states it."""
    addr = a.__array_interface__["data"][0]
    return min(16, addr & -addr) if addr else 16


def _host_call(fn, params, ins, out_shape, np, extra_rows=0, out_like=None, **plan_kw):
    """Call the program of ``fn`` over the numpy arrays ``ins`` (float32 or float16 views,
    any strides) on the host (``_host_run``): the spec from the arrays as the op makes it,
    the plan (``plan_kw`` overriding), every thread of every block of the launch
    (``extra_rows`` row blocks more, to show the harness sees what a wrong launch writes);
    ``out_like``: the input whose memory order the output takes (as ``torch.empty_like``),
    else the output is contiguous.
    Returns the output, whether the guards around it are untouched (and, with
    ``extra_rows``, the child unharmed), and the plan."""
    dtype = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}[ins[0].dtype]
    sys.path.insert(0, str(Path(__file__).parent))  # _host_run, beside this file
    from _host_run import run_kernel, shared_array

    numel = math.prod(out_shape)
    buf = shared_array(np, numel + 2 * _GUARD, ins[0].dtype, -7.25)
    out = buf[_GUARD:_GUARD + numel].reshape(out_shape)
    if out_like is not None:  # the input's dims from its largest stride to its smallest
        order = sorted(range(len(out_shape)), key=lambda d: -ins[out_like].strides[d])
        out = buf[_GUARD:_GUARD + numel].reshape([out_shape[d] for d in order]).transpose(
            [order.index(d) for d in range(len(out_shape))])
    item = ins[0].dtype.itemsize
    s = E.ElementwiseSpec(
        device=None, fn=fn, params=params, in_dtypes=(dtype,) * len(ins),
        out_dtypes=(dtype,), compute="float32", out_shape=tuple(out_shape),
        in_shapes=tuple(tuple(a.shape) for a in ins),
        in_strides=tuple(tuple(st // item for st in a.strides) for a in ins),
        in_align=tuple(_align(a) for a in ins),
        out_strides=(tuple(st // item for st in out.strides),), out_align=(_align(out),))
    p = E.plan(s, **plan_kw)
    src = E.build_kernel(fn, params, s.in_dtypes, s.out_dtypes, "float32", len(out_shape), p,
                         "sm_90").get_kernel_source()
    # the program's parameters by build_program's names: tensors A-D and Y, extents n<d>,
    # strides sx<k>_<j> (inputs) and sy0_<j> (the output), in elements
    values = dict(zip("ABCD"[:len(ins)], ins, strict=True)) | {"Y": out}
    values |= {f"n{d}": size for d, size in enumerate(out_shape)}
    for tag, arrays in (("x", ins), ("y", [out])):
        for k, a in enumerate(arrays):
            values |= {f"s{tag}{k}_{j}": st // item for j, st in enumerate(a.strides)}
    # the launch's grid exactly: TileLang takes the block indices' extents as facts (a row
    # block's bound check against the grid's y folds away), so a larger grid is not a launch
    # the program was built for
    if p.kind == "flat":
        grid = (-(-numel // (p.threads * p.per * p.vec)), 1)
    else:
        ncols = math.prod(out_shape[d] for d in p.groups[-1])
        ncb = -(-(ncols // p.vec) // p.tcols)
        nrb = -(-(numel // ncols) // (p.threads // p.tcols * p.per))
        grid = (ncb, nrb + extra_rows) if p.grid_y else (ncb * (nrb + extra_rows), 1)
    crashed = run_kernel(src, values, grid, p.threads)
    guards = bool((buf[:_GUARD] == -7.25).all() and (buf[-_GUARD:] == -7.25).all())
    if extra_rows:
        return out, crashed is None and guards, p
    assert crashed is None, (fn, p, crashed)
    return out, guards, p


def _layout(name, np, rng):
    """(fn, params, inputs, output shape, numpy reference) of a layout, float32; a name ending
    in ``-f16`` the same in float16 (16-byte accesses of eight elements; the reference is
    the float32 result rounded once, as the program computes it)."""
    if name.endswith("-f16"):
        fn, params, ins, shape, _ = _layout(name[:-4], np, rng)
        halves = [a.astype(np.float16) for a in ins]
        if name.startswith("halves-"):  # the halves of one float16 array, as the op has them
            x = np.concatenate([a.astype(np.float16) for a in ins], axis=1)
            n = ins[0].shape[1]
            halves = [x[:, :n], x[:, n:]]
        wide = [a.astype(np.float32) for a in halves]
        ref = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b,
               "neg": lambda a: -a}[fn](*wide)
        return fn, params, halves, shape, ref.astype(np.float16)

    def r(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    if name.startswith("flat-"):
        n = int(name.split("-")[1])
        a, b = r(n), r(n)
        return "add", (1,), [a, b], (n,), a + b
    if name == "scalar":
        a, b = r(33, 1000), r()
        return "mul", (), [a, np.asarray(b)], (33, 1000), a * b
    if name == "odd-row-bias":
        a, b = r(33, 4097), r(4097)
        return "add", (1,), [a, b], (33, 4097), a + b
    if name == "row-bias":
        a, b = r(40, 1024), r(1024)
        return "add", (1,), [a, b], (40, 1024), a + b
    if name == "column":
        a, b = r(300, 96), r(300, 1)
        return "add", (1,), [a, b], (300, 96), a + b
    if name.startswith("halves-"):
        n = int(name.split("-")[1])
        x = r(37, 2 * n)
        return "mul", (), [x[:, :n], x[:, n:]], (37, n), x[:, :n] * x[:, n:]
    if name == "strided-1d":  # one dim, read at a stride: a strided run of one group
        a = r(3 * 701)[::3]
        return "neg", (), [a], a.shape, -a
    if name == "transposed-3d":
        a = r(6, 40, 52).transpose(0, 2, 1)
        return "neg", (), [a], a.shape, -a
    if name == "permuted-4d":
        a, b = r(3, 9, 5, 40).transpose(0, 2, 1, 3), r(3, 5, 9, 40)
        return "add", (1,), [a, b], b.shape, a + b
    if name == "permuted-4d-both":
        a, b = r(3, 9, 5, 40).transpose(0, 2, 1, 3), r(3, 9, 5, 40).transpose(0, 2, 1, 3)
        return "add", (1,), [a, b], b.shape, a + b
    raise KeyError(name)


@needs_nvcc
@pytest.mark.parametrize(("layout", "plan_kw"), [
    ("flat-3", {}), ("flat-16896", {}), ("flat-16897", {}), ("flat-40000", {}),
    ("flat-40003", {}), ("flat-40003", {"threads": 64, "per": 2}),
    ("flat-40003", {"threads": 256, "per": 4}), ("flat-40003", {"threads": 128, "vec": 2}),
    ("scalar", {}), ("odd-row-bias", {}), ("row-bias", {}), ("column", {}),
    ("halves-4097", {}), ("halves-4096", {}), ("halves-4096", {"grid_y": False}),
    ("halves-1", {}), ("halves-1", {"grid_y": False}), ("strided-1d", {}), ("halves-1-f16", {}),
    ("halves-4096", {"threads": 256, "per": 4}), ("row-bias", {"grid_y": False}),
    ("transposed-3d", {}), ("transposed-3d", {"grid_y": False}), ("permuted-4d", {}),
    ("flat-40003-f16", {}), ("odd-row-bias-f16", {}), ("halves-4096-f16", {}),
    ("halves-4097-f16", {}), ("permuted-4d-f16", {}),
])
def test_programs_write_every_element_once_on_the_host(layout, plan_kw):
    """The generated program, run on the host thread by thread (``_host_run``), writes the
    exact result into every output element and nothing outside it, for each layout class and
    its edges: a flat run of three elements, the single-element rule's edge (16896) and the
    element past it, a last CTA part full with and without elements left after its vectors, a
    0-dim scalar, an odd row bias (the modular run), a row bias, a column, a gated op's halves
    at odd and even offsets and of one column each, a dimension read at a stride (the strided
    kind with no row group), the one-dimension grid, and three and four row groups (the
    strided kind's row offsets)."""
    np = pytest.importorskip("numpy")
    fn, params, ins, out_shape, ref = _layout(layout, np, np.random.default_rng(7))
    out, guards, p = _host_call(fn, params, ins, tuple(out_shape), np, **plan_kw)
    assert guards, (layout, p)
    assert np.array_equal(out, ref), (layout, p, float(np.abs(out - ref).max()))


@st.composite
def _views(draw, np):
    """An output shape and one or two float32 inputs as numpy views over it: dims of 1 to 9
    (1 included: the dims a plan drops), each input maybe a slice with a step of 2, maybe
    transposed, and the second maybe broadcast (dims of 1, or fewer dims)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))

    def view(full):
        """A view of shape ``full``: stored in a drawn dim order, every ``step``-th element."""
        step = draw(st.sampled_from([1, 2]))
        order = list(range(len(full)))
        if len(full) > 1 and draw(st.booleans()):
            order = draw(st.permutations(order))
        stored = tuple(full[d] for d in order)
        base = rng.standard_normal(tuple(n * step for n in stored), dtype=np.float32)
        return base[tuple(slice(None, None, step) for _ in stored)].transpose(np.argsort(order))

    ins = [view(shape)]
    if draw(st.booleans()):
        keep = tuple(n if draw(st.booleans()) else 1 for n in shape)
        lead = draw(st.integers(0, ndim - 1))
        ins.append(view(keep[lead:]))
    return shape, ins


@needs_nvcc
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_programs_over_drawn_views_match_numpy_on_the_host(data):
    """Drawn layouts, whatever plan they take (flat, rows, strided; dims of one dropped;
    slices, transposes, broadcasts), run on the host: numpy's result in every element and
    nothing written outside the output."""
    np = pytest.importorskip("numpy")
    shape, ins = data.draw(_views(np))
    fn, params = ("add", (1,)) if len(ins) == 2 else ("neg", ())
    want = ins[0] + ins[1] if len(ins) == 2 else -ins[0]
    out, guards, p = _host_call(fn, params, ins, shape, np)
    assert guards, p
    assert np.array_equal(out, want), (p, [a.strides for a in ins])


def _remainder_cuda(a, b, np):
    """torch.remainder of floats as torch's CUDA kernel computes it: fmod (exact), plus the
    divisor where the signs differ. torch's vectorised CPU kernel takes ``a - b * floor(a /
    b)`` instead, NaN where ``a / b`` overflows (1e30 by -1e-30), where its scalar path and
    the CUDA kernel give -1.83e-31."""
    with np.errstate(all="ignore"):
        mod = np.fmod(a, b)
        return np.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@needs_nvcc
@pytest.mark.parametrize(("fn", "params"), [
    ("maximum", ()), ("minimum", ()), ("clamp_tensor", (True, True)), ("div_floor", ()),
    ("remainder", ())])
def test_nan_propagating_and_floor_division_programs_match_torch_on_the_host(fn, params):
    """The programs of torch.maximum and torch.minimum (a NaN from either operand), clamp with
    tensor bounds (NaN from any of the three, ``min > max`` giving ``max``), floor division
    and remainder (signed zeros, infinities, a zero divisor), run on the host over every pair (or
    triple) of special values plus random ones, float32: the values of torch's CPU kernels
    (remainder's as its CUDA kernel computes it, :func:`_remainder_cuda`), NaN where torch
    gives NaN, and the zero signs of floor division and remainder too."""
    np = pytest.importorskip("numpy")
    special = np.array([0.0, -0.0, 0.5, -2.5, 3.0, 7.0, -7.0, 1e30, -1e-30, np.inf, -np.inf,
                        np.nan], dtype=np.float32)
    rng = np.random.default_rng(5)
    arity = E.SCALAR_FNS[fn].arity
    grids = np.meshgrid(*([special] * arity), indexing="ij")
    ins = [np.ascontiguousarray(np.concatenate(
        [g.reshape(-1), rng.standard_normal(64, dtype=np.float32) * 4]).reshape(8, -1))
        for g in grids]
    out, guards, _ = _host_call(fn, params, ins, ins[0].shape, np)
    torch = pytest.importorskip("torch")
    t = [torch.from_numpy(a) for a in ins]
    want = {"maximum": torch.maximum, "minimum": torch.minimum,
            "clamp_tensor": lambda x, lo, hi: torch.clamp(x, lo, hi),
            "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
            "remainder": lambda a, b: _remainder_cuda(a.numpy(), b.numpy(), np)}[fn](*t)
    want = want if isinstance(want, np.ndarray) else want.numpy()
    assert guards
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan), (fn, [a[np.isnan(out) != nan] for a in ins])
    assert np.array_equal(out[~nan], want[~nan]), fn
    if fn in ("div_floor", "remainder"):
        assert np.array_equal(np.signbit(out[~nan]), np.signbit(want[~nan]))


@needs_nvcc
@pytest.mark.parametrize(("fn", "grad_of"), [
    ("pow_bwd_a", (0, "pow")), ("pow_bwd_b", (1, "pow")), ("remainder_bwd_b", (1, "remainder")),
    ("div_bwd_b", (1, "div"))])
def test_power_and_remainder_gradient_programs_match_torch_on_the_host(fn, grad_of):
    """The gradient programs of pow (of the base and of the exponent) and of remainder's and
    div's divisor (1e-30 squared underflows: torch divides twice), run on the host in float32 over every triple of an upstream gradient, a first and
    a second operand drawn from special values (zeros of both signs, negative bases,
    fractional and negative exponents, infinities, NaN) plus random ones: torch's float32
    autograd values (its limits included: zero where b == 0, or a == 0 and b >= 0), NaN where
    torch's is NaN, within float32's rounding of the power elsewhere."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    first = np.array([0.0, -0.0, 0.5, 2.0, -2.0, 3.0, 1e-30, np.inf, -np.inf, np.nan],
                     dtype=np.float32)
    second = np.array([0.0, 1.0, 2.0, 0.5, -1.0, -0.5, 3.0, 7.0, 1e-30, np.inf, np.nan],
                      dtype=np.float32)
    douts = np.array([1.0, -2.5, 0.0], dtype=np.float32)
    rng = np.random.default_rng(9)
    grids = np.meshgrid(douts, first, second, indexing="ij")
    ins = [np.ascontiguousarray(np.concatenate(
        [g.reshape(-1), rng.standard_normal(62, dtype=np.float32) * 3]).reshape(8, -1))
        for g in grids]
    ins[1][-1] = np.abs(ins[1][-1]) + 0.1  # a row of positive bases: powers of every kind
    out, guards, _ = _host_call(fn, (), ins, ins[0].shape, np)
    assert guards
    dout, a, b = (torch.from_numpy(x).clone() for x in ins)
    a.requires_grad_(), b.requires_grad_()
    index, op = grad_of
    want = torch.autograd.grad(getattr(torch, op)(a, b), (a, b)[index], dout)[0].numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan), (fn, [x[np.isnan(out) != nan] for x in ins])
    finite = np.isfinite(want)
    assert np.array_equal(out[~finite & ~nan], want[~finite & ~nan]), fn
    np.testing.assert_allclose(out[finite], want[finite], rtol=2e-6, atol=0, err_msg=fn)


#: the unary math's gradient functions: (the forward torch function, whether the program
#: reads the output (else the input))
_MATH_GRADS = {"expm1_bwd": ("expm1", True), "sqrt_bwd": ("sqrt", True),
               "rsqrt_bwd": ("rsqrt", True), "reciprocal_bwd": ("reciprocal", True),
               "log1p_bwd": ("log1p", False), "sin_bwd": ("sin", False),
               "cos_bwd": ("cos", False), "erf_bwd": ("erf", False), "abs_bwd": ("abs", False)}


@needs_nvcc
@pytest.mark.parametrize("fn", sorted(_MATH_GRADS))
def test_unary_math_gradient_programs_match_torch_on_the_host(fn):
    """The unary math's gradient programs, run on the host in float32 over every pair of an
    upstream gradient and an input drawn from special values (zeros of both signs, -1, tiny,
    huge, infinities, NaN) plus random ones, reading the forward's output where the op saves
    it: torch's float32 autograd values, NaN and infinities where torch's are, within a few
    float32 ulps elsewhere (the programs' exp, sin and cos are the device's)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    op, from_output = _MATH_GRADS[fn]
    xs = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 1e-30, 1e30, np.inf, -np.inf, np.nan],
                  dtype=np.float32)
    douts = np.array([1.0, -2.5, 0.0], dtype=np.float32)
    rng = np.random.default_rng(5)
    d, x = (g.reshape(-1) for g in np.meshgrid(douts, xs, indexing="ij"))
    d = np.concatenate([d, rng.standard_normal(60, dtype=np.float32)])
    x = np.concatenate([x, rng.standard_normal(60, dtype=np.float32) * 3])
    xt = torch.from_numpy(x).clone().requires_grad_()
    y = getattr(torch, op)(xt)
    want = torch.autograd.grad(y, xt, torch.from_numpy(d))[0].numpy()
    saved = y.detach().numpy() if from_output else x
    ins = [np.ascontiguousarray(d.reshape(8, -1)), np.ascontiguousarray(saved.reshape(8, -1))]
    out, guards, _ = _host_call(fn, (), ins, ins[0].shape, np)
    assert guards
    out = out.reshape(-1)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan), (fn, x[np.isnan(out) != nan])
    finite = np.isfinite(want)
    assert np.array_equal(out[~finite & ~nan], want[~finite & ~nan]), fn
    np.testing.assert_allclose(out[finite], want[finite], rtol=1e-5, atol=1e-30, err_msg=fn)


@needs_nvcc
@pytest.mark.parametrize(("layout", "kind"), [
    ("transposed-3d", "flat"), ("permuted-4d", "strided"), ("permuted-4d-both", "flat"),
    ("transposed-3d-f16", "flat"), ("permuted-4d-both-f16", "flat")])
def test_programs_write_an_output_in_its_inputs_layout_on_the_host(layout, kind):
    """An output in its first input's memory order (as torch allocates it for a permuted
    dense input): where every operand shares that order the call is one flat run over the
    storages (a transposed [6, 52, 40], two [3, 5, 9, 40] read as [3, 9, 5, 40]); where the
    other input is in the logical order, the strided kind in the output's order."""
    np = pytest.importorskip("numpy")
    fn, params, ins, out_shape, ref = _layout(layout, np, np.random.default_rng(11))
    out, guards, p = _host_call(fn, params, ins, tuple(out_shape), np, out_like=0)
    assert p.kind == kind, p
    assert guards, (layout, p)
    assert out.strides != tuple(sorted(out.strides, reverse=True))  # not contiguous
    assert np.array_equal(out, ref), (layout, p, float(np.abs(out - ref).max()))


def test_the_host_run_sees_a_write_past_the_output():
    """The harness can fail: a rows program launched with one row block more than it was
    built for (its row bound folded away against the grid's extent) writes the row past the
    output, which the guards (or the child's crash) report."""
    np = pytest.importorskip("numpy")
    fn, params, ins, out_shape, _ = _layout("row-bias", np, np.random.default_rng(7))
    _, clean, p = _host_call(fn, params, ins, tuple(out_shape), np, extra_rows=1)
    assert p.kind == "rows" and p.grid_y and not clean
