"""The kernels' on-disk caches: a tuning entry that fails to decode for any reason is rebuilt,
a cache that cannot be written warns once and tuning still serves the call, and TileLang's
compiled kernels live under TILEOPS_CACHE_DIR."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import gemm as G
from tileops.kernels.gemm import (
    GENERAL_CONFIG,
    HOPPER_CONFIGS,
    GemmPlan,
    TuningCacheWarning,
    load_tuned,
    store_tuned,
    tune_key,
)

SPEC = GemmPlan(device="cuda", m=G.m_bucket(128), n=4096, k=4096, dtype="bfloat16",
                trans_a=False, trans_b=False)
KEY = tune_key("sm_90", SPEC, "GemmHopperKernel")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(G, "_warned_unwritable", set())  # each test sees its first warning
    return tmp_path / "gemm"


def _good() -> str:
    return json.dumps({"key": KEY, "config": GENERAL_CONFIG._asdict(), "timings_ms": {}})


def _with(**config) -> str:
    return json.dumps({"key": KEY, "config": {**GENERAL_CONFIG._asdict(), **config}})


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# every way an entry can fail to decode or to be one; each is refused, then rebuilt
CORRUPT: dict[str, bytes] = {
    "empty": b"",
    "truncated": _good()[: len(_good()) // 2].encode(),
    "truncated-one-byte": _good()[:-1].encode(),
    "binary-garbage": bytes(range(256)) * 4,
    "not-utf8": b'{"key": "\xff\xfe"}',
    "utf16-garbage": "\ufeff{]".encode("utf-16"),
    "nul-bytes": b"\0" * 64,
    "nested-array": _nested(30000).encode(),  # RecursionError inside json, under the size bound
    "nested-object": ('{"a":' * 20000 + "1" + "}" * 20000).encode(),
    "nested-in-config": _with(block_m=json.loads(_nested(50))).encode(),
    "too-large": (_good() + " " * (1 << 16)).encode(),
    "not-object": b"[]",
    "null": b"null",
    "string": b'"config"',
    "key-missing": json.dumps({"config": GENERAL_CONFIG._asdict()}).encode(),
    "key-wrong": _good().replace(KEY, "another").encode(),
    "key-int": json.dumps({"key": 1, "config": GENERAL_CONFIG._asdict()}).encode(),
    "config-list": json.dumps({"key": KEY, "config": list(GENERAL_CONFIG)}).encode(),
    "config-missing-field": json.dumps(
        {"key": KEY, "config": {k: v for k, v in GENERAL_CONFIG._asdict().items()
                                if k != "split"}}).encode(),
    "config-extra-field": _with(unroll=2).encode(),
    "int-as-str": _with(block_m="64").encode(),
    "int-as-float": _with(block_m=64.0).encode(),
    "int-as-bool": _with(stages=True).encode(),
    "bool-as-int": _with(tma=1).encode(),
    "bool-as-str": _with(persistent="false").encode(),
    "policy-unknown": _with(policy="diagonal").encode(),
    "policy-list": _with(policy=["square"]).encode(),
    "zero-tile": _with(block_n=0).encode(),
    "negative-panel": _with(panel=-1).encode(),
    "negative-split": _with(split=-2).encode(),
    "nan": _good().replace('"stages": 2', '"stages": NaN').encode(),
    "huge-int": _good().replace('"threads": 128', '"threads": ' + "9" * 5000).encode(),
}


def test_the_corpus_changes_a_valid_entry() -> None:
    assert '"stages": 2' in _good() and '"threads": 128' in _good()  # what nan/huge-int edit


@pytest.mark.parametrize("name", CORRUPT)
def test_a_corrupt_entry_is_refused_then_rebuilt(cache: Path, name: str) -> None:
    cache.mkdir(parents=True)
    path = cache / f"{KEY}.json"
    path.write_bytes(CORRUPT[name])
    assert load_tuned(KEY) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilding over it is no failure to write
        assert store_tuned(KEY, GENERAL_CONFIG) == path
    assert load_tuned(KEY) == GENERAL_CONFIG


@pytest.mark.parametrize("shape", ["empty-dir", "full-dir", "fifo"])
def test_what_is_not_a_regular_file_in_its_place_is_refused_then_rebuilt(
        cache: Path, shape: str) -> None:
    path = cache / f"{KEY}.json"
    cache.mkdir(parents=True)
    if shape == "fifo":
        os.mkfifo(path)  # opened without blocking, then refused
    else:
        path.mkdir()
        if shape == "full-dir":
            (path / "sub").mkdir()
            (path / "sub" / "x").write_text(_good())
    assert load_tuned(KEY) is None
    assert store_tuned(KEY, GENERAL_CONFIG) == path
    assert path.is_file() and load_tuned(KEY) == GENERAL_CONFIG


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=512))
def test_no_bytes_make_loading_raise(tmp_path_factory, data: bytes) -> None:
    root = tmp_path_factory.mktemp("bytes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILEOPS_CACHE_DIR", str(root))
        (root / "gemm").mkdir()
        (root / "gemm" / f"{KEY}.json").write_bytes(data)
        assert load_tuned(KEY) is None


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(G.GemmConfig._fields), value=_JSON)
def test_a_field_of_any_other_json_value_is_refused_or_equal(tmp_path_factory, field: str,
                                                             value: object) -> None:
    """One field replaced by any json value: the entry loads only where the value passes its
    field's check, and then loads as exactly that configuration."""
    root = tmp_path_factory.mktemp("json")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILEOPS_CACHE_DIR", str(root))
        (root / "gemm").mkdir()
        (root / "gemm" / f"{KEY}.json").write_text(_with(**{field: value}))
        got = load_tuned(KEY)
    default = GENERAL_CONFIG._asdict()[field]
    valid = (type(value) is type(default) and (
        value in ("square", "col") if field == "policy"
        else isinstance(value, bool) or value >= (0 if field == "panel" else 1)))
    assert got == (GENERAL_CONFIG._replace(**{field: value}) if valid else None)


# --- a cache that cannot be written ---------------------------------------------------------


def _fail(exc: OSError):
    def raise_(*args, **kwargs):
        raise exc

    return raise_


def _under_a_file(root: Path, mp: pytest.MonkeyPatch) -> None:
    """TILEOPS_CACHE_DIR under a regular file: no directory can be made there, root or not."""
    (root / "file").write_text("x")
    mp.setenv("TILEOPS_CACHE_DIR", str(root / "file" / "cache"))


UNWRITABLE = {
    "cache-dir-under-a-file": _under_a_file,
    "part-is-a-file": lambda root, mp: (root / "gemm").write_text("x"),
    # a read-only directory (simulated: the tests may run as root, which permissions spare)
    "read-only": lambda root, mp: mp.setattr(G.tempfile, "mkstemp", _fail(
        PermissionError(errno.EACCES, "Permission denied"))),
    "disk-full": lambda root, mp: mp.setattr(G.os, "replace", _fail(
        OSError(errno.ENOSPC, "No space left on device"))),
}


@pytest.mark.parametrize("how", UNWRITABLE)
def test_an_unwritable_cache_warns_once_per_directory(cache: Path, monkeypatch, how) -> None:
    UNWRITABLE[how](cache.parent, monkeypatch)
    with pytest.warns(TuningCacheWarning, match=r"the GEMM tuning cache .* cannot be written "
                      r"\(\w+Error: .*\); tuned configurations serve this process only "
                      r"\(set TILEOPS_CACHE_DIR to a writable directory\)"):
        assert store_tuned(KEY, GENERAL_CONFIG) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert store_tuned(KEY, HOPPER_CONFIGS["64x64"][0]) is None
    assert load_tuned(KEY) is None
    if cache.is_dir():  # the failed write left no temporary file behind
        assert [p.name for p in cache.iterdir()] == []


def test_another_unwritable_directory_warns_again(cache: Path, monkeypatch) -> None:
    (cache.parent / "gemm").write_text("x")
    with pytest.warns(TuningCacheWarning):
        store_tuned(KEY, GENERAL_CONFIG)
    other = cache.parent / "other"
    other.mkdir()
    (other / "gemm").write_text("x")
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(other))
    with pytest.warns(TuningCacheWarning, match=str(other / "gemm")):
        store_tuned(KEY, GENERAL_CONFIG)


class _FakeTensor:
    def __init__(self, shape):
        self.shape = shape
        self.device = "cpu"


def test_tuning_with_an_unwritable_cache_warns_and_serves_the_call(cache, monkeypatch) -> None:
    (cache.parent / "gemm").write_text("not a folder")
    ran = []
    monkeypatch.setattr(G, "build_gemm_kernel",
                        lambda n, k, dt, ta, tb, cfg, target, pdl, sms, accumulate=False, prefetch=False:
                        (lambda a, b, c, cfg=cfg: ran.append(cfg) or cfg))
    fastest = HOPPER_CONFIGS["128x128"][0]
    monkeypatch.setattr(G, "_time_ms", lambda fn: 1.0 if fn() == fastest else 2.0)
    monkeypatch.setattr(G, "device_arch", lambda device: (9, 0))
    spec = GemmPlan(device="cuda", m=G.m_bucket(2048), n=4096, k=4096, dtype="bfloat16",
                    trans_a=False, trans_b=False)
    kern = G.GemmHopperKernel(spec)
    kern.request_tune()
    args = (_FakeTensor((2048, 4096)), _FakeTensor((4096, 4096)), _FakeTensor((2048, 4096)))
    with pytest.warns(TuningCacheWarning, match="cannot be written"):
        kern(*args)
    assert kern.config == fastest and ran[-1] == fastest  # the call ran the tuned program
    ran.clear()
    kern(*args)  # later calls run it too, with no tuning and no warning
    assert ran == [fastest]


# --- TileLang's compiled kernels --------------------------------------------------------------

_CHILD = r"""
import json, os, sys
from tileops.kernels import gemm
from tileops.kernels._tilelang import tl
key = gemm.tune_key("sm_90", gemm.GemmPlan(device="cuda", m=1, n=8, k=8, dtype="float16",
                    trans_a=False, trans_b=False), "GemmGemvKernel")
before = "tilelang" in sys.modules
tilelang, _ = tl()
from tilelang.cache.kernel_cache import KernelCache
print(json.dumps({"imported_before": before, "env": str(tilelang.env.TILELANG_CACHE_DIR),
                  "kernels": KernelCache._get_cache_root(),
                  "tvm_ffi": os.environ["TVM_FFI_CACHE_DIR"]}))
"""


def test_tilelang_writes_under_tileops_cache_dir(tmp_path: Path) -> None:
    """In a fresh process whose environment names only TILEOPS_CACHE_DIR (and a TileLang
    cache elsewhere, which is replaced): naming a tuning entry does not import TileLang, and
    once it is imported its kernel cache and tvm-ffi's lie under TILEOPS_CACHE_DIR, and
    nothing is written anywhere else in the home directory."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    child_env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home),
                 "TILEOPS_CACHE_DIR": str(cache),
                 "TILELANG_CACHE_DIR": str(tmp_path / "elsewhere")}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=child_env, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["imported_before"] is False
    assert got["env"] == str(cache / "tilelang")
    assert Path(got["kernels"]).is_relative_to(cache / "tilelang")
    assert Path(got["kernels"]).is_dir()  # TileLang made it on import: where we said
    assert got["tvm_ffi"] == str(cache / "tvm-ffi")
    assert not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "home"]
    assert [p for p in home.rglob("*") if p.is_file()] == []


def test_pointing_the_compiler_caches_replaces_and_logs_another_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tileops.kernels._tilelang import point_compiler_caches
    from tileops.runtime import log

    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TILELANG_CACHE_DIR", "/elsewhere")  # monkeypatch restores both after
    monkeypatch.delenv("TVM_FFI_CACHE_DIR", raising=False)
    seen: list[str] = []
    monkeypatch.setattr(log, "info", lambda msg, *args: seen.append(msg % args))
    point_compiler_caches()
    assert os.environ["TILELANG_CACHE_DIR"] == str(tmp_path / "tilelang")
    assert os.environ["TVM_FFI_CACHE_DIR"] == str(tmp_path / "tvm-ffi")
    assert seen == [f"TILELANG_CACHE_DIR=/elsewhere replaced by {tmp_path / 'tilelang'}: "
                    "TILEOPS_CACHE_DIR is the one cache directory of TileOPs"]
    point_compiler_caches()  # already pointed there: nothing to replace, nothing logged
    assert len(seen) == 1
