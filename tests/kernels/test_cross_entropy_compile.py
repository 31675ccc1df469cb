"""The cross-entropy kernels lower and compile for sm_90 on a machine without a GPU.

Each compiled configuration stands for one code path of the generated programs (why it exists
is on its line); the launch plans are checked over the whole input space without compiling.
"""

import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import cross_entropy as C

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")

PLAIN = (-100, 0.0, 0.0, None)
EVERY = (-1, 0.1, 1e-4, 30.0)  # smoothing, z-loss and softcap, another ignore_index

ROWS = [
    # (classes, dtype, options, grad, per_row_scale)
    pytest.param(128256, "bfloat16", PLAIN, False, False, id="loss-llama3-16B"),
    pytest.param(7, "float32", PLAIN, False, False, id="loss-narrower-than-a-warp"),
    pytest.param(4097, "bfloat16", EVERY, True, True, id="grad-odd-per-row-scale"),
]


@needs_nvcc
@pytest.mark.parametrize(("classes", "dtype", "options", "grad", "per_row"), ROWS)
def test_rows_program_compiles_for_sm90(classes, dtype, options, grad, per_row):
    src = C.build_rows_kernel(classes, dtype, options, grad, per_row, 132,
                              "sm_90").get_kernel_source()
    threads, vec, _, ctas = C.rows_plan(classes, dtype, grad)
    assert f"__launch_bounds__({threads}" in src
    if vec * C._ITEMSIZE[dtype] == 16:
        assert "uint4" in src  # 16-byte accesses where the row allows them
    assert "CUDART_NAN_F" in src  # a target outside [0, V) gives NaN
    assert ("tanhf" in src) == (options[3] is not None)
    assert (f"/ {ctas})" in src) == grad  # the persistent row loop
    if threads > 32:
        assert "__syncthreads" in src  # the cross-warp merge


@needs_nvcc
def test_a_wide_rows_gradient_stages_its_first_chunks_in_shared_memory():
    """At a vocabulary whose rows in flight outgrow the L2 the plans' gradient program keeps
    its first chunks in shared memory for the second pass (three 32 KB chunks a 512-thread CTA
    at 128256 bfloat16), and a narrow one keeps none."""
    threads, vec, per, ctas = C.rows_plan(128256, "bfloat16", True, 132)
    assert C.staged_chunks(128256, "bfloat16", threads, vec, per, ctas, 132) == 3
    wide = C.build_rows_kernel(128256, "bfloat16", PLAIN, True, False, 132, "sm_90",
                               with_loss=True).get_kernel_source()
    unstaged = C.compile_program(C.rows_program(128256, "bfloat16", PLAIN, True, False, threads,
                                                vec, per, ctas, True, 0),
                                 "sm_90").get_kernel_source()
    # the staged chunks are written into and read back from shared memory
    assert wide.count("buf_dyn_shmem") > unstaged.count("buf_dyn_shmem")
    narrow = C.rows_plan(32000, "bfloat16", True, 132)
    assert C.staged_chunks(32000, "bfloat16", *narrow, 132) == 0


@needs_nvcc
def test_kept_rows_program_compiles_for_sm90():
    """The gradient program that also writes each row's loss (the kept gradient's): thread 0
    reads the target's logit before the merge's barrier, the loss is written between the
    passes, every option compiled in."""
    src = C.build_rows_kernel(4097, "bfloat16", EVERY, True, False, 132, "sm_90",
                              with_loss=True).get_kernel_source()
    assert "float* __restrict__ L" in src and "L[" in src
    assert src.index("xt[0] = ((float)") < src.index("__syncthreads") < src.index("L[")
    ctas = C.rows_plan(4097, "bfloat16", True, 132)[3]  # the persistent grid's stride
    assert f"/ {ctas})" in src and "tanhf" in src


@needs_nvcc
@pytest.mark.parametrize(("classes", "dtype"), [(128256, "bfloat16"), (7, "float32")],
                         ids=["llama3-16B", "odd-fp32"])
def test_scale_program_compiles_for_sm90(classes, dtype):
    threads, vec, ctas = C.scale_plan(classes, dtype)
    src = C.build_scale_kernel(classes, dtype, 132, "sm_90").get_kernel_source()
    assert f"__launch_bounds__({threads}" in src and f"/ {ctas})" in src
    assert "!= 0x1p+0f" in src  # the early exit for a scale of exactly 1
    assert ("uint4" in src) == (vec * C._ITEMSIZE[dtype] == 16)


def test_with_loss_is_the_gradient_scaled_by_one_value():
    with pytest.raises(ValueError) as info:
        C.rows_program(7, "float32", PLAIN, True, True, 32, 1, 2, 132, with_loss=True)
    assert str(info.value) == ("rows_program: with_loss is the gradient scaled by G[0] (grad, "
                               "not per_row_scale), got grad=True, per_row_scale=True")


@settings(max_examples=200, deadline=None)
@given(classes=st.integers(1, 1 << 20), dtype=st.sampled_from(sorted(C._DTYPES)),
       sms=st.sampled_from([108, 132, 144]))
def test_scale_plan(classes, dtype, sms):
    threads, vec, ctas = C.scale_plan(classes, dtype, sms)
    assert classes % vec == 0 and vec * C._ITEMSIZE[dtype] <= 16
    assert 32 <= threads <= 512 and threads & (threads - 1) == 0
    assert threads == 512 or threads * vec >= classes  # a narrow row in one step
    assert ctas * threads == sms * 2048


@needs_nvcc
@pytest.mark.parametrize(("mean", "grad"), [(True, False), (True, True)],
                         ids=["loss-mean", "grad-mean-scale"])
def test_finish_program_compiles_for_sm90(mean, grad):
    src = C.build_finish_kernel(-100, mean, grad, "sm_90").get_kernel_source()
    assert "__launch_bounds__(1024" in src
    assert ("/ acc[1]" in src) == mean


@settings(max_examples=300, deadline=None)
@given(classes=st.integers(1, 1 << 20), dtype=st.sampled_from(sorted(C._DTYPES)),
       grad=st.booleans(), sms=st.sampled_from([108, 132, 144]))
def test_rows_plan(classes, dtype, grad, sms):
    threads, vec, per, ctas = C.rows_plan(classes, dtype, grad, sms)
    item = C._ITEMSIZE[dtype]
    assert classes % vec == 0 and vec * item <= 16  # aligned accesses on every row
    assert 32 <= threads <= 512 and threads & (threads - 1) == 0 and per == 4
    accesses = -(-classes // vec)
    steps = C._GRAD_STEPS if grad else 1  # the gradient's CTA walks a row in about 4 steps
    want = 1 << max(0, (-(-accesses // (per * steps)) - 1).bit_length())  # a power of two >=
    assert threads == max(32, min(512, want))
    if not grad:
        assert ctas == 0
        return
    per_sm = ctas // sms
    assert ctas % sms == 0 and per_sm * threads == 1024  # every CTA the SMs hold at once
    # the staged chunks: only where the rows in flight outgrow the L2, within the shared
    # memory the SM's CTAs give them, never more than the row's
    staged = C.staged_chunks(classes, dtype, threads, vec, per, ctas, sms)
    item = C._ITEMSIZE[dtype]
    chunk = threads * vec * per
    if ctas * classes * item <= C._L2_BYTES:
        assert staged == 0
    else:
        assert 1 <= staged <= -(-classes // chunk)
        assert per_sm * staged * chunk * item <= C._STAGE_BYTES_PER_SM
        assert staged == -(-classes // chunk) or \
            per_sm * (staged + 1) * chunk * item > C._STAGE_BYTES_PER_SM


def test_spec_refuses_what_the_kernels_do_not_serve():
    ok = dict(device="cuda", rows=4, classes=7, dtype="bfloat16", ignore_index=-100,
              reduction=C.Reduction.MEAN, label_smoothing=0.0, lse_square_scale=0.0,
              softcap=None)
    C.CrossEntropySpec(**ok)
    for bad, msg in [({"dtype": "float64"}, "CrossEntropySpec.dtype must be one of bfloat16, "
                                            "float16, float32, got 'float64'"),
                     ({"classes": 0}, "CrossEntropySpec.classes must be > 0, got 0"),
                     ({"label_smoothing": 1.5}, "CrossEntropySpec.label_smoothing must be in "
                                                "[0, 1], got 1.5"),
                     ({"softcap": 0.0}, "CrossEntropySpec.softcap must be > 0 or None, got 0.0")]:
        with pytest.raises(ValueError) as info:
            C.CrossEntropySpec(**{**ok, **bad})
        assert str(info.value) == msg
    with pytest.raises(TypeError, match="CrossEntropySpec.reduction must be a Reduction, got "
                                        "'mean'"):
        C.CrossEntropySpec(**{**ok, "reduction": "mean"})


# --- the cluster gradient program: a row held on chip over a thread-block cluster ------------


@needs_nvcc
@pytest.mark.parametrize(("classes", "dtype", "options", "per_row", "with_loss"), [
    pytest.param(128256, "bfloat16", (-100, 0.0, 0.0, None), False, True, id="bar-kept"),
    pytest.param(151936, "bfloat16", (-100, 0.1, 1e-4, 30.0), True, False,
                 id="every-option-per-row"),
    pytest.param(128257, "float32", (-1, 0.0, 0.0, None), False, False, id="odd-scalar"),
])
def test_cluster_rows_program_compiles_for_sm90a(classes, dtype, options, per_row, with_loss):
    cluster, threads, _vec, _per = C.cluster_plan(classes, dtype)
    src = C.build_cluster_rows_kernel(classes, dtype, options, per_row, "sm_90a",
                                      with_loss).get_kernel_source()
    assert f"__launch_bounds__({threads}" in src
    # the triples pushed into every CTA of the cluster, a barrier before the first push (all
    # running) and one before they are read
    assert src.count("map_shared_rank") == 1 and src.count("cluster_sync") == 2
    assert f"for (int d = 0; d < {cluster}; ++d)" in src
    # a cluster's rows in turn, the next one's read into the second register set, the
    # triples' two slots by the row's parity
    assert f"for (int j = 0; j < {C._CLUSTER_ROWS}; ++j)" in src
    assert "ahead[" in src and "(j & 1)" in src
    assert src.count("extern __shared__") == 1  # one array: the parts cannot overlap
    assert ("tanhf" in src or "tanh" in src) == (options[3] is not None)


@pytest.mark.parametrize("name", ["rows", "held"])
@pytest.mark.parametrize("value", [0, -3, 2.0, True])
def test_cluster_program_refuses_a_count_that_is_not_a_positive_int(name, value):
    with pytest.raises(ValueError, match=rf"{name}: the cluster program takes a positive int, "
                                         rf"not {value!r}"):
        C.build_cluster_rows_kernel(128256, "bfloat16", (-100, 0.0, 0.0, None), False,
                                    "sm_90a", **{name: value})


@needs_nvcc
def test_cluster_program_pushes_asynchronously_on_request():
    """``async_push``: thread 0 copies the CTA's triple into every CTA by a bulk copy onto the
    receiver's mbarrier of the row's parity, each CTA waits on its own, and no cluster barrier
    runs a row: one after the barriers' init and one at the end. The parts of the shared array
    are 16-byte units."""
    src = C.build_cluster_rows_kernel(128256, "bfloat16", (-100, 0.0, 0.0, None), False,
                                      "sm_90a", True, async_push=True).get_kernel_source()
    loop = src[src.index("for (int j = 0;"):]
    assert "tl::tma_store_cluster(" in loop and "(uint32_t)((uint)16)" in loop
    assert ".wait(" in loop and "bars[(j & 1)]" in loop
    assert src.count("cluster_sync") == 2 and loop.count("cluster_sync") == 1
    assert "map_shared_rank" not in src


@needs_nvcc
def test_cluster_program_holds_more_of_a_row_a_thread_on_request():
    """``held`` 128: 256 threads of 8 x 8 bfloat16 classes each over 8 CTAs (two CTAs an SM by
    their registers), against 512 of 4 x 8 at the default."""
    assert C.cluster_plan(128256, "bfloat16") == (8, 512, 8, 4)
    assert C.cluster_plan(128256, "bfloat16", 128) == (8, 256, 8, 8)
    src = C.build_cluster_rows_kernel(128256, "bfloat16", (-100, 0.0, 0.0, None), False,
                                      "sm_90a", held=128).get_kernel_source()
    assert "__launch_bounds__(256" in src


@settings(max_examples=300, deadline=None)
@given(classes=st.integers(1, 600_000), dtype=st.sampled_from(["float16", "bfloat16",
                                                               "float32"]))
def test_cluster_plan_holds_the_row_within_the_budget(classes, dtype):
    plan = C.cluster_plan(classes, dtype)
    item = C._ITEMSIZE[dtype]
    if plan is None:
        return
    cluster, threads, vec, per = plan
    assert classes * item * C.DEFAULT_SMS > C._L2_ROW_BUDGET  # only rows past the L2's grid
    assert cluster in (2, 4, 8) and classes // cluster >= C._MIN_CLUSTER_SHARE
    assert classes % vec == 0 and vec * item <= 16
    share = threads * per * vec
    assert cluster * share >= classes > cluster * threads * (per - 1) * vec  # no empty access
    assert per * vec * item <= C._CLUSTER_HELD_BYTES and threads <= 1024


def test_cluster_kernels_state_their_region_and_win_where_they_apply():
    import torch

    def spec(classes, kept=True, reduction=C.Reduction.MEAN):
        return C.CrossEntropySpec(device=torch.device("cuda", 0), rows=8192, classes=classes,
                                  dtype="bfloat16", ignore_index=-100, reduction=reduction,
                                  label_smoothing=0.0, lse_square_scale=0.0, softcap=None,
                                  kept=kept)

    fwd, bwd = C.CrossEntropyClusterFwdKernel, C.CrossEntropyClusterBwdKernel
    assert fwd.region_refusal(spec(128256)) is None and bwd.region_refusal(spec(128256)) is None
    assert fwd.region_refusal(spec(128256, kept=False)) == (
        "no kept gradient: the one-pass loss program reads each row once already")
    assert bwd.region_refusal(spec(32000)) == (
        "rows of 32000 bfloat16 classes: a grid of them stays in L2 (the two-pass program "
        "reads each from HBM once), or a CTA's share exceeds 64 bytes a thread")
    assert fwd.preferred_over == (C.CrossEntropyFwdKernel,) and not fwd.general
    assert bwd.preferred_over == (C.CrossEntropyBwdKernel,) and not bwd.general
    assert fwd.supported_archs == bwd.supported_archs == frozenset({(9, 0)})


@needs_nvcc
def test_the_staged_gradient_program_compiles_for_sm90():
    """The gradient program with the row's first chunks kept in shared memory: one dynamic
    shared buffer of those chunks; staged 0 leaves the program as it was."""
    opts = (-100, 0.0, 0.0, None)
    plain = C.rows_program(128256, "bfloat16", opts, True, False, 512, 8, 4, 264,
                           with_loss=True)
    staged = C.rows_program(128256, "bfloat16", opts, True, False, 512, 8, 4, 264,
                            with_loss=True, staged=3)
    assert "kept" in staged.script() and "kept" not in plain.script()
    src = C.compile_program(staged, "sm_90").get_kernel_source()
    assert "buf_dyn_shmem" in src


@pytest.mark.parametrize(("grad", "staged"), [(False, 1), (True, 9), (True, -1)])
def test_staged_is_a_gradient_programs_count_of_its_chunks(grad, staged):
    with pytest.raises(ValueError, match=r"rows_program: staged is a gradient program's count "
                                         r"of a row's 8 chunks, got staged="):
        C.rows_program(128256, "bfloat16", (-100, 0.0, 0.0, None), grad, False, 512, 8, 4,
                       264 if grad else 0, staged=staged)


sys.path.append(str(Path(__file__).parent))  # the SASS helpers, beside this file
from _sass import functions, loops, memory, needs_cuobjdump, sass  # noqa: E402


@needs_cuobjdump
def test_the_kept_gradients_passes_in_sass(tmp_path):
    """The bar's program (8192 x 128256 bfloat16, the kept gradient with its loss, three
    staged chunks): both passes read and write 16-byte vectors and touch no local memory, and
    the gradient's pass tests the target's column once an access (``tcol - col`` below the
    vector, unsigned: one ``LOP3`` of ``0xfffffff8``), not once an element (three
    instructions an element of the second pass before)."""
    threads, vec, per, ctas = C.rows_plan(128256, "bfloat16", True, 132)
    staged = C.staged_chunks(128256, "bfloat16", threads, vec, per, ctas, 132)
    prog = C.rows_program(128256, "bfloat16", PLAIN, True, False, threads, vec, per, ctas,
                          True, staged)
    src = C.compile_program(prog, "sm_90a").get_kernel_source()
    (ins,) = functions(sass(src, tmp_path, "ce")).values()
    found = memory(ins)
    assert not any(op.startswith(("LDL", "STL")) for op in found), found
    assert {op for op in found if op.startswith("STG")} <= {"STG.E.128", "STG.E"}, found
    # the second pass: the innermost loop that writes the gradient
    second = next(body for body in loops(ins) if memory(body)["STG.E.128"] == per)
    assert {op for op in memory(second) if op.startswith("LDG")} == {"LDG.E.128.CONSTANT"}
    tests = [t for _, t in second if t.startswith("LOP3.LUT P") and "0xfffffff8" in t]
    assert len(tests) == per, tests
