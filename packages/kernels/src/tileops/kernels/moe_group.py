"""The grouping of routed slots by expert, in TileLang: what MoePermuteAlignFwdOp's torch
grouping computes (a stable sort of the slots by expert, the layout's metadata, each slot's
row and each row's token) in four launches instead of some thirty torch kernels, whose
launches were the whole time of a call of a few tokens (some 60 us on the H200 for one token
of Mixtral's routing, where the row movement takes 2) and whose sort was most of a large one.

:class:`MoeGroupInterface` (``moe_group``) -- ``forward(ids, metadata, rows, src)``: ``ids``
``(M, K)`` int32 (an id outside ``[0, E)`` is a dropped slot, keyed ``E``), ``metadata`` the
layout's (``E`` valid rows of the masked blocks, ``E + 1`` segment offsets, or the expert of
each of the ``R`` rows), ``rows`` ``(M, K)`` the slot's row (-1 when dropped), ``src``
``(R,)`` the token of each row (-1 for a row no slot fills).

The slots are cut into chunks of :data:`CHUNK`:

- :func:`count_program`: a thread per row sets ``src`` to -1, and a thread per (chunk, key)
  counts the chunk's slots with that key;
- :func:`scan_program`: a thread per key sums its counts over the chunks before each chunk
  (``base``) and over all (``total``);
- :func:`meta_program`: a thread per key sums the aligned totals of the experts before it
  (its segment's offset), and a thread per metadata entry writes the layout's;
- :func:`place_program`: a thread per slot takes its rank in its expert (``base`` of its
  chunk and key, plus the slots before it in its chunk with its key: so the order within an
  expert is the tokens', the stable sort's), adds its expert's offset (or block) and writes
  its row and that row's token.

A thread's loop is at most a chunk's slots, the chunks or the experts long. Slot, row and
chunk counts are launch-time sizes: one set of programs a layout serves every token count.
The threads are independent within a launch (no shared memory, no barrier); the counts cross
between launches through a workspace in global memory.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

from typing import Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, tl

__all__ = [
    "CHUNK",
    "GroupMetadata",
    "MoeGroupInterface",
    "MoeGroupKernel",
    "MoeGroupSpec",
    "build_group",
    "count_program",
    "meta_program",
    "place_program",
    "scan_program",
]

GroupMetadata = Literal["masked", "offsets", "per_row"]
_METADATA = frozenset(get_args(GroupMetadata))
#: the slots a chunk: a slot's thread reads the slots before it in its chunk, and a key's
#: thread counts a chunk's slots, so a launch's longest chain is this many loads
CHUNK = 256
_THREADS = 256


class MoeGroupSpec(CallSpec, frozen=True, kw_only=True):
    """A grouping: ``e`` experts, ``k`` picks a token, the layout's ``metadata`` kind with its
    ``max_m`` (masked) or ``alignment`` (contiguous); the slot and row counts are launch-time."""

    e: int
    k: int
    metadata: GroupMetadata
    max_m: int = 0
    alignment: int = 1

    def __post_init__(self) -> None:
        self.check_fields(choices={"metadata": _METADATA}, sizes=("e", "k", "max_m",
                                                                  "alignment"))
        if self.e < 1 or self.k < 1 or self.alignment < 1:
            raise ValueError(f"MoeGroupSpec: e, k and alignment must be at least 1, got e="
                             f"{self.e}, k={self.k}, alignment={self.alignment}")
        if (self.metadata == "masked") != (self.max_m >= 1):
            raise ValueError("MoeGroupSpec.max_m: a masked layout's block has max_m >= 1 "
                             f"rows, and only a masked layout has one; got max_m={self.max_m} "
                             f"for metadata {self.metadata!r}")


class MoeGroupInterface(KernelInterface):
    """``forward(ids, metadata, rows, src)``: the grouping of ``ids`` (see the module
    docstring)."""

    slot = "moe_group"
    call_spec = MoeGroupSpec


def _key(T, v, e: int):
    """A slot's key: its expert, or ``e`` for an id outside ``[0, e)`` (dropped)."""
    return T.if_then_else(T.And(v >= 0, v < e), v, e)


#: slots a load: the count's and the rank's loops read a chunk's ids as 16-byte vectors (a
#: chunk starts at a multiple of CHUNK slots, so at a 16-byte boundary of ``ids``, whose
#: pointer the kernel aligns: :meth:`MoeGroupKernel.__call__`)
_VEC = 4


def _ids_loader(T, e: int):
    """A TileLang macro, ``load(ids, N, at, buf)``: ``buf[u]`` the key of slot ``at + u`` for
    ``u < _VEC``, a slot at or past ``N`` keyed ``e + 1`` (which no key equals); one vector
    load where the group lies below ``N``, else a load a slot (the chunk's tail)."""

    @T.macro
    def load(ids, N, at, buf):  # noqa: N803 - the slot count, as the programs name it
        if at + _VEC <= N:
            for u in T.vectorized(_VEC):
                buf[u] = ids[at + u]
            for u in T.unroll(_VEC):
                buf[u] = _key(T, buf[u], e)
        else:
            for u in T.unroll(_VEC):
                buf[u] = e + 1
                if at + u < N:
                    buf[u] = _key(T, ids[at + u], e)

    return load


def count_program(e: int):
    """``src[r] = -1`` for every row; ``cnt[c, q]``: the slots of chunk ``c`` (of
    :data:`CHUNK`) keyed ``q``, for ``q`` in ``[0, e]`` (see the module docstring)."""
    _, T = tl()
    N, R, C = T.dynamic("N"), T.dynamic("R"), T.dynamic("C")
    keys = e + 1
    load = _ids_loader(T, e)

    @T.prim_func
    def main(Ids: T.Tensor((N,), "int32"), Cnt: T.Tensor((C, keys), "int32"),
             Src: T.Tensor((R,), "int32")):
        with T.Kernel(T.ceildiv(R + C * keys, _THREADS), threads=_THREADS) as b:
            tx = T.get_thread_binding(0)
            acc = T.alloc_local((1,), "int32")
            buf = T.alloc_local((_VEC,), "int32")
            g = b * _THREADS + tx
            if g < R:
                Src[g] = -1
            elif g < R + C * keys:
                c = (g - R) // keys
                q = (g - R) % keys
                acc[0] = 0
                for j in T.serial(CHUNK // _VEC):
                    at = c * CHUNK + j * _VEC
                    load(Ids, N, at, buf)
                    for u in T.unroll(_VEC):
                        acc[0] = acc[0] + T.if_then_else(buf[u] == q, 1, 0)
                Cnt[c, q] = acc[0]

    return main


def scan_program(e: int):
    """``base[c, q]``: the slots keyed ``q`` in the chunks before ``c``; ``total[q]``: all of
    them (a thread a key, over the chunks)."""
    _, T = tl()
    C = T.dynamic("C")
    keys = e + 1

    @T.prim_func
    def main(Cnt: T.Tensor((C, keys), "int32"), Base: T.Tensor((C, keys), "int32"),
             Total: T.Tensor((keys,), "int32")):
        with T.Kernel(T.ceildiv(keys, _THREADS), threads=_THREADS) as b:
            tx = T.get_thread_binding(0)
            run = T.alloc_local((1,), "int32")
            q = b * _THREADS + tx
            if q < keys:
                run[0] = 0
                # eight chunks' counts loaded together: the loop is a chain of loads from L2
                # otherwise (a DeepSeek-V3 call of 8192 tokens has 256 chunks)
                for c8 in T.serial(T.ceildiv(C, 8)):
                    for u in T.unroll(8):
                        if c8 * 8 + u < C:
                            Base[c8 * 8 + u, q] = run[0]
                            run[0] = run[0] + Cnt[c8 * 8 + u, q]
                Total[q] = run[0]

    return main


def _aligned(c, alignment: int):
    return c if alignment == 1 else (c + (alignment - 1)) // alignment * alignment


def meta_program(e: int, metadata: str, max_m: int, alignment: int):
    """``off[q]``: where expert ``q``'s segment starts (the aligned totals before it), and the
    layout's metadata (see the module docstring)."""
    _, T = tl()
    R = T.dynamic("R")
    masked, per_row = metadata == "masked", metadata == "per_row"
    n_meta = e if masked else R if per_row else e + 1
    keys = e + 1

    @T.prim_func
    def main(Total: T.Tensor((keys,), "int32"), Off: T.Tensor((keys,), "int32"),
             Meta: T.Tensor((n_meta,), "int32")):
        with T.Kernel(T.ceildiv(keys + n_meta, _THREADS), threads=_THREADS) as b:
            tx = T.get_thread_binding(0)
            run = T.alloc_local((1,), "int32")
            hit = T.alloc_local((1,), "int32")
            g = b * _THREADS + tx
            if g < keys:  # the offset of segment g
                run[0] = 0
                for p in T.serial(g):
                    run[0] = run[0] + _aligned(Total[p], alignment)
                Off[g] = run[0]
            elif g < keys + n_meta:
                q = g - keys
                if masked:  # the valid rows of block q
                    Meta[q] = T.min(Total[q], max_m)
                elif per_row:  # the expert whose segment holds row q, -1 in padding
                    run[0] = 0
                    hit[0] = -1
                    for p in T.serial(e):
                        if run[0] <= q and q < run[0] + Total[p]:
                            hit[0] = p
                        run[0] = run[0] + _aligned(Total[p], alignment)
                    Meta[q] = hit[0]
                else:  # the offset of segment q
                    run[0] = 0
                    for p in T.serial(q):
                        run[0] = run[0] + _aligned(Total[p], alignment)
                    Meta[q] = run[0]

    return main


def place_program(e: int, k: int, metadata: str, max_m: int):
    """Each slot's row (its expert's offset, or block, plus its rank: the slots keyed alike in
    the chunks before its own, and before it in its chunk) and that row's token."""
    _, T = tl()
    N, R, C = T.dynamic("N"), T.dynamic("R"), T.dynamic("C")
    masked = metadata == "masked"
    keys = e + 1
    load = _ids_loader(T, e)

    @T.prim_func
    def main(Ids: T.Tensor((N,), "int32"), Base: T.Tensor((C, keys), "int32"),
             Off: T.Tensor((keys,), "int32"), Rows: T.Tensor((N,), "int32"),
             Src: T.Tensor((R,), "int32")):
        with T.Kernel(T.ceildiv(N, _THREADS), threads=_THREADS) as b:
            tx = T.get_thread_binding(0)
            rank = T.alloc_local((1,), "int32")
            row = T.alloc_local((1,), "int32")
            buf = T.alloc_local((_VEC,), "int32")
            i = b * _THREADS + tx
            if i < N:
                key = _key(T, Ids[i], e)
                c = i // CHUNK
                rank[0] = Base[c, key]
                # the slots before i in its chunk, _VEC at a time (the last group's slots
                # from i on are not counted)
                for j in T.serial(T.ceildiv(i - c * CHUNK, _VEC)):
                    at = c * CHUNK + j * _VEC
                    load(Ids, N, at, buf)
                    for u in T.unroll(_VEC):
                        rank[0] = rank[0] + T.if_then_else(
                            T.And(buf[u] == key, at + u < i), 1, 0)
                if masked:
                    row[0] = T.if_then_else(T.And(key < e, rank[0] < max_m),
                                            key * max_m + rank[0], -1)
                else:
                    row[0] = T.if_then_else(key < e, Off[key] + rank[0], -1)
                Rows[i] = row[0]
                if row[0] >= 0:
                    Src[row[0]] = i // k

    return main


@stored(maxsize=64)
def build_group(e: int, k: int, metadata: str, max_m: int, alignment: int,
                target: str | None = None):
    """``(count, scan, meta, place)``: the four compiled programs of a grouping
    (:class:`MoeGroupSpec`'s fields)."""
    return (compile_program(count_program(e), target),
            compile_program(scan_program(e), target),
            compile_program(meta_program(e, metadata, max_m, alignment), target),
            compile_program(place_program(e, k, metadata, max_m), target))


class MoeGroupKernel(Kernel, MoeGroupInterface):
    """Any slot count below 2^31, sm_80 to sm_90."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True

    def __init__(self, spec: MoeGroupSpec) -> None:
        super().__init__(spec)
        self.count, self.scan, self.meta, self.place = build_group(
            spec.e, spec.k, spec.metadata, spec.max_m, spec.alignment)

    def __call__(self, ids, metadata, rows, src) -> None:
        flat = ids.reshape(-1)
        if flat.data_ptr() % 16:  # the programs read the ids as 16-byte vectors
            flat = flat.clone()
        keys = self.spec.e + 1
        chunks = max(1, -(-flat.numel() // CHUNK))
        # one workspace: cnt, base, total, off, each at a 16-byte boundary
        a, b = -(-chunks * keys // 4) * 4, -(-keys // 4) * 4
        work = flat.new_empty((2 * a + 2 * b,))
        cnt = work[:chunks * keys].view(chunks, keys)
        base = work[a:a + chunks * keys].view(chunks, keys)
        total, off = work[2 * a:2 * a + keys], work[2 * a + b:2 * a + b + keys]
        self.count(flat, cnt, src)
        self.scan(cnt, base, total)
        self.meta(total, off, metadata.view(-1))
        if flat.numel():
            self.place(flat, base, off, rows.view(-1), src)
