"""What every kernel family shares about TileLang: the lazy import (importing an op never
imports TileLang), where TileLang writes, and the one way a program is compiled.

TileLang keeps compiled kernels in its own cache directory (``TILELANG_CACHE_DIR``) and
creates it on import; tvm-ffi, which it imports, may build an addon into
``TVM_FFI_CACHE_DIR``. :func:`tl` points both under ``TILEOPS_CACHE_DIR``
(:func:`tileops.runtime.env.compiler_cache_env`) before the import, and again on every later
call, so the one knob governs everything TileOPs writes and a change of it in-process is
followed: TileLang reads the variable each time it looks for its cache.

TileLang's compilation is not safe to run from several threads at once, so every family
compiles under one process-wide lock. The first compile of a process says so first, at
WARNING (a cold build takes seconds, and a first call that pauses without a word looks hung);
each build is logged at INFO by the op that asks for it. Programs launch through the ``tvm_ffi`` backend, the
fastest of TileLang's launchers (benchmarks/results/launch_cost.txt).

The families' launch plans share two pieces of arithmetic: :func:`widest_vec`, the widest
vector access a row allows, and :func:`pow2_at_least`.
"""

import os
import threading

from tileops.runtime import env, log
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

#: the widest access a thread issues (a 16-byte vector load or store)
VECTOR_BYTES = 16

_compile_lock = threading.Lock()
_announced = [False]


def point_compiler_caches() -> None:
    """Set TileLang's and tvm-ffi's cache variables from ``TILEOPS_CACHE_DIR``; a different
    value set for them before is replaced (and logged at INFO)."""
    for var, path in env.compiler_cache_env().items():
        old = os.environ.get(var)
        if old == path:
            continue
        if old is not None:
            log.info("%s=%s replaced by %s: TILEOPS_CACHE_DIR is the one cache directory of "
                     "TileOPs", var, old, path)
        os.environ[var] = path


def tl():
    """``(tilelang, tilelang.language)``, imported on first use, after
    :func:`point_compiler_caches`."""
    point_compiler_caches()
    import tilelang
    import tilelang.language as T

    return tilelang, T


def isnan(T, x):
    """CUDA's ``isnan`` of a float32 ``x`` as an opaque call: ``x != x`` is folded to False by
    TVM's simplifier (it takes floats to be reflexive), and ``T.isnan`` is lowered back to it."""
    return T.call_pure_extern("bool", "isnan", x)


def isinf(T, x):
    """CUDA's ``isinf`` of a float32 ``x`` as an opaque call (as :func:`isnan`)."""
    return T.call_pure_extern("bool", "isinf", x)


def compile_program(prog, target: str | None):
    """Compile a prim_func. ``target``: an arch such as ``"sm_90a"``, or None for the current
    device."""
    tilelang, _ = tl()
    with _compile_lock:
        if not _announced[0]:
            _announced[0] = True
            log.warning("building TileLang kernels (the first build of a configuration takes "
                        "seconds; built kernels are cached under %s and load from there); "
                        "TILEOPS_LOG_LEVEL=INFO names each one",
                        env.compiler_cache_env()["TILELANG_CACHE_DIR"])
        if target is None:
            return tilelang.compile(prog, execution_backend="tvm_ffi")
        return tilelang.compile(prog, target={"kind": "cuda", "arch": target},
                                execution_backend="tvm_ffi")


def widest_vec(n: int, dtype: str) -> int:
    """Widest power-of-two access (elements) that divides ``n`` and fits 16 bytes: a row of
    ``n`` elements starts at ``n * itemsize`` bytes, so a wider access would be misaligned."""
    vec = VECTOR_BYTES // _ITEMSIZE[dtype]
    while vec > 1 and n % vec:
        vec //= 2
    return vec


def pow2_at_least(x: int) -> int:
    """The least power of two at least ``x`` (1 for ``x <= 1``)."""
    p = 1
    while p < x:
        p *= 2
    return p
