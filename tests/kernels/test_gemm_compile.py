"""The GEMM kernels compile for Hopper on a CPU host (nvcc, no GPU), every tile configuration
the heuristic can choose; the heuristic's choices; and the on-disk tuning cache.

Hopper programs are compiled for ``sm_90a``: wgmma and the warp-specialized register
reallocation (setmaxnreg) exist only on the arch-specific target (TileLang itself picks
``sm_90a`` for a 9.0 device when no target is given).
"""

import hashlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import gemm as G
from tileops.kernels.gemm import (
    GENERAL_CONFIG,
    HOPPER_CONFIGS,
    HOPPER_ORDER_CONFIGS,
    HOPPER_SPLIT_CONFIGS,
    SMALL_M_CONFIGS,
    SMALL_M_SPLIT_CONFIGS,
    GemmPlan,
    GemmSpec,
    choose_config,
    load_tuned,
    m_bucket,
    store_tuned,
    tune_key,
)

HOPPER = "sm_90a"

sys.path.append(str(Path(__file__).parent))  # the ptxas guard, beside this file
from _ptxas import assert_asynchronous, ptxas_report  # noqa: E402


def _have_compiler() -> bool:
    try:
        import tilelang  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


needs_nvcc = pytest.mark.skipif(not _have_compiler(), reason="needs tilelang and nvcc")

# every configuration the heuristic can choose, each once, the transposes spread over them,
# the other tile order of each Hopper tile, and a split-K configuration of each implementation
COMPILES = [
    ("hopper-128x256-nn", HOPPER_CONFIGS["128x256"][0], 4096, 4096, False, False, "bfloat16"),
    ("hopper-128x128-tt", HOPPER_CONFIGS["128x128"][0], 14336, 4096, True, True, "bfloat16"),
    ("hopper-64x128-nt", HOPPER_CONFIGS["64x128"][0], 1000, 1000, False, True, "float16"),
    ("hopper-64x64-tn", HOPPER_CONFIGS["64x64"][0], 4096, 14336, True, False, "bfloat16"),
    ("small-16x64-nt", SMALL_M_CONFIGS["16x64"], 4096, 4096, False, True, "bfloat16"),
    ("small-16x128-nn", SMALL_M_CONFIGS["16x128"], 128256, 4096, False, False, "bfloat16"),
    ("small-64x64-tn", SMALL_M_CONFIGS["64x64"], 4096, 4096, True, False, "float16"),
    ("general-tt-odd", GENERAL_CONFIG, 37, 19, True, True, "bfloat16"),
    ("hopper-split-tt", HOPPER_SPLIT_CONFIGS["128x128s2"], 1000, 1000, True, True, "bfloat16"),
    ("hopper-128x256g-tn", HOPPER_ORDER_CONFIGS["128x256g"], 4096, 4096, True, False, "bfloat16"),
    ("hopper-128x128g-nt", HOPPER_ORDER_CONFIGS["128x128g"], 4104, 264, False, True, "bfloat16"),
    ("hopper-64x128g-tt", HOPPER_ORDER_CONFIGS["64x128g"], 1000, 1000, True, True, "float16"),
    ("hopper-64x64p-nn", HOPPER_ORDER_CONFIGS["64x64p"], 520, 72, False, False, "bfloat16"),
    ("small-split-nn", SMALL_M_SPLIT_CONFIGS["16x256s4"], 4096, 4096, False, False, "float16"),
]


@needs_nvcc
@pytest.mark.parametrize("name", sorted(G.GEMV_CONFIGS))
@pytest.mark.parametrize(("n", "k", "ta", "dtype"), [(4096, 4096, False, "bfloat16"),
                                                     (1001, 4104, True, "float16")])
def test_one_row_configuration_compiles(name, n, k, ta, dtype):
    cfg = G.GEMV_CONFIGS[name]
    assert cfg.threads == 32 * cfg.block_n and cfg.block_k == 32 * 8 * cfg.stages
    src = G.build_gemv_kernel(n, k, dtype, ta, cfg, HOPPER, True).get_kernel_source()
    assert "uint4" in src  # 16-byte loads of b and a
    assert "__shfl_down_sync" in src  # the warp's sums reduced by shuffles
    assert "cudaGridDependencySynchronize" in src
    if n % cfg.block_n or k % cfg.block_k:
        assert f"< {n}" in src or f"< {k}" in src  # rows past N, chunks past K predicated


@needs_nvcc
@pytest.mark.parametrize(("cfg", "n", "k", "ta", "tb", "dtype"),
                         [c[1:] for c in COMPILES], ids=[c[0] for c in COMPILES])
def test_configuration_compiles_for_hopper(cfg, n, k, ta, tb, dtype):
    kernel = G.build_gemm_kernel(n, k, dtype, ta, tb, cfg, HOPPER)
    src = kernel.get_kernel_source()
    if cfg.tma:
        assert "tma_load" in src
    else:
        assert "tma_load" not in src
        assert "< M" in src  # rows past M are predicated off
    if cfg.block_m >= 64:
        assert "wgmma" in src
    if cfg.persistent:  # 132 CTAs, each looping over its share of the tiles
        assert "rasterization2DRow" not in src
        assert ") / 132)" in src and "blockIdx.y" not in src
        # the load warp's registers go to the math warpgroups, once per CTA
        assert src.count("warpgroup_reg_dealloc<40>") == 2  # warp 0 and the idle warps 1-3
        assert src.count("warpgroup_reg_alloc<232>") == 1
        # ... before the math warpgroups' loop over the tiles, not in it
        after = src[src.index("warpgroup_reg_alloc<232>"):]
        assert re.match(r"warpgroup_reg_alloc<232>\(\);\s*for \(int \w+ = 0; [^\n]*/ 132\)", after)
    elif cfg.panel:
        assert "rasterization2DRow" in src
    if cfg.split > 1:  # one CTA per K share, fp32 partials to the workspace
        assert "blockIdx.z" in src and "float* __restrict__ C" in src


@needs_nvcc
def test_persistent_grid_follows_the_device():
    """A persistent program is built for the device's SM count (114 on an H100 PCIe); one
    CTA per tile needs none."""
    cfg = HOPPER_CONFIGS["64x128"][0]
    assert cfg.persistent
    src = G.build_gemm_kernel(1000, 1000, "bfloat16", False, False, cfg, HOPPER, False, 114)
    assert ") / 114)" in src.get_kernel_source()
    assert G.program_sms(cfg, "cpu") == 132
    assert G.program_sms(HOPPER_CONFIGS["64x64"][0], "cpu") == 132


def test_a_persistent_configuration_does_not_split_k():
    with pytest.raises(ValueError, match=r"^a persistent tile order does not split K \(got "
                       r"split=2\)$"):
        G.gemm_program(1000, 1000, "bfloat16", False, False,
                       HOPPER_SPLIT_CONFIGS["128x128s2"]._replace(persistent=True))


def test_a_persistent_configuration_loads_through_tma():
    with pytest.raises(ValueError, match=r"^a persistent tile order loads through TMA \(got "
                       r"tma=False\)$"):
        G.gemm_program(1000, 1000, "bfloat16", False, False,
                       GENERAL_CONFIG._replace(persistent=True))


def test_configuration_labels():
    assert HOPPER_CONFIGS["128x256"][0].label() == "128x256x64/st3p"
    assert HOPPER_CONFIGS["64x64"][0].label() == "64x64x128/st6"
    assert HOPPER_SPLIT_CONFIGS["128x128s2"].label() == "128x128x64s2/st4"


@needs_nvcc
def test_programmatic_dependent_launch():
    """With ``pdl`` every thread waits for the previous kernel before its first global read
    (after the barriers are set up, before the producer/consumer split), and the consumers
    let the next kernel launch after the main loop."""
    cfg = HOPPER_CONFIGS["64x64"][0]
    src = G.build_gemm_kernel(1000, 1000, "bfloat16", False, False, cfg, HOPPER, True)
    src = src.get_kernel_source()
    sync = src.index("cudaGridDependencySynchronize();")
    assert src.index("__syncthreads();") < sync < src.index("tma_load(")
    assert sync < src.index("warpgroup_reg_dealloc")  # before the warp-specialized branches
    assert src.index("cudaTriggerProgrammaticLaunchCompletion();") > src.rindex("wgmma")
    red = G.build_reduce_kernel(1000, "bfloat16", 2, HOPPER, True).get_kernel_source()
    assert red.index("cudaGridDependencySynchronize();") < red.index("W +")
    plain = G.build_gemm_kernel(1000, 1000, "bfloat16", False, False, cfg, HOPPER)
    assert "cudaGridDependencySynchronize" not in plain.get_kernel_source()
    # persistent: each role (the load warp, the math warpgroups) waits before its tile loop
    # and lets the next kernel launch after it
    pers = G.build_gemm_kernel(1000, 1000, "bfloat16", False, False, HOPPER_CONFIGS["64x128"][0],
                               HOPPER, True).get_kernel_source()
    assert pers.count("cudaGridDependencySynchronize();") == 2
    assert pers.index("cudaGridDependencySynchronize();") < pers.index("tma_load(")
    assert pers.count("cudaTriggerProgrammaticLaunchCompletion();") == 2
    assert pers.rindex("cudaTriggerProgrammaticLaunchCompletion();") > pers.rindex("tma_store(")


@pytest.mark.parametrize(("cfg", "arch", "want"), [
    (HOPPER_CONFIGS["64x128"][0], (9, 0), True), (SMALL_M_CONFIGS["16x64"], (8, 0), False),
    (GENERAL_CONFIG, (9, 0), False), (SMALL_M_CONFIGS["16x64"], None, False),
])
def test_uses_pdl_only_for_tma_programs_on_sm90(cfg, arch, want):
    assert G.uses_pdl(cfg, arch) is want


@needs_nvcc
@pytest.mark.parametrize(("n", "split"), [(4096, 4), (1000, 2)])
def test_splitk_reduction_compiles_vectorized(n, split):
    src = G.build_reduce_kernel(n, "bfloat16", split, HOPPER).get_kernel_source()
    assert "float4" in src  # 16-byte loads of the partial sums
    assert "< M" in src  # rows past M are predicated off
    assert "__float22bfloat162_rn" in src  # the cast to the output dtype


@needs_nvcc
@pytest.mark.parametrize(("m", "n", "k", "ta", "tb", "accumulate", "label"), [
    # the bar's square call (and an unaligned one, padded to it): the persistent 128 x 256
    (8192, 8192, 8192, False, True, False, "128x256x64/st3p"),
    # a short call: one CTA a 64 x 64 tile, six stages (the pipelined, not the persistent,
    # program)
    (128, 4096, 4096, False, True, False, "64x64x128/st6"),
    # the fused loss's dweight += z.T @ h: C fetched under the tile's last products
    (8192, 4096, 1024, True, False, True, "128x256x64/st3p"),
], ids=["8192-nt", "m128-nt", "accumulate-tn"])
def test_ptxas_keeps_the_served_products_asynchronous(m, n, k, ta, tb, accumulate, label,
                                                      tmp_path):
    """The program a call of the bar's shapes is served (the heuristic's configuration, with
    programmatic dependent launch and the grid of an H100/H200's 132 SMs, as the kernel
    builds it): no wgmma serialized by ptxas, no wait of its own and no register spilled
    (``_ptxas``)."""
    plan = GemmPlan("cuda", m_bucket(m), n, k, "bfloat16", ta, tb, True, accumulate)
    cfg = choose_config(plan)
    assert cfg.label() == label
    src = G.build_gemm_kernel(n, k, "bfloat16", ta, tb, cfg, HOPPER, G.uses_pdl(cfg, (9, 0)),
                              132, accumulate, accumulate and cfg.persistent and G.C_PREFETCH
                              ).get_kernel_source()
    assert "wgmma" in src
    assert_asynchronous(ptxas_report(src, tmp_path, "gemm"))


def test_every_choosable_configuration_is_compiled_above():
    compiled = {c[1] for c in COMPILES}
    choosable = {c for c, _ in HOPPER_CONFIGS.values()} | set(SMALL_M_CONFIGS.values())
    assert choosable | {GENERAL_CONFIG} <= compiled


def _spec(m, n, k, ta=False, tb=False, aligned=True):
    return GemmPlan("cuda", m_bucket(m), n, k, "bfloat16", ta, tb, aligned)


@pytest.mark.parametrize(("m", "n", "k", "want"), [
    (8192, 8192, 8192, (128, 256)),
    (4096, 4096, 4096, (128, 256)),
    (2048, 4096, 4096, (128, 256)),
    (128, 4096, 4096, (64, 64)),
    (128, 14336, 4096, (128, 128)),
    (1, 4096, 4096, (16, 64)),
    (16, 4096, 14336, (16, 64)),
    (1, 14336, 4096, (16, 128)),
    (1, 128256, 4096, (16, 128)),
    (48, 4096, 4096, (64, 64)),
])
def test_heuristic_choices(m, n, k, want):
    cfg = choose_config(_spec(m, n, k))
    assert (cfg.block_m, cfg.block_n) == want


def test_unaligned_calls_choose_the_general_configuration():
    assert choose_config(_spec(333, 4097, 4095, aligned=False)) == GENERAL_CONFIG


def test_padded_kernel_region_and_configuration():
    from tileops.kernels.gemm import PAD_MIN_FLOPS, GemmGeneralKernel, GemmPaddedKernel

    odd = _spec(333, 4097, 4095, aligned=False)
    assert GemmPaddedKernel.region_refusal(odd) is None
    padded = GemmPaddedKernel.padded_spec(odd)
    assert (padded.m, padded.n, padded.k, padded.aligned) == (odd.m, 4104, 4096, True)
    assert GemmPaddedKernel.config_for(odd) == choose_config(padded) != GENERAL_CONFIG
    assert GemmPaddedKernel.region_refusal(_spec(333, 4096, 4096)) == (
        "serves calls whose rows break TMA alignment (aligned ones run unpadded)")
    assert GemmPaddedKernel.region_refusal(_spec(16, 4097, 4095, aligned=False)) == (
        "serves M above 64 (padding would double a decode call's traffic)")
    assert GemmPaddedKernel.region_refusal(_spec(128, 129, 127, aligned=False)) == (
        f"serves calls of at least {PAD_MIN_FLOPS} flops (padding costs more below)")
    assert GemmGeneralKernel.region_refusal(odd) is None  # the fallback still serves it


@pytest.mark.parametrize(("k", "bk", "split", "want"), [
    (4096, 64, 1, 64), (4096, 64, 4, 16), (1000, 64, 2, 8), (1000, 128, 3, 3), (1, 64, 2, 1),
])
def test_k_iterations_cover_k(k, bk, split, want):
    it = G.k_iterations(k, bk, split)
    assert it == want
    assert it * split * bk >= k  # every K tile is some CTA's
    assert (split - 1) * it * bk < k or split == 1 or k <= bk  # the last share starts inside K


def test_selection_regions():
    from tileops.kernels.gemm import (
        GemmGemvKernel,
        GemmGeneralKernel,
        GemmHopperKernel,
        GemmSmallMKernel,
    )

    row_nt = _spec(1, 4096, 4096, tb=True)
    assert GemmGemvKernel.region_refusal(row_nt) is None
    assert GemmSmallMKernel in GemmGemvKernel.preferred_over
    assert "M = 1" in GemmGemvKernel.region_refusal(_spec(2, 4096, 4096, tb=True))
    assert "trans_b" in GemmGemvKernel.region_refusal(_spec(1, 4096, 4096))
    assert "multiple of 8" in GemmGemvKernel.region_refusal(_spec(1, 4096, 4095, tb=True))

    big, small, odd = _spec(2048, 4096, 4096), _spec(1, 4096, 4096), _spec(3, 7, 5, aligned=False)
    assert GemmHopperKernel.region_refusal(big) is None
    assert GemmHopperKernel.region_refusal(small) is not None
    assert GemmSmallMKernel.region_refusal(small) is None
    assert GemmSmallMKernel.region_refusal(big) is not None
    for k in (GemmHopperKernel, GemmSmallMKernel):
        assert k.region_refusal(odd) is not None
    assert GemmGeneralKernel.general and GemmGeneralKernel.region_refusal(odd) is None


# --- the tuning cache ---------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    return tmp_path / "gemm"


def test_cache_write_then_read(cache):
    key = tune_key("sm_90", _spec(2048, 4096, 4096, tb=True), "GemmHopperKernel")
    assert key.startswith("GemmHopperKernel-sm_90-bfloat16-NT-m2048-n4096-k4096-al-")
    assert load_tuned(key) is None
    cfg = HOPPER_CONFIGS["128x128"][0]
    path = store_tuned(key, cfg, {"a": 1.0})
    assert path == cache / f"{key}.json" and path.exists()
    assert not [p for p in cache.iterdir() if p.suffix == ".tmp"]  # the rename left nothing
    assert load_tuned(key) == cfg
    body = json.loads(path.read_text())
    assert body["key"] == key and body["config"]["block_n"] == 128


def test_key_changes_with_the_kernel_source(monkeypatch):
    a = tune_key("sm_90", _spec(1, 4096, 4096), "GemmSmallMKernel")
    assert tune_key("sm_90", _spec(1, 4096, 4096), "GemmGemvKernel") != a
    monkeypatch.setattr(G, "_source_hash", lambda: "0" * 16)
    assert tune_key("sm_90", _spec(1, 4096, 4096), "GemmSmallMKernel") != a


def _entry(key: str = "%s", drop: str = "", **broken) -> str:
    """A cache entry for GENERAL_CONFIG with one field dropped or given a wrong value."""
    cfg = {**GENERAL_CONFIG._asdict(), **broken}
    cfg.pop(drop, None)
    return json.dumps({"key": key, "config": cfg})


@pytest.mark.parametrize("corrupt", [
    "{not json",
    "[]",
    '{"key": "%s"}',
    _entry(drop="persistent"),
    _entry(block_m="64"),
    _entry(tma=1),
    _entry(persistent=1),
    _entry(policy="diagonal"),
    _entry(block_m=0),
    _entry(split=-1),
    _entry(key="other"),
], ids=["bad-json", "not-object", "no-config", "missing-key", "str-int", "int-bool",
        "int-bool-persistent", "unknown-policy", "zero-tile", "negative-split", "wrong-key"])
def test_corrupt_entry_is_ignored_and_rebuilt(cache, corrupt):
    key = tune_key("sm_90", _spec(128, 4096, 4096), "GemmHopperKernel")
    cache.mkdir(parents=True)
    path = cache / f"{key}.json"
    path.write_text(corrupt.replace("%s", key) if "%s" in corrupt else corrupt)
    assert load_tuned(key) is None
    store_tuned(key, GENERAL_CONFIG)  # what a tune run does after a miss
    assert load_tuned(key) == GENERAL_CONFIG


class _FakeTensor:
    def __init__(self, shape):
        self.shape = shape
        self.device = "cpu"


def test_tune_uses_a_cached_entry_without_timing(cache, monkeypatch):
    spec = _spec(2048, 4096, 4096)
    built = []
    monkeypatch.setattr(G, "build_gemm_kernel",
                        lambda n, k, dt, ta, tb, cfg, target, pdl, sms, acc, pre: built.append(cfg) or
                        (lambda a, b, c: None))
    monkeypatch.setattr(G, "_time_ms", lambda fn: pytest.fail("a cached entry was re-timed"))
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))
    want = HOPPER_CONFIGS["64x128"][0]
    store_tuned(tune_key("sm_90", spec, "GemmHopperKernel"), want)
    kern = G.GemmHopperKernel(spec)
    assert kern.config == HOPPER_CONFIGS["128x256"][0]
    kern.request_tune()
    kern(_FakeTensor((2048, 4096)), _FakeTensor((4096, 4096)), _FakeTensor((2048, 4096)))
    assert kern.config == want and built[-1] == want


def test_tune_times_candidates_and_stores_the_fastest(cache, monkeypatch):
    spec = _spec(2048, 4096, 4096)
    monkeypatch.setattr(G, "build_gemm_kernel",
                        lambda n, k, dt, ta, tb, cfg, target, pdl, sms, acc, pre:
                        (lambda a, b, c, cfg=cfg: cfg))
    fastest = HOPPER_CONFIGS["128x128"][0]
    monkeypatch.setattr(G, "_time_ms", lambda fn: 1.0 if fn() == fastest else 2.0)
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))
    kern = G.GemmHopperKernel(spec)
    kern.request_tune()
    kern(_FakeTensor((2048, 4096)), _FakeTensor((4096, 4096)), _FakeTensor((2048, 4096)))
    assert kern.config == fastest
    assert load_tuned(tune_key("sm_90", spec, "GemmHopperKernel")) == fastest


def test_tuning_logs_each_candidate_and_the_choice(cache, monkeypatch, caplog):
    from tileops.runtime import log

    spec = _spec(2048, 4096, 4096)

    def build(n, k, dt, ta, tb, cfg, target, pdl, sms, acc, pre):
        if cfg == HOPPER_CONFIGS["64x64"][0]:
            raise RuntimeError("no fit")
        return lambda a, b, c, cfg=cfg: cfg

    monkeypatch.setattr(G, "build_gemm_kernel", build)
    monkeypatch.setattr(G, "_time_ms", lambda fn: 0.5)
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))
    before = log.logger.level
    log.set_log_level("INFO")
    monkeypatch.setattr(log.logger, "propagate", True)  # to caplog's handler on the root
    try:
        with caplog.at_level("INFO", logger="tileops"):
            kern = G.GemmHopperKernel(spec)
            kern.request_tune()
            kern(_FakeTensor((2048, 4096)), _FakeTensor((4096, 4096)),
                 _FakeTensor((2048, 4096)))
    finally:
        log.set_log_level(logging.getLevelName(before) if before else "WARNING")
    lines = [r.getMessage() for r in caplog.records]
    # the stream-K candidates wait for G.TUNE_STREAM_K (off)
    n = len([c for c in G.GemmHopperKernel.tune_candidates if not c.stream_k])
    assert n < len(G.GemmHopperKernel.tune_candidates) and not G.TUNE_STREAM_K
    assert lines[0].startswith("GemmHopperKernel: tuning GemmHopperKernel-sm_90-bfloat16-NN")
    assert f"over {n} configurations" in lines[0]
    assert f"GemmHopperKernel: [1/{n}] 128x256x64/st3p 0.5000 ms" in lines
    assert any("64x64x128/st6 failed: RuntimeError: no fit" in m for m in lines)
    assert lines[-1].startswith("GemmHopperKernel: chose 128x256x64/st3p (0.5000 ms), cached in")


def test_a_cached_configuration_of_another_implementation_is_timed_over(cache, monkeypatch):
    """An entry whose configuration is none of this implementation's candidates (written by
    another version of the candidate lists) is not run: the candidates are timed again."""
    spec = _spec(2048, 4096, 4096)
    monkeypatch.setattr(G, "build_gemm_kernel",
                        lambda n, k, dt, ta, tb, cfg, target, pdl, sms, acc, pre:
                        (lambda a, b, c, cfg=cfg: cfg))
    fastest = HOPPER_CONFIGS["128x128"][0]
    timed = []
    monkeypatch.setattr(G, "_time_ms",
                        lambda fn: timed.append(1) or (1.0 if fn() == fastest else 2.0))
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))
    key = tune_key("sm_90", spec, "GemmHopperKernel")
    store_tuned(key, G.GEMV_CONFIGS["4x4"])
    kern = G.GemmHopperKernel(spec)
    kern.request_tune()
    kern(_FakeTensor((2048, 4096)), _FakeTensor((4096, 4096)), _FakeTensor((2048, 4096)))
    assert timed and kern.config == fastest and load_tuned(key) == fastest


def test_an_entry_shared_across_m_checks_every_call_for_an_empty_output(monkeypatch):
    """The general kernel's entry serves every M (its identity has no M bucket), so a call with
    M = 0 after one with M = 2048 must not launch an empty grid."""
    launched = []
    monkeypatch.setattr(G, "build_gemm_kernel",
                        lambda *a, **k: (lambda a, b, c: launched.append(c.shape)))
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))

    class _T:
        def __init__(self, shape):
            self.shape = shape

        def numel(self):
            return self.shape[0] * self.shape[1]

    big, empty = _spec(2048, 64, 32, aligned=False), _spec(0, 64, 32, aligned=False)
    assert G.GemmGeneralKernel.identity(big) == G.GemmGeneralKernel.identity(empty)
    kern = G.GemmGeneralKernel(big)
    kern(_T((2048, 32)), _T((32, 64)), _T((2048, 64)))
    kern(_T((0, 32)), _T((32, 64)), _T((0, 64)))
    assert launched == [(2048, 64)]
    hopper = G.GemmHopperKernel(_spec(2048, 64, 32))
    assert not hopper._degenerate  # its entries are per M bucket: M = 0 has its own
    assert G.GemmHopperKernel(_spec(0, 64, 32))._degenerate


# --- the regions and the heuristic over the whole call space ------------------------------------

_specs = st.builds(
    lambda m, n, k, dt, ta, tb, aligned, acc: GemmPlan("cuda", m_bucket(m), n, k, dt, ta, tb,
                                                       aligned, acc),
    st.integers(0, 1 << 16), st.integers(1, 1 << 18), st.integers(1, 1 << 16),
    st.sampled_from(["bfloat16", "float16"]), st.booleans(), st.booleans(), st.booleans(),
    st.booleans())


@settings(max_examples=400, deadline=None)
@given(_specs)
def test_at_most_one_specialised_implementation_claims_a_call(spec):
    """Selection needs the specialised regions disjoint (two claimants would be an ambiguity
    error) except where one is ``preferred_over`` the other; the general kernel serves
    whatever none claims."""
    from tileops.runtime.kernel import select

    specialised = (G.GemmHopperKernel, G.GemmSmallMKernel, G.GemmGemvKernel,
                   G.GemmPaddedKernel)
    claim = [k for k in specialised if k.region_refusal(spec) is None]
    # the one-row kernel: M = 1, b stored (N, K), 16-byte loads along K; aligned or not. It
    # overlaps the small-M kernel's region (and wins); the other regions are disjoint.
    gemv = spec.m == 1 and spec.trans_b and spec.k % 8 == 0
    assert (G.GemmGemvKernel in claim) == gemv
    others = [k for k in claim if k is not G.GemmGemvKernel]
    assert len(others) <= 1
    if not spec.aligned:
        assert G.GemmHopperKernel not in claim and G.GemmSmallMKernel not in claim
    assert G.GemmGeneralKernel.region_refusal(spec) is None
    impls = (*specialised, G.GemmGeneralKernel)
    chosen = select(G.GemmFwdInterface, impls, spec)  # never ambiguous
    assert chosen is (G.GemmGemvKernel if gemv else others[0] if others else G.GemmGeneralKernel)
    # the accumulating call and the plain one are served alike: every implementation, with
    # the configuration the heuristic picks, has its accumulating twin
    twin = msgspec.structs.replace(spec, accumulate=not spec.accumulate)
    assert select(G.GemmFwdInterface, impls, twin) is chosen
    assert chosen.config_for(twin) == chosen.config_for(spec)
    assert chosen.identity(twin) != chosen.identity(spec)  # but they are built apart


@settings(max_examples=400, deadline=None)
@given(_specs)
def test_the_heuristic_picks_a_listed_configuration_that_fits_the_call(spec):
    cfg = choose_config(spec)
    listed = ({c for c, _ in HOPPER_CONFIGS.values()} | set(SMALL_M_CONFIGS.values())
              | {GENERAL_CONFIG})
    assert cfg in listed and cfg.split == 1
    if not spec.aligned:
        assert cfg == GENERAL_CONFIG
    elif spec.m <= G.SMALL_M:
        assert cfg in SMALL_M_CONFIGS.values()
        assert cfg.block_m == (64 if spec.m > 16 else 16)
    else:
        assert cfg in {c for c, _ in HOPPER_CONFIGS.values()}
    if G.GemmPaddedKernel.region_refusal(spec) is None:
        padded = G.GemmPaddedKernel.padded_spec(spec)
        assert padded.aligned and padded.n % 8 == 0 and padded.k % 8 == 0
        assert 0 <= padded.n - spec.n < 8 and 0 <= padded.k - spec.k < 8
        assert G.GemmPaddedKernel.config_for(spec) in {c for c, _ in HOPPER_CONFIGS.values()}


@pytest.mark.parametrize(("m", "n", "k", "ta", "tb", "dt", "aligned"), [
    (2048, 4096, 4096, False, False, "bfloat16", True),
    (333, 4096, 4096, False, False, "bfloat16", True),  # M is no stored row length here
    (333, 4096, 4096, True, False, "bfloat16", False),  # a stored (K, M): rows of M
    (336, 4096, 4096, True, False, "float16", True),
    (2048, 4097, 4096, False, False, "bfloat16", False),  # c's rows (and b's) of N
    (2048, 4097, 4096, False, True, "bfloat16", False),  # c's rows still N
    (2048, 4096, 4095, False, False, "bfloat16", False),  # a's rows of K
    (2048, 4096, 4095, True, False, "bfloat16", True),  # ...unless a is stored (K, M)
])
def test_the_plan_of_a_call_is_the_kernels(m, n, k, ta, tb, dt, aligned):
    """The op states exact sizes and layouts; the kernels derive the M bucket the heuristic
    reads and whether every stored row meets TMA's 16-byte alignment."""
    spec = GemmSpec(device="cuda", m=m, n=n, k=k, dtype=dt, trans_a=ta, trans_b=tb)
    plan = G.plan_of(spec)
    assert plan == GemmPlan("cuda", m_bucket(m), n, k, dt, ta, tb, aligned)
    assert G.plan_of(plan) is plan
    # every M of one bucket shares one built entry
    same = GemmSpec(device="cuda", m=m_bucket(m), n=n, k=k, dtype=dt, trans_a=ta, trans_b=tb)
    if aligned == G.plan_of(same).aligned:
        assert G.GemmHopperKernel.identity(spec) == G.GemmHopperKernel.identity(same)


@pytest.mark.parametrize(("field", "value", "error"), [
    ("dtype", "float32", "GemmSpec.dtype must be one of bfloat16, float16, got 'float32'"),
    ("m", -3, "GemmSpec.m must be a size (an int >= 0), got -3"),
    ("k", 2.0, "GemmSpec.k must be a size (an int >= 0), got 2.0"),
    ("trans_b", 1, "GemmSpec.trans_b must be a bool, got 1"),
])
def test_gemm_call_spec_invariants(field, value, error):
    good = dict(device="cuda", m=1, n=8, k=8, dtype="bfloat16", trans_a=False, trans_b=False)
    with pytest.raises((TypeError, ValueError)) as info:
        GemmSpec(**{**good, field: value})
    assert str(info.value) == error
    with pytest.raises(TypeError):  # keyword-only
        GemmSpec("cuda", 1, 8, 8, "bfloat16", False, False)


# --- the accumulating form ----------------------------------------------------------------------

#: sha256 (first 16 hex digits) of the TileLang script of one program of each kind, recorded
#: before the programs had an accumulating form: with the flag off they must stay exactly what
#: they were (a TileLang upgrade that prints scripts differently means recording them again,
#: from the programs of the commit before the upgrade)
_PLAIN_SCRIPTS = {
    "hopper-64x64-tn-pdl": ("0aab86725b7e9286", lambda: G.gemm_program(
        4096, 14336, "bfloat16", True, False, HOPPER_CONFIGS["64x64"][0])),
    "persistent-128x256-nn-pdl": ("fb8be9b96708d3d0", lambda: G.gemm_program(
        4096, 4096, "bfloat16", False, False, HOPPER_CONFIGS["128x256"][0], True)),
    "split-128x128s2-tt-pdl": ("6cbe8ebbbef5d327", lambda: G.gemm_program(
        1000, 1000, "bfloat16", True, True, HOPPER_SPLIT_CONFIGS["128x128s2"], True)),
    "general-tt-odd": ("894a4606bd80259e", lambda: G.gemm_program(
        37, 19, "bfloat16", True, True, GENERAL_CONFIG)),
    "reduce-s2-pdl": ("65ecdcb5284c23fe", lambda: G.splitk_reduce_program(
        1000, "bfloat16", 2, True)),
    "gemv-4x4-pdl": ("14767bc271484e6b", lambda: G.gemv_program(
        4096, 4096, "bfloat16", False, G.GEMV_CONFIGS["4x4"], True)),
}


@needs_nvcc
@pytest.mark.parametrize("name", sorted(_PLAIN_SCRIPTS))
def test_the_plain_programs_are_unchanged_by_the_accumulating_form(name):
    want, program = _PLAIN_SCRIPTS[name]
    assert hashlib.sha256(program().script().encode()).hexdigest()[:16] == want


#: one accumulating program of each kind: (builder, where C's prior values are read)
_ACCUMULATING = {
    "hopper-64x64-tn": lambda: G.build_gemm_kernel(
        4096, 14336, "bfloat16", True, False, HOPPER_CONFIGS["64x64"][0], HOPPER, True, 132, True),
    "persistent-128x256-nn": lambda: G.build_gemm_kernel(
        4096, 4096, "bfloat16", False, False, HOPPER_CONFIGS["128x256"][0], HOPPER, True, 132,
        True),
    "small-16x64-nt-fp16": lambda: G.build_gemm_kernel(
        4096, 4096, "float16", False, True, SMALL_M_CONFIGS["16x64"], HOPPER, True, 132, True),
    "general-tt-odd": lambda: G.build_gemm_kernel(
        37, 19, "bfloat16", True, True, GENERAL_CONFIG, HOPPER, False, 132, True),
    "reduce-s2": lambda: G.build_reduce_kernel(1000, "bfloat16", 2, HOPPER, True, True),
    "gemv-4x4": lambda: G.build_gemv_kernel(4096, 4096, "bfloat16", False, G.GEMV_CONFIGS["4x4"],
                                            HOPPER, True, True),
}


@needs_nvcc
@pytest.mark.parametrize("name", sorted(_ACCUMULATING))
def test_accumulating_programs_compile_and_read_c(name):
    src = _ACCUMULATING[name]().get_kernel_source()
    if name.startswith("gemv"):  # lane 0 adds c's element to the warp's sum
        assert re.search(r"C\[(.*)\] = \(\(bfloat16_t\)\(red_buf0\[0\] \+ \(\(float\)C\[\1\]\)\)\)",
                         src)
        return
    # c is read through a plain pointer (as well as written), after the previous kernel is
    # done (programmatic dependent launch) and cast to fp32 into the accumulator
    dt = "half_t" if "fp16" in name else "bfloat16_t"
    assert re.search(rf"{dt}\* (__restrict__ )?C\b", src)  # c in the operands' dtype
    if name.startswith("general"):  # element by element, each predicated on both edges
        read = src.index("condval = C[")
        assert re.search(r"< M\) && \(.*< 37\)\)\) \{\s*condval = C\[", src)
    elif name.startswith("reduce"):  # vectors of 2 (4 bytes), widened in pairs
        read = src.index("(C + ")
        assert src.index("cudaGridDependencySynchronize();") < read
        assert "2float2(" in src[read:]
        # added to the partial sums, once, before the one cast
        assert src.index("(W + ") < read < src.rindex("__float22bfloat162_rn")
        assert "< M" in src
        return
    else:  # vectors (16 bytes; 8 where a 16-row tile gives a thread no more), unrolled so
        # that every load of a thread is in flight at once
        read = src.index("(C + ")
        assert src.index("cudaGridDependencySynchronize();") < read
        assert re.search(r"condval = \*\(uint(4|2)\*\)\(C \+ ", src)
        if not name.startswith("small"):
            assert "#pragma unroll" in src[read - 800:read]
    # through the shared C tile: stored there, then each thread's fragment read and widened
    stage = src.index("C_s", read)
    assert "2float2(" in src[stage:]
    # the accumulator starts from c where it was cleared, before the first MMA
    mma = "tl::mma_sync<" if name.startswith("small") else "tl::wgmma_"
    assert mma not in src[:read] and mma in src[read:]
    assert "make_float4(broadcast_var" not in src  # no clear of the accumulator
    assert "M + " in src[read - 600:read] or "< M" in src[read - 600:read]  # rows past M
    if name.startswith("persistent"):  # per tile, by the math warpgroups, in their tile loop
        after = src[src.index("warpgroup_reg_alloc<232>"):]
        assert after.index("(C + ") < after.index("wgmma")
        assert re.match(r"warpgroup_reg_alloc<232>\(\);\s*cudaGridDependencySynchronize\(\);\s*"
                        r"for \(int \w+ = 0; [^\n]*/ 132\)", after)


@needs_nvcc
@pytest.mark.parametrize("cfg_name", ["128x256", "64x128"])
def test_the_prefetching_persistent_program_fetches_c_under_the_last_mmas(cfg_name):
    # c_prefetch: the load warp fetches the tile's C by TMA after issuing its last K step, once
    # the previous tile's store has read the shared tile; the math warps clear the
    # accumulator, wait for the fetch after their last MMA, add it and store, then release
    src = G.build_gemm_kernel(4096, 1024, "bfloat16", True, False, HOPPER_CONFIGS[cfg_name][0],
                              HOPPER, True, 132, True, True).get_kernel_source()
    assert "(C + " not in src  # no plain read of c: the fetch is TMA's
    load = src[src.index("warpgroup_reg_dealloc<40>"):src.index("} else {")]
    math = src[src.index("warpgroup_reg_alloc<232>"):]
    sync = load.index("cudaGridDependencySynchronize();")
    k_loads = load.rindex("tl::tma_load(B_desc") if "tma_load(B_desc" in load else -1
    fetch = load.index("tl::tma_load(C_desc, c_full[0]")
    assert sync < k_loads < load.index("c_empty[0].wait(") < fetch
    assert "c_full[0].arrive_and_expect_tx(" in load[k_loads:fetch]
    last_mma = math.rindex("tl::wgmma_")
    wait = math.index("c_full[0].wait(")
    assert last_mma < wait
    assert re.search(r"__1\.x = \(v_\.x\+__2\.x\)", math[wait:])  # added in fp32
    assert math.index("tl::tma_store_wait<0, true>();") < math.index("c_empty[0].arrive();")
    # the accumulator is cleared in the tile loop, before the tile's first MMA
    clear = math.index("= make_float4(broadcast_var, broadcast_var, broadcast_var, broadcast_var)")
    assert math.index("for (int i_") < clear < math.index("tl::wgmma_")


def test_the_call_s_program_prefetches_c_where_the_switch_says(monkeypatch):
    seen = []
    monkeypatch.setattr(G, "build_gemm_kernel", lambda *a: seen.append(a) or object())
    plan = G.plan_of(GemmSpec(device="cuda:0", m=4096, n=4096, k=1024, dtype="bfloat16",
                              trans_a=True, trans_b=False, accumulate=True))
    cfg = HOPPER_CONFIGS["128x256"][0]
    for on in (False, True):
        monkeypatch.setattr(G, "C_PREFETCH", on)
        G.GemmHopperKernel._build_for(object.__new__(G.GemmHopperKernel), plan, cfg)
        assert seen[-1][-2:] == (True, on)
    plain = G.plan_of(GemmSpec(device="cuda:0", m=4096, n=4096, k=1024, dtype="bfloat16",
                               trans_a=True, trans_b=False))
    G.GemmHopperKernel._build_for(object.__new__(G.GemmHopperKernel), plain, cfg)
    assert seen[-1][-2:] == (False, False)  # a plain product never prefetches


def test_a_split_program_accumulates_in_its_reduction():
    with pytest.raises(ValueError, match=r"^a split-K program writes partial sums; its reduction "
                       r"accumulates \(got accumulate=True with split=2\)$"):
        G.gemm_program(1000, 1000, "bfloat16", False, False, HOPPER_SPLIT_CONFIGS["128x128s2"],
                       accumulate=True)


def test_a_split_accumulating_call_builds_the_plain_main_program_and_an_adding_reduction(
        monkeypatch):
    built = []
    monkeypatch.setattr(G, "build_gemm_kernel",
                        lambda *a: built.append(("main", *a[-2:])) or a)  # accumulate, prefetch
    monkeypatch.setattr(G, "build_reduce_kernel", lambda *a: built.append(("reduce", a[-1])) or a)
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))
    kern = G.GemmHopperKernel(GemmPlan("cuda", 2048, 4096, 4096, "bfloat16", False, False, True,
                                       True))
    built.clear()
    launch = kern._build(HOPPER_SPLIT_CONFIGS["128x128s2"])
    assert isinstance(launch, G.SplitKLaunch)
    assert built == [("main", False, False), ("reduce", True)]
    built.clear()
    kern._build(HOPPER_CONFIGS["128x256"][0])
    assert built == [("main", True, G.C_PREFETCH)]


class _Acc:
    """A stand-in for ``c``: records the calls a kernel makes on it."""

    def __init__(self, shape):
        self.shape, self.device, self.seen = shape, "cpu", []

    def numel(self):
        return self.shape[0] * self.shape[1]

    def zero_(self):
        self.seen.append("zero_")

    def clone(self):
        self.seen.append("clone")
        return _Acc(self.shape)


def test_k_zero_leaves_an_accumulated_c_as_it_is(monkeypatch):
    monkeypatch.setattr(G, "build_gemm_kernel", lambda *a: pytest.fail("K = 0 builds nothing"))
    for acc, want in ((True, []), (False, ["zero_"])):
        kern = G.GemmGeneralKernel(GemmPlan("cuda", 64, 64, 0, "bfloat16", False, False, False,
                                            acc))
        c = _Acc((64, 64))
        kern(_FakeTensor((64, 0)), _FakeTensor((0, 64)), c)
        assert c.seen == want


def test_tuning_an_accumulating_call_times_the_candidates_on_a_copy_of_c(cache, monkeypatch):
    spec = GemmPlan("cuda", 2048, 4096, 4096, "bfloat16", False, False, True, True)
    ran = []
    monkeypatch.setattr(G, "build_gemm_kernel",
                        lambda n, k, dt, ta, tb, cfg, target, pdl, sms, acc, pre:
                        (lambda a, b, c: ran.append(c)))
    monkeypatch.setattr(G, "build_reduce_kernel", lambda *a: (lambda w, c: ran.append(c)))
    monkeypatch.setattr(G, "_time_ms", lambda fn: fn() or 1.0)
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(G, "TUNE_STREAM_K", True)  # every candidate, stream-K's too
    kern = G.GemmHopperKernel(spec)
    kern.request_tune()
    c = _Acc((2048, 4096))
    monkeypatch.setattr(G.SplitKLaunch, "__call__", lambda self, a, b, c: ran.append(c))
    monkeypatch.setattr(G.StreamKLaunch, "__call__", lambda self, a, b, c: ran.append(c))
    kern(_FakeTensor((2048, 4096)), _FakeTensor((4096, 4096)), c)
    assert c.seen == ["clone"] and len(ran) == len(G.GemmHopperKernel.tune_candidates) + 1
    assert all(x is not c for x in ran[:-1]) and ran[-1] is c  # only the call itself adds into c
    key = tune_key("sm_90", spec, "GemmHopperKernel")
    assert "-al-acc-" in key and key != tune_key("sm_90", _spec(2048, 4096, 4096),
                                                 "GemmHopperKernel")


def test_the_call_spec_accumulate_flag():
    good = dict(device="cuda", m=1, n=8, k=8, dtype="bfloat16", trans_a=False, trans_b=False)
    assert GemmSpec(**good).accumulate is False  # the plain product unless asked
    assert G.plan_of(GemmSpec(**good, accumulate=True)).accumulate is True
    with pytest.raises(TypeError, match=r"^GemmSpec.accumulate must be a bool, got 1$"):
        GemmSpec(**good, accumulate=1)


@pytest.mark.parametrize(("ta", "tb"), [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("acc", [False, True], ids=["plain", "accumulate"])
def test_the_padded_kernel_pads_c_when_it_accumulates(monkeypatch, ta, tb, acc):
    """The padded kernel's own work on the CPU (a stand-in for the Hopper program on the
    padded sizes): an accumulating call pads c with the operands and copies the corner back,
    so c's values are in the sum; a plain call's output starts from nothing."""
    import torch

    def program(n, k, dt, ta_, tb_, cfg, target, pdl, sms, accumulate, prefetch):
        assert n % 8 == 0 and k % 8 == 0 and accumulate is acc

        def run(a, b, c):
            am = a.double().T if ta_ else a.double()
            bm = b.double().T if tb_ else b.double()
            out = am @ bm
            c.copy_(out[:c.shape[0]] + c.double() if accumulate else out[:c.shape[0]])
        return run

    monkeypatch.setattr(G, "build_gemm_kernel", program)
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))
    m, n, k = 100, 37, 19
    kern = G.GemmPaddedKernel(GemmPlan("cuda", m_bucket(m), n, k, "bfloat16", ta, tb, False, acc))
    g = torch.Generator().manual_seed(5)
    a = torch.randn((k, m) if ta else (m, k), generator=g, dtype=torch.float64)
    b = torch.randn((n, k) if tb else (k, n), generator=g, dtype=torch.float64)
    c = torch.randn((m, n), generator=g, dtype=torch.float64)
    want = (a.T if ta else a) @ (b.T if tb else b) + (c if acc else 0)
    kern(a, b, c)
    assert torch.allclose(c, want, rtol=1e-12, atol=1e-12)


# --- stream-K ----------------------------------------------------------------------------------

STREAM_K = G.HOPPER_STREAM_K_CONFIGS["128x256sk"]


def _check_stream_k_schedule(tiles: int, iters: int, sms: int) -> list[int]:
    """Every tile's K steps are run once, by consecutive segments; a segment that does not
    start its tile is its CTA's first job (the one partial sum a CTA writes); the CTA that
    starts a tile it does not finish adds exactly the partial sums of the tile's other
    segments, all of later CTAs (waits go one way); the K steps each CTA runs."""
    schedule = G.stream_k_schedule(tiles, iters, sms)
    assert len(schedule) == sms
    segments: dict[int, list] = {}
    partial_of = {}
    for cta, jobs in enumerate(schedule):
        for j, (tile, k0, k1, peers) in enumerate(jobs):
            assert 0 <= tile < tiles and 0 <= k0 < k1 <= iters
            segments.setdefault(tile, []).append((k0, k1, cta, peers))
            if k0 > 0:
                assert j == 0 and not peers
                partial_of[cta] = tile
    assert sorted(segments) == list(range(tiles))
    for tile, segs in segments.items():
        segs.sort()
        assert segs[0][0] == 0 and segs[-1][1] == iters
        assert all(a[1] == b[0] for a, b in zip(segs, segs[1:], strict=False))
        owner, rest = segs[0], segs[1:]
        assert owner[3] == tuple(c for _, _, c, _ in rest)
        assert all(c > owner[2] and partial_of[c] == tile for c in owner[3])
    return [sum(k1 - k0 for _, k0, k1, _ in jobs) for jobs in schedule]


@pytest.mark.parametrize(("m", "n", "k", "most"), [
    (5001, 1000, 1000, 20),  # 160 tiles of 16 K steps: 2560 over 132, where 28 CTAs ran 32
    (2999, 1000, 1000, 12),  # 96 tiles: 1536 steps, where each CTA that had a tile ran 16
    (1000, 1000, 1000, 4),  # 32 tiles: each split four ways
    (8191, 1000, 1000, 32),  # 256 tiles: two waves less 8 tiles, nothing to gain
    # 2048 tiles of 64 K steps: 14 whole waves a tile a CTA, then 200 tiles shared out (97)
    (16384, 4096, 4096, 14 * 64 + 97),
    (128 * 132, 256, 1000, 16),  # whole waves: every tile whole
])
def test_the_stream_k_split_balances_the_k_steps(m, n, k, most):
    tiles = -(-m // 128) * -(-n // 256)
    iters = G.k_iterations(k, 64, 1)
    work = _check_stream_k_schedule(tiles, iters, 132)
    assert max(work) == most and max(work) - min(work) <= iters  # whole tiles after the split
    assert sum(work) == tiles * iters


@settings(max_examples=300, deadline=None)
@given(tiles=st.integers(1, 700), iters=st.integers(1, 70), sms=st.integers(1, 140))
def test_the_stream_k_schedule_covers_every_tile_once(tiles, iters, sms):
    work = _check_stream_k_schedule(tiles, iters, sms)
    sk = G.StreamKMath(iters, sms).tiles(tiles)
    assert sk in (0, tiles) or sk == tiles % sms + sms
    if sk:  # the stream-K iterations are spread evenly
        shared = [w - iters * len(range(sk + c, tiles, sms)) for c, w in enumerate(work)]
        assert max(shared) - min(shared) <= 1


def test_the_stream_k_configuration():
    assert STREAM_K.label() == "128x256x64/st3sk" and STREAM_K.persistent
    assert G.HOPPER_STREAM_K_CONFIGS["128x128sk"].label() == "128x128x128/st3sk"
    for cfg in G.HOPPER_STREAM_K_CONFIGS.values():
        assert cfg.stream_k and cfg.persistent and cfg.tma and cfg.split == 1
        assert cfg in G.GemmHopperKernel.tune_candidates
        assert cfg in G.GemmPaddedKernel.tune_candidates
    assert not any(c.stream_k for c, _ in HOPPER_CONFIGS.values())  # never the heuristic's
    assert G.program_sms(STREAM_K, "cpu") == 132
    with pytest.raises(ValueError, match="persistent grid loading through TMA"):
        G.gemm_program(1000, 1000, "bfloat16", False, False, STREAM_K._replace(persistent=False))


def test_a_stream_k_call_launches_with_its_workspace_and_flags(monkeypatch):
    seen = []
    monkeypatch.setattr(G, "build_gemm_kernel", lambda *a: seen.append(a) or "main")
    plan = G.plan_of(GemmSpec(device="cuda:0", m=5001, n=1000, k=1000, dtype="bfloat16",
                              trans_a=False, trans_b=True))
    kern = G.GemmHopperKernel(plan)
    launch = kern._build_for(plan, STREAM_K)
    assert isinstance(launch, G.StreamKLaunch)
    assert (launch.main, launch.sms, launch.block_m, launch.block_n) == ("main", 132, 128, 256)
    assert seen[-1][5] == STREAM_K and seen[-1][9] is False  # not accumulating
    # an accumulating call: c added by the program after the fixup, never prefetched
    launch = kern._build_for(msgspec.structs.replace(plan, accumulate=True), STREAM_K)
    assert isinstance(launch, G.StreamKLaunch) and seen[-1][9:] == (True, False)


#: (name, configuration, n, k, trans_a, trans_b, dtype): the shapes the stream-K grid is for,
#: both layouts of b, a K that is no multiple of 64 and a's transposed layout, each tile
_STREAM_K_COMPILES = [
    ("5001x1000x1000-nn", STREAM_K, 1000, 1000, False, False, "bfloat16"),
    ("8191x1000x1000-nt", STREAM_K, 1000, 1000, False, True, "bfloat16"),
    ("k1000-n4096-nt-fp16", STREAM_K, 4096, 1000, False, True, "float16"),
    ("k1032-tn", STREAM_K, 1000, 1032, True, False, "bfloat16"),
    ("128x128-5001x1000x1000-nt", G.HOPPER_STREAM_K_CONFIGS["128x128sk"], 1000, 1000, False,
     True, "bfloat16"),
    ("128x128-k1032-tt-fp16", G.HOPPER_STREAM_K_CONFIGS["128x128sk"], 4096, 1032, True, True,
     "float16"),
]


@needs_nvcc
@pytest.mark.parametrize(("cfg", "n", "k", "ta", "tb", "dtype"),
                         [c[1:] for c in _STREAM_K_COMPILES],
                         ids=[c[0] for c in _STREAM_K_COMPILES])
def test_the_stream_k_program_compiles_asynchronous(cfg, n, k, ta, tb, dtype, tmp_path):
    """The stream-K program as the kernel builds it (programmatic dependent launch, 132 CTAs):
    its load warp's TMA ring, the math warpgroups' products, the partial sums' publication
    (release) and collection (acquire, the flag cleared after), and ptxas's report: no wgmma
    serialized, no wait injected, no spill."""
    src = G.build_gemm_kernel(n, k, dtype, ta, tb, cfg, HOPPER, True, 132).get_kernel_source()
    _check_stream_k_source(src)
    assert "(C + " not in src  # c is written, never read
    assert_asynchronous(ptxas_report(src, tmp_path, "stream_k"))


def _check_stream_k_source(src: str) -> None:
    assert "__launch_bounds__(384, 1)" in src
    assert "float* W" in src and "int* F" in src
    assert src.count("warpgroup_reg_dealloc<40>") == 1
    assert src.count("warpgroup_reg_alloc<232>") == 1
    load = src[src.index("warpgroup_reg_dealloc<40>"):src.index("warpgroup_reg_alloc<232>")]
    math = src[src.index("warpgroup_reg_alloc<232>"):]
    assert "tl::tma_load(A_desc" in load and "tl::tma_load(B_desc" in load
    assert "wgmma" not in load and "tma_load" not in math
    # the CTA's partial sum, each thread's stores fenced (the named barrier is no compiler
    # fence), then its flag raised with release order (3) after the barrier
    write = math.index("*(float2*)(W + ")
    fence = math.index("__threadfence();", write)
    assert write < fence < math.index("__sync_thread_partial(10, 256)", fence) < math.index(
        "AtomicStore((&(F[((int)blockIdx.x)])), 1, 3)", fence)
    # the owner spins on a later CTA's flag with acquire order (2), clears it, meets the
    # others at the barrier, each fenced before it reads the sum
    spin = math.index("AtomicLoad((&(F[((int64_t)p)])), 2);")
    clear = math.index("F[p] = 0;", spin)
    meet = math.index("__sync_thread_partial(10, 256);", clear)
    assert re.match(r"__sync_thread_partial\(10, 256\);\s*__threadfence\(\);", math[meet:])
    assert meet < math.index("(W + ", meet)
    assert "tl::tma_store(C_desc" in math  # tiles stored through the shared tile, clipped
    assert "cudaGridDependencySynchronize" in load and "cudaGridDependencySynchronize" in math


@needs_nvcc
@pytest.mark.parametrize("name", sorted(G.HOPPER_STREAM_K_CONFIGS))
def test_the_accumulating_stream_k_program_adds_c_after_the_fixup(name, tmp_path):
    """With ``accumulate`` the math warpgroups read the tile's c (16-byte loads into the
    shared tile, after a barrier that orders them behind the previous tile's store) once the
    later CTAs' sums are added, add it in fp32 and store; ptxas as for the plain program."""
    src = G.build_gemm_kernel(1000, 1000, "bfloat16", False, True,
                              G.HOPPER_STREAM_K_CONFIGS[name], HOPPER, True, 132, True
                              ).get_kernel_source()
    _check_stream_k_source(src)
    math = src[src.index("warpgroup_reg_alloc<232>"):]
    read = math.index("*(uint4*)(C + ")
    fixup = math.rindex("(W + ", 0, read)
    assert fixup < math.rindex("__sync_thread_partial(10, 256);", 0, read)
    assert "__bfloat1622float2" in math[read:]  # widened and added in fp32
    assert read < math.index("ptx_stmatrix", read) < math.index("tl::tma_store(C_desc", read)
    assert_asynchronous(ptxas_report(src, tmp_path, "stream_k_acc"))
