"""Top-k of each row by radix select, in TileLang.

A call is a contiguous ``(M, N)`` input; each row's ``k`` largest (or smallest) elements are
written, by value and then by index, into ``values`` ``(M, k)`` and int64 ``indices``. ``N``,
``k``, the dtype and ``largest`` are compiled in; ``M`` is a launch-time size. One CTA a row
(or a row's segment, below).

Every element is compared as its order-preserving integer key (16 bits for float16 and
bfloat16, 32 for float32): the bits of a non-negative number with the sign bit set, those of a
negative one inverted, so that unsigned comparison of keys is the numeric order; every NaN
takes the largest key (torch orders NaN above every number) and -0.0 takes +0.0's. For the
smallest k the keys are complemented, so the program always selects the largest keys. The
k kept are the k greatest ``(key, -index)`` pairs: among equal values the lowest indices, the
answer a stable sort gives (torch.topk allows any).

The program, per row:

1. **A bound.** The first ``pre`` chunks of the row (a chunk is 16 bytes a thread) are read
   into registers, and each thread takes the largest key it holds (for k above the thread
   count, the largest of each 16-byte piece). The k-th largest of those maxima, ``tau``
   (found by the radix select of step 3 over them), is a lower bound of the row's k-th
   largest key: k distinct elements reach it.
2. **One pass over the row.** Every element whose key reaches ``tau`` is appended to a
   candidate buffer in shared memory (an atomic counter; ``cap`` entries of key and index).
   For normal logits the bound keeps about 0.3% of a 128k row at k = 50 (400 elements) and
   8% at k = 1024, whose buffer is four times larger. The lean plan (the default; see
   :func:`topk_plan`) tests each element as a float against the bound's value and computes
   the key of the candidates only: a comparison an element where the key took a dozen
   integer operations, which at 4096 rows of 128256 cost as much time as the row's read.
   It first tests each 16-byte access as a whole: the largest magnitude of its elements
   (sign bits cleared, 16-bit pairs compared two at a time) against the bound's, where the
   bound is on the kept side of zero (else every access passes); an element beyond the bound
   is at least as far from zero, and a NaN's magnitude exceeds every number's.
3. **Radix select.** Rounds of 8 bits from the top: a 256-bin histogram in shared memory of
   the keys that match the digits found so far, the bin holding the k-th largest found by a
   warp's scan over the bins. After the last round the k-th largest key ``t`` is known
   exactly, and how many of the elements equal to it are kept (``need``). The rounds read the
   candidate buffer, or the row again when the buffer overflowed.
4. **Gather and sort.** The candidates at or above ``t`` go to a shared array of ``sort``
   composite keys ``key << 32 | ~index`` when they fit, and a bitonic sort orders them; the
   first k are the answer. (The lean plan, where the array has no more entries than the CTA
   has threads, writes each entry at its rank instead: how many entries are greater.) Where they do not fit (a row of many equal values, or an overflowed
   buffer), a pass over the row in index order takes every element above ``t`` and, by a
   block scan of each chunk's count of elements equal to ``t``, the ``need`` lowest-indexed of
   those, before the same sort.
5. The values are read back from the row by index.

Few rows are split into segments, each a CTA, and their candidates merged by a second call of
the same program (:class:`TopkRadixKernel`).

The common case reads the row once from memory (the bound's chunks are held); only a row whose
candidates overflow the buffer reads it again for each round and once more to gather.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import functools
from typing import Literal, get_args

import torch

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl
from ._tilelang import pow2_at_least as _pow2_at_least

__all__ = [
    "TopkDType",
    "TopkInterface",
    "TopkRadixKernel",
    "TopkSpec",
    "build_topk",
    "split_plan",
    "topk_plan",
]

_VECTOR_BYTES = 16
_WARP = 32
_MAX_THREADS = 512
#: chunks of the row held in registers for the bound
_PRE = 4
#: candidate buffer entries (a key and an index each: 8 bytes), for k up to _CAP_K and above
_CAP, _CAP_K, _CAP_LARGE = 4096, 256, 16384
_BINS = 256
#: the lean plan's threads a CTA, chunks held, and buffer for k up to _LEAN_CAP_K
_LEAN_THREADS, _LEAN_PRE, _LEAN_CAP, _LEAN_CAP_K = 256, 8, 2048, 64

#: the storage dtypes the top-k kernels are written for
TopkDType = Literal["float16", "bfloat16", "float32"]
_TOPK_DTYPES = frozenset(get_args(TopkDType))
#: (key bits, the largest magnitude bits that are not NaN: the infinity's)
_KEY = {"float16": (16, 0x7C00), "bfloat16": (16, 0x7F80), "float32": (32, 0x7F800000)}


class TopkSpec(CallSpec, frozen=True, kw_only=True):
    """What a top-k implementation is told about a call: the rows of the contiguous ``(rows,
    n)`` input, ``k`` and which end is kept."""

    rows: int
    n: int
    k: int
    dtype: TopkDType
    largest: bool

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _TOPK_DTYPES}, sizes=("rows", "n", "k"),
                          flags=("largest",))
        if self.k > self.n:
            raise ValueError(f"TopkSpec: k ({self.k}) exceeds the row length ({self.n})")


class TopkInterface(KernelInterface):
    """One slot: ``forward(x, values, indices)`` with ``x`` a contiguous ``(M, N)`` tensor at a
    16-byte aligned address, ``values`` ``(M, k)`` of its dtype and ``indices`` ``(M, k)``
    int64."""

    slot = "topk_fwd"
    call_spec = TopkSpec


# --- the plan --------------------------------------------------------------------------------


def topk_plan(n: int, k: int, dtype: str, lean: bool = True
              ) -> tuple[int, int, int, int, int, bool]:
    """``(threads, vec, pre, cap, sort, lean)``: ``threads`` a CTA, each reading ``vec``
    elements a chunk (the widest access the row length keeps aligned, up to 16 bytes); ``pre``
    chunks held for the bound, and read together a step of the pass; a candidate buffer of
    ``cap`` entries and a sort of ``sort`` composite keys (twice ``k``, so that ties at the
    threshold usually fit).

    ``lean`` (the default) is the plan for many CTAs an SM: at most 256 threads holding 8
    chunks (the same 16384 held elements as 512 threads holding 4, so the bound is as tight,
    with 8 loads in flight a thread), a 2048-entry buffer for k up to 64 (16 KiB where 4096
    took 32 KiB: the bound keeps about 430 of a 128256 row at k = 50), and the pass's filter
    a float comparison against the bound's value, the key computed only for the candidates.
    ``lean=False`` is the earlier plan (512 threads, 4 chunks, the key of every element), kept
    for comparison."""
    vec = _VECTOR_BYTES // _ITEMSIZE[dtype]
    while vec > 1 and n % vec:
        vec //= 2
    most, pre = (_LEAN_THREADS, _LEAN_PRE) if lean else (_MAX_THREADS, _PRE)
    threads = min(most, max(_WARP, _pow2_at_least(-(-n // vec))))
    chunks = -(-n // (threads * vec))
    cap = _CAP if k <= _CAP_K else _CAP_LARGE
    if lean and k <= _LEAN_CAP_K:
        cap = _LEAN_CAP
    cap = min(cap, _pow2_at_least(n))
    sort = max(_WARP, _pow2_at_least(2 * k))
    return threads, vec, min(pre, chunks), cap, sort, lean


# --- the program -----------------------------------------------------------------------------


def topk_program(n: int, k: int, dtype: str, largest: bool, threads: int, vec: int, pre: int,
                 cap: int, sort: int, lean: bool = True):
    """The TileLang prim_func of the radix select (not compiled)."""
    _, T = tl()
    M = T.dynamic("M")
    bits, inf_bits = _KEY[dtype]
    full = (1 << bits) - 1
    sign = 1 << (bits - 1)
    rounds = bits // 8
    chunk = threads * vec
    chunks = -(-n // chunk)
    warps = threads // _WARP
    exact = chunks * chunk == n
    u32, i32, u64 = "uint32", "int32", "uint64"
    # the bound's values: each thread's largest held key, or (k above the thread count) each
    # held 16-byte piece's; too few of them for k (a short row): no bound
    per = 1 if k <= threads else pre
    bounded = threads * per >= k
    groups = -(-chunks // pre)
    log_sort = sort.bit_length() - 1
    # the lean plan places each of at most `threads` entries by its rank instead of sorting
    ranked = lean and sort <= threads

    def raw(v):
        """The bits of element ``v`` as uint32."""
        if bits == 16:
            return T.cast(T.reinterpret(v, "uint16"), u32)
        return T.reinterpret(v, u32)

    def key(v):
        """The order-preserving key of ``v`` (complemented for the smallest k)."""
        b = raw(v)
        mag = b & T.uint32(full >> 1)
        ordered = T.if_then_else(b >= T.uint32(sign), (~b) & T.uint32(full), b | T.uint32(sign))
        kv = T.if_then_else(mag > T.uint32(inf_bits), T.uint32(full),
                            T.if_then_else(mag == T.uint32(0), T.uint32(sign), ordered))
        return kv if largest else T.uint32(full) - kv

    def composite(kv, col):
        return (T.cast(kv, u64) << T.uint64(32)) | T.cast(
            T.uint32(0xFFFFFFFF) - T.cast(col, u32), u64)

    def bound_value(t):
        """The float32 value whose key is the bound ``t`` (an element's key, or 0), for the
        lean filter: a number whose key reaches ``t`` compares at or beyond it as a float
        (float order is the keys' but for NaN, and -0.0 compares equal to 0.0 as its key
        does; nvcc's flush of subnormals to zero is monotone, so it may let more through,
        never fewer). ``t = 0`` (no bound) is every element: the infinity of the far side."""
        kv = t if largest else T.uint32(full) - t
        b = T.if_then_else(kv >= T.uint32(sign), kv ^ T.uint32(sign), (~kv) & T.uint32(full))
        if bits == 16:
            f = T.cast(T.reinterpret(T.cast(b, "uint16"), dtype), "float32")
        else:
            f = T.reinterpret(b, "float32")
        far = -T.infinity("float32") if largest else T.infinity("float32")
        return T.if_then_else(t == T.uint32(0), far, f)

    def reaches(v, lo):
        """Whether element ``v`` passes the lean filter against bound value ``lo``: every
        NaN passes, which the largest k must keep (its key is the greatest) and the smallest
        passes on needlessly (a superset of the keys reaching the bound is harmless: the
        rounds select by key), one test where telling them apart would take two."""
        f = T.cast(v, "float32") if bits == 16 else v
        beyond = f >= lo if largest else f <= lo
        # CUDA's isnan as an opaque call (TVM folds f != f to False)
        return T.Or(beyond, T.call_pure_extern("bool", "isnan", f))

    def magnitude_floor(lo):
        """The lean pass's test of a whole access: the magnitude bits (sign cleared) an
        element must reach for its key to reach the bound whose value is ``lo``. Where ``lo``
        is on the kept side of zero (at or above it for the largest k, at or below for the
        smallest) an element beyond it is at least as far from zero, and a NaN's magnitude
        bits exceed every number's; elsewhere (a bound of the other sign, no bound, a NaN
        bound) 0, which every access passes."""
        side = lo >= T.float32(0) if largest else lo <= T.float32(0)
        if bits == 16:
            b = T.cast(T.reinterpret(T.cast(lo, dtype), "uint16"), u32)
        else:
            b = T.reinterpret(lo, u32)
        return T.if_then_else(side, b & T.uint32(full >> 1), T.uint32(0))

    def magnitude(held, base):
        """The largest magnitude bits of the ``vec`` elements of ``held`` from ``base``: the
        16-bit elements two a 32-bit word, their magnitudes compared in pairs
        (``__vmaxu2``), about one instruction an element."""
        if bits == 16 and vec >= 2:
            words = [(raw(held[base + 2 * j]) | (raw(held[base + 2 * j + 1]) << T.uint32(16)))
                     & T.uint32(0x7FFF7FFF) for j in range(vec // 2)]
            m = functools.reduce(
                lambda a, b: T.call_pure_extern(u32, "__vmaxu2", a, b), words)
            return T.max(m & T.uint32(0xFFFF), m >> T.uint32(16))
        return functools.reduce(T.max, [raw(held[base + i]) & T.uint32(full >> 1)
                                        for i in range(vec)])

    def claim(st, j):
        """The next slot of counter ``st[j]`` (in shared memory): CUDA's ``atomicAdd`` on the
        array's own address, which nvcc issues as a shared-memory atomic (``ATOMS``), where
        TileLang's ``atomic_add`` with ``return_prev`` (a ``cuda::atomic_ref`` of device
        scope) was a generic one (``ATOM.E.ADD.STRONG.GPU``) in the SASS (sm_90a)."""
        return T.call_extern(i32, "atomicAdd", T.address_of(st[j]), 1)

    @T.macro
    def select(src, X, row, tx, gm, piece, bufk, hist, st, u, iv):
        """The k-th largest key of a source into u[1], 8 bits a round from the top, and into
        iv[0] how many of the keys equal to it are among the k largest, st[4] how many there
        are: src 0 is the thread's ``per`` maxima ``gm``, 1 the candidate buffer (iv[1]
        entries), 2 the row."""
        iv[0] = k  # how many of the keys matching the digits found are still to keep
        u[1] = T.uint32(0)  # the digits found so far
        for r in T.serial(rounds):
            # this round's digit: its shift, and the mask of the digits above it (found before)
            u[3] = T.uint32(full) ^ (T.uint32(full) >> T.cast(8 * r, u32))
            shift = T.cast(bits - 8 - 8 * r, u32)
            for j in T.unroll(-(-_BINS // threads)):
                if j * threads + tx < _BINS:
                    hist[j * threads + tx] = 0
            T.sync_threads()
            if src == 0:
                for p in T.unroll(per):
                    if (gm[p] & u[3]) == u[1]:
                        T.atomic_add(hist[T.cast((gm[p] >> shift) & T.uint32(255), i32)], 1)
            elif src == 1:
                for j in T.serial(-(-cap // threads)):
                    if j * threads + tx < iv[1]:
                        u[2] = bufk[j * threads + tx]
                        if (u[2] & u[3]) == u[1]:
                            T.atomic_add(hist[T.cast((u[2] >> shift) & T.uint32(255), i32)], 1)
            else:
                for c in T.serial(chunks):
                    if exact or c * chunk + tx * vec < n:
                        for i in T.vectorized(vec):
                            piece[i] = X[row, c * chunk + tx * vec + i]
                        for i in T.unroll(vec):
                            u[2] = key(piece[i])
                            if (u[2] & u[3]) == u[1]:
                                T.atomic_add(hist[T.cast((u[2] >> shift) & T.uint32(255), i32)],
                                             1)
            T.sync_threads()
            # warp 0 finds the bin holding the iv[0]-th largest: each lane sums 8 bins, from
            # the top, and an inclusive scan over the lanes says whose they are
            if tx < _WARP:
                iv[3] = 0
                for j in T.unroll(8):
                    iv[3] += hist[_BINS - 1 - 8 * tx - j]
                iv[4] = iv[3]
                for s in T.unroll(5):
                    iv[5] = T.shfl_up(iv[4], 1 << s)
                    if tx >= (1 << s):
                        iv[4] += iv[5]
                iv[5] = iv[4] - iv[3]  # the count in the bins above this lane's
                if iv[5] < iv[0] and iv[0] <= iv[4]:
                    iv[6] = 0  # found
                    for j in T.unroll(8):
                        iv[7] = hist[_BINS - 1 - 8 * tx - j]
                        if iv[6] == 0 and iv[5] + iv[7] >= iv[0]:
                            st[2] = _BINS - 1 - 8 * tx - j
                            st[3] = iv[5]
                            st[4] = iv[7]
                            iv[6] = 1
                        iv[5] += iv[7]
            T.sync_threads()
            iv[0] -= st[3]
            u[1] = u[1] | (T.cast(st[2], u32) << shift)

    @T.prim_func
    def main(X: T.Tensor((M, n), dtype), V: T.Tensor((M, k), dtype),
             Idx: T.Tensor((M, k), "int64")):
        with T.Kernel(M, threads=threads) as row:
            tx = T.get_thread_binding()
            lane = tx % _WARP
            warp = tx // _WARP
            held = T.alloc_local((pre * vec,), dtype)
            piece = T.alloc_local((vec,), dtype)
            kv = T.alloc_local((vec,), u32)
            sw = T.alloc_local((1,), u64)
            gm = T.alloc_local((per,), u32)  # the bound's maxima
            u = T.alloc_local((4,), u32)  # tau, the selected key, scratch
            lo = T.alloc_local((1,), "float32")  # tau's value (the lean filter)
            lm = T.alloc_local((1,), u32)  # the magnitude an access must reach (lean)
            iv = T.alloc_local((8,), i32)  # kk, count, scratch
            bufk = T.alloc_shared((cap,), u32)
            bufi = T.alloc_shared((cap,), i32)
            srt = T.alloc_shared((sort,), u64)
            hist = T.alloc_shared((_BINS,), i32)
            st = T.alloc_shared((8,), i32)  # count, sorted, bin, above, in bin, scan total
            wsi = T.alloc_shared((warps,), i32)

            # 1. the bound: the k-th largest of the held chunks' thread (or piece) maxima
            for c in T.unroll(pre):
                if exact or c * chunk + tx * vec < n:
                    for i in T.vectorized(vec):
                        held[c * vec + i] = X[row, c * chunk + tx * vec + i]
            for p in T.unroll(per):
                gm[p] = T.uint32(0)
            for c in T.unroll(pre):
                for i in T.unroll(vec):
                    if exact or c * chunk + tx * vec < n:
                        gm[c % per] = T.max(gm[c % per], key(held[c * vec + i]))
            u[0] = T.uint32(0)
            if bounded:
                select(0, X, row, tx, gm, piece, bufk, hist, st, u, iv)
                u[0] = u[1]
            if lean:
                lo[0] = bound_value(u[0])
                lm[0] = magnitude_floor(lo[0])
            if tx == 0:
                st[0] = 0
                st[1] = 0
            T.sync_threads()

            # 2. one pass: the candidates reaching tau into the buffer, `pre` chunks a step
            # (their loads in flight together), the held ones first
            for g in T.serial(groups):
                if g > 0:
                    for c in T.unroll(pre):
                        if (g * pre + c) * chunk + tx * vec < n:
                            for i in T.vectorized(vec):
                                held[c * vec + i] = X[row, (g * pre + c) * chunk + tx * vec + i]
                for c in T.unroll(pre):
                    if lean:
                        if (g * pre + c) * chunk + tx * vec < n:
                            # one test of the whole access first (whether an element's
                            # magnitude reaches the bound's: about 5% of the accesses of
                            # normal logits at k = 50), the elements' tests and appends only
                            # where one does. The SASS of a branch around each element's test
                            # was about 12 instructions an element; the access's test is 12
                            # an access (sm_90a). A warp still takes the elements' path where
                            # any of its lanes' accesses passes (most steps of normal logits)
                            u[3] = T.if_then_else(magnitude(held, c * vec) >= lm[0],
                                                  T.uint32(1), T.uint32(0))
                            if u[3] != T.uint32(0):
                                for i in T.unroll(vec):
                                    # held in a register: TileLang repeats the condition for
                                    # each statement of the branch
                                    u[2] = T.if_then_else(reaches(held[c * vec + i], lo[0]),
                                                          T.uint32(1), T.uint32(0))
                                    if u[2] != T.uint32(0):
                                        iv[2] = claim(st, 0)
                                        if iv[2] < cap:
                                            bufk[iv[2]] = key(held[c * vec + i])
                                            bufi[iv[2]] = ((g * pre + c) * chunk + tx * vec
                                                           + i)
                    else:
                        for i in T.unroll(vec):
                            if (g * pre + c) * chunk + tx * vec < n:
                                u[2] = key(held[c * vec + i])
                                if u[2] >= u[0]:
                                    iv[2] = claim(st, 0)
                                    if iv[2] < cap:
                                        bufk[iv[2]] = u[2]
                                        bufi[iv[2]] = (g * pre + c) * chunk + tx * vec + i
            T.sync_threads()
            iv[1] = st[0]  # candidates (more than cap: the buffer overflowed)

            # 3. radix select of the k-th largest key, from the buffer or, overflowed, the row
            if iv[1] <= cap:
                select(1, X, row, tx, gm, piece, bufk, hist, st, u, iv)
            else:
                select(2, X, row, tx, gm, piece, bufk, hist, st, u, iv)
            # u[1]: the k-th largest key; iv[0]: how many equal to it are kept; st[4]: how
            # many equal it (all of them in the buffer when it did not overflow)

            # 4. gather into the sort array
            for j in T.unroll(-(-sort // threads)):
                if j * threads + tx < sort:
                    srt[j * threads + tx] = T.uint64(0)
            T.sync_threads()
            if iv[1] <= cap and k - iv[0] + st[4] <= sort:
                for j in T.serial(-(-cap // threads)):
                    if j * threads + tx < iv[1]:
                        u[2] = bufk[j * threads + tx]
                        if u[2] >= u[1]:
                            iv[2] = claim(st, 1)
                            srt[iv[2]] = composite(u[2], bufi[j * threads + tx])
            else:
                # in index order: all above t, and the lowest-indexed iv[0] equal to it
                iv[6] = 0  # equal ones taken by the chunks before
                for c in T.serial(chunks):
                    iv[3] = 0
                    if exact or c * chunk + tx * vec < n:
                        for i in T.vectorized(vec):
                            piece[i] = X[row, c * chunk + tx * vec + i]
                        for i in T.unroll(vec):
                            kv[i] = key(piece[i])
                            if kv[i] == u[1]:
                                iv[3] += 1
                            if kv[i] > u[1]:
                                iv[2] = claim(st, 1)
                                srt[iv[2]] = composite(kv[i], c * chunk + tx * vec + i)
                    else:
                        for i in T.unroll(vec):
                            kv[i] = T.uint32(0)
                    # exclusive scan of the threads' counts of equal ones, in index order
                    iv[4] = iv[3]
                    for s in T.unroll(5):
                        iv[5] = T.shfl_up(iv[4], 1 << s)
                        if lane >= (1 << s):
                            iv[4] += iv[5]
                    iv[7] = iv[4] - iv[3]
                    if warps > 1:
                        if lane == _WARP - 1:
                            wsi[warp] = iv[4]
                        T.sync_threads()
                        for w in T.unroll(warps - 1):
                            if w < warp:
                                iv[7] += wsi[w]
                        iv[5] = 0
                        for w in T.unroll(warps):
                            iv[5] += wsi[w]
                        T.sync_threads()
                    else:
                        iv[5] = T.shfl_sync(iv[4], _WARP - 1)
                    iv[7] += iv[6]
                    if exact or c * chunk + tx * vec < n:
                        for i in T.unroll(vec):
                            if kv[i] == u[1]:
                                if iv[7] < iv[0]:
                                    iv[2] = claim(st, 1)
                                    srt[iv[2]] = composite(kv[i], c * chunk + tx * vec + i)
                                iv[7] += 1
                    iv[6] += iv[5]
            T.sync_threads()

            if ranked:
                # 5-6. each entry's place is how many entries are greater (the composite keys
                # of the gathered differ, and exceed the empty entries' 0): one scan of the
                # array a thread, no barrier, where the bitonic sort takes log2(sort)^2 / 2
                if tx < sort:
                    sw[0] = srt[tx]
                    if sw[0] != T.uint64(0):
                        iv[3] = 0
                        for j in T.serial(sort):
                            if srt[j] > sw[0]:
                                iv[3] += 1
                        if iv[3] < k:
                            iv[2] = T.cast(T.uint32(0xFFFFFFFF) - T.cast(
                                sw[0] & T.uint64(0xFFFFFFFF), u32), i32)
                            V[row, iv[3]] = X[row, iv[2]]
                            Idx[row, iv[3]] = T.cast(iv[2], "int64")
            else:
                # 5. bitonic sort, descending: pairs (pos, pos + stride) with pos's stride
                # bit clear, ordered descending where pos's size bit is clear, else ascending
                for a in T.serial(1, log_sort + 1):
                    for b in T.serial(a):
                        for j in T.unroll(-(-(sort // 2) // threads)):
                            if j * threads + tx < sort // 2:
                                # stride 2^(a-1-b) within bitonic runs of 2^a
                                iv[3] = 1 << (a - 1 - b)
                                iv[2] = (2 * (j * threads + tx)
                                         - ((j * threads + tx) & (iv[3] - 1)))
                                if (((iv[2] & (1 << a)) == 0
                                     and srt[iv[2]] < srt[iv[2] + iv[3]])
                                        or ((iv[2] & (1 << a)) != 0
                                            and srt[iv[2]] > srt[iv[2] + iv[3]])):
                                    sw[0] = srt[iv[2]]
                                    srt[iv[2]] = srt[iv[2] + iv[3]]
                                    srt[iv[2] + iv[3]] = sw[0]
                        T.sync_threads()

                # 6. the values and indices of the first k
                for j in T.serial(-(-k // threads)):
                    if j * threads + tx < k:
                        iv[2] = T.cast(T.uint32(0xFFFFFFFF) - T.cast(
                            srt[j * threads + tx] & T.uint64(0xFFFFFFFF), u32), i32)
                        V[row, j * threads + tx] = X[row, iv[2]]
                        Idx[row, j * threads + tx] = T.cast(iv[2], "int64")

    # every barrier the program needs is written above: TileLang's inserted ones would also
    # separate the appends of one phase (it cannot tell that atomically claimed slots differ),
    # a barrier per element; the buffers keep their own shared memory (no reuse across phases)
    return main.with_attr("tilelang_pass_configs", {
        "tl.disable_thread_storage_sync": True, "tl.disable_shared_memory_reuse": True})


@stored(maxsize=256)
def build_topk(n: int, k: int, dtype: str, largest: bool, target: str | None = None,
               plan: tuple | None = None):
    """Compile the radix select (cached per configuration); ``plan`` overrides
    :func:`topk_plan`'s lean plan, for tuning and for the earlier plan."""
    plan = plan or topk_plan(n, k, dtype)
    return compile_program(topk_program(n, k, dtype, largest, *plan), target)


# --- the implementation ----------------------------------------------------------------------

#: fewer CTAs than this (one an SM of an H100/H200) leave the GPU idle: rows are split
_FEW_CTAS = 132
#: the shortest segment a split row is cut into, in elements and in multiples of k
_MIN_SEGMENT, _MIN_SEGMENT_K = 4096, 8


def split_plan(rows: int, n: int, k: int) -> int:
    """How many segments each row is cut into: doubled while the rows launch fewer than
    :data:`_FEW_CTAS` CTAs and each segment keeps at least :data:`_MIN_SEGMENT` elements and
    :data:`_MIN_SEGMENT_K` times k (a segment's top k are its candidates, and the second pass
    selects from ``segs * k`` of them), dividing ``n`` exactly."""
    segs = 1
    while (rows * segs < _FEW_CTAS and n % (2 * segs) == 0
           and n // (2 * segs) >= max(_MIN_SEGMENT, _MIN_SEGMENT_K * k)):
        segs *= 2
    return segs


class TopkRadixKernel(Kernel, TopkInterface):
    """Any row: one CTA a row, radix select over a bounded candidate buffer.

    Few rows (a sampling step's batch, one long row) are split (:func:`split_plan`): the same
    program selects the top k of each of a row's ``segs`` equal segments, viewed as rows of
    their own, and then the top k of those ``segs * k`` candidates, whose positions map back
    to the row (segment ``p // k``, the first pass's index at ``p``). The candidates lie in
    segment order and, within a segment, by value and then index, so among equal values a
    lower position is a lower index: the second pass's ties resolve as one pass's would.
    """

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True

    @classmethod
    def identity(cls, spec: TopkSpec):
        # the row count matters only through the split
        return (spec.device, spec.n, spec.k, spec.dtype, spec.largest,
                split_plan(spec.rows, spec.n, spec.k))

    def __init__(self, spec: TopkSpec, lean: bool = True) -> None:
        """``lean=False`` runs both passes on the earlier plan (:func:`topk_plan`), for the
        GPU tests and the sweep's comparison; the runtime builds the lean one."""
        super().__init__(spec)
        self._k = spec.k
        self._segs = segs = split_plan(spec.rows, spec.n, spec.k)
        self.program = self.merge = None
        if spec.k:
            sub = spec.n // segs
            self.program = build_topk(sub, spec.k, spec.dtype, spec.largest,
                                      plan=topk_plan(sub, spec.k, spec.dtype, lean))
            if segs > 1:
                self.merge = build_topk(segs * spec.k, spec.k, spec.dtype, spec.largest, plan=(
                    topk_plan(segs * spec.k, spec.k, spec.dtype, lean)))

    def __call__(self, x, values, indices) -> None:
        rows = x.shape[0]
        if rows == 0 or self.program is None:
            return
        if self.merge is None:
            self.program(x, values, indices)
            return
        segs, k = self._segs, self._k
        sub = x.shape[1] // segs
        v1 = torch.empty((rows * segs, k), dtype=x.dtype, device=x.device)
        i1 = torch.empty((rows * segs, k), dtype=torch.int64, device=x.device)
        self.program(x.view(rows * segs, sub), v1, i1)
        pos = torch.empty((rows, k), dtype=torch.int64, device=x.device)
        self.merge(v1.view(rows, segs * k), values, pos)
        indices.copy_(torch.gather(i1.view(rows, segs * k), 1, pos)
                      .add_(pos.div(k, rounding_mode="floor").mul_(sub)))
