"""Run a generated CUDA kernel on the host, for CPU tests of its index arithmetic.

A kernel whose threads are independent (no shared memory, no barrier: the elementwise
family's programs) computes the same thing whichever order its threads run in.
:func:`host_kernel` compiles a kernel's CUDA source (TileLang's, from ``get_kernel_source()``)
as host code: ``blockIdx`` and ``threadIdx`` become host variables and a driver runs every
thread of every block in turn, on host arrays. A kernel whose threads exchange values by warp
shuffles (``__shfl_xor_sync``, ``__shfl_sync``, ``__shfl_down_sync``, ``__shfl_up_sync``: a
warp a token) runs a warp at a time, its 32 lanes host threads meeting at each shuffle. A
kernel that shares memory across its block (``__shared__``, ``__syncthreads``: a block's
reduction or scan) runs a block at a time, every thread of it a host thread: its shared arrays
become one host array the block's threads share (blocks run one after another), and
``__syncthreads`` a barrier of all of them. A CPU test then checks the program's own indexing
(which element each thread reads and writes, the masks of the edge blocks, that nothing
outside the arrays is written), its warp exchanges and its block's exchanges without a GPU.
It compiles with ``nvcc`` (the CUDA toolkit's headers), so the arithmetic that runs is the
program's C++; other device intrinsics (``asm``: the 16-bit forms' ``rcp.approx``, TMA,
``bar.sync`` of part of a block) cannot run, so programs that use them are out of reach; the
bit casts TileLang prints for infinities (``__int_as_float``), its packing of two 16-bit
values (``__pack_half2``), its fp8 vector types (their copies) and its clamp get host versions.
A kernel may have any name (``<name>_kernel``).

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


#: the warp shuffles a kernel may call, as host functions over the lanes of one warp run as
#: threads in lockstep: each lane publishes its value, all wait, each reads its source lane's,
#: all wait again (a warp whose lanes do not all reach a shuffle never passes it: the wait
#: gives up after 20 s and aborts the child, reported as a crash)
_WARP_HOST = r"""
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
struct HostBarrier {
  std::mutex m; std::condition_variable cv; unsigned n = 32, count = 0, gen = 0;
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    unsigned g = gen;
    if (++count == n) { count = 0; ++gen; cv.notify_all(); return; }
    if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return g != gen; })) std::abort();
  }
};
// a warp's barrier and lanes, by the warp's index in its block (blocks of up to 1024 threads)
static HostBarrier host_warps[32];
static unsigned long long host_lanes[32][32];
#define host_warp host_warps[host_thread.x / 32]
template <typename V> static V host_shfl(V v, unsigned src) {
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  host_lanes[host_thread.x / 32][host_thread.x % 32] = bits;
  host_warp.wait();
  unsigned long long got = host_lanes[host_thread.x / 32][src % 32];
  host_warp.wait();
  V out;
  std::memcpy(&out, &got, sizeof(V));
  return out;
}
template <typename V> static V host_shfl_xor_sync(unsigned, V v, int mask, int = 32) {
  return host_shfl(v, (host_thread.x % 32) ^ mask);
}
template <typename V> static V host_shfl_sync(unsigned, V v, int src, int = 32) {
  return host_shfl(v, (unsigned)src);
}
template <typename V> static V host_shfl_down_sync(unsigned, V v, unsigned d, int = 32) {
  unsigned lane = host_thread.x % 32;
  return host_shfl(v, lane + d < 32 ? lane + d : lane);
}
template <typename V> static V host_shfl_up_sync(unsigned, V v, unsigned d, int = 32) {
  unsigned lane = host_thread.x % 32;
  return host_shfl(v, lane >= d ? lane - d : lane);
}
static unsigned host_activemask() { return 0xFFFFFFFFu; }  // every lane runs
static void host_syncwarp(unsigned = 0xFFFFFFFFu) { host_warp.wait(); }
#define __activemask host_activemask
#define __syncwarp host_syncwarp
// every thread of the block (its count set by the driver before the block runs)
static HostBarrier host_block_barrier;
static void host_syncthreads() { host_block_barrier.wait(); }
#define __syncthreads host_syncthreads
#define __shfl_xor_sync host_shfl_xor_sync
#define __shfl_sync host_shfl_sync
#define __shfl_down_sync host_shfl_down_sync
#define __shfl_up_sync host_shfl_up_sync
"""


def host_source(source: str) -> tuple[str, list[tuple[str, str]]]:
    """The host version of a kernel's source and its parameters as ``(type, name)``: the
    kernel becomes a static function over host ``blockIdx``/``threadIdx``, and ``run(params...,
    gx, gy, threads)`` calls it for every thread of a ``gx`` x ``gy`` grid: one after another,
    or, where the kernel shuffles values across a warp (``__shfl*``), a warp at a time with its
    32 lanes as host threads in lockstep at each shuffle (:data:`_WARP_HOST`)."""
    if "asm" in source:
        raise ValueError("the kernel uses inline PTX (asm), which cannot run on the host")
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines)
              if "__global__" in line and "_kernel(" in line and line.rstrip().endswith("{"))
    params = re.search(r"\w+_kernel\((.*)\)\s*\{\s*$", lines[at]).group(1)
    decls = [p.strip() for p in params.split(",")]
    names = [d.split()[-1] for d in decls]
    head = [line for line in lines[:at] if not line.startswith('extern "C" __global__')]
    block = "__syncthreads" in source or "__shared__" in source
    warps = block or "__shfl" in source
    call = f"kernel_body({', '.join(names)});"
    body = [_host_shared(line) for line in lines[at + 1:]] if block else lines[at + 1:]
    body = [line.replace("tl::clamp(", "host_clamp(") for line in body]
    if block:  # every thread of a block at once, meeting at __syncthreads and the shuffles
        driver = [
            "      if (threads % 32 || threads > 1024) std::abort();",
            "      host_block_barrier.n = threads;",
            "      for (unsigned w = 0; w < threads; w += 32) host_warps[w / 32].n = 32;",
            "      std::vector<std::thread> team;",
            "      for (unsigned t = 0; t < threads; ++t)",
            "        team.emplace_back([&, t] {",
            "          host_block = {x, y, 0};",
            "          host_thread = {t, 0, 0};",
            f"          {call}",
            "        });",
            "      for (auto& member : team) member.join();",
        ]
    elif warps:
        driver = [  # whole warps only: a shuffle's barrier waits for 32 lanes
            "      if (threads % 32) std::abort();",
            "      for (unsigned w = 0; w < threads; w += 32) {",
            "        std::vector<std::thread> lanes;",
            "        for (unsigned l = 0; l < 32; ++l)",
            "          lanes.emplace_back([&, l] {",
            "            host_block = {x, y, 0};",
            "            host_thread = {w + l, 0, 0};",
            f"            {call}",
            "          });",
            "        for (auto& lane : lanes) lane.join();",
            "      }",
        ]
    else:
        driver = [
            "      for (unsigned t = 0; t < threads; ++t) {",
            "        host_block = {x, y, 0};",
            "        host_thread = {t, 0, 0};",
            f"        {call}",
            "      }",
        ]
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
        # the packing of two 16-bit values into a 32-bit word (TileLang's zero fills of
        # 16-byte vectors), as TileLang's common.h states it
        "template <typename H> static inline unsigned host_pack_half2(H x, H y) {"
        " unsigned short a, b; std::memcpy(&a, &x, 2); std::memcpy(&b, &y, 2);"
        " return ((unsigned)b << 16) | a; }",
        "#define __pack_half2 host_pack_half2",
        "#define __pack_nv_bfloat162 host_pack_half2",
        # TileLang's fp8 vectors (fp8_e4_4_t ...: their copies are device-only operators) as
        # host structs of their bytes, and its clamp (a NaN passes) as a host function
        "template <int N> struct alignas(N) HostBytes { unsigned char b[N]; };",
        *[f"#define fp8_{e}_{n}_t HostBytes<{n}>" for e in ("e4", "e5")
          for n in (2, 4, 8, 16, 32)],
        "static inline float host_clamp(float x, float lo, float hi) {"
        " if (x != x) return x; if (lo != lo) return lo; if (hi != hi) return hi;"
        " return fminf(fmaxf(x, lo), hi); }",
        "struct HostIndex { unsigned x, y, z; };",
        "static thread_local HostIndex host_block, host_thread;",
        *([_WARP_HOST] if warps else []),
        "#define blockIdx host_block",
        "#define threadIdx host_thread",
        f"static void kernel_body({params}) {{",
        *body,
        "#undef blockIdx",
        "#undef threadIdx",
        f'extern "C" void run({params}, unsigned gx, unsigned gy, unsigned threads) {{',
        "  for (unsigned y = 0; y < gy; ++y)",
        "    for (unsigned x = 0; x < gx; ++x) {",
        *driver,
        "    }",
        "}",
        "",
    ]), [(" ".join(d.split()[:-1]), name) for d, name in zip(decls, names, strict=True)]


#: the host array a block's dynamic shared memory becomes: the H100's / H200's 227 KiB
_SHARED_BYTES = 227 * 1024


def _host_shared(line: str) -> str:
    """A kernel body's line with its shared arrays made host arrays that the block's threads
    share: ``extern __shared__ __align__(A) T name[];`` (dynamic) becomes a static array of
    :data:`_SHARED_BYTES`, ``__shared__ T name[N];`` a static one of its own size."""
    dynamic = re.match(r"(\s*)extern __shared__ (__align__\(\d+\) )?([\w:]+) (\w+)\[\];\s*$",
                       line)
    if dynamic:
        indent, align, typ, name = dynamic.groups()
        return f"{indent}static {align or ''}{typ} {name}[{_SHARED_BYTES} / sizeof({typ})];"
    return re.sub(r"\b__shared__\s+", "static ", line)


def host_kernel(source: str) -> ctypes.CDLL:
    """The compiled host version of a kernel's source (cached by the source's hash); its
    ``run`` takes the kernel's parameters, then the grid and the block's threads."""
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
                        "-Xcompiler", "-fPIC", "-Xcompiler", "-pthread", "-w", "-DENABLE_BF16",
                        *_include_dirs(),
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


def launch_threads(source: str) -> int:
    """The threads of a kernel's block, as its ``__launch_bounds__`` declares them."""
    return int(re.search(r"__launch_bounds__\((\d+)", source).group(1))


class HostProgram:
    """A compiled TileLang kernel (a ``JITKernel``) called as a kernel class calls it, with
    torch CPU tensors, and run on the host (:func:`run_kernel`): the launch-time sizes are read
    off the tensors' shapes as the prim_func's buffers declare them, the grid is the prim_func's
    ``blockIdx`` extents evaluated at those sizes, and each tensor is copied into memory the
    forked run shares and back out after it (so a kernel class's workspaces and outputs work as
    on the GPU). Lets a CPU test run a kernel class's whole call: its programs, their grids and
    the workspaces between them."""

    def __init__(self, kernel) -> None:
        import tvm  # TileLang's (the kernel's build imported it)

        self.source = kernel.get_kernel_source()
        pf = kernel.prim_func
        self._buffers = [pf.buffer_map[p] for p in pf.params if p in pf.buffer_map]
        tirx = tvm.tirx
        self._grid = {}
        self._lets = {}  # the let-bound names a grid extent may be written in

        def visit(node):
            if isinstance(node, tirx.Bind):  # a let: `grid: T.int32 = ...`
                self._lets[node.var] = node.value
            if isinstance(node, tirx.For) and node.thread_binding is not None:
                tag = node.thread_binding.thread_tag
                if tag.startswith("blockIdx."):
                    self._grid[tag[-1]] = node.extent

        tirx.stmt_functor.post_order_visit(pf.body, visit)
        self._threads = launch_threads(self.source)
        self._tvm = tvm

    def __call__(self, *tensors) -> None:
        import numpy as np
        import torch

        tirx = self._tvm.tirx
        if len(tensors) != len(self._buffers):
            raise TypeError(f"the kernel takes {len(self._buffers)} tensors, got "
                            f"{len(tensors)}")
        sizes: dict = {}
        for buf, t in zip(self._buffers, tensors, strict=True):
            if not t.is_contiguous() or t.dim() != len(buf.shape):
                raise ValueError(f"{buf.name}: a contiguous tensor of {len(buf.shape)} dims, "
                                 f"got {tuple(t.shape)} strides {t.stride()}")
            for dim, size in zip(buf.shape, t.shape, strict=True):
                if isinstance(dim, tirx.Var):
                    if sizes.setdefault(dim, size) != size:
                        raise ValueError(f"{dim.name} is {sizes[dim]} and {size}")
                elif int(dim) != size:
                    raise ValueError(f"{buf.name}: dim {int(dim)} given {size}")
        analyzer = self._tvm.arith.Analyzer()
        at = {v: tirx.IntImm(v.dtype, s) for v, s in sizes.items()}

        def extent(expr):
            for _ in range(8):  # lets defined in terms of lets
                expr = tirx.stmt_functor.substitute(expr, self._lets)
            return int(analyzer.simplify(tirx.stmt_functor.substitute(expr, at)))

        grid = tuple(extent(self._grid[a]) if a in self._grid else 1 for a in "xy")
        values: dict = {v.name: s for v, s in sizes.items()}
        shared = []
        for buf, t in zip(self._buffers, tensors, strict=True):
            bits = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
            # bool and the fp8 types as bytes (numpy has no fp8)
            bytewise = (torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
            bits = bits.view(torch.uint8) if t.dtype in bytewise else bits
            host = bits.reshape(-1).numpy()
            arr = shared_array(np, host.size, host.dtype, 0)
            arr[:] = host
            shared.append((t, bits, arr))
            values[buf.name] = arr
        if 0 in grid:
            return
        ended = run_kernel(self.source, values, grid, self._threads)
        if ended is not None:
            raise RuntimeError(f"the kernel's host run ended: {ended}")
        for _, bits, arr in shared:
            bits.reshape(-1).copy_(torch.from_numpy(arr.copy()))


#: the numpy type of each element type a kernel's parameters declare (16-bit floats as bits)
_HOST_TYPES = {"float": "float32", "half_t": "float16", "bfloat16_t": "uint16", "int": "int32",
               "int64_t": "int64", "uchar": "uint8", "bool": "bool", "signed char": "int8"}


def host_array(t):
    """A torch CPU tensor as the contiguous numpy array a kernel reads (bfloat16 as its bits,
    bool as bytes)."""
    import numpy as np
    import torch

    if t.dtype == torch.bfloat16:
        return np.ascontiguousarray(t.view(torch.int16).numpy().view(np.uint16))
    if t.dtype == torch.bool:
        return np.ascontiguousarray(t.numpy().view(np.uint8))
    return np.ascontiguousarray(t.numpy())


def from_host(arr, ctype: str):
    """A kernel's output array of element type ``ctype`` as a float64 torch tensor."""
    import numpy as np
    import torch

    if ctype == "bfloat16_t":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16).double()
    return torch.from_numpy(arr.astype(np.float64))


def run_outputs(source: str, values: dict, grid: tuple[int, int], outs: dict[str, int]) -> dict:
    """:func:`run_kernel` with fresh output arrays of the sizes in ``outs`` (filled with a
    byte pattern no program writes, of the element type the kernel declares); the outputs by
    name as ``(array, element type)``. Asserts the run ended normally."""
    import numpy as np

    _, decls = host_source(source)
    types = {name: typ.replace("const", "").replace("__restrict__", "").replace("*", "").strip()
             for typ, name in decls}
    arrays = {name: shared_array(np, size, np.dtype(_HOST_TYPES[types[name]]), 0x5A)
              for name, size in outs.items()}
    ended = run_kernel(source, {**values, **arrays}, grid, launch_threads(source))
    assert ended is None, ended
    return {name: (arr, types[name]) for name, arr in arrays.items()}
