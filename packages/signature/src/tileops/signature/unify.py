"""The check body of one presence combination: every input unified with its declaration.

For each given input in declared order, its device is compared with the call's (the first
given input's; an input declared ``device: any`` is left out), then its dtype and its shape
are unified with the declaration folded at the point (:mod:`.fold`): the first occurrence of an index binds it,
later ones must equal it; a variadic ``*S`` is sliced (lazily: the record keeps the whole
shape and the bounds); an affine axis (``2 * H + 1``) is solved for its one unknown; an axis
that binds nothing where it stands waits until later inputs have bound its indices. Then the
lets, the deferred axes and the refinements, and the outputs (:mod:`.infer`). Every check is
emitted with the description of its failure, so ``check_exact`` raises the precise error and
the hot path (``fast``) only needs to know that something missed (:mod:`.simplify` then
drops what cannot change its outcome).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tileops.spec import expr as E
from tileops.spec.primitives import PrimitiveError

from .common import FastBody, GenError, LazyConflict, ev, fmt_value, tuple_code
from .fold import subst
from .infer import emit_outputs
from .simplify import simplify_fast

if TYPE_CHECKING:  # pragma: no cover
    from .gen_check import Generator

__all__ = ["Body"]


class _Off:
    """An axis offset: a constant plus runtime terms (``len(i_B)``)."""

    def __init__(self, const: int = 0, terms: tuple[str, ...] = ()) -> None:
        self.const, self.terms = const, terms

    def add(self, n: int | str) -> _Off:
        if isinstance(n, int):
            return _Off(self.const + n, self.terms)
        return _Off(self.const, (*self.terms, n))

    def code(self) -> str:
        parts = [*self.terms] + ([str(self.const)] if self.const or not self.terms else [])
        return " + ".join(parts)

    def is_const(self) -> bool:
        return not self.terms


def _arith_text(e: BaseException) -> str:
    """What went wrong in the signature's arithmetic, in words: a primitive's or an axis's
    own message, a division by zero by name; any other exception with its type."""
    if isinstance(e, ZeroDivisionError):
        return "a division by zero (a size or param that is 0 divides)"
    if isinstance(e, PrimitiveError):  # an AxisError too
        return str(e)
    return f"{type(e).__name__}: {e}"


class Body:
    """The straight-line body for one presence combination, in one of four modes:

    - ``exact``: every check raises its precise error (``check_exact``);
    - ``fast``: the same checks, but a miss (a failing check or an exception) leaves the body
      and hands the call to ``check_exact``; bindings no later check reads are left out (the
      record derives them), so the hot path reads, compares and builds one object;
    - ``symbolic``: size comparisons through the adapter's hook (``check_symbolic``);
    - ``derive``: the bindings, lets and output inference over a record's stored shapes and
      dtypes, no checks; returns ``(values, output_shapes, output_dtypes)``.
    """

    def __init__(self, gen: Generator, presence: dict[str, bool], mode: str) -> None:
        self.g = gen
        self.sig = gen.sig
        self.presence = presence
        self.mode = mode
        self.symbolic = mode == "symbolic"
        self.lines: list[str] = []
        self.bound: list[str] = []
        self.bound_set: set[str] = set()
        self.by: dict[str, str] = {}  # index -> where it was bound ("a.shape[1]")
        # Shape indices bound by a slice are materialised only when later code reads them
        # (slicing a torch.Size costs more than the rest of a check); the record stores the
        # whole shape and the slice bounds instead.
        self.pending: dict[str, tuple[str, int, int]] = {}
        self.forms: dict[str, E.Node] = {}
        # axes that cannot be unified where they stand (two unknowns, a let, a non-affine
        # form): solved once later inputs bind their indices, or checked after the lets
        self.deferred: list[tuple[str, E.Node, str, str, str, str]] = []
        self._devices()
        derive = mode == "derive"
        if not derive:
            self.lines.append("try:")
        self.ind = "" if derive else "    "
        for n, decl in self.sig.inputs.items():
            if n in presence and not presence[n]:
                continue
            self.unify(n, decl)
        self.solve_deferred()
        missing = [n for n in self.sig.forall
                   if n not in self.bound_set and n not in self.g.optional_indices(presence)]
        if missing:
            raise GenError(f"forall index {missing[0]} is not bound by the inputs")
        self.lets()
        for n, it, at, disp, expected, path in self.deferred:
            if self.unbound(it):
                raise GenError(f"{n}: axis {E.unparse(it)} cannot be unified")
            self.check_axis(n, it, at, disp, expected, path)
        self.refinements()
        self.absent_allowed()
        emit_outputs(self)
        if derive:
            return
        if mode == "fast":
            self.lines, statements = simplify_fast(self.lines)
            self.fast_body = FastBody.of(presence, statements, self.fresh_branch)
            self.lines.append("except Exception:")  # a miss: the exact check says why
            self.lines.append("    pass")
            self.lines.append(f"return {self.g.exact_call()}")
            return
        # a missing or non-tensor input (AttributeError, TypeError), or arithmetic of the
        # signature that fails on these sizes (a let dividing by zero, a primitive refusing)
        self.lines.append("except _SCE:")  # our own errors (a ValueError) pass through
        self.lines.append("    raise")
        self.lines.append("except (AttributeError, TypeError, ArithmeticError, ValueError) as _e:")
        fid = self.g.fail(*self._missing_failure())
        self.lines.append(f"    raise _fail({fid}, locals()) from None")

    def _devices(self) -> None:
        """Which device each given input is compared with. The first given input not declared
        ``device: any`` holds the call's device; each later one must be on it (one comparison
        each), and only when there is a later one is the first's device kept in a local
        (``dev_<input>``), which the record then reuses. ``device_code`` is the record's
        device: that input's (else the first given input's, when every given one may be
        anywhere), or None for an adapter without devices or a call without inputs."""
        ad = self.g.adapter
        attr = ad.device
        given = [n for n in self.sig.inputs if self.presence.get(n, True)]
        compared = [n for n in given if self.sig.inputs[n].device != "any"]
        #: the input whose device the later compared ones must share (None: no comparison)
        self.device_ref = compared[0] if attr and len(compared) > 1 else None
        self.device_compared = frozenset(compared[1:]) if self.device_ref else frozenset()
        first = compared[0] if compared else given[0] if given else None
        self.device_code = ("None" if attr is None or first is None
                            else f"dev_{first}" if self.device_ref else f"t_{first}.{attr}")

    def unify_device(self, n: str, expected: str, path: str) -> None:
        """Input ``n``'s device: kept (``dev_<n>``) when ``n`` is the reference, else compared
        with the reference's (``expected`` names it); a plain check in every mode (a device
        is static under tracing)."""
        attr, ref = self.g.adapter.device, self.device_ref
        if n == ref:
            self.emit(f"dev_{n} = t_{n}.{attr}")
        elif n in self.device_compared:
            fid = self.fail_id(n, expected,
                               lambda env, n=n, ref=ref, attr=attr:
                               f"{n} is on {getattr(env[f't_{n}'], attr)}, {ref} on "
                               f"{env[f'dev_{ref}']}: the tensors of one call must share a "
                               f"device", path)
            self.check_plain(f"t_{n}.{attr} == dev_{ref}", fid)

    def guard_sizes(self, n: str, expected: str, path: str) -> None:
        """Input ``n``'s shape must be a tuple of sizes (:mod:`.sizes`). An array of the
        adapter's library has one by construction: one set lookup of its exact type
        (``DTypeAdapter.admitted``), and its shape is not read. Any other object's shape is
        checked entry by entry and normalised to a tuple of ints (``s_<n>`` then holds that),
        so no later check or record sees a bool, a float, a negative or a numpy scalar."""
        self.g.namespace.setdefault("_AT", self.g.adapter.admitted)
        self.g.namespace.setdefault("_admit", self.g.adapter.admit)
        ad = self.g.adapter
        fid = self.fail_id(n, expected, lambda env, n=n: ad.problem(n, env[f"t_{n}"]), path)
        miss = "raise _Miss" if self.mode == "fast" else f"raise _fail({fid}, locals())"
        self.emit(f"if type(t_{n}) not in _AT:")
        self.emit(f"    s_{n} = _admit(t_{n}, s_{n})")
        self.emit(f"    if s_{n} is None: {miss}")

    def _missing_failure(self):
        names = [n for n in self.sig.inputs if not (n in self.presence
                                                    and not self.presence[n])]
        ad = self.g.adapter
        attr = ad.device

        def because(env: dict) -> str:
            for n in names:
                t = env.get(f"t_{n}")
                if t is None:
                    return f"{n} is required, got None"
                if not (hasattr(t, "shape") and hasattr(t, "dtype")):
                    return f"{n} must be a tensor (an object with .shape and .dtype), got " \
                           f"{type(t).__name__}"
                if attr is not None and not hasattr(t, attr):
                    # an array of another library: its dtype says so best, if it does
                    return ad.refusal(f"{n}.dtype", t.dtype, f"{n} is a {type(t).__module__}."
                                      f"{type(t).__qualname__}, not a tensor of {ad.name}") \
                        or (f"{n} has no .{attr} (a {type(t).__module__}."
                            f"{type(t).__qualname__}): the {ad.name} adapter reads each "
                            f"tensor's device there")
            e = env.get("_e")
            return (f"evaluating the signature on these sizes failed: {_arith_text(e)}"
                    if e is not None else "a tensor could not be read")

        return ("(inputs)", "tensors for " + ", ".join(names), because, [], "signature.inputs")

    # emitted statements

    def emit(self, line: str) -> None:
        self.lines.append(self.ind + line)

    def check(self, cond_ok: str, fid: int) -> None:
        if self.mode == "derive":
            return
        if self.mode == "fast":
            self.emit(f"if not ({cond_ok}): raise _Miss")
        elif self.symbolic:
            self.emit(f"_chk({cond_ok}, _M{fid})")
            self.g.namespace.setdefault("_chk", self.g.adapter.check)
            f = self.g.failures[fid]
            self.g.namespace[f"_M{fid}"] = (
                lambda f=f: f"{self.g.plan.name}: argument {f.argument}: expected "
                            f"{f.expected} ({f.location})")
        else:
            self.emit(f"if not ({cond_ok}): raise _fail({fid}, locals())")

    def fail_id(self, arg: str, expected: str, because: Callable[[dict], str], path: str) -> int:
        return self.g.fail(arg, expected, because, list(self.bound), path)

    def bind(self, name: str, code: str, where: str) -> None:
        self.emit(f"i_{name} = {code}")
        self.bound.append(name)
        self.bound_set.add(name)
        self.by[name] = where

    # unification of one input

    def unify(self, n: str, decl) -> None:
        path = f"signature.inputs.{n}"
        shape = self.g.fold(decl.shape.node, self.presence, self.bound_set)
        if not isinstance(shape, E.List | E.Tuple):
            raise GenError(f"shape of {n} ({decl.shape.text}) did not resolve to a list")
        expected = f"{n}: Tensor[{decl.dtype.text}, {E.unparse(E.List(shape.items))}]"
        declared = (f"  (declared {decl.shape.text})"
                    if E.unparse(E.List(shape.items)) != decl.shape.text else "")
        on_device = f"{expected} on {self.device_ref}'s device{declared}"
        expected += declared
        self.forms[n] = shape if isinstance(shape, E.List) else E.List(shape.items)
        self.g.expected_inputs.setdefault(n, expected)
        if self.mode != "derive":  # derive has the record's stored reads
            self.emit(f"s_{n} = t_{n}.shape")
            self.emit(f"d_{n} = t_{n}.dtype")
            self.guard_sizes(n, expected, path)
            self.unify_device(n, on_device, path)
        self.unify_dtype(n, decl, expected, path)
        items = list(shape.items)
        unknown = [i for i, it in enumerate(items) if isinstance(it, E.Starred)
                   and not self._star_known(it)]
        if len(unknown) > 1:
            raise GenError(f"{n}: shape {decl.shape.text} has two unknown-length parts")
        if self.mode == "fast" and items and not any(
                isinstance(it, E.Starred) or self.unbound(it) for it in items):
            # every axis is known already (weight: [4096]): one tuple comparison stands for
            # the rank and each axis; a miss goes to the exact check, which says which
            self.emit(f"if not (s_{n} == {tuple_code([self.expr(it) for it in items])}): "
                      f"raise _Miss")
            return
        # rank
        fixed = _Off()
        for it in items:
            if isinstance(it, E.Starred):
                if self._star_known(it):
                    fixed = fixed.add(self._star_len(it))
            else:
                fixed = fixed.add(1)
        rank_text = E.unparse(E.List(shape.items))
        if unknown:
            fid = self.fail_id(n, expected, lambda env, n=n, fx=fixed, r=rank_text:
                               f"{n} has {len(env[f's_{n}'])} dims, but {r} needs at least "
                               f"{_eval_off(fx, env)}", path)
            self.check_plain(f"len(s_{n}) >= {fixed.code()}", fid)
        else:
            fid = self.fail_id(n, expected, lambda env, n=n, fx=fixed, r=rank_text:
                               f"{n} has {len(env[f's_{n}'])} dims, but {r} has "
                               f"{_eval_off(fx, env)}", path)
            self.check_plain(f"len(s_{n}) == {fixed.code()}", fid)
        u = unknown[0] if unknown else len(items)
        # the axes after the last part of known length (*B bound by an earlier input) are read
        # from the end: the rank is checked, so residual.shape[-1] is the axis a message names
        # and the code reads, where the start's offset (len(i_B)) is neither
        stars = [i for i, it in enumerate(items) if isinstance(it, E.Starred)]
        tail = stars[-1] + 1 if stars and not unknown else u
        left = _Off()
        for it in items[:tail]:
            left = self.unify_item(n, it, left, None, expected, path)
        for j, it in enumerate(items[tail:u]):
            self.unify_item(n, it, None, _Off(u - tail - 1 - j), expected, path)
        if unknown:
            right = _Off()
            for it in reversed(items[u + 1:]):
                right = self.unify_item(n, it, None, right, expected, path)
            star = items[u]
            assert isinstance(star, E.Starred)
            end = f"len(s_{n}) - ({right.code()})" if (right.const or right.terms) else ""
            sl = f"s_{n}[{left.code() if (left.const or left.terms) else ''}:{end}]"
            if isinstance(star.value, E.Name) and star.value.id in self.sig.forall:
                disp = f"{n}.shape[{left.code()}:{('-' + right.code()) if end else ''}]"
                if left.is_const() and right.is_const() and star.value.id not in self.g.eager:
                    name = star.value.id
                    self.pending[name] = (f"s_{n}", left.const, right.const)
                    self.bound.append(name)
                    self.bound_set.add(name)
                    self.by[name] = disp
                    how = (n, left.const, right.const)
                    if self.g.lazy.setdefault(name, how) != how:
                        raise LazyConflict(name)
                else:
                    self.bind(star.value.id, sl, disp)
            else:
                raise GenError(f"{n}: cannot unify *{E.unparse(star.value)}")

    def check_plain(self, cond_ok: str, fid: int) -> None:
        # rank and dtype checks are static under tracing: always plain
        if self.mode == "derive":
            return
        if self.mode == "fast":
            self.emit(f"if not ({cond_ok}): raise _Miss")
        else:
            self.emit(f"if not ({cond_ok}): raise _fail({fid}, locals())")

    def _star_known(self, it: E.Starred) -> bool:
        return all(m in self.bound_set for m in E.names(it.value))

    def _star_len(self, it: E.Starred) -> str:
        v = self.expr(it.value)
        return f"len({v})"

    def expr(self, node: E.Node) -> str:
        """Code for ``node``, first materialising any pending Shape index it reads."""
        for m in E.names(node):
            if m in self.pending:
                src, a, b = self.pending.pop(m)
                self.emit(f"i_{m} = {src}[{a or ''}:{f'len({src}) - {b}' if b else ''}]")
        return self.g.code(node)

    def unify_item(self, n: str, it: E.Node, left: _Off | None, right: _Off | None,
                   expected: str, path: str) -> _Off:
        """One item at ``left`` (from the start) or at ``-(right + 1)`` (from the end)."""
        if isinstance(it, E.Starred):
            val = self.expr(it.value)
            ln = f"len({val})"
            if left is not None:
                sl = f"s_{n}[{left.code()}:{left.code()} + {ln}]"
                nxt = left.add(ln)
            else:
                sl = f"s_{n}[len(s_{n}) - ({right.add(ln).code()}):len(s_{n}) - ({right.code()})]"
                nxt = right.add(ln)
            text = E.unparse(it.value)
            origin = {m: self.by.get(m, "construction") for m in E.names(it.value)}
            fid = self.fail_id(n, expected, lambda env, sl=sl, text=text, val=val, o=origin:
                               f"{text} is {fmt_value(ev(val, env))}"
                               + "".join(f" (bound by {w})" for w in o.values()
                                         if w != "construction")
                               + f", but that part of the shape is {fmt_value(ev(sl, env))}",
                               path)
            self.check(f"tuple({sl}) == tuple({val})", fid)
            return nxt
        if left is not None:
            ax = left.code()
            nxt = left.add(1)
        else:
            assert right is not None
            ax = f"-({right.add(1).code()})" if right.terms else str(-(right.const + 1))
            nxt = right.add(1)
        at = f"s_{n}[{ax}]"
        disp = f"{n}.shape[{ax}]"
        unbound = self.unbound(it)
        if len(unbound) == 1 and self.solvable(it, unbound[0]):
            self.solve_axis(n, it, at, disp, expected, path, unbound[0])
        elif unbound:
            self.deferred.append((n, it, at, disp, expected, path))
        else:
            self.check_axis(n, it, at, disp, expected, path)
        return nxt

    def unbound(self, it: E.Node) -> list[str]:
        return [m for m in E.names(it) if m not in self.bound_set and m not in self.g.const]

    def solvable(self, it: E.Node, x: str) -> bool:
        """``x`` can be read off an axis ``it``: a bare forall index, or ``it`` is affine in it
        (the validator's rule: +, -, and * by a known factor)."""
        return x in self.sig.forall and (isinstance(it, E.Name) or _affine_in(it, x))

    def solve_deferred(self) -> None:
        progress = True
        while progress:  # as the validator does: until no deferred axis binds anything
            progress = False
            for d in list(self.deferred):
                n, it, at, disp, expected, path = d
                unbound = self.unbound(it)
                if len(unbound) == 1 and self.solvable(it, unbound[0]):
                    self.deferred.remove(d)
                    self.solve_axis(n, it, at, disp, expected, path, unbound[0])
                    progress = True

    def solve_axis(self, n: str, it: E.Node, at: str, disp: str, expected: str, path: str,
                   x: str) -> None:
        if isinstance(it, E.Name):
            self.bind(it.id, at, disp)
            return
        b = self.g.fold(subst(it, {x: E.Int(0)}, {}), self.presence, self.bound_set)
        a1 = self.g.fold(subst(it, {x: E.Int(1)}, {}), self.presence, self.bound_set)
        bc, a1c = self.expr(b), self.expr(a1)
        text = E.unparse(it)
        if isinstance(b, E.Int) and isinstance(a1, E.Int) and a1.value == b.value:
            # N - N + 3, 0 * N, k * N with k = 0: the axis does not depend on x here
            raise GenError(f"{n}: axis {text} does not depend on {x} (its factor is 0 at "
                           f"this construction point), so {x} cannot be read off it")
        # // and % rather than divmod, which a symbolic size (torch's SymInt) does not take
        self.emit(f"_q = {at} - ({bc})")
        self.emit(f"_d = ({a1c}) - ({bc})")
        if not (isinstance(b, E.Int) and isinstance(a1, E.Int)):
            # a factor read from the call (an index bound earlier) may be 0
            zid = self.fail_id(n, expected, lambda env, text=text, x=x, d=disp:
                               f"{text} does not depend on {x} for these sizes (its factor "
                               f"is 0), so {d} cannot give {x}", path)
            self.check("_d != 0", zid)
        self.emit(f"i_{x} = _q // _d")
        self.emit("_r = _q % _d")
        # the failure lists what was bound before: x has no value when there is no solution
        fid = self.fail_id(n, expected, lambda env, at=at, text=text, x=x, d=disp:
                           f"{d} is {ev(at, env)}, but {text} has no solution "
                           f"{x} >= 0 there", path)
        self.bound.append(x)
        self.bound_set.add(x)
        self.by[x] = disp
        self.check(f"_r == 0 and i_{x} >= 0", fid)

    def check_axis(self, n: str, it: E.Node, at: str, disp: str, expected: str,
                   path: str) -> None:
        """``at`` must equal ``it``, whose indices are all bound."""
        code = self.expr(it)
        text = E.unparse(it)
        if isinstance(it, E.Name) and it.id in self.by:
            src = self.by[it.id]
            fid = self.fail_id(n, expected, lambda env, at=at, code=code, t=text, src=src,
                               d=disp: f"{t} bound to {ev(code, env)} by {src}, but {d} is "
                                       f"{ev(at, env)}", path)
        elif isinstance(it, E.Int):
            fid = self.fail_id(n, expected, lambda env, at=at, t=text, d=disp:
                               f"{d} must be {t}, but is {ev(at, env)}", path)
        else:
            fid = self.fail_id(n, expected, lambda env, at=at, code=code, t=text, d=disp:
                               f"{d} must be {t} = {ev(code, env)}, but is {ev(at, env)}", path)
        self.check(f"{at} == {code}", fid)

    def unify_dtype(self, n: str, decl, expected: str, path: str) -> None:
        node = decl.dtype.node
        ad = self.g.adapter
        if isinstance(node, E.Name) and node.id in self.sig.forall:
            t = node.id
            if t not in self.bound_set:
                members = self.g.plan.kinds[t].members  # type: ignore[attr-defined]
                allowed = frozenset(ad.natives[m] for m in members if m in ad.natives)
                name = self.g._name("DT", allowed)
                fid = self.fail_id(n, expected, lambda env, n=n, t=t, ms=members:
                                   ad.refusal(f"{n}.dtype", env[f"d_{n}"],
                                              f"{t} must be one of {', '.join(ms)}")
                                   or f"{n}.dtype is {ad.name_of(env[f'd_{n}'])}, but {t} must "
                                      f"be one of {', '.join(ms)}", path)
                self.check_plain(f"d_{n} in {name}", fid)
                self.bind(t, f"d_{n}", f"{n}.dtype")
                return
            src = self.by[t]
            fid = self.fail_id(n, expected, lambda env, n=n, t=t, src=src:
                               ad.refusal(f"{n}.dtype", env[f"d_{n}"],
                                          f"{t} is bound to {ad.name_of(env[f'i_{t}'])} by "
                                          f"{src}")
                               or f"{t} bound to {ad.name_of(env[f'i_{t}'])} by {src}, but "
                                  f"{n}.dtype is {ad.name_of(env[f'd_{n}'])}", path)
            self.check_plain(f"d_{n} == i_{t}", fid)
            return
        value = node.id if isinstance(node, E.Name) and node.id not in self.g.const \
            else self.g.const.get(node.id) if isinstance(node, E.Name) else None
        if not isinstance(value, str):
            raise GenError(f"dtype of {n} ({decl.dtype.text}) is not a dtype")
        const = self.g._native(value)
        fid = self.fail_id(n, expected, lambda env, n=n, v=value:
                           ad.refusal(f"{n}.dtype", env[f"d_{n}"], f"it must be {v}")
                           or f"{n}.dtype must be {v}, but is {ad.name_of(env[f'd_{n}'])}", path)
        self.check_plain(f"d_{n} == {const}", fid)

    def lets(self) -> None:
        for n in self.g._let_order():
            if n in self.g.const:
                continue
            node = self.g.fold(self.sig.let[n].node, self.presence, self.bound_set)
            code = self.expr(node)
            if self.mode in ("exact", "symbolic") and any(
                    isinstance(x, E.Call) for x in E.walk(node)):
                # a primitive may refuse these sizes (shapes that do not broadcast): say so,
                # at the input that bound the last of the indices the let reads
                self.let_failure(n, code)
            else:
                self.emit(f"i_{n} = {code}")
            self.bound.append(n)
            self.bound_set.add(n)
            self.by[n] = f"let {n} = {self.sig.let[n].text}"

    def let_failure(self, n: str, code: str) -> None:
        """``i_<n> = <code>`` under its own ``try``: a primitive's refusal (a ValueError or an
        arithmetic error) is the call error of the input that bound the last index the let
        reads, saying which let refused and why."""
        reached = _through_lets(self.sig.let, self.sig.let[n].names())
        by_input = [self.by[m].split(".")[0] for m in self.bound if m in reached
                    and self.by.get(m, "").split(".")[0] in self.sig.inputs]
        arg = by_input[-1] if by_input else next(iter(self.sig.inputs))
        text = self.sig.let[n].text
        fid = self.fail_id(arg, self.g.expected_inputs.get(arg, arg),
                           lambda env, n=n, text=text:
                           f"let {n} = {text} fails on these sizes: {env['_e']}",
                           f"signature.let.{n}")
        self.emit("try:")
        self.emit(f"    i_{n} = {code}")
        self.emit("except (ArithmeticError, ValueError) as _e:")
        self.emit(f"    raise _fail({fid}, locals()) from None")

    def absent_allowed(self) -> None:
        """An input absent in this body whose ``optional`` is a predicate may be left out
        only where it holds: folded at the construction point (a param's test), else read
        from the call's indices; where it does not hold the call is refused naming it."""
        for n, decl in self.sig.inputs.items():
            if self.presence.get(n, True):
                continue
            node = self.g.fold(decl.optional.node, self.presence, self.bound_set)
            if isinstance(node, E.Bool) and node.value:
                continue
            text = decl.optional.text
            names = [m for m in decl.optional.names()
                     if m in self.bound_set or m in self.g.const]
            codes = {m: (f"i_{m}" if m in self.bound_set else None) for m in names}
            consts = {m: self.g.const[m] for m in names if m not in self.bound_set}
            def because(env, n=n, text=text, codes=codes, consts=consts) -> str:
                values = ", ".join(f"{m} = {fmt_value(consts[m] if c is None else ev(c, env))}"
                                   for m, c in codes.items())
                return (f"{n} is required here: it may be left out only where {text!r} "
                        f"holds, and it does not ({values})")

            fid = self.fail_id(n, f"{n} (optional only where {text})", because,
                               f"signature.inputs.{n}")
            self.check_plain("False" if isinstance(node, E.Bool) else self.expr(node), fid)

    def refinements(self) -> None:
        for i, rule in enumerate(self.sig.shape_rules):
            node = self.g.fold(rule.node, self.presence, self.bound_set)
            if isinstance(node, E.Bool) and node.value:
                continue  # holds at this construction point (a False one fails every call)
            code = self.expr(node)
            names = [m for m in rule.names() if m in self.bound_set or m in self.g.const]
            text = rule.text
            # an index's value is read from the call; a construction value is shown as it
            # is (an ADT value has no source text the generated code could evaluate)
            codes = {m: (f"i_{m}" if m in self.bound_set else None) for m in names}
            consts = {m: self.g.const[m] for m in names if m not in self.bound_set}
            # the argument: an input the rule names, else the first input that bound one of
            # its indices (looking through let definitions: H_out is read from H_in)
            reached = _through_lets(self.sig.let, rule.names())
            arg = next((t for t in self.sig.inputs if t in rule.names()),
                       next((t for t in self.sig.inputs
                             if any(self.by.get(m, "").startswith(f"{t}.") for m in reached)),
                            "(refinement)"))
            fid = self.fail_id(arg, f"{text}", lambda env, text=text, codes=codes,
                               consts=consts:
                               f"refinement {text!r} does not hold ("
                               + ", ".join(f"{m} = {fmt_value(consts[m] if c is None else ev(c, env))}"
                                           for m, c in codes.items()) + ")",
                               f"signature.shape_rules[{i}]")
            self.check(code, fid)


def _affine_in(node: E.Node, x: str) -> bool:
    """``node`` is affine in ``x``: built from +, -, unary - and * with ``x`` on one side."""
    if isinstance(node, E.Name | E.Int):
        return True
    if isinstance(node, E.BinOp) and node.op in ("+", "-"):
        return _affine_in(node.left, x) and _affine_in(node.right, x)
    if isinstance(node, E.BinOp) and node.op == "*":
        return not (x in E.names(node.left) and x in E.names(node.right)) and \
            _affine_in(node.left, x) and _affine_in(node.right, x)
    if isinstance(node, E.UnaryOp) and node.op == "-":
        return _affine_in(node.operand, x)
    return x not in E.names(node)


def _through_lets(lets: Mapping[str, Any], names: list[str]) -> list[str]:
    """``names`` and, for each let among them, the names its definition reads (transitively)."""
    out: dict[str, None] = {}

    def visit(n: str) -> None:
        if n in out:
            return
        out[n] = None
        if n in lets:
            for m in lets[n].names():
                visit(m)

    for n in names:
        visit(n)
    return list(out)


def _eval_off(off: _Off, env: dict) -> int:
    return ev(off.code(), env)
