"""The decode-attention kernels on a machine without a GPU: the launch plan over the input
space (a pure function: hypothesis), the call spec's invariants and the kernel's region (exact
text), and three programs that lower and compile for sm_90a, each for the paths it alone
covers (on its line), with what its source must show."""

import math
import re
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import attention_decode as K

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


def _spec(layout=K.CacheLayout.CONTIGUOUS, batch=4, heads=8, kv_heads=2, head_dim=128,
          capacity=300, page_size=0, max_pages=0, dtype="bfloat16", scale=0.125, softcap=None,
          device="cuda"):
    return K.AttentionDecodeSpec(device=device, layout=layout, batch=batch, heads=heads,
                                 kv_heads=kv_heads, head_dim=head_dim, capacity=capacity,
                                 page_size=page_size, max_pages=max_pages, dtype=dtype,
                                 scale=scale, softcap=softcap)


# --- the plan ---------------------------------------------------------------------------------


def _fill(ctas, s, slots):
    w = ctas * s / slots
    return w / math.ceil(w)


def _no_empty_part(tiles, s):
    return (s - 1) * -(-tiles // s) < tiles


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 512), kv_heads=st.integers(1, 16), groups=st.integers(1, 128),
       head_dim=st.sampled_from([16, 64, 96, 128, 192, 256]),
       max_keys=st.integers(0, 1 << 18),
       page_size=st.sampled_from([0, 16, 32, 64, 128, 256]), sms=st.integers(1, 200))
def test_the_plan_over_the_input_space(batch, kv_heads, groups, head_dim, max_keys, page_size,
                                       sms):
    args = dict(batch=batch, heads=groups * kv_heads, kv_heads=kv_heads, head_dim=head_dim,
                max_keys=max_keys, page_size=page_size, sms=sms)
    plan = K.decode_plan(**args)
    assert plan == K.decode_plan(**args)  # pure
    # a CTA's heads share one key head; the MMA has at least 16 rows, a power of two
    assert groups % plan.vh == 0 and 1 <= plan.vh <= 64
    assert plan.block_h >= max(16, plan.vh) and plan.block_h & (plan.block_h - 1) == 0
    assert plan.block_n == (64 if head_dim <= 128 else 32)
    if page_size:  # a tile inside one page, or 2 or 4 whole pages
        assert page_size % plan.block_n == 0 or plan.block_n // page_size in (2, 4)
    assert plan.smem_bytes(head_dim) * plan.resident <= 227 * 1024
    assert 1 <= plan.resident <= 4
    # the split: at most one part a tile, no part left without tiles, and a last wave within
    # 10% of that of the best count that leaves none empty
    tiles = -(-max_keys // plan.block_n)
    assert 1 <= plan.num_split <= max(1, min(32, tiles))
    assert plan.num_split == 1 or _no_empty_part(tiles, plan.num_split)
    if tiles > 1:
        ctas, slots = batch * groups * kv_heads // plan.vh, sms * plan.resident
        best = max(_fill(ctas, s, slots) for s in range(1, min(32, tiles) + 1)
                   if _no_empty_part(tiles, s))
        assert _fill(ctas, plan.num_split, slots) >= 0.9 * best


def test_the_bars_plans():
    """The H200's bars: 512 CTAs of 4 heads over 396 slots fill 1.3 waves unsplit and 3.9 in
    three parts; B8's 64 CTAs take six; a one-key call is not split."""
    bar = dict(heads=32, kv_heads=8, head_dim=128, sms=132)
    assert K.decode_plan(batch=64, max_keys=8192, **bar) == K.DecodePlan(4, 16, 64, 2, 3, 3)
    assert K.decode_plan(batch=64, max_keys=8192, page_size=64, **bar) == \
        K.DecodePlan(4, 16, 64, 2, 3, 3)
    assert K.decode_plan(batch=8, max_keys=32768, **bar).num_split == 6
    assert K.decode_plan(batch=3, max_keys=1, **bar).num_split == 1
    # head_dim 256: 32-key tiles, two CTAs an SM by registers
    assert K.decode_plan(batch=4, heads=16, kv_heads=4, head_dim=256, max_keys=2049) == \
        K.DecodePlan(4, 16, 32, 2, 13, 2)


def test_split_count_degenerate_inputs():
    assert K.split_count(0, 10, 132) == 1
    assert K.split_count(10, 1, 132) == 1
    assert K.split_count(132, 1000, 132) == 1  # one full wave


# --- the call spec and the region ------------------------------------------------------------


def test_the_call_spec_refuses_what_the_op_never_sends():
    with pytest.raises(ValueError) as exc:
        _spec(dtype="float32")
    assert str(exc.value) == ("AttentionDecodeSpec.dtype must be one of bfloat16, float16, "
                              "got 'float32'")
    with pytest.raises(ValueError) as exc:
        _spec(heads=6, kv_heads=4)
    assert str(exc.value) == ("AttentionDecodeSpec: heads (6) must be a multiple of kv_heads "
                              "(4) > 0")
    with pytest.raises(ValueError) as exc:
        _spec(page_size=16)
    assert str(exc.value) == ("AttentionDecodeSpec: page_size is > 0 exactly for a paged cache "
                              "and max_pages 0 for a contiguous one, got 16 and 0 for "
                              "contiguous")
    with pytest.raises(ValueError) as exc:
        _spec(K.CacheLayout.PAGED, page_size=0, max_pages=3)
    assert str(exc.value).endswith("got 0 and 3 for paged")
    # a block table of no columns: nothing to read, every output 0
    assert _spec(K.CacheLayout.PAGED, page_size=16, max_pages=0).max_keys == 0
    with pytest.raises(ValueError) as exc:
        _spec(softcap=0.0)
    assert str(exc.value) == "AttentionDecodeSpec: scale and softcap must be > 0, got 0.125 and 0.0"
    with pytest.raises(TypeError) as exc:
        _spec(layout="paged")
    assert str(exc.value) == "AttentionDecodeSpec.layout must be a CacheLayout, got 'paged'"
    assert _spec(K.CacheLayout.PAGED, capacity=9, page_size=16, max_pages=5).max_keys == 80


def test_the_kernel_serves_head_widths_of_32_up_to_256():
    for d in (32, 64, 96, 128, 256):
        assert K.AttentionDecodeSplitKernel.region_refusal(_spec(head_dim=d)) is None
    for d in (16, 80, 320):
        assert K.AttentionDecodeSplitKernel.region_refusal(_spec(head_dim=d)) == \
            f"serves head widths that are multiples of 32 up to 256, not {d}"
    # a tile of several pages is copied 64 columns at a time
    paged = dict(layout=K.CacheLayout.PAGED, capacity=9, max_pages=4)
    assert K.AttentionDecodeSplitKernel.region_refusal(
        _spec(head_dim=96, page_size=32, **paged)) == (
        "serves pages shorter than a tile (32 < 64 keys) for head widths that are multiples of "
        "64, not 96")
    assert K.AttentionDecodeSplitKernel.region_refusal(
        _spec(head_dim=96, page_size=64, **paged)) is None
    assert K.AttentionDecodeSplitKernel.region_refusal(
        _spec(head_dim=192, page_size=32, **paged)) is None


# --- the programs -------------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize(("spec", "plan"), [
    # contiguous MHA (one head a CTA, padded to 16 rows), unsplit: o written by the CTA
    pytest.param(_spec(batch=16, heads=32, kv_heads=32, capacity=8192),
                 K.DecodePlan(1, 16, 64, 2, 1, 3), id="contiguous-mha-unsplit"),
    # contiguous GQA with a softcap, three parts and the combine
    pytest.param(_spec(batch=64, heads=32, kv_heads=8, capacity=8192, softcap=30.0),
                 K.DecodePlan(4, 16, 64, 2, 3, 3), id="contiguous-gqa-softcap-split"),
    # paged, 16-token pages: a tile is four pages, each copied (by TMA, at its page) in two
    # pieces of 64 columns; split
    pytest.param(_spec(K.CacheLayout.PAGED, batch=13, heads=8, kv_heads=2, head_dim=128,
                       capacity=260, page_size=16, max_pages=20),
                 K.DecodePlan(4, 16, 64, 2, 4, 3), id="paged16-split"),
])
def test_decode_compiles_for_sm90(spec, plan):
    src = K.build_decode(spec, plan, "sm_90a").get_kernel_source()
    paged = spec.layout is K.CacheLayout.PAGED
    # whole tiles by TMA through a producer warpgroup, registers capped for resident CTAs
    assert f"__launch_bounds__(256, {plan.resident})" in src
    copies = 4 * 2 if paged else 1  # pages a tile, pieces a page
    assert src.count("tl::tma_load(") == 2 * copies  # K and V alike
    assert "warpgroup_reg_alloc" not in src
    assert "mma_sync" in src and "exp2f" in src
    assert ("tanhf" in src) is (spec.softcap is not None)
    # the combine kernel exactly where the keys are split
    assert ("main_kernel_1" in src) is (plan.num_split > 1)
    # the length clamped to the cache; a page clamped into the pool and the table
    assert f"min(Lens[((int)blockIdx.y)], {spec.max_keys})" in src
    if paged:
        assert re.search(rf", {spec.max_pages - 1}\)+\], {spec.capacity - 1}\), 0\)", src)
    # data that breaks the contract (a length outside the cache, a page read outside the
    # pool) is found where it is read, and the sequence's output is NaN
    assert f"({spec.max_keys} < Lens[((int)blockIdx.y)])" in src and "CUDART_NAN_F" in src
    assert ("int page = BT[" in src) is paged
    if paged:
        assert f"({spec.capacity} <= page)" in src


def test_the_kernel_refuses_gpus_before_hopper(monkeypatch):
    import torch

    from tileops.runtime import kernel as runtime_kernel

    dev = torch.device("cuda", 7)
    monkeypatch.setitem(runtime_kernel._ARCH_CACHE, dev, (8, 0))
    assert K.AttentionDecodeSplitKernel.refusal(_spec(device=dev)) == "written for sm_90, not sm_80"
    monkeypatch.setitem(runtime_kernel._ARCH_CACHE, dev, (9, 0))
    assert K.AttentionDecodeSplitKernel.refusal(_spec(device=dev)) is None
