"""The row-norm kernels lower and compile for sm_90 on a machine without a GPU.

Each compiled configuration below stands for one code path of the generated program (why it
exists is on its line); the launch plans themselves are checked over the whole input space
without compiling, and a sample of every row length from 1 to 2**20 is compiled.
"""

import shutil

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tileops.kernels import norm

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")

CONFIGS = [
    # (kind, N, dtype, weight, bias, few_rows)
    pytest.param("rms", 8192, "bfloat16", True, False, False, id="rms-16B-exact"),
    pytest.param("rms", 4097, "bfloat16", True, False, False, id="rms-scalar-predicated"),
    pytest.param("rms", 128, "float16", False, False, False, id="rms-8-rows-a-cta"),
    pytest.param("rms", 4096, "bfloat16", True, False, True, id="rms-few-rows"),
    pytest.param("add_rms", 4096, "float16", True, False, False, id="fused-add"),
    pytest.param("layer", 7, "float32", True, True, False, id="layer-tiny-fp32"),
    pytest.param("layer", 16384, "bfloat16", True, True, False, id="layer-cross-warp"),
]


@needs_nvcc
@pytest.mark.parametrize(("kind", "n", "dtype", "weight", "bias", "few"), CONFIGS)
def test_register_kernel_compiles_for_sm90(kind, n, dtype, weight, bias, few):
    kernel = norm.build_register_kernel(kind, n, dtype, 1e-6, weight, bias, "sm_90", None, few)
    src = kernel.get_kernel_source()
    tpr, rpc, vec, per = norm.register_plan(n, dtype, few)
    assert f"__launch_bounds__({tpr * rpc}" in src
    if vec * norm._ITEMSIZE[dtype] == 16:
        assert "uint4" in src  # 16-byte accesses where the row allows them
    if tpr > 32:
        assert "__syncthreads" in src  # the cross-warp reduction


@needs_nvcc
@pytest.mark.parametrize(("kind", "n", "dtype"), [
    pytest.param("rms", 65536, "bfloat16", id="rms-wide"),
    pytest.param("layer", 131072, "float32", id="layer-wide-fp32"),
    pytest.param("add_rms", 4097, "float16", id="fused-odd"),
])
def test_looped_kernel_compiles_for_sm90(kind, n, dtype):
    kernel = norm.build_looped_kernel(kind, n, dtype, 1e-5, True, kind == "layer", "sm_90")
    assert "main_kernel" in kernel.get_kernel_source()


@needs_nvcc
@settings(max_examples=10, deadline=None)  # a compile takes seconds
@given(n=st.one_of(st.integers(1, 1 << 15), st.integers(1, 1 << 20)),  # register / looped rows
       kind=st.sampled_from(["rms", "layer", "add_rms"]),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       weight=st.booleans(), bias=st.booleans(), few=st.booleans())
# N mod 2**16 >= 2**15: lengths whose direct load of a fixed column TileLang cannot lower
@example(n=100000, kind="layer", dtype="bfloat16", weight=True, bias=True, few=False)
@example(n=100000, kind="rms", dtype="float16", weight=True, bias=False, few=False)
@example(n=100000, kind="add_rms", dtype="float32", weight=False, bias=False, few=True)
@example(n=(1 << 20) - 1, kind="layer", dtype="float32", weight=False, bias=False, few=True)
def test_every_row_length_compiles_for_sm90(n, kind, dtype, weight, bias, few):
    bias = bias and kind == "layer"
    plan = norm.register_plan(n, dtype, few)  # the kernel the op picks: registers if it fits
    build = norm.build_looped_kernel if plan is None else norm.build_register_kernel
    src = build(kind, n, dtype, 1e-5, weight, bias, "sm_90", None, few).get_kernel_source()
    assert "main_kernel" in src
    if plan is None and kind == "layer":  # the shift: broadcast from lane 0 only where needed
        assert ("__shfl_sync(" in src) == norm._direct_row_load_fails(n)


@pytest.mark.parametrize(("n", "lowers"), [
    pytest.param(98303, True, id="98303-mod-2^16-is-2^15-1"),
    pytest.param(98304, False, id="98304-mod-2^16-is-2^15"),
    pytest.param(131071, False, id="131071-mod-2^16-is-2^16-1"),
    pytest.param(131072, True, id="131072-mod-2^16-is-0"),
])
def test_tilelang_lowers_a_direct_fixed_column_load_exactly_where_stated(n, lowers, monkeypatch):
    """The looped LayerNorm's direct ``X[row, 0]`` load, forced for every N, lowers exactly
    where :func:`norm._direct_row_load_fails` says it does. This fails once a TileLang release
    lowers it for every N: the warp broadcast is then no longer needed."""
    import tilelang
    from tilelang import tvm

    monkeypatch.setattr(norm, "_direct_row_load_fails", lambda n: False)
    prog = norm.looped_program("layer", n, "float32", 1e-5, False, False,
                               *norm.looped_plan(n, "float32"))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        if lowers:
            assert "__shfl_sync(" not in tilelang.lower(prog, target=target).kernel_source
        else:
            with pytest.raises(Exception, match="lanes of a scalable vector"):
                tilelang.lower(prog, target=target)
    monkeypatch.undo()
    assert norm._direct_row_load_fails(n) is not lowers


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 1 << 17), dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       few=st.booleans())
def test_register_plan_covers_the_row_within_the_register_budget(n, dtype, few):
    plan = norm.register_plan(n, dtype, few)
    item = norm._ITEMSIZE[dtype]
    if plan is None:  # only rows too wide for registers go to the looped kernel
        assert n * item > norm._HELD_BYTES_PER_THREAD * norm._MAX_REGISTER_THREADS // 2
        return
    tpr, rpc, vec, per = plan
    assert n % vec == 0 and vec * item <= 16
    assert tpr * per * vec >= n > tpr * (per - 1) * vec  # covers the row, no empty access
    assert per * vec * item <= norm._HELD_BYTES_PER_THREAD
    assert tpr % 32 == 0 and tpr & (tpr - 1) == 0 and tpr * rpc <= 1024
    assert rpc == 1 or tpr == 32  # several rows a CTA only one warp a row


def test_widest_access_divides_the_row():
    assert norm._vec(4096, "bfloat16") == 8
    assert norm._vec(4097, "bfloat16") == 1
    assert norm._vec(4100, "bfloat16") == 4
    assert norm._vec(6, "float32") == 2


def test_implementations_state_their_regions():
    import torch

    def spec(device, n, rows=2048):
        return norm.RowNormSpec(device=device, kind=norm.RowNormKind.RMS, rows=rows, n=n,
                                dtype="bfloat16", eps=1e-6, has_weight=True, has_bias=False)

    cuda = torch.device("cuda", 0)
    assert "exceeds the 128 bytes" in norm.RowNormRegisterKernel.region_refusal(
        spec(cuda, 1 << 20))
    assert norm.RowNormLoopedKernel.general
    assert norm.RowNormRegisterKernel.region_refusal(spec(cuda, 4096)) is None
    assert norm.RowNormRegisterKernel.refusal(spec(torch.device("cpu"), 4096)) == \
        "runs on cuda, not cpu"


def test_the_launch_plan_of_a_row_count_is_the_kernels():
    """The op states the exact row count; the kernel's identity holds only the plan it picks
    (few rows or not), so every row count of one plan shares one built program."""
    import torch

    def spec(rows):
        return norm.RowNormSpec(device=torch.device("cuda", 0), kind=norm.RowNormKind.RMS,
                                rows=rows, n=4096, dtype="bfloat16", eps=1e-6, has_weight=True,
                                has_bias=False)

    k = norm.RowNormRegisterKernel
    assert spec(1).few_rows and spec(norm.FEW_ROWS - 1).few_rows
    assert not spec(norm.FEW_ROWS).few_rows
    assert k.identity(spec(1)) == k.identity(spec(131)) != k.identity(spec(132))
    assert k.identity(spec(132)) == k.identity(spec(32768))


@pytest.mark.parametrize(("field", "value", "error"), [
    ("kind", "rms", "RowNormSpec.kind must be a RowNormKind, got 'rms'"),
    ("dtype", "float64", "RowNormSpec.dtype must be one of bfloat16, float16, float32, got "
                         "'float64'"),
    ("rows", -1, "RowNormSpec.rows must be a size (an int >= 0), got -1"),
    ("n", True, "RowNormSpec.n must be a size (an int >= 0), got True"),
    ("has_bias", True, "RowNormSpec: only LAYER normalizes with a bias, not RowNormKind.RMS"),
])
def test_call_spec_invariants_are_checked_at_construction(field, value, error):
    import torch

    good = dict(device=torch.device("cpu"), kind=norm.RowNormKind.RMS, rows=4, n=8,
                dtype="bfloat16", eps=1e-6, has_weight=False, has_bias=False)
    with pytest.raises((TypeError, ValueError)) as info:
        norm.RowNormSpec(**{**good, field: value})
    assert str(info.value) == error
    with pytest.raises(TypeError):  # keyword-only: no positional booleans
        norm.RowNormSpec(torch.device("cpu"), norm.RowNormKind.RMS, 4, 8, "bfloat16", 1e-6,
                         False, False)


@pytest.mark.parametrize(("kind", "weight", "bias", "names"), [
    ("rms", True, False, ["X", "W", "Y"]),
    ("rms", False, False, ["X", "Y"]),
    ("layer", True, True, ["X", "W", "B", "Y"]),
    ("layer", False, True, ["X", "B", "Y"]),
    ("add_rms", True, False, ["X", "R", "W", "Y", "RO"]),
    ("add_rms", False, False, ["X", "R", "Y", "RO"]),
])
@pytest.mark.parametrize("program", ["register", "looped"])
def test_programs_take_exactly_the_present_tensors_in_call_order(kind, weight, bias, names,
                                                                 program):
    # _RowNormKernel.__call__ passes x, [residual], [weight], [bias], y, [residual_out]
    if program == "register":
        plan = norm.register_plan(4096, "bfloat16")
        prog = norm.register_program(kind, 4096, "bfloat16", 1e-6, weight, bias, *plan)
    else:
        prog = norm.looped_program(kind, 4096, "bfloat16", 1e-6, weight, bias,
                                   *norm.looped_plan(4096, "bfloat16"))
    assert [prog.buffer_map[p].name for p in prog.params if p in prog.buffer_map] == names


@needs_nvcc
def test_the_first_build_of_a_process_says_so_first(monkeypatch):
    """A cold build takes seconds: the first compile of a process logs one WARNING line
    before it starts (naming where built kernels are cached), later ones log nothing more.
    The warnings are taken where the module emits them (log.warning), whatever handlers and
    propagation the tileops logger has in this process."""
    from tileops.kernels import _tilelang
    from tileops.runtime import env, log

    monkeypatch.setattr(_tilelang, "_announced", [False])
    seen: list[str] = []
    monkeypatch.setattr(log, "warning", lambda msg, *args: seen.append(msg % args))
    build = norm.build_register_kernel.__wrapped__  # past the in-process memo
    build("rms", 96, "float32", 1e-6, True, False, "sm_90a")
    build("rms", 160, "float32", 1e-6, True, False, "sm_90a")
    assert seen == [
        "building TileLang kernels (the first build of a configuration takes seconds; built "
        f"kernels are cached under {env.compiler_cache_env()['TILELANG_CACHE_DIR']} and load "
        "from there); TILEOPS_LOG_LEVEL=INFO names each one"]


# --- the cluster kernel: few rows of a wide row split over a thread-block cluster -------------


@needs_nvcc
@pytest.mark.parametrize(("kind", "rows", "n", "dtype", "weight", "bias"), [
    pytest.param("rms", 8, 131072, "bfloat16", True, False, id="rms-8x131072"),
    pytest.param("layer", 4, 100000, "bfloat16", True, True, id="layer-predicated-two-rounds"),
    pytest.param("add_rms", 1, 65536, "float16", True, False, id="fused-add-one-row"),
    pytest.param("rms", 3, 8191, "float32", False, False, id="rms-scalar-two-ctas"),
])
def test_cluster_kernel_compiles_for_sm90a(kind, rows, n, dtype, weight, bias):
    plan = norm.cluster_plan(rows, n, dtype)
    cluster, threads = plan[0], plan[1]
    src = norm.build_cluster_kernel(kind, n, dtype, 1e-6, weight, bias, "sm_90a",
                                    plan).get_kernel_source()
    assert f"__launch_bounds__({threads}" in src
    rounds = 2 if kind == "layer" else 1
    # the partials pushed into each CTA of the cluster, a barrier before they are read (and
    # one before the first push: every CTA is running)
    assert src.count("map_shared_rank") == rounds
    assert src.count("cluster_sync") == rounds + 1
    assert f"& {cluster - 1})" in src or cluster == 1  # the CTA's rank in its cluster
    # one shared array: the storage planner cannot overlap the partials other CTAs write
    assert src.count("extern __shared__") == 1 and "scratch" in src


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 200), n=st.integers(1, 1 << 20),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_cluster_plan_covers_the_row_within_the_budget(rows, n, dtype):
    plan = norm.cluster_plan(rows, n, dtype)
    if plan is None:
        return
    cluster, threads, vec, per = plan
    item = norm._ITEMSIZE[dtype]
    assert cluster in (2, 4, 8) and rows * cluster <= norm.FEW_ROWS
    assert n // cluster >= norm._MIN_CLUSTER_SHARE
    assert n % vec == 0 and vec * item <= 16
    share = threads * per * vec
    assert cluster * share >= n > cluster * threads * (per - 1) * vec  # no empty access
    assert per * vec * item <= norm._HELD_BYTES_PER_THREAD
    assert threads % 32 == 0 and threads & (threads - 1) == 0 and threads <= 1024


def test_cluster_kernel_states_its_region_and_wins_where_the_register_kernel_claims():
    import torch

    def spec(rows, n):
        return norm.RowNormSpec(device=torch.device("cuda", 0), kind=norm.RowNormKind.RMS,
                                rows=rows, n=n, dtype="bfloat16", eps=1e-6, has_weight=True,
                                has_bias=False)

    k = norm.RowNormClusterKernel
    assert k.region_refusal(spec(8, 131072)) is None
    assert k.region_refusal(spec(132, 131072)) == (
        "132 rows of 131072 x bfloat16 do not split over a cluster (at least 2048 elements a "
        "CTA, rows x 2 within 132, at most 128 bytes a thread)")
    assert k.region_refusal(spec(64, 131072)) == (
        "64 rows of 131072 x bfloat16 split over 2 CTAs: the split serves rows of at least "
        "128 KiB over at least 4 CTAs")
    assert k.region_refusal(spec(8, 16384)) == (
        "8 rows of 16384 x bfloat16 split over 8 CTAs: the split serves rows of at least "
        "128 KiB over at least 4 CTAs")
    assert norm.RowNormRegisterKernel in k.preferred_over
    assert k.supported_archs == frozenset({(9, 0)})
    # the row count picks the cluster, so it is part of the built program's identity
    assert k.identity(spec(8, 131072)) != k.identity(spec(64, 131072))
    assert k.identity(spec(9, 131072)) == k.identity(spec(16, 131072))


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 200), n=st.integers(1, 1 << 20), cluster=st.sampled_from([2, 4, 8]),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_a_given_split_is_taken_at_any_row_count(rows, n, cluster, dtype):
    """The sweep's split: that cluster whatever the row count, two CTAs an SM's worth of
    threads at most where the CTAs outnumber the SMs, the row covered within the budget."""
    plan = norm.cluster_plan(rows, n, dtype, cluster)
    if n // cluster < norm._MIN_CLUSTER_SHARE:
        assert plan is None
        return
    cap = norm._MAX_THREADS if rows * cluster <= norm.FEW_ROWS else norm._MAX_THREADS // 2
    vec = norm._vec(n, dtype)
    accesses = -(-n // vec)  # in a row
    share = -(-accesses // cluster)  # a CTA's
    if plan is None:  # only a share too wide for the threads to hold
        assert -(-share // cap) * vec * norm._ITEMSIZE[dtype] > norm._HELD_BYTES_PER_THREAD
        return
    got, threads, vec, per = plan
    assert got == cluster
    assert threads <= cap
    assert per * vec * norm._ITEMSIZE[dtype] <= norm._HELD_BYTES_PER_THREAD
    assert cluster * threads * per * vec >= n
    assert norm.cluster_plan(rows, n, dtype, 3) is None  # not a power of two


# --- the split kernel: few RMS rows of 256-512 KiB or more, two programs --------------------


@needs_nvcc
@pytest.mark.parametrize(("rows", "n", "dtype", "weight"), [
    pytest.param(33, 262144, "bfloat16", True, id="exact-shares"),
    pytest.param(48, 100000, "float16", True, id="predicated-last-share"),
    pytest.param(16, 131073, "bfloat16", False, id="scalar-accesses-no-weight"),
    pytest.param(20, 65536, "float32", True, id="float32"),
    pytest.param(1, 1048576, "bfloat16", True, id="one-row-128-ctas"),
])
def test_split_kernel_compiles_for_sm90a(rows, n, dtype, weight):
    plan = norm.split_plan(rows, n, dtype)
    splits, threads, vec, per = plan
    first, second = (norm.build_split_kernel(n, dtype, 1e-6, weight, part, "sm_90a", plan)
                     .get_kernel_source() for part in ("partial", "scale"))
    for src in (first, second):
        assert f"__launch_bounds__({threads}" in src
        wide = "uint4" in src or "*(float4*)(X" in src  # the row's 16-byte accesses
        assert wide == (vec * norm._ITEMSIZE[dtype] == 16)
    # one float32 partial a (row, CTA), written by one thread; the scale adds all of a row's
    assert f"* (int64_t){splits}) + ((int64_t)((int)blockIdx.x)))] = acc[0]" in first
    # read in 16-byte vectors (four a load) and added in one order
    assert "*(float4*)(part + (j * 4)) = *(float4*)(P + " in second
    assert f"for (int j_1 = 0; j_1 < {splits}; ++j_1)" in second and "rsqrtf" in second
    assert ("const bfloat16_t* __restrict__ W" in second or
            "const half_t* __restrict__ W" in second or
            "const float* __restrict__ W" in second) == weight


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 200), n=st.integers(1, 1 << 20),
       splits=st.sampled_from([None, *norm.SPLITS]),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_split_plan_covers_the_row_within_the_budget(rows, n, splits, dtype):
    plan = norm.split_plan(rows, n, dtype, splits)
    if rows >= norm.FEW_ROWS:
        assert plan is None
        return
    if plan is None:  # a share under the minimum, or too wide for the threads to hold
        vec = norm._vec(n, dtype)
        for s in [splits] if splits else norm.SPLITS:
            share = -(-(n // vec) // s)
            assert (share * vec < norm._MIN_CLUSTER_SHARE or
                    -(-share // 512) * vec * norm._ITEMSIZE[dtype] > norm._HELD_BYTES_PER_THREAD)
        return
    got, threads, vec, per = plan
    assert got in norm.SPLITS and (splits is None or got == splits)
    assert n % vec == 0 and vec * norm._ITEMSIZE[dtype] <= 16
    assert threads % 32 == 0 and threads <= 512
    assert per * vec * norm._ITEMSIZE[dtype] <= norm._HELD_BYTES_PER_THREAD
    share = -(-(n // vec) // got)
    assert threads * per >= share and got * share * vec >= n
    assert share * vec >= norm._MIN_CLUSTER_SHARE
    if splits is None:  # a split that fits, over 32 CTAs a row only where the sweep had it
        fits = [s for s in norm.SPLITS if norm.split_plan(rows, n, dtype, s) is not None]
        assert got in fits
        one_or_two_wide = rows <= 2 and n * norm._ITEMSIZE[dtype] >= 1 << 20
        assert got <= 32 or (one_or_two_wide and got == 64) or min(fits) > 32


# the default split at the H200 sweep's shapes (benchmarks/results/norm_few_rows_wide-cuda0.txt,
# bf16, TB/s of the split taken): 32 from 1 to 16 rows, 16 from 33 rows where it fits, 64 for
# one or two rows of 1 MiB and more
@pytest.mark.parametrize(("rows", "n", "splits"), [
    (1, 262144, 32),  # 0.29, the row's best
    (8, 262144, 32),  # 1.69, the best
    (16, 262144, 32),  # 2.52, tied with 16
    (33, 262144, 16),  # 3.06, tied with 32
    (64, 524288, 16),  # 2.38 (32: 2.42)
    (1, 524288, 64),  # 0.53 (32: 0.49)
    (2, 1048576, 64),  # 1.54 (32: 1.46)
    (4, 1048576, 32),  # 2.26 (64: 2.28)
    (33, 1048576, 32),  # 16 does not fit: 2.33
])
def test_the_default_split_at_the_sweeps_shapes(rows, n, splits):
    assert norm.split_plan(rows, n, "bfloat16")[0] == splits


def test_split_kernel_states_its_region_and_wins_where_it_serves():
    import torch

    def spec(rows, n, kind=norm.RowNormKind.RMS, dtype="bfloat16"):
        return norm.RowNormSpec(device=torch.device("cuda", 0), kind=kind, rows=rows, n=n,
                                dtype=dtype, eps=1e-6, has_weight=True,
                                has_bias=kind is norm.RowNormKind.LAYER)

    k = norm.RowNormSplitKernel
    # 16-64 rows of 256 KiB; 1-64 rows of 512 KiB, also past the L2 (33 x 1 MiB, 64 x 2 MiB)
    for rows, n in ((16, 131072), (33, 131072), (64, 262144), (48, 65536), (1, 262144),
                    (8, 262144), (4, 1048576), (33, 524288), (64, 1048576)):
        dtype = "float32" if n == 65536 else "bfloat16"
        assert k.region_refusal(spec(rows, n, dtype=dtype)) is None, (rows, n)
    assert k.region_refusal(spec(96, 131072)) == (
        "96 rows of 131072 x bfloat16: the split serves at most 64 rows of at least 512 KiB, "
        "or of 256 KiB from 16 rows on")
    assert k.region_refusal(spec(65, 1048576)) is not None
    assert k.region_refusal(spec(8, 131072)) is not None  # 256 KiB rows under 16: the cluster's
    assert k.region_refusal(spec(15, 262143)) is not None
    assert k.region_refusal(spec(33, 65536)) is not None  # 128 KiB rows: the cluster's
    assert k.region_refusal(spec(33, 131072, norm.RowNormKind.LAYER)) == (
        "splits RMS rows without a residual, not layer")
    assert k.region_refusal(spec(33, 131072, norm.RowNormKind.ADD_RMS)) == (
        "splits RMS rows without a residual, not add_rms")
    assert set(k.preferred_over) == {norm.RowNormClusterKernel, norm.RowNormRegisterKernel}
    assert k.identity(spec(16, 131072)) != k.identity(spec(64, 131072))  # 64 and 16 CTAs
