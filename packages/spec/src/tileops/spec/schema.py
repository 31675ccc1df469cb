"""The spec language as typed, frozen msgspec Structs.

Every concept of the language is a type here, never a dict: an op entry, its signature, the
construction params, inputs and outputs with their effects, type families, ADTs, workloads,
the roofline and the composition of composite ops. Expression-valued fields hold an
:class:`Expr` (the text as written and its parsed AST), so nothing downstream parses text.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from . import expr as E

__all__ = [
    "UNSET",
    "AdtDef",
    "Backward",
    "Composition",
    "Constructor",
    "Expr",
    "FamilyCase",
    "FamilyDef",
    "Feed",
    "GradOf",
    "Grid",
    "GridRow",
    "GridUse",
    "InputDecl",
    "OpEntry",
    "OutputDecl",
    "ParamDecl",
    "Roofline",
    "Saved",
    "Signature",
    "SpecFile",
    "Stage",
    "TypeFamily",
    "TypesFile",
    "Workload",
    "feed_of",
]


class Expr:
    """An expression field: the text as written and its AST. Equal when the ASTs are equal."""

    __slots__ = ("node", "text")

    def __init__(self, text: str, node: E.Node | None = None) -> None:
        self.text = text
        self.node = E.parse(text) if node is None else node

    @classmethod
    def of(cls, node: E.Node) -> Expr:
        return cls(E.unparse(node), node)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Expr) and self.node == other.node

    def __hash__(self) -> int:
        return hash(self.node)

    def __repr__(self) -> str:
        return f"Expr({self.text!r})"

    def __str__(self) -> str:
        return self.text

    def names(self) -> list[str]:
        return E.names(self.node)


FALSE = Expr("False", E.Bool(False))
TRUE = Expr("True", E.Bool(True))


class Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The policy every spec struct shares, stated once:

    - ``frozen``: a loaded spec is a value; nothing downstream may edit it.
    - ``forbid_unknown_fields``: a misspelt key (``optinal: true``) is an error, not ignored.
    - ``kw_only``: fields are named at construction, so adding one never shifts the others.
    """


class ParamDecl(Base, frozen=True):
    """A construction parameter: ``{type: "int | None", default: null}``."""

    type: Expr
    default: Any = msgspec.UNSET
    kw_only: bool = False
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is msgspec.UNSET


UNSET = msgspec.UNSET


#: where an input may be: on the call's device (``same``) or on any device (``any``)
Device = Literal["same", "any"]


class InputDecl(Base, frozen=True):
    """An input tensor and its effects.

    ``optional`` (bool or predicate): the caller may omit it. ``mutated`` (bool or predicate):
    the op writes it. ``write_only``: a mutated input whose prior contents are not read.
    ``values``: a generator that fills a metadata tensor in workloads (``prefix_sum(q_lens)``).
    ``device``: ``same`` (the default) when the input must be on the call's device, the device
    of the call's other tensors; ``any`` for one that may be elsewhere (a CPU scalar tensor, a
    host-side index tensor), which the call check then leaves out of the device comparison.
    ``shape_only``: the op reads the tensor's shape, dtype and device, never its elements (a
    sum's gradient reads the input's shape); it counts no traffic, and a ``backward:`` block
    that feeds it a saved tensor keeps a stand-in of that shape instead of the tensor, as
    torch keeps only the sizes.
    """

    dtype: Expr
    shape: Expr
    optional: Expr = FALSE
    mutated: Expr = FALSE
    write_only: bool = False
    values: Expr | None = None
    device: Device = "same"
    shape_only: bool = False
    doc: str = ""


class OutputDecl(Base, frozen=True):
    """An output tensor. ``nullable`` (bool or predicate): it may be None. ``returned`` (bool
    or predicate over construction params): whether the call's result holds it; an output
    left out is still produced (a ``backward:`` block may save it), as attention's
    log-sum-exp is unless ``return_lse``. ``alias``: the output *is* that (mutated) input
    object. ``buffer``: the caller may pass its storage (``out=``); the op then writes into it
    and returns it."""

    dtype: Expr
    shape: Expr
    nullable: Expr = FALSE
    returned: Expr = TRUE
    alias: str | None = None
    buffer: bool = False
    doc: str = ""


class FamilyCase(Base, frozen=True):
    """One case of a type family: ``{when: false, is: "[R, C]"}``. ``when`` is a discriminant
    value (bool, enum string, dtype name, ADT constructor name, ``_`` for any), or a list of
    them when the family matches on several parameters."""

    when: Any
    is_: Expr = msgspec.field(name="is")


class TypeFamily(Base, frozen=True):
    """``Mat[t: Bool, R: Dim, C: Dim] = match t { false -> [R, C]; true -> [C, R] }``."""

    params: dict[str, Expr]
    match: str | tuple[str, ...]
    cases: tuple[FamilyCase, ...]
    doc: str = ""

    @property
    def discriminants(self) -> tuple[str, ...]:
        return (self.match,) if isinstance(self.match, str) else self.match


class Signature(Base, frozen=True):
    forall: dict[str, Expr] = {}
    params: dict[str, ParamDecl] = {}
    inputs: dict[str, InputDecl] = {}
    outputs: dict[str, OutputDecl] = {}
    types: dict[str, TypeFamily] = {}
    let: dict[str, Expr] = {}
    shape_rules: tuple[Expr, ...] = ()
    #: indices carried by the *values* of metadata tensors (``q_lens: Shape``): workload rows
    #: give them and generators read them; no call check can see them.
    data: dict[str, Expr] = {}


class Roofline(Base, frozen=True):
    """``flops`` and optionally ``bytes``; without ``bytes`` the traffic is derived from the
    signature and its effects."""

    flops: Expr
    bytes: Expr | None = None
    doc: str = ""


class Stage(Base, frozen=True):
    name: str
    op: str
    doc: str = ""


class Composition(Base, frozen=True):
    """A composite op's stages: each sub-op call is recorded into one named stage."""

    stages: tuple[Stage, ...]


class Workload(Base, frozen=True):
    """One workload row: index and parameter values, dtype cases, present optional inputs."""

    label: str
    values: dict[str, Any]
    dtype_cases: tuple[dict[str, str], ...] = ()
    some: tuple[str, ...] = ()


Status = Literal["implemented", "spec-only", "planned"]


class GridRow(Base, frozen=True):
    """One row of a workload grid: plain values of the grid's variables (``rows: 2048``,
    ``hidden: 4096``), the row's label and its dtype cases."""

    label: str
    values: dict[str, Any]
    dtype_cases: tuple[dict[str, str], ...] = ()


class Grid(Base, frozen=True):
    """A named list of rows that several entries of a family expand into workloads, each
    mapping the grid's variables onto its own indices and params (:class:`GridUse`)."""

    rows: tuple[GridRow, ...]
    doc: str = ""


class FamilyDef(Base, frozen=True):
    """What the entries of one family share, declared once under ``families:``.

    ``status`` is the status of every entry of the family that does not give its own;
    ``grids`` are the workload grids their workload items may expand.
    """

    status: Status | None = None
    grids: dict[str, Grid] = {}
    doc: str = ""


class GridUse(Base, frozen=True):
    """A workload item that expands a grid of the entry's family: one workload per row.

    ``map`` gives each index or param it feeds an expression over the grid's variables
    (``B: "[rows]"``); ``label`` is a template over the row's ``{label}`` and its variables;
    ``values``, ``some`` and ``dtype_cases`` are added to every expanded workload (a row's
    own dtype cases and the item's exclude each other). Only the loader sees this: the
    entry holds the expanded :class:`Workload` rows.
    """

    grid: str
    map: dict[str, Expr]
    label: str = "{label}"
    values: dict[str, Any] = {}
    some: tuple[str, ...] = ()
    dtype_cases: tuple[dict[str, str], ...] = ()


class Feed(msgspec.Struct, frozen=True, kw_only=True):
    """Where one input of a backward op comes from: :class:`GradOf` or :class:`Saved`."""


class GradOf(Feed, frozen=True):
    """``grad(y)``: the gradient flowing into the forward output ``output``."""

    output: str


class Saved(Feed, frozen=True):
    """``x``: the forward input or output ``name``, kept from the forward call (``saves``)."""

    name: str


def feed_of(ex: Expr) -> Feed | None:
    """The feed an ``inputs`` value of a ``backward:`` block writes, read from its AST:
    ``grad(y)`` (one positional name argument) is ``GradOf('y')``, a bare name ``x`` is
    ``Saved('x')``; None for anything else (the validator reports it)."""
    node = ex.node
    if isinstance(node, E.Call) and node.func == "grad" and not node.kwargs \
            and len(node.args) == 1 and isinstance(node.args[0], E.Name):
        return GradOf(output=node.args[0].id)
    if isinstance(node, E.Name):
        return Saved(name=node.id)
    return None


class Backward(Base, frozen=True):
    """A forward entry's ``backward:`` block: how its gradients are computed by another entry
    of the same file, an ordinary op with its own signature, checks and kernels.

    ``op`` names the backward entry; ``saves`` the forward inputs and outputs it reads;
    ``inputs`` feeds every input of the backward op from ``grad(<forward output>)`` or a saved
    name (expressions, read by :attr:`feeds`); ``grads`` maps each differentiable forward
    input to the backward output holding its gradient (two inputs may share one output);
    ``needs`` maps a differentiable input to the backward's Bool param that says whether its
    gradient is wanted; ``reaches`` maps a differentiable input to the forward outputs whose
    values depend on it (one not listed reaches every output): where none of those outputs'
    results is used, the input has no gradient (None, as torch's autograd gives an input no
    used output depends on). The backward's params are the forward's params of the same
    names, the ``needs`` params, and params with defaults.
    """

    op: str
    inputs: dict[str, Expr]
    grads: dict[str, str]
    saves: tuple[str, ...] = ()
    needs: dict[str, str] = {}
    reaches: dict[str, tuple[str, ...]] = {}

    @property
    def feeds(self) -> dict[str, Feed]:
        """Backward input name -> its :class:`GradOf` or :class:`Saved`, in ``inputs`` order.
        Raises ValueError on a value that is neither (a validated entry has none)."""
        out: dict[str, Feed] = {}
        for name, ex in self.inputs.items():
            feed = feed_of(ex)
            if feed is None:
                raise ValueError(f"backward input {name} is fed {ex.text!r}, which is neither "
                                 f"grad(<forward output>) nor a saved name")
            out[name] = feed
        return out


class OpEntry(Base, frozen=True):
    family: str
    status: Status
    signature: Signature
    ref_api: str | None = None
    doc: str = ""
    workloads: tuple[Workload, ...] = ()
    roofline: Roofline | None = None
    composition: Composition | None = None
    #: how the op is differentiated; None for an op without gradients (and for backward ops)
    backward: Backward | None = None


class Constructor(Base, frozen=True):
    """One constructor of an ADT: its fields (name -> kind) and the Python class it maps to."""

    python: str
    fields: dict[str, Expr] = {}
    invariant: Expr | None = None
    doc: str = ""


class AdtDef(Base, frozen=True):
    constructors: dict[str, Constructor]
    doc: str = ""


class TypesFile(Base, frozen=True):
    adts: dict[str, AdtDef] = {}


class SpecFile(msgspec.Struct, frozen=True, kw_only=True):
    """A loaded spec file: its entries and where each piece was written."""

    path: str
    entries: dict[str, OpEntry]
    #: entry path ("GemmFwdOp.signature.inputs.a.shape") -> 1-based line
    lines: dict[str, int]
    #: the file's ``families:`` block (already applied to the entries)
    families: dict[str, FamilyDef] = {}

    def line_of(self, path: str) -> int | None:
        """The line of ``path`` or of its nearest written ancestor."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path.rpartition(".")[0]
        return None
