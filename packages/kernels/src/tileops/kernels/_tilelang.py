"""What every kernel family shares about TileLang: the lazy import (importing an op never
imports TileLang) and the one way a program is compiled.

TileLang's compilation is not safe to run from several threads at once, so every family
compiles under one process-wide lock. Programs launch through the ``tvm_ffi`` backend, the
fastest of TileLang's launchers (benchmarks/results/launch_cost.txt).
"""

import threading

_compile_lock = threading.Lock()


def tl():
    """``(tilelang, tilelang.language)``, imported on first use."""
    import tilelang
    import tilelang.language as T

    return tilelang, T


def compile_program(prog, target: str | None):
    """Compile a prim_func. ``target``: an arch such as ``"sm_90a"``, or None for the current
    device."""
    tilelang, _ = tl()
    with _compile_lock:
        if target is None:
            return tilelang.compile(prog, execution_backend="tvm_ffi")
        return tilelang.compile(prog, target={"kind": "cuda", "arch": target},
                                execution_backend="tvm_ffi")
