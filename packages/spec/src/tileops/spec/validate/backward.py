"""The ``backward`` rule: a forward entry's ``backward:`` block against the entry it names.

The backward op is an ordinary entry of the same file, so the block is checked as a wiring
between two signatures: the op exists and is not differentiated again; ``saves`` names
forward tensors; ``inputs`` feeds every required backward input from ``grad(<output>)`` or a
saved name and nothing else; ``grads`` maps forward inputs to backward outputs; ``needs``
maps ``grads`` keys to Bool params of the backward; ``reaches`` maps ``grads`` keys to forward
outputs (at least one, each once); every backward param without a default is given (a
forward param of the same name, whose value is passed, or a ``needs`` param).

Then the shapes and dtypes unify, by one-way matching of the backward's declarations
(patterns) against the forward's (terms): one substitution of the backward's indices (forall,
params, data) by forward expressions, consistent across every mapped tensor. A Shape index
stands for a sequence of forward axes (``*B`` for ``*B``, or ``M, N``), a Dim or a DType
index for one forward expression; a param the two share by name stands for itself (its value
is passed), and a ``let`` of either entry for its definition (a broadcast output's ``[*S]``,
``S = broadcast(SA, SB)``, matches the backward's ``[*S]`` of the same definition). Everything else (a family application
``Mat[trans_a, M, K]``, a literal, an operator) must be the same node, so a family is
compared as written, without evaluating it; a family both entries declare must then be the
same declaration. The match is one-way on purpose: the backward may be more general than the
forward (its ``[M, N]`` accepts a forward ``[M, M]``), never less. A differentiated input (a
``grads`` key, fed saved or not), its gradient, an output's gradient (``grad(y)``) and a saved
output need agree only over floating dtypes (only a floating tensor requires grad or is handed one: a
sum's ``promote(T, int64)`` output is ``T`` wherever it has a gradient): evaluated for each
assignment of the forward's dtype indices to their floating members (:func:`_floats_agree`).

Recursion is bounded: matching walks pattern and term together, so it goes no deeper than
the term (at most MAX_EXPR_DEPTH), plus one level per ``let`` expanded, which is capped at
MAX_EXPR_DEPTH too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from .. import expr as E
from ..bounds import MAX_EXPR_DEPTH
from ..kinds import DTYPES, BoolK, DTypeK, Kind, MaybeK, ShapeK
from ..schema import Feed, GradOf, InputDecl, OpEntry, OutputDecl, Saved, SpecFile, feed_of
from .context import EntryContext, Report
from .effects import check_tensors
from .families import check_families
from .infer import InferError
from .signature import check_lets, check_sources

__all__ = ["check_backward"]

RULE = "backward"

#: the rules whose breach leaves an entry's declarations unreadable for unification
_BROKEN = ("kind", "unknown-name", "index-source", "let-cycle", "family")


def check_backward(ctx: EntryContext, spec: SpecFile | None) -> None:
    """``backward``: the entry's ``backward:`` block, when it has one."""
    bw = ctx.entry.backward
    if bw is None:
        return
    path = f"{ctx.name}.backward"
    _check_forward_side(ctx, path)
    if spec is None:
        ctx.report.add(f"{path}.op", f"backward op {bw.op!r} is looked up among the entries "
                       f"of the spec file, and none was given (validate the file, or pass "
                       f"spec=)", RULE)
        return
    target = spec.entries.get(bw.op)
    if target is None:
        if bw.op not in spec.lines:  # an entry that failed to load has its own error
            ctx.report.add(f"{path}.op", f"backward op {bw.op!r} is not an entry of "
                           f"{spec.path} (entries: {', '.join(spec.entries)})", RULE)
        return
    if target.backward is not None:
        ctx.report.add(f"{path}.op", f"backward op {bw.op} has a backward: block of its own; "
                       f"a backward op is not differentiated again", RULE)
    bctx = _context_of(bw.op, target, ctx)
    bsig = target.signature
    feeds = {n: feed_of(ex) for n, ex in bw.inputs.items()}
    for n in bw.inputs:
        if n not in bsig.inputs:
            ctx.report.add(f"{path}.inputs.{n}", f"inputs feeds {n!r}, which is not an input "
                           f"of {bw.op} (inputs: {_names(bsig.inputs)})", RULE)
    for n in bsig.inputs:
        if n in bw.inputs:
            feed = feeds[n]
            absent = _may_be_absent(ctx, feed)
            if absent and n not in bctx.model.optional_inputs:
                ctx.report.add(f"{path}.inputs.{n}", f"{bw.op}'s input {n} is required, but "
                               f"it is fed {feed.name}, which may be absent from a call of "
                               f"{ctx.name} ({absent}); declare {n} optional", RULE)
        elif n not in bctx.model.optional_inputs:
            ctx.report.add(f"{path}.inputs", f"inputs does not feed {n}, a required input "
                           f"of {bw.op} (inputs: {_names(bsig.inputs)})", RULE)
    for k, o in bw.grads.items():
        if o not in bsig.outputs:
            ctx.report.add(f"{path}.grads.{k}", f"grads maps {k} to {o!r}, which is not an "
                           f"output of {bw.op} (outputs: {_names(bsig.outputs)})", RULE)
    for k, p in bw.needs.items():
        kind = bctx.model.kinds.get(p)
        if p not in bsig.params:
            ctx.report.add(f"{path}.needs.{k}", f"needs maps {k} to {p!r}, which is not a "
                           f"param of {bw.op} (params: {_names(bsig.params)})", RULE)
        elif kind is not None and not isinstance(kind, BoolK):
            ctx.report.add(f"{path}.needs.{k}", f"needs maps {k} to {p}, a param of {bw.op} "
                           f"of kind {kind}; a needs param is Bool", RULE)
        else:  # the gradient it turns off is an output that may be None
            out = bsig.outputs.get(bw.grads.get(k, ""))
            if out is not None and p not in E.names(out.nullable.node):
                seen = ("never None" if out.nullable.node == E.Bool(False)
                        else f"nullable: {out.nullable.text}")
                ctx.report.add(f"{path}.needs.{k}", f"needs turns the gradient of {k} off with "
                               f"{p}, but {bw.op}'s output {bw.grads[k]} is not nullable on it "
                               f"({seen}); declare it nullable: \"not {p}\"", RULE)
    _check_params(ctx, bctx, path)
    if ctx.has(*_BROKEN) or bctx.has(*_BROKEN):
        return  # unreadable declarations: reported at their own entry
    _check_families_agree(ctx, bctx, path)
    _unify_tensors(ctx, bctx, path, feeds)


def _check_forward_side(ctx: EntryContext, path: str) -> None:
    """What the block says about the forward alone: saves, the grads and needs keys, and
    the form of each ``inputs`` value."""
    bw = ctx.entry.backward
    assert bw is not None
    fwd = ctx.sig
    tensors = f"inputs: {_names(fwd.inputs)}; outputs: {_names(fwd.outputs)}"
    seen: set[str] = set()
    for i, s in enumerate(bw.saves):
        if s not in fwd.inputs and s not in fwd.outputs:
            ctx.report.add(f"{path}.saves[{i}]", f"saves names {s!r}, which is not an input "
                           f"or an output of {ctx.name} ({tensors})", RULE)
        elif s in seen:
            ctx.report.add(f"{path}.saves[{i}]", f"saves names {s} twice", RULE)
        seen.add(s)
    if not bw.grads:
        ctx.report.add(f"{path}.grads", f"grads maps no input of {ctx.name} to a gradient; "
                       f"a backward differentiates at least one input", RULE)
    for k in bw.grads:
        if k not in fwd.inputs:
            ctx.report.add(f"{path}.grads.{k}", f"grads names {k!r}, which is not an input of "
                           f"{ctx.name} (inputs: {_names(fwd.inputs)})", RULE)
    for k in bw.needs:
        if k not in bw.grads:
            ctx.report.add(f"{path}.needs.{k}", f"needs names {k!r}, which is not a key of "
                           f"grads (grads: {_names(bw.grads)})", RULE)
    for k, reached in bw.reaches.items():
        where = f"{path}.reaches.{k}"
        if k not in bw.grads:
            ctx.report.add(where, f"reaches names {k!r}, which is not a key of grads (grads: "
                           f"{_names(bw.grads)})", RULE)
        if not reached:
            ctx.report.add(where, f"reaches lists no output for {k}; an input with a gradient "
                           f"reaches at least one output", RULE)
        for o in reached:
            if o not in fwd.outputs:
                ctx.report.add(where, f"reaches lists {o!r} for {k}, which is not an output "
                               f"of {ctx.name} (outputs: {_names(fwd.outputs)})", RULE)
        if len(set(reached)) != len(reached):
            ctx.report.add(where, f"reaches lists an output twice for {k}", RULE)
    for n, ex in bw.inputs.items():
        feed = feed_of(ex)
        where = f"{path}.inputs.{n}"
        if feed is None:
            ctx.report.add(where, f"{ex.text!r} is neither grad(<output of {ctx.name}>) nor a "
                           f"saved name (saves: {', '.join(bw.saves) or 'none'})", RULE)
        elif isinstance(feed, GradOf) and feed.output not in fwd.outputs:
            ctx.report.add(where, f"{ex.text!r}: {feed.output!r} is not an output of "
                           f"{ctx.name} (outputs: {_names(fwd.outputs)})", RULE)
        elif isinstance(feed, Saved) and feed.name not in bw.saves:
            ctx.report.add(where, f"{ex.text!r} is not a saved name (saves: "
                           f"{', '.join(bw.saves) or 'none'}); a backward input is "
                           f"grad(<output>) or a name listed in saves", RULE)


def _may_be_absent(ctx: EntryContext, feed: Feed | None) -> str:
    """The flag that lets a saved tensor be absent (``optional: true``), or ""."""
    if not isinstance(feed, Saved):
        return ""
    if feed.name in ctx.sig.inputs and feed.name in ctx.model.optional_inputs:
        return f"optional: {ctx.sig.inputs[feed.name].optional.text}"
    if feed.name in ctx.sig.outputs and feed.name in ctx.model.nullable_outputs:
        return f"nullable: {ctx.sig.outputs[feed.name].nullable.text}"
    return ""


def _context_of(name: str, entry: OpEntry, ctx: EntryContext) -> EntryContext:
    """The backward entry's declarations read as its own validation reads them, into a
    report of its own: its diagnostics belong to its entry, where they are reported."""
    bctx = EntryContext(name, entry, Report(ctx.report.file, ctx.report.spec), ctx.adts, None)
    check_sources(bctx)
    check_families(bctx)
    check_lets(bctx)
    check_tensors(bctx)
    return bctx


def _check_params(ctx: EntryContext, bctx: EntryContext, path: str) -> None:
    """Every backward param is given: a forward param of its name passes its value (of the
    same kind, or the backward takes Maybe of it), a needs param is set per call, any other
    has a default."""
    bw = ctx.entry.backward
    assert bw is not None
    needs = set(bw.needs.values())
    for n, prm in bctx.sig.params.items():
        if n in ctx.sig.params:
            fk, bk = ctx.model.kinds.get(n), bctx.model.kinds.get(n)
            if fk is not None and bk is not None and bk not in (fk, MaybeK(fk)):
                ctx.report.add(f"{path}.op", f"{bctx.name}'s param {n} is {bk}, but it is "
                               f"passed {ctx.name}'s {n}, which is {fk}", RULE)
        elif prm.required and n not in needs:
            ctx.report.add(f"{path}.op", f"{bctx.name}'s param {n} has no default and is "
                           f"neither a param of {ctx.name} nor a needs param; give it a "
                           f"default", RULE)


def _check_families_agree(ctx: EntryContext, bctx: EntryContext, path: str) -> None:
    """A family both entries declare is one declaration: shapes written with it are
    compared as written."""
    for fname, fam in bctx.sig.types.items():
        other = ctx.sig.types.get(fname)
        if other is not None and msgspec.structs.replace(fam, doc="") != \
                msgspec.structs.replace(other, doc=""):
            ctx.report.add(f"{path}.op", f"{bctx.name} declares type family {fname} unlike "
                           f"{ctx.name}; a shape written {fname}[...] in both is compared as "
                           f"written, so the two declarations must be the same", RULE)


# --- unification ------------------------------------------------------------------------------


class _Mismatch(Exception):
    """Why a pattern does not match. ``keep``: the binding made stands (a DType index that
    leaves out a forward dtype is reported once, not at every tensor of that dtype)."""

    def __init__(self, reason: str, keep: bool = False) -> None:
        self.reason = reason
        self.keep = keep


class _Defer(Exception):
    """A list with two Shape indices still unbound: tried again once others have bound."""

    def __init__(self, names: list[str]) -> None:
        self.names = names


#: a bound index: one forward expression, or (for a Shape index) a sequence of list items
_Value = E.Node | tuple[E.Node, ...]


class _Matcher:
    """One substitution of the backward's indices, grown tensor by tensor."""

    def __init__(self, ctx: EntryContext, bctx: EntryContext) -> None:
        self.ctx, self.bctx = ctx, bctx
        self.kinds: dict[str, Kind] = {n: k for n, k in bctx.model.kinds.items()
                                       if bctx.model.sources.get(n) != "let"}
        self.lets = {n: ex.node for n, ex in bctx.sig.let.items()}
        self.subst: dict[str, tuple[_Value, str]] = {}
        for n in bctx.sig.params:
            if n in ctx.sig.params and n in self.kinds:
                name = E.Name(n)
                value = (E.Starred(name),) if isinstance(self.kinds[n], ShapeK) else name
                self.subst[n] = (value, f"passing {ctx.name}'s {n}")
        self.origin = ""

    def match(self, pat: E.Node, term: E.Node, lets: int = 0) -> None:  # noqa: C901
        if isinstance(pat, E.Name) and pat.id in self.lets:
            self.match(self._let(pat.id, lets), term, lets + 1)
        elif isinstance(pat, E.Name) and pat.id in self.kinds:
            self._bind(pat.id, term)
        elif isinstance(pat, E.List) and isinstance(term, E.List):
            self._match_items(pat, term, lets)
        elif type(pat) is not type(term):
            raise _Mismatch(f"{pat} does not match {term}")
        elif isinstance(pat, E.Name | E.Int | E.Float | E.Str | E.Bool | E.NoneLit
                        | E.Ellipsis_):
            if pat != term:
                raise _Mismatch(f"{pat} does not match {term}")
        else:
            self._match_fields(pat, term, lets)

    def _match_fields(self, pat: E.Node, term: E.Node, lets: int) -> None:
        """Nodes of one type: their plain fields equal, their child nodes match pairwise."""
        for f in pat.__struct_fields__:
            a, b = getattr(pat, f), getattr(term, f)
            if isinstance(a, E.Node):
                self.match(a, b, lets)
            elif isinstance(a, tuple) and a and isinstance(a[0], E.Node | tuple):
                if len(a) != len(b):
                    raise _Mismatch(f"{pat} does not match {term}")
                for x, y in zip(a, b, strict=True):
                    if isinstance(x, tuple):  # a keyword argument: (name, value)
                        if x[0] != y[0]:
                            raise _Mismatch(f"{pat} does not match {term}")
                        self.match(x[1], y[1], lets)
                    else:
                        self.match(x, y, lets)
            elif a != b:
                raise _Mismatch(f"{pat} does not match {term}")

    def _let(self, n: str, lets: int) -> E.Node:
        if lets >= MAX_EXPR_DEPTH:
            raise _Mismatch(f"its lets nest deeper than {MAX_EXPR_DEPTH} levels")
        return self.lets[n]

    def _items(self, items: tuple[E.Node, ...], lets: int) -> list[tuple[str, E.Node | str]]:
        """A pattern list's items as ``pat`` (a pattern), ``lit:<index>`` (a forward item
        the bound Shape index stands for) or ``star`` (an unbound Shape index)."""
        out: list[tuple[str, E.Node | str]] = []
        for it in items:
            v = it.value if isinstance(it, E.Starred) else None
            if isinstance(v, E.Name) and v.id in self.lets:
                v = self._let(v.id, lets)
                if isinstance(v, E.List):
                    out += self._items(v.items, lets + 1)
                else:
                    out.append(("pat", E.Starred(v)))
            elif isinstance(v, E.Name) and isinstance(self.kinds.get(v.id), ShapeK):
                if v.id in self.subst:
                    out += [(f"lit:{v.id}", x)
                            for x in self.subst[v.id][0]]  # type: ignore[union-attr]
                else:
                    out.append(("star", v.id))
            elif isinstance(v, E.List):
                out += self._items(v.items, lets)
            else:
                out.append(("pat", it))
        return out

    def _match_items(self, pat: E.List, term: E.List, lets: int) -> None:
        items = self._items(pat.items, lets)
        stars = [i for i, (tag, _) in enumerate(items) if tag == "star"]
        if len(stars) > 1:
            raise _Defer([str(items[i][1]) for i in stars])
        fixed = len(items) - len(stars)
        got = term.items
        if (len(got) < fixed) if stars else (len(got) != fixed):
            besides = f" besides *{items[stars[0]][1]}" if stars else ""
            raise _Mismatch(f"{pat} lists {_count(fixed)}{besides} (its Shape indices spliced) "
                            f"and {term} lists {len(got)}")
        cut = stars[0] if stars else len(items)
        tail = len(items) - cut - 1 if stars else 0
        pairs = list(zip(items[:cut], got[:cut], strict=True))
        pairs += list(zip(items[len(items) - tail:], got[len(got) - tail:], strict=True))
        for (tag, p), t in pairs:
            if tag.startswith("lit:") and p != t:
                n = tag[4:]
                bound, origin = self.subst[n]
                raise _Mismatch(f"{self.bctx.name}'s {n} stands for {_show(bound)} (bound by "
                                f"{origin}), and {p} does not match {t}")
            if tag == "pat":
                self.match(p, t, lets)  # type: ignore[arg-type]
        if stars:
            self._bind(str(items[cut][1]), E.List(tuple(got[cut:len(got) - tail])))

    def _bind(self, n: str, term: E.Node) -> None:
        kind = self.kinds[n]
        if isinstance(kind, ShapeK):
            value: _Value = term.items if isinstance(term, E.List) else (E.Starred(term),)
        elif isinstance(term, E.Starred):
            raise _Mismatch(f"{n} is a {kind} of {self.bctx.name} and cannot stand for {term}")
        else:
            value = term
        if n in self.subst:
            bound, origin = self.subst[n]
            if bound != value:
                raise _Mismatch(f"{self.bctx.name}'s {n} stands for {_show(bound)} (bound by "
                                f"{origin}), but here for {_show(value)}")
            return
        if isinstance(kind, DTypeK):
            members = self._dtype_members(term)
            missing = [m for m in members if m not in kind.members]
            self.subst[n] = (value, self.origin)
            if missing:
                raise _Mismatch(f"{self.bctx.name}'s {n} is {kind} and cannot stand for "
                                f"{self.ctx.name}'s {term}, which may be "
                                f"{' or '.join(missing)}", keep=True)
        self.subst[n] = (value, self.origin)


    def _dtype_members(self, term: E.Node) -> tuple[str, ...]:
        """The dtypes a forward dtype expression may take: an index's union, a dtype name, or
        the DType a computed dtype (``promote(TA, TB)``) is inferred to be."""
        if isinstance(term, E.Name):
            fk = self.ctx.model.kinds.get(term.id)
            return fk.members if isinstance(fk, DTypeK) else \
                (term.id,) if term.id in DTYPES else ()
        try:
            k = self.ctx.kinds().infer(term)
        except InferError:  # reported where the forward declares it
            return ()
        return k.members if isinstance(k, DTypeK) else ()


def _count(n: int) -> str:
    return f"{n} item{'' if n == 1 else 's'}"


def _show(value: _Value) -> str:
    if isinstance(value, tuple):
        return f"[{', '.join(map(str, value))}]"
    return str(value)


@dataclass(frozen=True)
class _Job:
    """One backward tensor against the forward tensor it is fed from or the gradient of."""

    path: str
    name: str
    decl: InputDecl | OutputDecl
    source: InputDecl | OutputDecl
    whence: str
    #: a differentiated input, its gradient, an output's gradient or a saved output: only its
    #: floating dtypes need agree (only a floating tensor requires grad or has a gradient)
    floating_only: bool = False


def _unify_tensors(ctx: EntryContext, bctx: EntryContext, path: str,
                   feeds: dict[str, Feed | None]) -> None:
    """Each fed backward input against its forward tensor, then each backward output named
    in grads against the forward input it is the gradient of; all through one matcher.
    A tensor that fails leaves the substitution as it was, so the others are still checked
    (and each mismatch reported once). A tensor whose list has two unbound Shape indices
    waits until the others have bound what they can."""
    bw = ctx.entry.backward
    assert bw is not None
    fwd, bsig = ctx.sig, bctx.sig
    jobs: list[_Job] = []
    for n, d in bsig.inputs.items():
        feed = feeds.get(n)
        if isinstance(feed, GradOf) and feed.output in fwd.outputs:
            # an output's gradient exists only where the output is floating (autograd gives
            # an integer output none): a sum's int64 output of an integer input has none
            jobs.append(_Job(f"{path}.inputs.{n}", n, d, fwd.outputs[feed.output],
                             f"grad({feed.output})", True))
        elif isinstance(feed, Saved) and feed.name in bw.saves:
            src = fwd.inputs.get(feed.name) or fwd.outputs.get(feed.name)
            whence = "input" if feed.name in fwd.inputs else "output"
            if src is not None:
                # a differentiated input, or an output (of a call whose gradient runs: its
                # differentiated inputs are floating), agrees over floating dtypes only
                jobs.append(_Job(f"{path}.inputs.{n}", n, d, src,
                                 f"the saved {whence} {feed.name}",
                                 feed.name in fwd.outputs or feed.name in bw.grads))
    for k, o in bw.grads.items():
        if k in fwd.inputs and o in bsig.outputs:
            jobs.append(_Job(f"{path}.grads.{k}", o, bsig.outputs[o], fwd.inputs[k],
                             f"the input {k}", True))
    m = _Matcher(ctx, bctx)
    pending = [(job, what) for job in jobs for what in ("shape", "dtype")]
    while pending:
        deferred = [(job, what) for job, what in pending
                    if not _attempt(m, ctx, bctx, job, what, final=False)]
        if len(deferred) == len(pending):
            for job, what in deferred:
                _attempt(m, ctx, bctx, job, what, final=True)
            return
        pending = deferred


def _expand_lets(node: E.Node, lets: dict[str, E.Node], depth: int = 0) -> E.Node:
    """``node`` (a forward tensor's shape or dtype) with the forward's ``let`` names replaced
    by their definitions, a spliced Shape let (``[*S]``, ``S = broadcast(SA, SB)``) by its
    items or its spliced expression, as the backward's own lets are when matched."""
    if not lets or not set(E.names(node)) & set(lets):
        return node
    if depth >= MAX_EXPR_DEPTH:
        raise _Mismatch(f"its lets nest deeper than {MAX_EXPR_DEPTH} levels")
    if isinstance(node, E.Name) and node.id in lets:
        return _expand_lets(lets[node.id], lets, depth + 1)
    if isinstance(node, E.List | E.Tuple):
        items: list[E.Node] = []
        for it in node.items:
            v = it.value if isinstance(it, E.Starred) else None
            if isinstance(v, E.Name) and v.id in lets:
                v = _expand_lets(lets[v.id], lets, depth + 1)
                items += list(v.items) if isinstance(v, E.List) else [E.Starred(v)]
            elif isinstance(it, E.Starred):
                items.append(E.Starred(_expand_lets(it.value, lets, depth + 1)))
            else:
                items.append(_expand_lets(it, lets, depth + 1))
        return type(node)(tuple(items))
    fields = {}
    for f in node.__struct_fields__:
        a = getattr(node, f)
        if isinstance(a, E.Node):
            fields[f] = _expand_lets(a, lets, depth + 1)
        elif isinstance(a, tuple) and a and isinstance(a[0], E.Node | tuple):
            fields[f] = tuple((x[0], _expand_lets(x[1], lets, depth + 1)) if isinstance(x, tuple)
                              else _expand_lets(x, lets, depth + 1) for x in a)
    return msgspec.structs.replace(node, **fields)


def _attempt(m: _Matcher, ctx: EntryContext, bctx: EntryContext, job: _Job, what: str,
             final: bool) -> bool:
    """Match one shape or dtype; False when it must wait for other tensors to bind."""
    pat, term = getattr(job.decl, what), getattr(job.source, what)
    saved = dict(m.subst)
    m.origin = job.name
    try:
        m.match(pat.node, _expand_lets(term.node, {n: ex.node for n, ex in ctx.sig.let.items()}))
        return True
    except _Defer as d:
        m.subst = saved
        if not final:
            return False
        reason = (f"{' and '.join('*' + n for n in d.names)} are both unbound there, so the "
                  f"axes each stands for are ambiguous")
    except _Mismatch as err:
        if what == "dtype" and job.floating_only and \
                _floats_agree(m, ctx, pat.node, term.node, _differentiated_indices(ctx)):
            m.subst = saved
            return True
        if not err.keep:
            m.subst = saved
        reason = err.reason
    ctx.report.add(job.path, f"{bctx.name}.{job.name} has {what} {pat.text}, which does not "
                   f"unify with {term.text}, the {what} of {job.whence}: {reason}", RULE)
    return True


#: the dtypes a tensor that requires grad may have
_FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
#: the most assignments of the forward's dtype indices _floats_agree evaluates
_MAX_ASSIGNMENTS = 256


def _differentiated_indices(ctx: EntryContext) -> frozenset[str]:
    """The forward's DType indices that a differentiated input's dtype reads: a gradient runs
    only where those are floating (only a floating tensor requires grad)."""
    bw = ctx.entry.backward
    assert bw is not None
    return frozenset(n for k in bw.grads if k in ctx.sig.inputs
                     for n in ctx.sig.inputs[k].dtype.names()
                     if isinstance(ctx.model.kinds.get(n), DTypeK))


def _floats_agree(m: _Matcher, ctx: EntryContext, pat: E.Node, term: E.Node,
                  differentiated: frozenset[str]) -> bool:
    """Whether a backward tensor's dtype (the backward's ``pat``, its indices as the
    substitution binds them) equals the forward tensor's (``term``) wherever a gradient runs:
    only a floating tensor requires grad, so a gradient ``promote_int_to_float(T)`` of an
    input ``T`` that may be an integer is its input's dtype wherever there is a gradient.
    Evaluated over every assignment of the forward's dtype indices (a bounded number): those
    a differentiated input's dtype reads take their floating members, the others every
    member (an index of a non-differentiated input is whatever the caller passes)."""
    from itertools import product

    from ..evaluate import EvalError, Scope, evaluate

    def resolved(node: E.Node) -> E.Node:
        if isinstance(node, E.Name) and node.id in m.subst:
            value = m.subst[node.id][0]
            return value if isinstance(value, E.Node) else node
        return node

    left = resolved(pat)
    names = sorted({n for n in (*E.names(left), *E.names(term))
                    if isinstance(ctx.model.kinds.get(n), DTypeK)})
    members = [[x for x in ctx.model.kinds[n].members  # type: ignore[union-attr]
                if n not in differentiated or x in _FLOATING] for n in names]
    count = 1
    for ms in members:
        count *= len(ms)
    if not names or not count or count > _MAX_ASSIGNMENTS:
        return False
    # the backward's own index must also take each value: its union bounds what it stands for
    own = m.kinds.get(pat.id) if isinstance(pat, E.Name) else None
    allowed = own.members if isinstance(own, DTypeK) else None
    try:
        for combo in product(*members):
            scope = dict(zip(names, combo, strict=True))
            value = evaluate(left, Scope(scope))
            if value != evaluate(term, Scope(scope)) or \
                    (allowed is not None and value not in allowed):
                return False
        return True
    except EvalError:
        return False


def _names(table: Iterable[str]) -> str:
    return ", ".join(table) or "none"
