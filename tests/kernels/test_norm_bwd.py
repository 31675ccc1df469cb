"""The row-norm backward kernels lower and compile for sm_90 on a machine without a GPU; their
launch plans cover the row within the register budget; the call spec refuses bad fields.

Each compiled configuration stands for one code path of the generated programs (why it
exists is on its line); numerics are checked on the GPU (test_norm_bwd_cuda.py).
"""

import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import norm_bwd as nb
from tileops.kernels.norm import RowNormKind

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")

REGISTER = [
    # (kind, N, dtype, weight, grad_weight, grad_bias, few_rows)
    pytest.param("rms", 8192, "bfloat16", True, True, False, False, id="rms-16B-exact"),
    pytest.param("rms", 4096, "bfloat16", True, False, False, False, id="rms-no-dweight"),
    pytest.param("rms", 4097, "bfloat16", True, True, False, False, id="rms-scalar-predicated"),
    pytest.param("rms", 128, "float16", False, False, False, False, id="rms-8-rows-a-cta"),
    pytest.param("rms", 128, "float16", True, True, False, False, id="rms-8-slots-dweight"),
    pytest.param("rms", 4096, "bfloat16", True, True, False, True, id="rms-few-rows"),
    pytest.param("rms", 16384, "bfloat16", True, True, False, False, id="rms-512-threads"),
    pytest.param("add_rms", 4096, "float16", True, True, False, False, id="fused-add"),
    pytest.param("add_rms", 8192, "bfloat16", False, False, False, False, id="fused-no-weight"),
    pytest.param("add_rms", 8192, "bfloat16", True, False, False, False, id="fused-no-dweight"),
    pytest.param("layer", 7, "float32", True, True, True, False, id="layer-tiny-fp32"),
    pytest.param("layer", 8192, "bfloat16", True, True, True, False, id="layer-dw-db"),
    pytest.param("layer", 8192, "bfloat16", True, False, True, False, id="layer-db-only"),
    pytest.param("layer", 4096, "float16", True, True, False, False, id="layer-dw-only"),
    pytest.param("layer", 4097, "bfloat16", False, False, True, False, id="layer-no-weight-db"),
    pytest.param("layer", 16384, "bfloat16", False, False, False, True, id="layer-no-affine"),
]


@needs_nvcc
@pytest.mark.parametrize(("kind", "n", "dtype", "weight", "gw", "gb", "few"), REGISTER)
def test_register_backward_compiles_for_sm90(kind, n, dtype, weight, gw, gb, few):
    kernel = nb.build_bwd_register_kernel(kind, n, dtype, 1e-6, weight, gw, gb, "sm_90", None,
                                          few)
    src = kernel.get_kernel_source()
    tpr, rpc, vec, per, resident, smem = nb.bwd_register_plan(n, dtype, few, kind)
    assert f"__launch_bounds__({tpr * rpc}" in src
    held = per * vec
    if gw:  # the dweight partials: a register array, or words of shared memory
        assert (f"float pw[{held}];" in src) != smem
    if gb:
        assert (f"float pb[{held}];" in src) != smem
    if vec * nb._ITEMSIZE[dtype] == 16:
        assert "uint4" in src  # 16-byte accesses where the row allows them
    if tpr > 32:
        assert "__syncthreads" in src  # the cross-warp reduction
    assert ("float* __restrict__ WS" in src) == (gw or gb)  # the workspace only for sums
    assert "atomic" not in src  # column sums go through the workspace, not atomics
    if kind == "add_rms" and tpr > 32:  # dres is loaded with x and dy, before the reductions
        body = src[src.index("__launch_bounds__"):]
        assert "(DR + " in body and body.index("(DR + ") < body.index("__syncthreads")
    if gw or gb:
        sums = int(gw) + int(gb)
        colsum = nb.build_colsum_kernel(rpc, n, sums, dtype, "sm_90").get_kernel_source()
        assert "main_kernel" in colsum


LOOPED = [
    pytest.param("rms", 65536, "bfloat16", True, True, False, id="rms-wide"),
    pytest.param("rms", 1 << 20, "float32", True, True, False, id="rms-2^20-fp32"),
    pytest.param("add_rms", 65536, "bfloat16", True, True, False, id="fused-wide"),
    pytest.param("add_rms", 4097, "float16", False, False, False, id="fused-odd-no-weight"),
    pytest.param("layer", 65536, "bfloat16", True, True, True, id="layer-wide"),
    pytest.param("layer", 100000, "float32", False, False, True, id="layer-fixed-column-n"),
    pytest.param("layer", (1 << 20) - 1, "bfloat16", True, True, False, id="layer-2^20-1"),
    pytest.param("layer", 7, "float16", True, True, True, id="layer-narrower-than-warp"),
]


@needs_nvcc
@pytest.mark.parametrize(("kind", "n", "dtype", "weight", "gw", "gb"), LOOPED)
def test_looped_backward_compiles_for_sm90(kind, n, dtype, weight, gw, gb):
    src = nb.build_bwd_looped_kernel(kind, n, dtype, 1e-5, weight, gw, gb,
                                     "sm_90").get_kernel_source()
    assert "__launch_bounds__(1024" in src
    assert ("float* __restrict__ WS" in src) == (gw or gb)
    assert "atomic" not in src
    if kind == "layer":  # the shift: broadcast from lane 0 for every row of a warp or more
        assert ("__shfl_sync(" in src) == (n >= 32)
    if gw or gb:
        colsum = nb.build_colsum_kernel(1, n, int(gw) + int(gb), dtype, "sm_90")
        assert "main_kernel" in colsum.get_kernel_source()


@needs_nvcc
@settings(max_examples=6, deadline=None)  # a compile takes seconds
@given(n=st.one_of(st.integers(1, 1 << 14), st.integers(1, 1 << 20)),
       kind=st.sampled_from(["rms", "layer", "add_rms"]),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       weight=st.booleans(), gw=st.booleans(), gb=st.booleans(), few=st.booleans())
def test_every_row_length_compiles_for_sm90(n, kind, dtype, weight, gw, gb, few):
    gw = gw and weight
    gb = gb and kind == "layer"
    plan = nb.bwd_register_plan(n, dtype, few, kind)  # the op's pick: registers if it fits
    build = nb.build_bwd_looped_kernel if plan is None else nb.build_bwd_register_kernel
    src = build(kind, n, dtype, 1e-5, weight, gw, gb, "sm_90", None, few).get_kernel_source()
    assert "main_kernel" in src


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 1 << 17), dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       few=st.booleans(), kind=st.sampled_from(["rms", "add_rms", "layer"]))
def test_register_plan_covers_the_row_within_the_register_budget(n, dtype, few, kind):
    plan = nb.bwd_register_plan(n, dtype, few, kind)
    item = nb._ITEMSIZE[dtype]
    if plan is None:  # only rows too wide for registers go to the looped kernel
        assert n * item > nb._BWD_HELD_BYTES * nb._BWD_MAX_REGISTER_THREADS // 2
        return
    tpr, rpc, vec, per, resident, smem = plan
    assert n % vec == 0 and vec * item <= 16
    assert tpr * per * vec >= n > tpr * (per - 1) * vec  # covers the row, no empty access
    assert per * vec * item <= nb._BWD_HELD_BYTES
    assert tpr % 32 == 0 and tpr & (tpr - 1) == 0 and tpr <= 512
    assert rpc == 1 or (tpr == 32 and rpc * tpr == 256)  # several rows a CTA: a warp a row
    assert resident == 512
    # partials in shared memory only for many-row LayerNorm calls whose rows a thread's half
    # share would not cover on at most 256 threads (two CTAs an SM); few rows keep them in
    # registers whatever a thread holds (the sweep of the backward's plans)
    half = per * vec * item <= nb._BWD_HELD_BYTES // 2
    assert smem == (kind == "layer" and not few and not (half and tpr <= 256))


@pytest.mark.parametrize(("n", "rows", "plan"), [
    # LayerNorm calls of up to 2048 rows: register partials, one 256-thread CTA an SM (the
    # sweep: 2048 x 8192 bf16 52 us against 76 with shared partials); more rows, or rows
    # spread over 512 threads: shared partials on two CTAs an SM (32768 x 8192: 495 us
    # against 611; 2048 x 16384: 122 against 145)
    (8192, 2048, (256, 1, 8, 4, 256, False)),
    (8192, 2049, (256, 1, 8, 4, 512, True)),
    (8192, 32768, (256, 1, 8, 4, 512, True)),
    (16384, 2048, (512, 1, 8, 4, 512, True)),
    (8192, None, (256, 1, 8, 4, 512, True)),
])
def test_layer_norm_register_partials_up_to_2048_rows(n, rows, plan):
    assert tuple(nb.bwd_register_plan(n, "bfloat16", False, "layer", rows)) == plan


@pytest.mark.parametrize(("kind", "n", "dtype", "plan"), [
    # the plans the performance figures in the README are estimated for
    ("rms", 8192, "bfloat16", (256, 1, 8, 4, 512, False)),
    ("rms", 4096, "bfloat16", (128, 1, 8, 4, 512, False)),
    ("add_rms", 4096, "bfloat16", (128, 1, 8, 4, 512, False)),
    ("rms", 16384, "bfloat16", (512, 1, 8, 4, 512, False)),
    ("rms", 4097, "bfloat16", (256, 1, 1, 17, 512, False)),
    ("rms", 7, "bfloat16", (32, 8, 1, 1, 512, False)),
    ("rms", 8192, "float32", (512, 1, 4, 4, 512, False)),
    ("rms", 16384, "float32", None),  # 64 KiB rows: looped
    ("rms", 65536, "bfloat16", None),
    # LayerNorm: two accesses a thread, partials in registers, up to 256 threads a row
    ("layer", 4096, "bfloat16", (256, 1, 8, 2, 512, False)),
    ("layer", 2048, "float32", (256, 1, 4, 2, 512, False)),
    ("layer", 8192, "bfloat16", (256, 1, 8, 4, 512, True)),
    ("layer", 4097, "bfloat16", (256, 1, 1, 17, 512, True)),
    ("layer", 7, "bfloat16", (32, 8, 1, 1, 512, False)),
])
def test_register_plans_of_the_benchmarked_rows(kind, n, dtype, plan):
    assert nb.bwd_register_plan(n, dtype, False, kind) == plan


def test_grid_is_capped_at_the_resident_ctas_and_covers_few_rows():
    assert nb.grid_ctas(32768, 1, 256, 132) == 264  # two 256-thread CTAs an SM
    assert nb.grid_ctas(32768, 1, 512, 132) == 132
    assert nb.grid_ctas(32768, 8, 256, 132) == 264
    assert nb.grid_ctas(100, 1, 256, 132) == 100  # fewer rows: a CTA a row
    assert nb.grid_ctas(1, 8, 256, 132) == 1
    assert nb.grid_ctas(17, 8, 256, 132) == 3
    assert nb.grid_ctas(64, 1, 1024, 132) == 64


@pytest.mark.parametrize(("cols", "vec"), [
    (16384, 4), (32768, 4),  # 16-byte loads where 128 CTAs of 128 columns remain
    (8192, 2), (4096, 1),  # narrower tiles: 128 CTAs rather than 64 or 32
    (16386, 2), (4097, 1), (7, 1),  # the widest access dividing the columns
])
def test_colsum_spreads_over_128_ctas_with_64_bytes_a_thread_in_flight(cols, vec):
    assert nb.colsum_plan(cols) == (16, vec, 16 // vec)


def _spec(device=None, **kw):
    import torch

    good = dict(device=device or torch.device("cuda", 0), kind=RowNormKind.RMS, rows=2048,
                n=4096, dtype="bfloat16", eps=1e-6, has_weight=True, grad_weight=True,
                grad_bias=False)
    return nb.RowNormBwdSpec(**{**good, **kw})


def test_implementations_state_their_regions():
    import torch

    assert nb.RowNormBwdRegisterKernel.region_refusal(_spec(n=1 << 20)) == (
        "a row of 1048576 x bfloat16 exceeds the 64 bytes of x a thread holds at 512 threads")
    assert nb.RowNormBwdRegisterKernel.region_refusal(_spec(n=16384)) is None
    assert nb.RowNormBwdRegisterKernel.region_refusal(_spec(n=16384, dtype="float32"))
    assert nb.RowNormBwdLoopedKernel.general
    assert not nb.RowNormBwdRegisterKernel.general
    assert nb.RowNormBwdRegisterKernel.refusal(_spec(torch.device("cpu"))) == \
        "runs on cuda, not cpu"
    assert nb.RowNormBwdInterface.slot == "row_norm_bwd"
    assert nb.RowNormBwdInterface.call_spec is nb.RowNormBwdSpec


def test_the_launch_plan_of_a_row_count_is_the_kernels():
    k = nb.RowNormBwdRegisterKernel
    assert k.identity(_spec(rows=2)) == k.identity(_spec(rows=131)) != \
        k.identity(_spec(rows=132))
    # one row stores its sums directly: an entry of its own, unless no sum is wanted
    assert k.identity(_spec(rows=1)) != k.identity(_spec(rows=2))
    assert k.direct(_spec(rows=1)) and not k.direct(_spec(rows=2))
    assert not k.direct(_spec(rows=1, grad_weight=False))
    assert k.identity(_spec(rows=1, grad_weight=False)) == \
        k.identity(_spec(rows=2, grad_weight=False))
    assert not nb.RowNormBwdLoopedKernel.direct(_spec(rows=1))
    assert k.identity(_spec(rows=132)) == k.identity(_spec(rows=32768))
    assert k.identity(_spec(grad_weight=False)) != k.identity(_spec())
    assert _spec().sums == 1
    assert _spec(kind=RowNormKind.LAYER, grad_bias=True).sums == 2
    assert _spec(grad_weight=False).sums == 0


@pytest.mark.parametrize(("field", "value", "error"), [
    ("kind", "rms", "RowNormBwdSpec.kind must be a RowNormKind, got 'rms'"),
    ("dtype", "float64", "RowNormBwdSpec.dtype must be one of bfloat16, float16, float32, got "
                         "'float64'"),
    ("rows", -1, "RowNormBwdSpec.rows must be a size (an int >= 0), got -1"),
    ("n", True, "RowNormBwdSpec.n must be a size (an int >= 0), got True"),
    ("n", 4.0, "RowNormBwdSpec.n must be a size (an int >= 0), got 4.0"),
    ("grad_weight", 1, "RowNormBwdSpec.grad_weight must be a bool, got 1"),
    ("has_weight", False, "RowNormBwdSpec: grad_weight needs has_weight (there is no weight "
                          "to take the gradient of)"),
    ("grad_bias", True, "RowNormBwdSpec: only LAYER has a bias gradient, not RowNormKind.RMS"),
])
def test_call_spec_invariants_are_checked_at_construction(field, value, error):
    import torch

    with pytest.raises((TypeError, ValueError)) as info:
        _spec(torch.device("cpu"), **{field: value})
    assert str(info.value) == error
    with pytest.raises(TypeError):  # keyword-only: no positional booleans
        nb.RowNormBwdSpec(torch.device("cpu"), RowNormKind.RMS, 4, 8, "bfloat16", 1e-6, True,
                          True, False)


@pytest.mark.parametrize(("kind", "weight", "gw", "gb", "names"), [
    ("rms", True, True, False, ["DY", "X", "W", "DX", "WS"]),
    ("rms", True, False, False, ["DY", "X", "W", "DX"]),
    ("rms", False, False, False, ["DY", "X", "DX"]),
    ("add_rms", True, True, False, ["DY", "DR", "X", "W", "DX", "WS"]),
    ("add_rms", True, False, False, ["DY", "DR", "X", "W", "DX"]),
    ("add_rms", False, False, False, ["DY", "DR", "X", "DX"]),
    ("layer", True, True, True, ["DY", "X", "W", "DX", "WS"]),
    ("layer", False, False, True, ["DY", "X", "DX", "WS"]),
    ("layer", False, False, False, ["DY", "X", "DX"]),
])
@pytest.mark.parametrize("program", ["register", "looped"])
def test_programs_take_exactly_the_present_tensors_in_call_order(kind, weight, gw, gb, names,
                                                                 program):
    # _RowNormBwdKernel.__call__ passes dy, [dres], x, [weight], dx, [workspace]
    if program == "register":
        prog = nb.register_bwd_program(kind, 4096, "bfloat16", 1e-6, weight, gw, gb,
                                       *nb.bwd_register_plan(4096, "bfloat16", False, kind))
    else:
        prog = nb.looped_bwd_program(kind, 4096, "bfloat16", 1e-6, weight, gw, gb,
                                     *nb.bwd_looped_plan(4096, "bfloat16"))
    assert [prog.buffer_map[p].name for p in prog.params if p in prog.buffer_map] == names


@pytest.mark.parametrize(("kind", "weight", "gw", "gb", "names"), [
    ("rms", True, True, False, ["DY", "X", "W", "DX", "DW"]),
    ("add_rms", True, True, False, ["DY", "DR", "X", "W", "DX", "DW"]),
    ("layer", True, True, True, ["DY", "X", "W", "DX", "DW", "DB"]),
    ("layer", True, True, False, ["DY", "X", "W", "DX", "DW"]),
    ("layer", True, False, True, ["DY", "X", "W", "DX", "DB"]),
    ("layer", False, False, True, ["DY", "X", "DX", "DB"]),
])
def test_direct_programs_take_the_sums_in_place_of_the_workspace(kind, weight, gw, gb, names):
    # _RowNormBwdKernel.__call__ passes dy, [dres], x, [weight], dx, [dweight], [dbias]
    plan = nb.bwd_register_plan(4096, "bfloat16", True, kind)
    prog = nb.register_bwd_program(kind, 4096, "bfloat16", 1e-6, weight, gw, gb, *plan, True)
    assert [prog.buffer_map[p].name for p in prog.params if p in prog.buffer_map] == names


DIRECT = [
    # (kind, N, dtype, weight, grad_weight, grad_bias): one row, sums stored by the program
    pytest.param("rms", 4096, "bfloat16", True, True, False, id="rms-16B"),
    pytest.param("add_rms", 4097, "float16", True, True, False, id="fused-scalar-predicated"),
    pytest.param("layer", 7, "float32", True, True, True, id="layer-narrower-than-warp"),
    pytest.param("layer", 16384, "bfloat16", True, True, True, id="layer-shared-partials"),
    pytest.param("layer", 4096, "bfloat16", False, False, True, id="layer-dbias-only"),
]


@needs_nvcc
@pytest.mark.parametrize(("kind", "n", "dtype", "weight", "gw", "gb"), DIRECT)
def test_direct_backward_compiles_for_sm90(kind, n, dtype, weight, gw, gb):
    kernel = nb.build_bwd_register_kernel(kind, n, dtype, 1e-6, weight, gw, gb, "sm_90", None,
                                          True, True)
    src = kernel.get_kernel_source()
    assert "WS" not in src  # no workspace: the sums are stored in the storage dtype
    assert ("DW" in src) == gw and ("DB" in src) == gb


F32_SUMS = [
    # (kind, N, dtype, grad_bias, direct): a float32 weight's sums stored in float32
    pytest.param("rms", 4096, "bfloat16", False, True, id="direct-rms-16B"),
    pytest.param("layer", 4097, "float16", True, True, id="direct-layer-scalar-predicated"),
    pytest.param("layer", 16384, "bfloat16", True, True, id="direct-layer-shared-partials"),
    pytest.param("rms", 8192, "bfloat16", False, False, id="colsum-dweight"),
    pytest.param("layer", 4097, "bfloat16", True, False, id="colsum-dweight-dbias"),
]


@needs_nvcc
@pytest.mark.parametrize(("kind", "n", "dtype", "gb", "direct"), F32_SUMS)
def test_float32_sums_compile_for_sm90(kind, n, dtype, gb, direct):
    """The programs storing dweight/dbias take them as float32 (out_dtype), the rest in the
    storage dtype: the sums are rounded once, to float32."""
    c = {"bfloat16": "bfloat16_t", "float16": "half_t"}[dtype]
    if direct:
        src = nb.build_bwd_register_kernel(kind, n, dtype, 1e-6, True, True, gb, "sm_90", None,
                                           True, True, "float32").get_kernel_source()
        assert "float* __restrict__ DW" in src and f"{c}* __restrict__ W" in src
        assert ("float* __restrict__ DB" in src) == gb
        assert f"{c}* __restrict__ DX" in src
    else:
        sums = 1 + int(gb)
        src = nb.build_colsum_kernel(1, n, sums, dtype, "sm_90",
                                     "float32").get_kernel_source()
        outs = ["DW", "DB"] if gb else ["OUT"]
        assert all(f"float* __restrict__ {o}" in src for o in outs)
        assert c not in src  # float32 throughout: no rounding to the storage dtype
    prog = (nb.colsum_program(1, n, 2, dtype, *nb.colsum_plan(2 * n)) if not direct else
            nb.register_bwd_program(kind, n, dtype, 1e-6, True, True, gb,
                                    *nb.bwd_register_plan(n, dtype, True, kind), True))
    assert all(str(prog.buffer_map[p].dtype) == dtype for p in prog.params[-1:])  # default


def test_direct_programs_need_one_row_a_cta_and_a_sum():
    with pytest.raises(ValueError) as info:
        nb.register_bwd_program("rms", 128, "float16", 1e-6, True, True, False,
                                *nb.bwd_register_plan(128, "float16"), True)
    assert str(info.value) == ("a direct program stores one row's sums: it needs rows_per_cta "
                               "1 and a wanted sum, got rows_per_cta 8 and 1 sums")
    with pytest.raises(ValueError, match="got rows_per_cta 1 and 0 sums"):
        nb.register_bwd_program("rms", 4096, "float16", 1e-6, True, False, False,
                                *nb.bwd_register_plan(4096, "float16", True), True)
    with pytest.raises(ValueError, match="the looped backward has no direct program"):
        nb.build_bwd_looped_kernel("rms", 65536, "bfloat16", 1e-6, True, True, False, "sm_90",
                                   None, True, True)


@pytest.mark.parametrize(("sums", "names"), [(1, ["WS", "OUT"]), (2, ["WS", "DW", "DB"])])
def test_colsum_takes_the_workspace_and_the_wanted_sums(sums, names):
    prog = nb.colsum_program(1, 4096, sums, "bfloat16", *nb.colsum_plan(sums * 4096))
    assert [prog.buffer_map[p].name for p in prog.params if p in prog.buffer_map] == names


def test_programs_refuse_sums_the_call_spec_refuses():
    with pytest.raises(ValueError, match="grad_weight needs a weight"):
        nb.register_bwd_program("rms", 64, "float32", 1e-6, False, True, False, 32, 8, 2, 1,
                                512, False)
    with pytest.raises(ValueError, match="only layer has a bias gradient, not rms"):
        nb.looped_bwd_program("rms", 64, "float32", 1e-6, True, True, True, 1024, 4, 2)
