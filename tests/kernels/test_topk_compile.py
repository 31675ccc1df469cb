"""The top-k kernel lowers and compiles for sm_90 on a machine without a GPU: one program for
each code path (why it exists is on its line), and what each must show in its source."""

import shutil
import sys
from pathlib import Path

import pytest

from tileops.kernels import topk

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


@needs_nvcc
@pytest.mark.parametrize(("n", "k", "dtype", "largest", "lean"), [
    pytest.param(128256, 50, "bfloat16", True, True, id="vocab-lean-float-filter"),
    pytest.param(128256, 50, "bfloat16", True, False, id="vocab-earlier-plan-key-filter"),
    pytest.param(131072, 1024, "bfloat16", True, True, id="k1024-piece-maxima-large-buffer"),
    pytest.param(7, 2, "float32", False, True, id="tiny-one-warp-32-bit-keys-smallest"),
    pytest.param(4096, 200, "bfloat16", True, True, id="lean-sort-above-threads-bitonic"),
])
def test_topk_compiles_for_sm90(n, k, dtype, largest, lean):
    plan = topk.topk_plan(n, k, dtype, lean)
    threads, vec, _, cap, sort, _ = plan
    src = topk.build_topk(n, k, dtype, largest, "sm_90", plan).get_kernel_source()
    assert f"__launch_bounds__({threads}" in src
    assert "atomicAdd((&(((int*)st)" in src  # the buffer's and the sort array's appends
    assert "__shfl_up_sync" in src  # the bins' scan
    if vec * topk._ITEMSIZE[dtype] == 16:
        assert "uint4" in src
    # the bitonic stages, or (lean, no more entries than threads) each entry put at its rank
    ranked = lean and sort <= threads
    assert (f"for (int a = 1; a < {sort.bit_length()}; ++a)" in src) is not ranked
    assert "(uint)4294967295 -" in src  # the composite key's complemented index
    assert ("isnan(" in src) is lean  # the lean pass compares floats, NaN passing
    assert f"< {cap})" in src  # the buffer's bound on the appends


sys.path.append(str(Path(__file__).parent))  # the SASS helpers, beside this file
from _sass import functions, loops, memory, needs_cuobjdump, opcodes, sass  # noqa: E402


@needs_cuobjdump
def test_the_lean_pass_tests_each_access_whole_in_sass(tmp_path):
    """The bar's program (4096 x 128256 bfloat16, k = 50): the pass's step reads its 8 chunks
    with 16-byte loads, spills nothing, and tests each access as a whole (the magnitudes'
    pairwise maximum, ``VIMNMX*.U16x2``) before any element's test: a branch around every
    element's test and append cost about 12 instructions an element where the access's test
    costs about 12 an access; a candidate's slot is claimed by a shared-memory atomic."""
    n, k = 128256, 50
    plan = topk.topk_plan(n, k, "bfloat16")
    pre = plan[2]
    src = topk.build_topk(n, k, "bfloat16", True, "sm_90a", plan).get_kernel_source()
    (ins,) = functions(sass(src, tmp_path, "topk")).values()
    # the pass: the loop that issues a step's `pre` loads
    step = next(body for body in loops(ins)
                if memory(body)["LDG.E.128.CONSTANT"] == pre and len(body) > 500)
    loads = [op for op in memory(step) if op.startswith("LDG")]
    assert loads == ["LDG.E.128.CONSTANT"], memory(step)
    assert not any(op.startswith(("LDL", "STL")) for op in memory(ins))
    # the counters' slots are claimed by shared-memory atomics, not generic ones
    assert not any(op.startswith("ATOM.") for op in memory(ins)), memory(ins)
    assert memory(step)["ATOMS.ADD"] >= pre
    ops = opcodes(step)
    whole = [i for i, op in enumerate(ops) if op.startswith("VIMNMX") and ".U16x2" in op]
    assert len(whole) >= pre, ops
    # the first access's test comes before any element's float comparison
    assert whole[0] < next(i for i, op in enumerate(ops) if op.startswith("FSETP"))
