"""Run a generated CUDA kernel on the host, for CPU tests of its index arithmetic.

A kernel whose threads are independent (no shared memory, no barrier, no warp intrinsic:
the elementwise family's programs) computes the same thing whichever order its threads run
in. :func:`host_kernel` compiles a kernel's CUDA source (TileLang's, from
``get_kernel_source()``) as host code: ``blockIdx`` and ``threadIdx`` become host variables
and a driver runs every thread of every block in turn, on host arrays. A CPU test then checks
the program's own indexing (which element each thread reads and writes, the masks of the edge
blocks, that nothing outside the arrays is written) without a GPU. It compiles with ``nvcc``
(the CUDA toolkit's headers), so the arithmetic that runs is the program's C++; only device
intrinsics (``asm``, ``__shfl``) cannot run, so programs that use them (the 16-bit forms'
``rcp.approx``) are out of reach; the bit casts TileLang prints for infinities
(``__int_as_float``) get host versions.

This is test code: it edits the kernel's text (the declaration line, the qualifiers) to
make the host version; it is never part of the library.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

_BUILT: dict[str, ctypes.CDLL] = {}
_DIR = Path(tempfile.gettempdir()) / f"tileops-host-kernels-{os.getuid()}"


def _include_dirs() -> list[str]:
    import tilelang

    root = Path(tilelang.__file__).parent
    return [f"-I{root / 'src'}", f"-I{root / '3rdparty' / 'cutlass' / 'include'}"]


def host_source(source: str) -> tuple[str, list[tuple[str, str]]]:
    """The host version of a kernel's source and its parameters as ``(type, name)``: the
    kernel becomes a static function over host ``blockIdx``/``threadIdx``, and ``run(params...,
    gx, gy, threads)`` calls it for every thread of a ``gx`` x ``gy`` grid."""
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines)
              if "__global__" in line and "main_kernel(" in line and line.rstrip().endswith("{"))
    params = re.search(r"main_kernel\((.*)\)\s*\{\s*$", lines[at]).group(1)
    decls = [p.strip() for p in params.split(",")]
    names = [d.split()[-1] for d in decls]
    head = [line for line in lines[:at] if not line.startswith('extern "C" __global__')]
    return "\n".join([
        *head,
        "#include <cstring>",
        # the bit casts TileLang prints for infinities and NaNs, as host functions
        "static inline float host_int_as_float(int v) { float f; std::memcpy(&f, &v, 4);"
        " return f; }",
        "static inline int host_float_as_int(float f) { int v; std::memcpy(&v, &f, 4);"
        " return v; }",
        "#define __int_as_float host_int_as_float",
        "#define __float_as_int host_float_as_int",
        "struct HostIndex { unsigned x, y, z; };",
        "static HostIndex host_block, host_thread;",
        "#define blockIdx host_block",
        "#define threadIdx host_thread",
        f"static void kernel_body({params}) {{",
        *lines[at + 1:],
        "#undef blockIdx",
        "#undef threadIdx",
        f'extern "C" void run({params}, unsigned gx, unsigned gy, unsigned threads) {{',
        "  for (unsigned y = 0; y < gy; ++y)",
        "    for (unsigned x = 0; x < gx; ++x)",
        "      for (unsigned t = 0; t < threads; ++t) {",
        "        host_block = {x, y, 0};",
        "        host_thread = {t, 0, 0};",
        f"        kernel_body({', '.join(names)});",
        "      }",
        "}",
        "",
    ]), [(" ".join(d.split()[:-1]), name) for d, name in zip(decls, names, strict=True)]


def host_kernel(source: str) -> ctypes.CDLL:
    """The compiled host version of a kernel's source (cached by the source's hash); its
    ``run`` takes the kernel's parameters, then the grid and the block's threads."""
    if "asm" in source:
        raise ValueError("the kernel uses inline PTX (asm), which cannot run on the host")
    text, _ = host_source(source)
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    if key in _BUILT:
        return _BUILT[key]
    _DIR.mkdir(parents=True, exist_ok=True)
    lib = _DIR / f"{key}.so"
    if not lib.exists():
        src = _DIR / f"{key}.cu"
        src.write_text(text)
        partial = _DIR / f"{key}.{os.getpid()}.so"
        subprocess.run([shutil.which("nvcc") or "nvcc", "-std=c++17", "-O1", "-shared",
                        "-Xcompiler", "-fPIC", "-w", "-DENABLE_BF16", *_include_dirs(),
                        "-o", str(partial), str(src)], check=True, capture_output=True)
        partial.replace(lib)
    _BUILT[key] = ctypes.CDLL(str(lib))
    return _BUILT[key]


def shared_array(np, n: int, dtype, fill):
    """A numpy array of ``n`` elements in memory shared with forked children (what
    :func:`call_isolated`'s child writes, the parent reads)."""
    item = np.dtype(dtype).itemsize
    arr = np.frombuffer(mmap.mmap(-1, max(1, n) * item), dtype=dtype, count=n)
    arr[:] = fill
    return arr


def call_isolated(fn, *args) -> str | None:
    """Call ``fn(*args)`` in a forked child: a program that writes out of bounds or makes a
    misaligned vector access (the host compiler's aligned loads fault as the GPU's would)
    kills the child, not the test process. None when the child returned, else what ended it.
    The child's writes reach the parent only through shared memory (:func:`shared_array`)."""
    pid = os.fork()
    if pid == 0:  # the child: the call and nothing else
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - reported by the exit status
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)} (an access out of bounds or misaligned)"
    if os.WEXITSTATUS(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return None


def run_kernel(source: str, values: dict, grid: tuple[int, int], threads: int) -> str | None:
    """Run a kernel's source on the host (:func:`host_kernel`, in a forked child:
    :func:`call_isolated`) over a ``grid`` of ``threads``-thread blocks. ``values`` maps the
    kernel's parameter names to numpy arrays (passed by data pointer; an output should be a
    :func:`shared_array` or a view of one) or ints (typed as the kernel declares them); names
    the kernel does not take are ignored. None when every thread ran, else what ended the
    child."""
    _, decls = host_source(source)
    missing = [name for _, name in decls if name not in values]
    if missing:
        raise KeyError(f"no value for the kernel's parameters {missing}")
    args = []
    for typ, name in decls:
        v = values[name]
        if hasattr(v, "__array_interface__"):
            args.append(ctypes.c_void_p(v.__array_interface__["data"][0]))
        else:
            args.append((ctypes.c_int64 if "64" in typ else ctypes.c_int)(v))
    return call_isolated(host_kernel(source).run, *args, ctypes.c_uint(grid[0]),
                         ctypes.c_uint(grid[1]), ctypes.c_uint(threads))
