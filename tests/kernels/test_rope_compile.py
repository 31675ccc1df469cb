"""The RoPE kernel lowers and compiles for sm_90 on a machine without a GPU.

Each compiled configuration stands for code paths of the generated program (why on its line);
the launch plan is checked over the whole space of head shapes without compiling.
"""

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tileops.kernels import rope as R

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


def spec(**kw):
    base = dict(device=None, style=R.RopeStyle.NEOX, layout=R.RopeLayout.BSHD, heads_q=32,
                heads_k=8, head_dim=128, rotary_dim=128, dtype="bfloat16", pos_dtype=None,
                freq=R.FreqSource.BASE, base=10000.0, mscale=1.0, cache_length=0, switch_at=0,
                inverse=False, inplace=False)
    base.update(kw)
    return R.RopeSpec(**base)


CONFIGS = [
    # the bar: neox, bshd, 16-byte vectors, angles from base in the kernel, no position_ids
    pytest.param(spec(), id="neox-base-bshd"),
    # interleaved in bhsd with int64 positions, a frequency table, a cos/sin cache, half
    # rotation (the pass-through copy) and the transposed rotation of the gradient
    pytest.param(spec(style=R.RopeStyle.INTERLEAVED, layout=R.RopeLayout.BHSD,
                      pos_dtype="int64", rotary_dim=64, freq=R.FreqSource.TABLE,
                      cache_length=4096, inverse=True), id="gptj-table-cache-half-bwd"),
    # LongRoPE's switch on the largest position, in place, odd heads, head_dim 96 (a rotated
    # half of 48: 3 threads a head), float16, an attention factor
    pytest.param(spec(heads_q=7, heads_k=3, head_dim=96, rotary_dim=96, pos_dtype="int64",
                      freq=R.FreqSource.SWITCH, switch_at=4096, mscale=1.19, inplace=True,
                      dtype="float16"), id="switch-inplace-odd-fp16"),
]


@needs_nvcc
@pytest.mark.parametrize("s", CONFIGS)
def test_rope_kernel_compiles_for_sm90(s):
    src = R.build_rope_kernel(s, "sm_90").get_kernel_source()
    vec, tph, groups, _ = R.rope_plan(s.style, s.head_dim, s.rotary_dim, s.dtype,
                                      s.heads_q + s.heads_k)
    assert f"__launch_bounds__({tph * groups}" in src
    if vec * 2 == 16:
        assert "uint4" in src  # 16-byte accesses where the head allows them
    assert ("QO" in src) is not s.inplace  # in place: the inputs are written
    assert "cosf(" in src and "sinf(" in src  # float32 cos/sin of the reduced angle
    assert "floor(" in src  # the float64 reduction to [-pi, pi]
    if s.freq is R.FreqSource.BASE:
        assert "exp(" in src  # inv_freq from base, once a thread
    if s.cache_length:
        assert "AUX" in src
    if s.freq is R.FreqSource.SWITCH:
        # the CTAs' own scan up to SCAN_POSITIONS (one barrier ORs the answers), else MAXP
        assert "MAXP" in src and "__syncthreads_or(" in src
        assert f"(B * S) <= {R.SCAN_POSITIONS})" in src


@given(style=st.sampled_from(list(R.RopeStyle)), half=st.integers(1, 256),
       extra=st.integers(0, 64), dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       heads=st.integers(2, 200))
def test_plan_covers_every_head_shape(style, half, extra, dtype, heads):
    rd = 2 * half
    d = rd + 2 * extra
    vec, tph, groups, passes = R.rope_plan(style, d, rd, dtype, heads)
    span = rd // 2 if style is R.RopeStyle.NEOX else rd
    assert d % vec == 0 and span % vec == 0  # every access is aligned and inside the head
    assert vec * {"float16": 2, "bfloat16": 2, "float32": 4}[dtype] <= 16
    if style is R.RopeStyle.INTERLEAVED:
        assert vec % 2 == 0  # a vector holds whole pairs
    assert tph * vec == span  # the head's threads cover its rotated span exactly once
    assert groups * passes >= heads > groups * (passes - 1)
    assert tph * groups <= max(128, tph)


def test_spec_refuses_bad_fields():
    with pytest.raises(ValueError, match=r"RopeSpec.rotary_dim must be even and in \(0, "
                                         r"head_dim = 128\], got 130"):
        spec(rotary_dim=130)
    with pytest.raises(ValueError, match="RopeSpec.dtype must be one of"):
        spec(dtype="float64")
    with pytest.raises(TypeError, match="RopeSpec.style must be a RopeStyle, got 'neox'"):
        spec(style="neox")
    with pytest.raises(ValueError, match="FreqSource.SWITCH reads the largest position"):
        spec(freq=R.FreqSource.SWITCH)
    with pytest.raises(ValueError, match="RopeSpec.pos_dtype must be one of int32, int64 or "
                                         "None, got 'int16'"):
        spec(pos_dtype="int16")


def test_aux_layout():
    assert R.aux_layout(spec()) == (0, 0, 0)
    assert R.aux_layout(spec(freq=R.FreqSource.TABLE, cache_length=10)) == (1, 64, 64 + 1280)
    assert R.aux_layout(spec(freq=R.FreqSource.SWITCH, pos_dtype="int64")) == (2, 128, 128)
