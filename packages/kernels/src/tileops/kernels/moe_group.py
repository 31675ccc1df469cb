"""The grouping of routed slots by expert, for few slots, in TileLang: what
MoePermuteAlignFwdOp's torch grouping computes (a stable sort of the slots by expert, the
layout's metadata, each slot's row and each row's token) in two launches instead of some
thirty torch kernels, whose launches were the whole time of a call of a few tokens (some 60
us on the H200 for one token of Mixtral's routing, where the row movement takes 2).

:class:`MoeGroupInterface` (``moe_group``) -- ``forward(ids, metadata, rows, src)``: ``ids``
``(M, K)`` int32 (an id outside ``[0, E)`` is a dropped slot, keyed ``E``), ``metadata`` the
layout's (``E`` valid rows of the masked blocks, ``E + 1`` segment offsets, or the expert of
each of the ``R`` rows), ``rows`` ``(M, K)`` the slot's row (-1 when dropped), ``src``
``(R,)`` the token of each row (-1 for a row no slot fills).

- :func:`count_program`: a thread per row sets ``src`` to -1, and a thread per expert (and
  one for the dropped slots) counts the slots with its key, reading every slot;
- :func:`place_program`: a thread per slot counts the slots before it with its key (its rank
  in its expert, so the order within an expert is the tokens': the stable sort's), adds its
  expert's offset (the aligned counts of the experts before it, summed) and writes its row
  and that row's token; a thread per metadata entry sums or scans the counts.

Each thread reads every slot (or every count) in turn, so the work grows as slots x slots:
:data:`GROUP_SLOTS_MAX` slots at most, where the loop is a few microseconds; the op groups
more slots with its torch grouping. Slot and row counts are launch-time sizes: one program a
layout serves every token count. The threads are independent within a launch (no shared
memory, no barrier), and the counts cross between the launches through global memory.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

from typing import Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, tl

__all__ = [
    "GROUP_SLOTS_MAX",
    "GroupMetadata",
    "MoeGroupInterface",
    "MoeGroupKernel",
    "MoeGroupSpec",
    "build_group",
    "count_program",
    "place_program",
]

GroupMetadata = Literal["masked", "offsets", "per_row"]
_METADATA = frozenset(get_args(GroupMetadata))
#: the most slots (tokens x picks) the kernel groups: each slot's thread reads the slots before
#: it, so a launch's longest chain is this many loads
GROUP_SLOTS_MAX = 1024
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


def count_program(e: int):
    """``src[r] = -1`` for every row, ``counts[q]`` the slots keyed ``q`` for ``q`` in ``[0,
    e]`` (see the module docstring)."""
    _, T = tl()
    N, R = T.dynamic("N"), T.dynamic("R")

    @T.prim_func
    def main(Ids: T.Tensor((N,), "int32"), Counts: T.Tensor((e + 1,), "int32"),
             Src: T.Tensor((R,), "int32")):
        with T.Kernel(T.ceildiv(R + e + 1, _THREADS), threads=_THREADS) as b:
            tx = T.get_thread_binding(0)
            acc = T.alloc_local((1,), "int32")
            g = b * _THREADS + tx
            if g < R:
                Src[g] = -1
            elif g < R + e + 1:
                acc[0] = 0
                for j in T.serial(N):
                    acc[0] = acc[0] + T.if_then_else(_key(T, Ids[j], e) == g - R, 1, 0)
                Counts[g - R] = acc[0]

    return main


def place_program(e: int, k: int, metadata: str, max_m: int, alignment: int):
    """Each slot's row, each row's token and the layout's metadata from the counts (see the
    module docstring)."""
    _, T = tl()
    N, R = T.dynamic("N"), T.dynamic("R")
    masked, per_row = metadata == "masked", metadata == "per_row"
    n_meta = e if masked else R if per_row else e + 1

    def aligned(c):
        return c if alignment == 1 else (c + (alignment - 1)) // alignment * alignment

    @T.prim_func
    def main(Ids: T.Tensor((N,), "int32"), Counts: T.Tensor((e + 1,), "int32"),
             Rows: T.Tensor((N,), "int32"), Src: T.Tensor((R,), "int32"),
             Meta: T.Tensor((n_meta,), "int32")):
        with T.Kernel(T.ceildiv(N + n_meta, _THREADS), threads=_THREADS) as b:
            tx = T.get_thread_binding(0)
            rank = T.alloc_local((1,), "int32")
            off = T.alloc_local((1,), "int32")
            row = T.alloc_local((1,), "int32")
            g = b * _THREADS + tx
            if g < N:  # slot g: its rank among the slots before it with its key
                key = _key(T, Ids[g], e)
                rank[0] = 0
                for j in T.serial(g):
                    rank[0] = rank[0] + T.if_then_else(_key(T, Ids[j], e) == key, 1, 0)
                if masked:
                    row[0] = T.if_then_else(T.And(key < e, rank[0] < max_m),
                                            key * max_m + rank[0], -1)
                else:  # its expert's segment starts past the aligned segments before it
                    off[0] = 0
                    for q in T.serial(key):
                        off[0] = off[0] + aligned(Counts[q])
                    row[0] = T.if_then_else(key < e, off[0] + rank[0], -1)
                Rows[g] = row[0]
                if row[0] >= 0:
                    Src[row[0]] = g // k
            elif g < N + n_meta:
                q = g - N
                if masked:  # the valid rows of block q
                    Meta[q] = T.min(Counts[q], max_m)
                elif per_row:  # the expert whose segment holds row q, -1 in padding
                    off[0] = 0
                    row[0] = -1
                    for p in T.serial(e):
                        if off[0] <= q and q < off[0] + Counts[p]:
                            row[0] = p
                        off[0] = off[0] + aligned(Counts[p])
                    Meta[q] = row[0]
                else:  # the offset of segment q
                    off[0] = 0
                    for p in T.serial(q):
                        off[0] = off[0] + aligned(Counts[p])
                    Meta[q] = off[0]

    return main


@stored(maxsize=64)
def build_group(e: int, k: int, metadata: str, max_m: int, alignment: int,
                target: str | None = None):
    """``(count, place)``: the two compiled programs of a grouping (:class:`MoeGroupSpec`'s
    fields)."""
    return (compile_program(count_program(e), target),
            compile_program(place_program(e, k, metadata, max_m, alignment), target))


class MoeGroupKernel(Kernel, MoeGroupInterface):
    """Up to :data:`GROUP_SLOTS_MAX` slots, sm_80 to sm_90."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True

    def __init__(self, spec: MoeGroupSpec) -> None:
        super().__init__(spec)
        self.count, self.place = build_group(spec.e, spec.k, spec.metadata, spec.max_m,
                                             spec.alignment)

    def __call__(self, ids, metadata, rows, src) -> None:
        n = ids.numel()
        if n > GROUP_SLOTS_MAX:
            raise ValueError(f"MoeGroupKernel: groups at most {GROUP_SLOTS_MAX} slots (tokens x "
                             f"picks), got {n}")
        flat = ids.reshape(-1)
        counts = flat.new_empty((self.spec.e + 1,))
        self.count(flat, counts, src)
        self.place(flat, counts, rows.view(-1), src, metadata.view(-1))
