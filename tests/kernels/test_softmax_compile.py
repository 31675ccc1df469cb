"""The softmax kernels lower and compile for sm_90 on a machine without a GPU, and their launch
plans and regions hold over the whole input space (checked without compiling).

Each compiled configuration stands for one code path of a generated program (why it exists
is on its line); the whole set compiles in about 30 s on one core.
"""

import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import softmax as S

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")

L = S.Layout
DTYPES = ("float16", "bfloat16", "float32")


def _spec(cls, kind, outer, r, inner, dtype):
    import torch

    return cls(device=torch.device("cuda", 0), kind=S.SoftmaxKind(kind), outer=outer, r=r,
               inner=inner, dtype=dtype)


FWD = [
    # (layout, kind, outer, R, inner, dtype)
    pytest.param(L.REGISTER, "softmax", 32768, 8192, 1, "bfloat16", id="register-16B-4-warps"),
    pytest.param(L.REGISTER, "log_softmax", 16384, 1024, 1, "bfloat16", id="register-half-warp-a-row"),
    pytest.param(L.REGISTER, "softmax", 16384, 4097, 1, "bfloat16", id="register-scalar-predicated"),
    pytest.param(L.REGISTER, "logsumexp", 3, 7, 1, "float32", id="register-lse-thread-a-row"),
    pytest.param(L.LOOPED, "softmax", 4096, 128256, 1, "bfloat16", id="looped-staged-row"),
    pytest.param(L.LOOPED, "softmax", 4096, 32000, 1, "bfloat16", id="looped-three-ctas-an-sm"),
    pytest.param(L.LOOPED, "logsumexp", 64, 262144, 1, "float32", id="looped-lse-one-pass"),
    pytest.param(L.STRIDED, "softmax", 1, 1024, 4096, "bfloat16", id="strided-narrowed-vector"),
    pytest.param(L.STRIDED, "logsumexp", 8, 3, 7, "float16", id="strided-lse-predicated"),
]
BWD = [
    pytest.param(L.REGISTER, "softmax", 32768, 8192, 1, "bfloat16", id="register-two-held"),
    pytest.param(L.LOOPED, "log_softmax", 4096, 128256, 1, "bfloat16", id="looped"),
    pytest.param(L.STRIDED, "softmax", 8, 512, 1024, "float16", id="strided"),
]


@needs_nvcc
@pytest.mark.parametrize(("layout", "kind", "outer", "r", "inner", "dtype"), FWD)
def test_forward_programs_compile_for_sm90(layout, kind, outer, r, inner, dtype):
    spec = _spec(S.SoftmaxSpec, kind, outer, r, inner, dtype)
    plan = S.plan_of(layout, spec)
    src = S.build_fwd(layout, kind, r, inner if layout is L.STRIDED else 1, dtype, plan,
                      "sm_90").get_kernel_source()
    threads = plan[0] * plan[1] if layout is not L.LOOPED else plan[0]
    assert f"__launch_bounds__({threads}" in src
    vec = plan[2]
    if vec * S._ITEMSIZE[dtype] == 16 and dtype != "float32":
        assert "uint4" in src  # 16-byte accesses where the layout allows them
    keep = layout is L.REGISTER and plan[4]
    assert keep == (kind == "softmax" and layout is L.REGISTER and plan[0] <= 128)
    assert ("log2f" in src) != keep  # the lse, unless softmax scales its kept exponentials
    if kind == "softmax" and layout is L.REGISTER:  # one exponential an element when kept
        assert src.count("exp2f(") == (1 if keep else 2)
    if layout is L.REGISTER and plan[0] > 32 or layout is not L.REGISTER:
        assert "__syncthreads" in src  # the reduction across warps
    if layout is not L.STRIDED and vec > 1:  # a row's lse: one scalar store; rows: vectors
        assert ("Y[" in src) == (kind == "logsumexp")


@needs_nvcc
@pytest.mark.parametrize(("layout", "kind", "outer", "r", "inner", "dtype"), BWD)
def test_gradient_programs_compile_for_sm90(layout, kind, outer, r, inner, dtype):
    spec = _spec(S.SoftmaxBwdSpec, kind, outer, r, inner, dtype)
    plan = S.plan_of(layout, spec)
    src = S.build_bwd(layout, kind, r, inner if layout is L.STRIDED else 1, dtype, plan,
                      "sm_90").get_kernel_source()
    assert "main_kernel" in src
    assert ("exp2f" in src) == (kind == "log_softmax")  # exp(y) only in log-softmax's


@needs_nvcc
@pytest.mark.parametrize(("kind", "n", "dtype"), [
    pytest.param("softmax", 128256, "bfloat16", id="bf16-whole-row-on-chip"),
    pytest.param("log_softmax", 65537, "bfloat16", id="scalar-accesses-17-chunks"),
])
def test_staged_looped_programs_keep_their_chunks_in_shared_memory(kind, n, dtype):
    plan = S.looped_staged_plan(S.SoftmaxKind(kind), n, dtype)
    threads, vec, per, hold, stage = plan
    src = S.build_fwd(L.LOOPED, kind, n, 1, dtype, plan, "sm_90").get_kernel_source()
    assert "staged" in src and src.count("__syncthreads") == 1  # the staging needs no barrier
    if vec == 8:  # the staged chunks are written and read back as 16-byte vectors
        assert src.count("*(uint4*)(((bfloat16_t*)staged)") == 2  # one store, one load
        assert src.count("= *(uint4*)(((bfloat16_t*)staged)") == 1
    old = S.build_fwd(L.LOOPED, kind, n, 1, dtype, S.looped_plan(n, dtype), "sm_90")
    assert "staged" not in old.get_kernel_source()
    early = S.build_fwd(L.LOOPED, kind, n, 1, dtype, (*plan, True), "sm_90").get_kernel_source()
    # the copies in an unrolled loop ahead of the head's arithmetic, and pass 1 reading the
    # chunks back from shared memory before the CTA's merge (one store, one load)
    lines = early.splitlines()
    uses = [i for i, line in enumerate(lines) if "staged)" in line]
    first = {w: next(i for i, line in enumerate(lines) if w in line)
             for w in ("exp2f", "__shfl_xor_sync")}
    assert uses[0] < first["exp2f"] and sum(i < first["__shfl_xor_sync"] for i in uses) == 2
    loop = max(i for i in range(uses[0]) if lines[i].lstrip().startswith("for (int step"))
    assert "#pragma unroll" in lines[loop - 1]


@needs_nvcc
def test_register_program_caps_its_registers_for_resident_ctas():
    base = (*S.register_plan(32000, "bfloat16"), False)
    src = S.build_fwd(L.REGISTER, "softmax", 32000, 1, "bfloat16", (*base, 2),
                      "sm_90").get_kernel_source()
    assert "__launch_bounds__(512, 2)" in src
    src = S.build_fwd(L.REGISTER, "softmax", 32000, 1, "bfloat16", base,
                      "sm_90").get_kernel_source()
    assert "__launch_bounds__(512, 1)" in src
    src = S.build_fwd(L.LOOPED, "softmax", 32000, 1, "bfloat16", (512, 8, 2, 4, 2, True, 2),
                      "sm_90").get_kernel_source()
    assert "__launch_bounds__(512, 2)" in src and "staged" in src


def test_looped_program_refuses_stages_it_has_no_use_for():
    with pytest.raises(ValueError, match=r"looped_fwd_program: 1 staged chunks for a logsumexp "
                                         r"row of 128256 with 3 chunks past the head \(the lse "
                                         r"has no second pass\)"):
        S.looped_fwd_program("logsumexp", 128256, "bfloat16", 1024, 8, 4, 4, 1)
    with pytest.raises(ValueError, match=r"4 staged chunks for a softmax row of 128256 with 3"):
        S.looped_fwd_program("softmax", 128256, "bfloat16", 1024, 8, 4, 4, 4)
    with pytest.raises(ValueError, match="looped_fwd_program: early copies staged chunks; "
                                         "the plan stages none"):
        S.looped_fwd_program("softmax", 128256, "bfloat16", 1024, 8, 4, 4, 0, True)


@needs_nvcc
@pytest.mark.parametrize(("layout", "r", "inner", "dtype"), [
    pytest.param(L.ROWS, 128256, 1, "bfloat16", id="rows-walk-in-steps"),
    pytest.param(L.STRIDED, 512, 1024, "float32", id="strided"),
])
def test_logsumexp_gradient_programs_compile_for_sm90(layout, r, inner, dtype):
    spec = _spec(S.LogSumExpBwdSpec, "logsumexp", 8, r, inner, dtype)
    plan = S.plan_of(layout, spec)
    src = S.build_lse_bwd(layout, "logsumexp", r, inner if layout is L.STRIDED else 1, dtype,
                          plan, "sm_90").get_kernel_source()
    assert "exp2f" in src and "__syncthreads" not in src  # no reduction: no barrier


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 1 << 21), dtype=st.sampled_from(DTYPES))
def test_rows_walk_plan_covers_the_row(n, dtype):
    tpr, rpc, vec, per, steps = S.rows_walk_plan(n, dtype)
    chunk = tpr * per * vec
    assert n % vec == 0 and steps * chunk >= n > (steps - 1) * chunk  # covers, no empty step
    assert steps == 1 or (tpr, rpc) == (1024, 1)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 1 << 19), dtype=st.sampled_from(DTYPES), held=st.sampled_from([1, 2]))
def test_register_plan_covers_the_row_within_the_register_budget(n, dtype, held):
    plan = S.register_plan(n, dtype, held)
    item = S._ITEMSIZE[dtype]
    if plan is None:  # only rows too wide to hold go to the looped kernel
        assert n * item * held > S._HELD_BYTES_PER_THREAD * S._MAX_REGISTER_THREADS // 2
        return
    tpr, rpc, vec, per = plan
    assert n % vec == 0 and vec * item <= 16
    assert tpr * per * vec >= n > tpr * (per - 1) * vec  # covers the row, no empty access
    assert per * vec * item * held <= S._HELD_BYTES_PER_THREAD
    assert tpr & (tpr - 1) == 0 and tpr <= S._MAX_REGISTER_THREADS
    assert rpc * tpr == S._ROWS_CTA_THREADS if tpr <= 32 else rpc == 1


def test_register_plans_of_the_bars():
    """The plans the bar workloads get (bf16): 8 16-byte accesses a thread where the row
    allows, a half warp a row for 1024 columns, 512 threads for a 32000-word row."""
    assert S.register_plan(8192, "bfloat16") == (128, 1, 8, 8)
    assert S.register_plan(1024, "bfloat16") == (16, 16, 8, 8)
    assert S.register_plan(32000, "bfloat16") == (512, 1, 8, 8)
    assert S.register_plan(128256, "bfloat16") is None
    assert S.register_plan(8192, "bfloat16", 2) == (256, 1, 8, 4)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 1 << 21), dtype=st.sampled_from(DTYPES), held=st.sampled_from([1, 2]))
def test_looped_plan_holds_a_head_of_the_row_within_64_bytes_a_thread(n, dtype, held):
    threads, vec, per, hold = S.looped_plan(n, dtype, held)
    item = S._ITEMSIZE[dtype]
    assert n % vec == 0 and vec * item <= 16 and threads == 1024 and per == 4
    assert hold >= 1 and (hold * vec * item * held <= 64 or hold == 1)
    assert (hold - 1) * threads * vec < n  # every held access starts inside the row


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 1 << 21), dtype=st.sampled_from(DTYPES),
       kind=st.sampled_from(list(S.SoftmaxKind)))
def test_looped_staged_plan_stages_what_fits_shared_memory(n, dtype, kind):
    threads, vec, per, hold, stage = S.looped_staged_plan(kind, n, dtype)
    assert (threads, vec, hold) == (lambda t, v, p, h: (t, v, h))(*S.looped_plan(n, dtype))
    chunk = threads * vec * per
    steps = max(0, -(-(n - threads * vec * hold) // chunk))
    assert per == 2 and 0 <= stage <= steps
    staged = stage * chunk * S._ITEMSIZE[dtype]
    assert staged <= S._STAGED_BYTES and staged + threads // 32 * 8 <= 227 * 1024
    if kind is S.SoftmaxKind.LOGSUMEXP:
        assert stage == 0
    else:  # as many as fit: the next chunk would pass the budget, or none is left
        assert stage == steps or staged + chunk * S._ITEMSIZE[dtype] > S._STAGED_BYTES


def test_staged_plan_of_the_bar_holds_the_whole_row():
    """4096 x 128256 bf16: a 64 KiB head in registers and six 32 KiB chunks staged."""
    assert S.looped_staged_plan(S.SoftmaxKind.SOFTMAX, 128256, "bfloat16") == (1024, 8, 2, 4, 6)
    assert 1024 * 8 * 4 + 6 * 1024 * 8 * 2 >= 128256


@settings(max_examples=200, deadline=None)
@given(outer=st.integers(1, 1 << 16), r=st.integers(1, 1 << 14), inner=st.integers(2, 1 << 16),
       dtype=st.sampled_from(DTYPES))
def test_strided_plan_tiles_the_inner_axis(outer, r, inner, dtype):
    lanes, groups, vec = S.strided_plan(outer, r, inner, dtype)
    assert inner % vec == 0 and vec * S._ITEMSIZE[dtype] <= 16
    assert lanes & (lanes - 1) == 0 and lanes <= 32
    assert lanes * groups <= S._STRIDED_THREADS and groups <= max(1, 2 * r)
    if vec > 1:  # the vector narrows only while the grid is short of CTAs
        assert outer * -(-inner // (lanes * vec)) >= S._STRIDED_MIN_CTAS or \
            vec == S._vec(inner, dtype)


@settings(max_examples=300, deadline=None)
@given(outer=st.integers(0, 1 << 20), r=st.integers(1, 1 << 19), inner=st.integers(1, 1 << 12),
       dtype=st.sampled_from(DTYPES), kind=st.sampled_from(list(S.SoftmaxKind)),
       bwd=st.booleans())
def test_exactly_one_kernel_claims_every_call(outer, r, inner, dtype, kind, bwd):
    if bwd and kind is S.SoftmaxKind.LOGSUMEXP:  # logsumexp's gradient: its own slot
        spec = _spec(S.LogSumExpBwdSpec, kind.value, outer, r, inner, dtype)
        kernels = (S.LogSumExpBwdRowsKernel, S.LogSumExpBwdStridedKernel)
        claim = [k for k in kernels if k.region_refusal(spec) is None]
        assert [k.layout for k in claim] == [L.STRIDED if inner > 1 else L.ROWS]
        return
    if bwd:
        spec = _spec(S.SoftmaxBwdSpec, kind.value, outer, r, inner, dtype)
        kernels = (S.SoftmaxBwdRegisterKernel, S.SoftmaxBwdLoopedKernel,
                   S.SoftmaxBwdStridedKernel)
    else:
        spec = _spec(S.SoftmaxSpec, kind.value, outer, r, inner, dtype)
        kernels = (S.SoftmaxRegisterKernel, S.SoftmaxLoopedKernel, S.SoftmaxStridedKernel)
    claim = [k for k in kernels if k.region_refusal(spec) is None]
    assert len(claim) == 1
    shared = None if bwd else S.shared_sm_plan(kind, r, dtype)
    expected = (L.STRIDED if inner > 1 else
                L.REGISTER if S.register_plan(r, dtype, 2 if bwd else 1) and shared is None
                else L.LOOPED)
    assert claim[0].layout is expected


@settings(max_examples=300, deadline=None)
@given(r=st.integers(1, 1 << 17), dtype=st.sampled_from(DTYPES),
       kind=st.sampled_from(list(S.SoftmaxKind)))
def test_rows_of_512_register_threads_are_held_on_chip_at_three_ctas_an_sm(r, dtype, kind):
    plan = S.shared_sm_plan(kind, r, dtype)
    reg = S.register_plan(r, dtype)
    if plan is None:
        assert kind is S.SoftmaxKind.LOGSUMEXP or reg is None or reg[0] < 512 or \
            S._vec(r, dtype) * S._ITEMSIZE[dtype] < 16
        return
    threads, vec, per, hold, stage, early, ctas = plan
    assert reg[0] == 512 and kind is not S.SoftmaxKind.LOGSUMEXP
    assert (threads, per, hold, early, ctas) == (256, 4, 4, True, 3) and vec == S._vec(r, dtype)
    # the head and the staged chunks hold the whole row, at most 48 KiB staged a CTA
    assert threads * vec * (hold + per * stage) >= r
    assert stage <= 3 and stage * threads * vec * per * S._ITEMSIZE[dtype] <= 48 * 1024
    spec = _spec(S.SoftmaxSpec, kind.value, 64, r, 1, dtype)
    assert S.plan_of(L.LOOPED, spec) == plan
    assert S.SoftmaxRegisterKernel.region_refusal(spec).endswith(
        "the looped kernel holds it on chip at three CTAs an SM")


def test_call_specs_refuse_what_no_kernel_serves():
    with pytest.raises(ValueError, match=r"SoftmaxSpec.dtype must be one of bfloat16, "
                                         r"float16, float32, got 'float64'"):
        _spec(S.SoftmaxSpec, "softmax", 1, 4, 1, "float64")
    with pytest.raises(ValueError, match=r"SoftmaxSpec: the reduced axis \(0\) and the inner "
                                         r"size \(1\) must be at least 1"):
        _spec(S.SoftmaxSpec, "softmax", 1, 0, 1, "float32")
    with pytest.raises(ValueError, match="SoftmaxBwdSpec: the gradient kernels serve SOFTMAX "
                                         "and LOG_SOFTMAX, not LOGSUMEXP"):
        _spec(S.SoftmaxBwdSpec, "logsumexp", 1, 4, 1, "float32")
    with pytest.raises(TypeError, match="SoftmaxSpec.kind must be a SoftmaxKind, got 'softmax'"):
        import torch

        S.SoftmaxSpec(device=torch.device("cuda", 0), kind="softmax", outer=1, r=4, inner=1,
                      dtype="float32")
