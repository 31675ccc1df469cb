"""The kernel store (tileops.kernels._store): keys, entries checked before use, the fall back
to a build on every failure, and that every family's builder goes through it. The store's
real load of a CUDA library runs on a GPU (tests/kernels/test_store_cuda.py); here the
library is a file of bytes and the loader a stand-in."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import pkgutil
import shutil
import subprocess
import sys
import types
from enum import Enum
from typing import NamedTuple

import msgspec
import pytest

import tileops.kernels as K
from tileops.kernels import _store as S
from tileops.runtime import log


@pytest.fixture(autouse=True)
def _warnings_reach_caplog(monkeypatch):
    """The ``tileops`` logger writes to its own handler and does not propagate; the tests read
    its warnings from caplog's handler on the root logger, whatever ran before them."""
    monkeypatch.setattr(log.logger, "propagate", True)

DEVICE = ["Stand-in GPU", [9, 0], 132]


class Kind(str, Enum):
    A = "a"


class Plan(NamedTuple):
    threads: int
    per: int


class Spec(msgspec.Struct, frozen=True):
    n: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class Box:
    a: int
    b: tuple


def test_canonical_encodings_keep_types_apart():
    assert S.canonical((1, True, None, "a")) == [1, True, None, "a"]
    assert S.canonical(Kind.A) != S.canonical("a")  # a str enum keeps its type
    assert S.canonical(0.1) == {"float": "0.1"} and S.canonical(1.0) != S.canonical(1)
    assert S.canonical(Plan(128, 2)) == {"tuple": f"{__name__}.Plan",
                                          "fields": [["threads", 128], ["per", 2]]}
    assert S.canonical(Plan(128, 2)) != S.canonical((128, 2))
    assert S.canonical(Spec(4, "bfloat16"))["fields"] == [["n", 4], ["dtype", "bfloat16"]]
    assert S.canonical(Box(2, (3,))) == {"struct": f"{__name__}.Box",
                                         "fields": [["a", 2], ["b", [3]]]}
    torch = pytest.importorskip("torch")
    assert S.canonical(torch.device("cuda", 0)) == {"device": "cuda:0"}
    assert S.canonical(torch.bfloat16) == {"dtype": "torch.bfloat16"}
    for bad in (object(), {1: 2}, b"x", 1j, Box):
        with pytest.raises(S.Unstorable, match="no stable encoding for a"):
            S.canonical(bad)


def _builder(calls):
    def build_thing(n: int, dtype: str, target: str | None = None, plan: Plan | None = None):
        calls.append((n, dtype, target, plan))
        return _Built(f"{n}-{dtype}-{plan}".encode())

    return build_thing


class _Built:
    """A compiled kernel's stand-in: exports its bytes as its library."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def export_library(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.payload)


class _NoLibrary:
    """What a compile without a device returns: no library to export."""

    def export_library(self, path: str) -> None:
        raise AttributeError("Runtime module is not available")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store under a temporary cache, the device a stand-in, the loader recording paths."""
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(S, "_device", lambda: list(DEVICE))
    loads = []

    def fake_load(path):
        loads.append(path)
        data = path.read_bytes()
        return types.SimpleNamespace(main=lambda *args: (data, args))

    monkeypatch.setattr(S, "load_module", fake_load)
    monkeypatch.setattr(S, "_state", {})
    return loads


def _entry(calls, n=4):
    build = _builder(calls)
    parts = S.key_parts(build, {"n": n, "dtype": "bfloat16", "target": None, "plan": None},
                        DEVICE)
    key = S.key_of(parts)
    return build, parts, key, S.root() / key


def test_a_build_is_stored_then_loaded_without_building(store):
    calls = []
    build, parts, key, folder = _entry(calls)
    first = S.build_or_load(build, (4, "bfloat16"), {})
    # built, stored, and called through the stored library, as a later process will
    assert isinstance(first, S.StoredKernel) and first.key == key and len(calls) == 1
    assert first(1, 2) == (b"4-bfloat16-None", (1, 2))
    assert sorted(p.name for p in folder.iterdir()) == ["entry.json", "executable.so"]
    rec = json.loads((folder / "entry.json").read_text())
    assert rec["key"] == key and rec["parts"] == json.loads(json.dumps(parts))
    again = S.build_or_load(build, (4,), {"dtype": "bfloat16"})  # the same bound arguments
    assert isinstance(again, S.StoredKernel) and len(calls) == 1
    assert again(1, 2) == (b"4-bfloat16-None", (1, 2)) and store == [folder / "executable.so"] * 2
    assert [p.name for p in S.root().iterdir()] == [key]  # no temporary folder left behind


def test_the_key_follows_every_part(store):
    calls = []
    build, parts, key, _ = _entry(calls)
    keys = {key}
    for other in ({"device": ["Other", [9, 0], 132]}, {"sources": "0" * 64},
                  {"arguments": parts["arguments"][:1] + [["dtype", "float16"]]
                   + parts["arguments"][2:]}):
        keys.add(S.key_of({**parts, **other}))
    plan = S.key_parts(build, {"n": 4, "dtype": "bfloat16", "target": None,
                               "plan": Plan(128, 2)}, DEVICE)
    keys.add(S.key_of(plan))
    assert len(keys) == 5
    assert S.key_parts(build, {"n": 4}, DEVICE)["builder"].endswith("build_thing")


@pytest.mark.parametrize("damage", ["library", "record-key", "record-parts", "not-json",
                                    "deep-json", "huge", "no-record", "format"])
def test_an_entry_that_fails_its_check_is_rebuilt(store, damage, caplog):
    calls = []
    build, parts, key, folder = _entry(calls)
    S.build_or_load(build, (4, "bfloat16"), {})
    rec_path, lib = folder / "entry.json", folder / "executable.so"
    rec = json.loads(rec_path.read_text())
    if damage == "library":
        lib.write_bytes(b"4-bfloat16-Nonf")  # same size, other bytes
    elif damage == "record-key":
        rec_path.write_text(json.dumps({**rec, "key": "0" * 64}))
    elif damage == "record-parts":
        rec_path.write_text(json.dumps({**rec, "parts": {**rec["parts"], "device": ["x"]}}))
    elif damage == "not-json":
        rec_path.write_bytes(b"\x80not json")
    elif damage == "deep-json":
        rec_path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "huge":
        rec_path.write_bytes(b" " * (S._RECORD_LIMIT + 1))
    elif damage == "no-record":
        rec_path.unlink()
    else:
        rec_path.write_text(json.dumps({**rec, "format": 0}))
    store.clear()
    with caplog.at_level(logging.WARNING, logger="tileops"):
        got = S.build_or_load(build, (4, "bfloat16"), {})
    # rebuilt, stored again, and that library (not the damaged one) is the one called
    assert isinstance(got, S.StoredKernel) and len(calls) == 2 and len(store) == 1
    assert got(0) == (b"4-bfloat16-None", (0,))
    assert f"stored kernel {key[:12]} of {parts['builder']} not used" in caplog.text
    assert S.check_entry(folder, key, parts) is None  # rewritten, whole
    assert isinstance(S.build_or_load(build, (4, "bfloat16"), {}), S.StoredKernel)


def test_a_library_that_fails_to_load_is_rebuilt(store, monkeypatch, caplog):
    calls = []
    build, _, key, folder = _entry(calls)
    S.build_or_load(build, (4, "bfloat16"), {})
    S.build_or_load.__globals__["_state"].pop("disabled", None)

    def broken(path):
        raise RuntimeError("Library binary was created using {cuda} but a loader of that "
                           "name is not registered")

    monkeypatch.setattr(S, "load_module", broken)
    with caplog.at_level(logging.WARNING, logger="tileops"):
        got = S.build_or_load(build, (4, "bfloat16"), {})
    assert isinstance(got, _Built) and len(calls) == 2
    assert "it failed to load (RuntimeError: Library binary" in caplog.text
    assert "the store is off for this process" in caplog.text and not folder.exists()
    assert caplog.text.count("WARNING") == 1  # the rebuild is not stored nor loaded again
    caplog.clear()
    other, _, _, other_folder = _entry(calls, n=8)
    with caplog.at_level(logging.WARNING, logger="tileops"):
        assert isinstance(S.build_or_load(build, (8, "bfloat16"), {}), _Built)
        assert isinstance(S.build_or_load(build, (4, "bfloat16"), {}), _Built)
    assert caplog.text == "" and len(calls) == 4 and not other_folder.exists()


def test_builds_the_store_does_not_take(store, tmp_path, monkeypatch, caplog):
    calls = []
    build, *_ = _entry(calls)
    S.build_or_load(build, (4, "bfloat16", "sm_90"), {})  # an explicit target: a CPU test's
    S.build_or_load(build, (4, "bfloat16"), {"plan": object()})  # no stable encoding
    assert len(calls) == 2 and not S.root().exists()
    monkeypatch.setattr(S, "_device", lambda: None)  # no CUDA device: the build decides
    S.build_or_load(build, (4, "bfloat16"), {})
    assert len(calls) == 3 and not S.root().exists()


@pytest.mark.parametrize("failure", ["no-library", "export-error", "unwritable"])
def test_a_kernel_without_a_library_or_an_unwritable_store_warns_once(store, monkeypatch,
                                                                       caplog, failure):
    monkeypatch.setattr(S, "_device", lambda: list(DEVICE))
    calls = []

    class _ExportFails:
        def export_library(self, path):
            raise RuntimeError("the linker failed")

    made = {"no-library": _NoLibrary, "export-error": _ExportFails,
            "unwritable": lambda: _Built(b"x")}[failure]

    def build_bare(n: int, target: str | None = None):
        calls.append(n)
        return made()

    if failure == "unwritable":
        S.root().parent.mkdir(parents=True, exist_ok=True)
        S.root().write_text("a file where the store's folder goes")
    with caplog.at_level(logging.WARNING, logger="tileops"):
        for n in (1, 2):
            assert S.build_or_load(build_bare, (n,), {}) is not None
    assert caplog.text.count("compiled kernels are not stored under") == 1
    assert calls == [1, 2]
    if failure != "unwritable":
        assert list(S.root().iterdir()) == []  # nothing half-written


def test_a_fresh_build_whose_library_does_not_load_is_served_by_itself(store, monkeypatch,
                                                                        caplog):
    def broken(path):
        raise OSError("undefined symbol: TVMFFIFunctionCall")

    monkeypatch.setattr(S, "load_module", broken)
    calls = []
    build, _, key, folder = _entry(calls)
    with caplog.at_level(logging.WARNING, logger="tileops"):
        got = S.build_or_load(build, (4, "bfloat16"), {})
        other = S.build_or_load(build, (5, "bfloat16"), {})
    assert isinstance(got, _Built) and isinstance(other, _Built) and len(calls) == 2
    assert f"stored kernel {key[:12]} of" in caplog.text and "does not load (OSError: " \
        "undefined symbol" in caplog.text and caplog.text.count("WARNING") == 1
    assert not (S.root() / S.key_of(_entry([], n=5)[1])).exists()  # the store is off


def test_the_decorator_keeps_the_lru_cache_in_front(store):
    calls = []
    cached = S.stored(maxsize=4)(_builder(calls))
    assert cached(4, "bfloat16") is cached(4, "bfloat16") and len(calls) == 1
    cached.cache_clear()
    assert isinstance(cached(4, "bfloat16"), S.StoredKernel) and len(calls) == 1
    assert cached.build.__name__ == "build_thing" and cached.__name__ == "build_thing"


def test_every_family_builder_goes_through_the_store():
    """Each family module's compiling functions (those that call compile_program) are the
    store's decorated builders: a builder left on a bare lru_cache would import TileLang on
    every first call."""
    import inspect

    seen = 0
    for info in pkgutil.iter_modules(K.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"tileops.kernels.{info.name}")
        for name, fn in vars(mod).items():
            target = getattr(fn, "build", None) or getattr(fn, "__wrapped__", None) or fn
            if not callable(fn) or getattr(target, "__module__", None) != mod.__name__:
                continue
            try:
                src = inspect.getsource(target)
            except (OSError, TypeError):
                continue
            if "return compile_program(" in src:
                assert hasattr(fn, "build") and hasattr(fn, "cache_clear"), \
                    f"{mod.__name__}.{name} compiles without the kernel store"
                seen += 1
    assert seen >= 38


def test_the_runtime_library_is_found_without_importing_tilelang():
    pytest.importorskip("tilelang")
    code = ("import sys; from tileops.kernels import _store as S; p = S.runtime_library(); "
            "print(p.name if p else None, 'tilelang' in sys.modules, 'tvm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["libtvm_runtime.so", "False", "False"]


# --- a real library: compiled for sm_90 here, stored, loaded by a process without TileLang ----

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc")

_LOAD = r"""
import sys
from pathlib import Path
import torch
from tileops.kernels import _store as S
S._device = lambda: {device!r}
folder = S.root() / {key!r}
assert S.check_entry(folder, {key!r}, {parts!r}) is None
kernel = S.StoredKernel({key!r}, S.load_module(folder / S.LIBRARY))
x = torch.randn(16, dtype=torch.bfloat16)
try:
    kernel(x, torch.empty_like(x))
except RuntimeError as exc:
    print("refused:", exc)
print("tilelang" in sys.modules, "tvm" in sys.modules)
"""


_REAL_LOAD = S.load_module


@needs_nvcc
def test_a_real_library_is_stored_and_loads_without_tilelang(store, monkeypatch):
    """The silu program compiled for sm_90 is exported into the store and loads in a fresh
    process that never imports TileLang; its own host code then checks the call (a CPU
    tensor is refused by the library, which is how it shows it is the kernel)."""
    from tileops.kernels import elementwise as E

    p = E.Plan("flat", ((0,),), ((1,),) * 2, ((False,),), 8, 128, 2, 128, False)
    args = ("silu", (), ("bfloat16",), ("bfloat16",), "float32", 1, p)

    def build_silu(*a, target=None):  # the current device's build, compiled for sm_90 here
        return E.build_kernel.build(*a, target="sm_90")

    monkeypatch.setattr(S, "load_module", _REAL_LOAD)
    kernel = S.build_or_load(build_silu, args, {})
    assert isinstance(kernel, S.StoredKernel)  # this process, too, calls the stored library
    x = pytest.importorskip("torch").randn(16)
    with pytest.raises(RuntimeError, match="device_type mismatch, expected cuda"):
        kernel(x.bfloat16(), x.bfloat16())
    bound = {"a": args, "target": None}
    parts = S.key_parts(build_silu, bound, DEVICE)
    key = S.key_of(parts)
    assert S.check_entry(S.root() / key, key, parts) is None
    code = _LOAD.format(device=DEVICE, key=key, parts=json.loads(json.dumps(parts)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ}, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == "False False", res.stdout  # neither TileLang nor TVM's Python
    assert lines[-2].startswith("refused:") and "device_type mismatch, expected cuda" in \
        lines[-2]


_LOAD_TMA = r"""
import sys
import torch
from tileops.kernels import _store as S
S._device = lambda: {device!r}
folder = S.root() / {key!r}
assert S.check_entry(folder, {key!r}, {parts!r}) is None
import tvm_ffi
before = tvm_ffi.get_global_func("__tvm_tensormap_create_tiled", allow_missing=True)
kernel = S.StoredKernel({key!r}, S.load_module(folder / S.LIBRARY))
after = tvm_ffi.get_global_func("__tvm_tensormap_create_tiled", allow_missing=True)
print(before is None, after is not None)
print("tilelang" in sys.modules, "tvm" in sys.modules)
"""


@needs_nvcc
def test_a_tma_program_loads_the_descriptor_encoders_without_tilelang(store, monkeypatch):
    """A Hopper GEMM program (TMA copies) looks up TileLang's descriptor encoder by name on
    every launch: a process that loads it from the store without importing TileLang gets the
    encoder registered by loading TileLang's library, not its Python package (without it the
    first launch failed: "Cannot find function __tvm_tensormap_create_tiled")."""
    from tileops.kernels import gemm as G

    cfg = G.HOPPER_CONFIGS["64x128"][0]
    args = (256, 256, "bfloat16", False, False, cfg)

    def build_gemm(*a, target=None):  # the current device's build, compiled for sm_90a here
        return G.build_gemm_kernel.build(*a, target="sm_90a")

    monkeypatch.setattr(S, "load_module", lambda path: path)  # this process: storing only
    S.build_or_load(build_gemm, args, {})
    parts = S.key_parts(build_gemm, {"a": args, "target": None}, DEVICE)
    key = S.key_of(parts)
    library = (S.root() / key / S.LIBRARY).read_bytes()
    assert S.needed_tilelang_functions(library) == ["__tvm_tensormap_create_tiled"]
    code = _LOAD_TMA.format(device=DEVICE, key=key, parts=json.loads(json.dumps(parts)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ}, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-2:] == ["True True", "False False"], res.stdout


def test_a_library_naming_an_unregistered_function_is_not_served(store, tmp_path, monkeypatch):
    """Where TileLang's library does not register what a stored library calls, the load
    raises (the store then serves the compiled kernel) instead of a launch failing later."""
    monkeypatch.setattr(S, "load_module", _REAL_LOAD)
    monkeypatch.setattr(S, "_tilelang_lib", lambda name: None)
    monkeypatch.setitem(S._state, "runtime", object())  # the runtime counts as loaded
    monkeypatch.delitem(S._state, "tilelang_lib", raising=False)
    lib = tmp_path / S.LIBRARY
    lib.write_bytes(b"\x7fELF...__tvm_tensormap_create_tiled\0...")
    with pytest.raises(FileNotFoundError, match="libtilelang.so is not installed"):
        S.load_module(lib)
    assert S.needed_tilelang_functions(b"plain host code") == []


def test_an_entry_a_peer_stored_first_is_checked_before_it_is_loaded(store, monkeypatch):
    """Where another process renamed its entry into place first, this build's is dropped and
    that one is used only if it passes the check; otherwise the fresh build serves."""
    calls = []
    build, parts, key, folder = _entry(calls)
    real_replace = S.os.replace

    def peer_first(src, dst):  # a peer's damaged entry lands first
        folder.mkdir(parents=True)
        (folder / S.LIBRARY).write_bytes(b"half a library")
        (folder / S.RECORD).write_text("{}")
        return real_replace(src, dst)  # fails: the folder is taken and not empty

    monkeypatch.setattr(S.os, "replace", peer_first)
    got = S.build_or_load(build, (4, "bfloat16"), {})
    assert isinstance(got, _Built) and store == []  # the peer's entry was not loaded
