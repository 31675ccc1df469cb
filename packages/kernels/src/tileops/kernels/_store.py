"""The kernel store: every program the runtime compiles for the current device is also kept as
a shared library under ``TILEOPS_CACHE_DIR/kernels``, and a later process loads it from there
without importing TileLang (whose import is most of a cold first call: about 2.7 s on the H200
host against 0.26 s for what a stored kernel needs).

A stored kernel is TileLang's exported library (``JITKernel.export_library``): its host code
checks every argument and launches the CUDA module embedded in it. Loading it takes tvm-ffi
(which TileLang imports anyway) and the TVM runtime library TileLang ships, the one that
registers the loader of CUDA modules, plus, for a program with TMA copies, TileLang's own
library, which registers the descriptor encoders its host code calls on every launch; each is
loaded by path, with ``RTLD_GLOBAL`` as TVM loads it, so a TileLang imported later in the
process finds it already there. Calling the loaded
module with every tensor is what TileLang's own launcher does for a program without
allocated outputs (all of this library's), on torch's current stream.

:func:`stored` decorates each family's ``build_*`` function (an ``lru_cache`` in front, as
before). A build for an explicit target (a CPU test compiling for ``sm_90``) never touches the
store. Otherwise the entry's key is the SHA-256 of, as canonical JSON:

- the builder (module and name) and its bound arguments, each encoded by :func:`canonical`
  (an argument of any other type leaves that build out of the store, never a guessed key);
- the digest of this package's sources (a change to any kernel file makes new keys);
- the device (name, compute capability, SM count) and the versions of TileOPs, TileLang and
  tvm-ffi.

The process that compiles a kernel stores it and then calls the stored library as well, so
every process launches the same way (through the library's entry function, without TileLang's
Python wrapper around it).

An entry is a folder named by its key: ``executable.so`` and ``entry.json`` (format, key, the
key's parts, the library's size and SHA-256). It is read only after those all match; one that
does not (truncated, edited, another key's) is removed and rebuilt, with a warning; one that
passes and still fails to load turns the store off for the process (one warning), every
later build compiling as TileLang alone would. Anything else that goes wrong while storing
(an unwritable folder, a kernel without a library) warns once and leaves the build as it is.
Folders
are written under a temporary name and renamed into place, so a reader never sees half an
entry. Nothing is unpickled: the entry's record is JSON, its library is checked by hash.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import threading
import uuid
from enum import Enum
from pathlib import Path
from typing import Any

from tileops.runtime import env, log

FORMAT = 1
LIBRARY = "executable.so"
RECORD = "entry.json"
#: the largest entry record read (a record is a few KB; a bigger file is not one of ours)
_RECORD_LIMIT = 1 << 20

_lock = threading.Lock()
_state: dict[str, Any] = {}


class Unstorable(TypeError):
    """An argument :func:`canonical` has no stable encoding for."""


def canonical(value: Any) -> Any:
    """A JSON value that names ``value`` across processes: bools, ints, strings and None as
    themselves, floats by ``repr`` (exact), tuples and lists as lists, enums, named tuples,
    dataclasses and msgspec structs tagged with their type's qualified name, ``torch.device``
    and ``torch.dtype`` by their strings; anything else raises :class:`Unstorable`."""
    if isinstance(value, Enum):  # before the primitives: a str or int enum keeps its type
        return {"enum": _qualname(type(value)), "value": canonical(value.value)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return {"tuple": _qualname(type(value)),
                "fields": [[f, canonical(getattr(value, f))] for f in type(value)._fields]}
    if isinstance(value, (tuple, list)):
        return [canonical(v) for v in value]
    fields = getattr(type(value), "__struct_fields__", None)
    if fields is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple(f.name for f in dataclasses.fields(value))
    if fields is not None:
        return {"struct": _qualname(type(value)),
                "fields": [[f, canonical(getattr(value, f))] for f in fields]}
    if type(value).__module__ == "torch" and type(value).__name__ in ("device", "dtype"):
        return {type(value).__name__: str(value)}
    raise Unstorable(f"no stable encoding for a {type(value).__qualname__}")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def sources_digest() -> str:
    """SHA-256 over this package's Python sources, by name and bytes (computed once)."""
    if "sources" not in _state:
        h = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        _state["sources"] = h.hexdigest()
    return _state["sources"]


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _device() -> list[Any] | None:
    """The current CUDA device's name, capability and SM count (None without one: the build
    then goes its own way, to compile or to refuse)."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return [props.name, list(torch.cuda.get_device_capability(index)),
            props.multi_processor_count]


def key_parts(build, arguments: dict[str, Any], device: list[Any]) -> dict[str, Any]:
    """What an entry's key is the hash of (raises :class:`Unstorable` for an argument with no
    stable encoding)."""
    return {"format": FORMAT, "builder": f"{build.__module__}.{build.__qualname__}",
            "arguments": [[k, canonical(v)] for k, v in arguments.items()],
            "sources": sources_digest(), "device": device,
            "versions": {d: _version(d) for d in ("tileops-kernels", "tilelang",
                                                   "apache-tvm-ffi")}}


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def root() -> Path:
    return env.cache_part("kernels")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_entry(folder: Path, key: str, parts: dict[str, Any]) -> str | None:
    """Why the entry in ``folder`` may not be loaded for ``key`` (None: it may)."""
    record, library = folder / RECORD, folder / LIBRARY
    if not record.is_file() or not library.is_file():
        return "it is incomplete"
    if record.stat().st_size > _RECORD_LIMIT:
        return "its record is too large to be one"
    try:
        rec = json.loads(record.read_bytes())
    except (ValueError, RecursionError) as exc:
        return f"its record does not decode ({type(exc).__name__})"
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        return "its record is not of this format"
    if rec.get("key") != key or rec.get("parts") != json.loads(json.dumps(parts)):
        return "its record is another kernel's"
    if rec.get("size") != library.stat().st_size or rec.get("sha256") != _sha256(library):
        return "its library does not match its record"
    return None


def _tilelang_lib(name: str) -> Path | None:
    """``name`` in TileLang's ``lib`` folder, found without importing TileLang (None if
    absent)."""
    spec = importlib.util.find_spec("tilelang")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base) / "lib" / name
        if path.is_file():
            return path
    return None


def runtime_library() -> Path | None:
    """TileLang's TVM runtime library, found without importing TileLang (None if absent)."""
    return _tilelang_lib("libtvm_runtime.so")


#: the global functions a library's host code may look up that TileLang's own library
#: (``libtilelang.so``), not the TVM runtime, registers: the TMA descriptor encoders a program
#: with TMA copies calls on every launch
TILELANG_RUNTIME_FUNCTIONS = ("__tvm_tensormap_create_tiled", "__tvm_tensormap_create_im2col")


def needed_tilelang_functions(library: bytes) -> list[str]:
    """Which of :data:`TILELANG_RUNTIME_FUNCTIONS` the library's host code names (it looks
    them up by name, so the name is in its bytes)."""
    return [f for f in TILELANG_RUNTIME_FUNCTIONS if f.encode() in library]


def _load_global(what: str, lib: Path | None, name: str) -> None:
    """Load ``lib`` once per process, globally, as TVM loads it (TileLang points
    TVM_LIBRARY_PATH at this folder, so a later import finds this same file already loaded);
    lazy binding, as TileLang's. Called under the lock."""
    if what in _state:
        return
    if lib is None:
        raise FileNotFoundError(f"TileLang's {name} is not installed")
    _state[what] = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)


def load_module(path: Path):
    """The stored library as a tvm-ffi module: the TVM runtime loaded first, once, and
    TileLang's own library too where the host code calls a function only it registers (a
    program with TMA copies encodes its descriptors through one on every launch; without it
    the launch fails with "Cannot find function __tvm_tensormap_create_tiled"). Raises where a
    function the library needs is still not registered, so the entry is never served."""
    needed = needed_tilelang_functions(path.read_bytes())
    with _lock:
        _load_global("runtime", runtime_library(), "libtvm_runtime.so")
        if needed:
            _load_global("tilelang_lib", _tilelang_lib("libtilelang.so"), "libtilelang.so")
    from ._tilelang import point_compiler_caches

    point_compiler_caches()  # tvm-ffi's import may build its addon: under TILEOPS_CACHE_DIR
    import tvm_ffi

    missing = [f for f in needed if tvm_ffi.get_global_func(f, allow_missing=True) is None]
    if missing:
        raise RuntimeError(f"{path} calls {', '.join(missing)}, which no loaded library "
                           "registers")
    return tvm_ffi.load_module(str(path))


class StoredKernel:
    """A kernel loaded from the store, called with every tensor as TileLang's is. The call
    goes straight to the library's entry function (``main``): TileLang's own kernel object
    first stitches the arguments in Python, about 2 us a call on the CI machine against 0.1."""

    __slots__ = ("key", "_module", "_main")

    def __init__(self, key: str, module) -> None:
        self.key = key
        self._module = module  # the library stays loaded while its function is held
        self._main = module.main

    def __call__(self, *args):
        return self._main(*args)

    def __repr__(self) -> str:
        return f"StoredKernel({self.key[:12]})"


def save(folder: Path, key: str, parts: dict[str, Any], kernel) -> bool:
    """Write ``kernel``'s library and record as ``folder`` (False where it has no library,
    as a compile without a device leaves none, or the folder cannot be written)."""
    tmp = folder.parent / f".{folder.name}.{uuid.uuid4().hex}"
    try:
        tmp.mkdir(parents=True)
        kernel.export_library(str(tmp / LIBRARY))
        lib = tmp / LIBRARY
        rec = {"format": FORMAT, "key": key, "parts": parts, "size": lib.stat().st_size,
               "sha256": _sha256(lib)}
        (tmp / RECORD).write_text(json.dumps(rec, sort_keys=True, indent=1))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process stored it first: theirs is as good
            return folder.is_dir()
        return True
    except Exception as exc:  # noqa: BLE001 - the kernel is built; only storing it failed
        _warn_once("save", "compiled kernels are not stored under %s (%s: %s); each process "
                   "will import TileLang to load them", root(), type(exc).__name__, exc)
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _warn_once(what: str, msg: str, *args) -> None:
    if what not in _state:
        _state[what] = True
        log.warning(msg, *args)


def build_or_load(build, args: tuple, kwargs: dict):
    """``build(*args, **kwargs)``, served from the store where it can be (see the module)."""
    bound = inspect.signature(build).bind(*args, **kwargs)
    bound.apply_defaults()
    if bound.arguments.get("target") is not None:
        return build(*args, **kwargs)
    device = None if "disabled" in _state else _device()
    if device is None:
        return build(*args, **kwargs)
    try:
        parts = key_parts(build, dict(bound.arguments), device)
    except Unstorable:
        return build(*args, **kwargs)
    key = key_of(parts)
    folder = root() / key
    try:
        why = check_entry(folder, key, parts) if folder.is_dir() else "absent"
    except OSError as exc:
        why = f"it cannot be read ({type(exc).__name__}: {exc})"
    if why is None:
        try:
            return StoredKernel(key, load_module(folder / LIBRARY))
        except Exception as exc:  # noqa: BLE001 - any failure to load: compile instead
            # a library that passed its check and does not load says the loader does not
            # work here: the rest of this process builds without the store
            _state["disabled"] = True
            why = f"it failed to load ({type(exc).__name__}: {exc}); the store is off for " \
                  "this process"
    if why != "absent":
        log.warning("stored kernel %s of %s not used: %s; rebuilding it", key[:12],
                    parts["builder"], why)
        shutil.rmtree(folder, ignore_errors=True)
    kernel = build(*args, **kwargs)
    if "disabled" in _state or not save(folder, key, parts, kernel):
        return kernel
    try:  # this entry, or a peer process's that was renamed into place first, checked too
        if check_entry(folder, key, parts) is not None:
            return kernel
    except OSError:
        return kernel
    # the process that compiled it calls the stored library too: one launch path for every
    # process, and a loader that does not work here is found at the first build
    try:
        return StoredKernel(key, load_module(folder / LIBRARY))
    except Exception as exc:  # noqa: BLE001 - the compiled kernel serves instead
        _state["disabled"] = True
        log.warning("stored kernel %s of %s does not load (%s: %s): the store is off for this "
                    "process, and its kernels run through TileLang's own launcher", key[:12],
                    parts["builder"], type(exc).__name__, exc)
        return kernel


def stored(maxsize: int):
    """``functools.lru_cache(maxsize)`` over :func:`build_or_load` of the decorated builder
    (``cache_clear`` and ``cache_info`` as the lru_cache's)."""
    def decorate(build):
        @functools.lru_cache(maxsize=maxsize)
        @functools.wraps(build)
        def cached(*args, **kwargs):
            return build_or_load(build, args, kwargs)

        cached.build = build  # the builder itself, past both caches
        return cached

    return decorate
