"""The grouping of routed slots by expert, in TileLang: what MoePermuteAlignFwdOp's torch
grouping computes (a stable sort of the slots by expert, the layout's metadata, each slot's
row and each row's token) in three launches (one for a decode step's slots) instead of some
thirty torch kernels, whose launches were the whole time of a call of a few tokens (some 60
us on the H200 for one token of Mixtral's routing, where the row movement takes 2) and whose
sort was most of a large one.

:class:`MoeGroupInterface` (``moe_group``) -- ``forward(ids, metadata, rows, src)``: ``ids``
``(M, K)`` int32 (an id outside ``[0, E)`` is a dropped slot, keyed ``E``), ``metadata`` the
layout's (``E`` valid rows of the masked blocks, ``E + 1`` segment offsets, or the expert of
each of the ``R`` rows), ``rows`` ``(M, K)`` the slot's row (-1 when dropped), ``src``
``(R,)`` the token of each row (-1 for a row no slot fills).

The slots are cut into chunks of :data:`CHUNK`:

- :func:`count_program`: a CTA a chunk puts the chunk's keys in shared memory; a thread a
  slot counts the slots before it in the chunk keyed as it is (its ``rank`` there: so the
  order within an expert is the tokens', the stable sort's), and a thread a key counts the
  chunk's slots with that key (``cnt``); the CTAs after the chunks set ``src`` to -1;
- :func:`scan_program`: one CTA; a thread a key sums its counts over the chunks before each
  chunk (``base``) and over all (its total), then, past a barrier, the aligned totals of the
  experts before it (its segment's offset, ``off``), and past another a thread a metadata
  entry writes the layout's (a row's expert found by binary search over the offsets);
- :func:`place_program`: a thread a slot adds its expert's offset (or block), ``base`` of its
  chunk and key and its ``rank``, and writes its row and that row's token.

Up to :data:`SMALL` slots, :func:`small_program` does all of it in one CTA, a thread a slot,
its phases apart by barriers (one launch where the three take three launches' latency: a
decode step's grouping is that latency).

A thread's loop is at most a chunk's slots (in shared memory; the one CTA's: its slots), the
chunks or the experts long. Slot, row and chunk counts are launch-time sizes: one set of programs a layout serves
every token count. The counts cross between launches through a workspace in global memory.
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
    "SMALL",
    "build_group",
    "count_program",
    "place_program",
    "scan_program",
    "small_program",
]

GroupMetadata = Literal["masked", "offsets", "per_row"]
_METADATA = frozenset(get_args(GroupMetadata))
#: the slots a chunk: a slot's thread reads the slots before it in its chunk, and a key's
#: thread counts a chunk's slots, so a launch's longest chain is this many loads
CHUNK = 256
_THREADS = 256
#: the scan's one CTA: a thread a key (and the keys past it in rounds), then a thread a
#: metadata entry
_SCAN_THREADS = 1024
#: the slots up to which one CTA groups a call in one launch (:func:`small_program`): a
#: thread a slot
SMALL = 1024


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


def count_program(e: int):
    """A CTA a chunk of :data:`CHUNK` slots, then a CTA a :data:`CHUNK` rows: the chunk's
    keys in shared memory; ``rank[i]``, the slots before slot ``i`` in its chunk keyed as it
    is, and ``cnt[c, q]``, the chunk's slots keyed ``q`` for ``q`` in ``[0, e]``; and ``src[r]
    = -1`` for every row (see the module docstring)."""
    _, T = tl()
    N, R, C = T.dynamic("N"), T.dynamic("R"), T.dynamic("C")
    keys = e + 1
    per_thread = -(-keys // CHUNK)  # keys a thread counts

    @T.prim_func
    def main(Ids: T.Tensor((N,), "int32"), Cnt: T.Tensor((C, keys), "int32"),
             Rank: T.Tensor((N,), "int32"), Src: T.Tensor((R,), "int32")):
        with T.Kernel(C + T.ceildiv(R, CHUNK), threads=CHUNK) as b:
            tx = T.get_thread_binding(0)
            acc = T.alloc_local((1,), "int32")
            key = T.alloc_local((1,), "int32")
            s_key = T.alloc_shared((CHUNK,), "int32")
            if b < C:
                i = b * CHUNK + tx
                key[0] = e + 1  # past the slots: a key no slot has
                if i < N:
                    key[0] = _key(T, Ids[i], e)
                s_key[tx] = key[0]
                T.sync_threads()
                if i < N:  # the stable rank: the slots before it in the chunk keyed alike
                    acc[0] = 0
                    for j in T.serial(tx):
                        acc[0] = acc[0] + T.if_then_else(s_key[j] == key[0], 1, 0)
                    Rank[i] = acc[0]
                for u in T.serial(per_thread):
                    q = u * CHUNK + tx
                    if q < keys:
                        acc[0] = 0
                        for j in T.serial(CHUNK):
                            acc[0] = acc[0] + T.if_then_else(s_key[j] == q, 1, 0)
                        Cnt[b, q] = acc[0]
            else:
                r = (b - C) * CHUNK + tx
                if r < R:
                    Src[r] = -1

    return main


def _aligned(c, alignment: int):
    return c if alignment == 1 else (c + (alignment - 1)) // alignment * alignment


def _tail_macros(T, e: int, metadata: str, max_m: int, alignment: int, threads: int, n_meta):
    """The macros the scan and the one-launch program share, over the keys' totals in shared
    memory (``s_tot``), with ``threads`` threads: ``offsets(tx, s_tot, s_off, Off, run)``,
    each key's segment offset (the aligned totals before it) into ``s_off`` (and ``Off``
    unless it is None), a thread a key; and ``meta(tx, s_tot, s_off, Meta, pos, step)``, the
    layout's ``n_meta`` metadata entries, a thread an entry (a row's expert found by binary
    search over the offsets). ``run``, ``pos`` and ``step`` are the caller's one-int locals."""
    masked, per_row = metadata == "masked", metadata == "per_row"
    keys = e + 1
    rounds = -(-keys // threads)  # keys a thread takes
    top = 1 << max(0, (e - 1).bit_length() - 1) if e > 1 else 0  # the binary search's step

    @T.macro
    def offsets(tx, s_tot, s_off, Off, run):
        for u in T.serial(rounds):
            q = u * threads + tx
            if q < keys:
                run[0] = 0
                for p in T.serial(q):
                    run[0] = run[0] + _aligned(s_tot[p], alignment)
                s_off[q] = run[0]
                if Off is not None:
                    Off[q] = run[0]

    @T.macro
    def meta(tx, s_tot, s_off, Meta, pos, step):
        for u in T.serial(T.ceildiv(n_meta, threads)):
            q = u * threads + tx
            if q < n_meta:
                if masked:  # the valid rows of block q
                    Meta[q] = T.min(s_tot[q], max_m)
                elif per_row:
                    # the expert whose segment holds row q (the last whose offset is at most
                    # q, by binary search), -1 in its padding
                    pos[0] = 0
                    step[0] = top
                    for _ in T.serial(top.bit_length()):
                        if pos[0] + step[0] < e:  # noqa: SIM102 - the offset read inside
                            if s_off[pos[0] + step[0]] <= q:
                                pos[0] = pos[0] + step[0]
                        step[0] = step[0] // 2
                    Meta[q] = T.if_then_else(q < s_off[pos[0]] + s_tot[pos[0]], pos[0], -1)
                else:  # the offset of segment q
                    Meta[q] = s_off[q]

    return offsets, meta


def scan_program(e: int, metadata: str, max_m: int, alignment: int):
    """One CTA of :data:`_SCAN_THREADS`: a thread a key sums its counts over the chunks before
    each chunk (``base``) and over all (the key's total, in shared memory); then each key's
    segment offset (the aligned totals before it: ``off``), and the layout's metadata from the
    totals and offsets (see the module docstring)."""
    _, T = tl()
    C, R = T.dynamic("C"), T.dynamic("R")
    masked, per_row = metadata == "masked", metadata == "per_row"
    n_meta = e if masked else R if per_row else e + 1
    keys = e + 1
    rounds = -(-keys // _SCAN_THREADS)  # keys a thread takes
    offsets, meta = _tail_macros(T, e, metadata, max_m, alignment, _SCAN_THREADS, n_meta)

    @T.prim_func
    def main(Cnt: T.Tensor((C, keys), "int32"), Base: T.Tensor((C, keys), "int32"),
             Off: T.Tensor((keys,), "int32"), Meta: T.Tensor((n_meta,), "int32")):
        with T.Kernel(1, threads=_SCAN_THREADS):
            tx = T.get_thread_binding(0)
            run = T.alloc_local((1,), "int32")
            pos = T.alloc_local((1,), "int32")
            step = T.alloc_local((1,), "int32")
            s_tot = T.alloc_shared((keys,), "int32")
            s_off = T.alloc_shared((keys,), "int32")
            for u in T.serial(rounds):
                q = u * _SCAN_THREADS + tx
                if q < keys:
                    run[0] = 0
                    # eight chunks' counts loaded together: the loop is a chain of loads from
                    # L2 otherwise (a DeepSeek-V3 call of 8192 tokens has 256 chunks)
                    for c8 in T.serial(T.ceildiv(C, 8)):
                        for v in T.unroll(8):
                            if c8 * 8 + v < C:
                                Base[c8 * 8 + v, q] = run[0]
                                run[0] = run[0] + Cnt[c8 * 8 + v, q]
                    s_tot[q] = run[0]
            T.sync_threads()
            offsets(tx, s_tot, s_off, Off, run)
            T.sync_threads()
            meta(tx, s_tot, s_off, Meta, pos, step)

    return main


def small_program(e: int, k: int, metadata: str, max_m: int, alignment: int):
    """The whole grouping in one CTA of :data:`SMALL` threads, for at most :data:`SMALL`
    slots (a decode step's: 128 tokens of top-8): a thread a slot puts its key in shared
    memory and the threads set ``src`` to -1; past a barrier, each slot's rank among the
    slots before it keyed alike, and a thread a key its total; past another, the offsets;
    past a third, the metadata, each slot's row and that row's token. One launch where the
    chunked programs take three."""
    _, T = tl()
    N, R = T.dynamic("N"), T.dynamic("R")
    masked, per_row = metadata == "masked", metadata == "per_row"
    n_meta = e if masked else R if per_row else e + 1
    keys = e + 1
    rounds = -(-keys // SMALL)
    offsets, meta = _tail_macros(T, e, metadata, max_m, alignment, SMALL, n_meta)

    @T.prim_func
    def main(Ids: T.Tensor((N,), "int32"), Meta: T.Tensor((n_meta,), "int32"),
             Rows: T.Tensor((N,), "int32"), Src: T.Tensor((R,), "int32")):
        with T.Kernel(1, threads=SMALL):
            tx = T.get_thread_binding(0)
            run = T.alloc_local((1,), "int32")
            key = T.alloc_local((1,), "int32")
            row = T.alloc_local((1,), "int32")
            pos = T.alloc_local((1,), "int32")
            step = T.alloc_local((1,), "int32")
            s_key = T.alloc_shared((SMALL,), "int32")
            s_tot = T.alloc_shared((keys,), "int32")
            s_off = T.alloc_shared((keys,), "int32")
            key[0] = e + 1  # past the slots: a key no slot has
            if tx < N:
                key[0] = _key(T, Ids[tx], e)
            s_key[tx] = key[0]
            for u in T.serial(T.ceildiv(R, SMALL)):
                if u * SMALL + tx < R:
                    Src[u * SMALL + tx] = -1
            T.sync_threads()
            for u in T.serial(rounds):  # a key's total
                q = u * SMALL + tx
                if q < keys:
                    run[0] = 0
                    for j in T.serial(N):
                        run[0] = run[0] + T.if_then_else(s_key[j] == q, 1, 0)
                    s_tot[q] = run[0]
            T.sync_threads()
            offsets(tx, s_tot, s_off, None, run)
            T.sync_threads()
            meta(tx, s_tot, s_off, Meta, pos, step)
            if tx < N:  # the slot's row: its rank among the slots before it keyed alike
                run[0] = 0
                for j in T.serial(tx):
                    run[0] = run[0] + T.if_then_else(s_key[j] == key[0], 1, 0)
                if masked:
                    row[0] = T.if_then_else(T.And(key[0] < e, run[0] < max_m),
                                            key[0] * max_m + run[0], -1)
                else:
                    row[0] = T.if_then_else(key[0] < e, s_off[T.min(key[0], e)] + run[0], -1)
                Rows[tx] = row[0]
                if row[0] >= 0:
                    Src[row[0]] = tx // k

    return main


def place_program(e: int, k: int, metadata: str, max_m: int):
    """Each slot's row (its expert's offset, or block, plus its rank: the slots keyed alike in
    the chunks before its own, and before it in its chunk) and that row's token."""
    _, T = tl()
    N, R, C = T.dynamic("N"), T.dynamic("R"), T.dynamic("C")
    masked = metadata == "masked"
    keys = e + 1

    @T.prim_func
    def main(Ids: T.Tensor((N,), "int32"), Base: T.Tensor((C, keys), "int32"),
             Rank: T.Tensor((N,), "int32"), Off: T.Tensor((keys,), "int32"),
             Rows: T.Tensor((N,), "int32"), Src: T.Tensor((R,), "int32")):
        with T.Kernel(T.ceildiv(N, _THREADS), threads=_THREADS) as b:
            tx = T.get_thread_binding(0)
            rank = T.alloc_local((1,), "int32")
            row = T.alloc_local((1,), "int32")
            i = b * _THREADS + tx
            if i < N:
                key = _key(T, Ids[i], e)
                rank[0] = Base[i // CHUNK, key] + Rank[i]
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
    """``(count, scan, place, small)``: the compiled programs of a grouping
    (:class:`MoeGroupSpec`'s fields): the three chunked ones, and the one-launch one for at
    most :data:`SMALL` slots."""
    return (compile_program(count_program(e), target),
            compile_program(scan_program(e, metadata, max_m, alignment), target),
            compile_program(place_program(e, k, metadata, max_m), target),
            compile_program(small_program(e, k, metadata, max_m, alignment), target))


class MoeGroupKernel(Kernel, MoeGroupInterface):
    """Any slot count below 2^31, sm_80 to sm_90: one launch for at most :data:`SMALL`
    slots, three above."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True

    def __init__(self, spec: MoeGroupSpec) -> None:
        super().__init__(spec)
        self.count, self.scan, self.place, self.small = build_group(
            spec.e, spec.k, spec.metadata, spec.max_m, spec.alignment)

    def __call__(self, ids, metadata, rows, src) -> None:
        flat = ids.reshape(-1)
        n, keys = flat.numel(), self.spec.e + 1
        if n <= SMALL:
            self.small(flat, metadata.view(-1), rows.view(-1), src)
            return
        chunks = -(-n // CHUNK)
        # one workspace: cnt, base, off, rank, each at a 16-byte boundary
        a, b = -(-chunks * keys // 4) * 4, -(-keys // 4) * 4
        work = flat.new_empty((2 * a + b + n,))
        cnt = work[:chunks * keys].view(chunks, keys)
        base = work[a:a + chunks * keys].view(chunks, keys)
        off, rank = work[2 * a:2 * a + keys], work[2 * a + b:2 * a + b + n]
        self.count(flat, cnt, rank, src)
        self.scan(cnt, base, off, metadata.view(-1))
        self.place(flat, base, rank, off, rows.view(-1), src)
