"""Output inference, the effect branch and the record: how every body of a point ends.

After the checks of a presence combination have bound every index, each output's shape and
dtype follow from its declaration (folded at the point: an output declared with an input's
shape reuses that input's ``torch.Size``); a given ``out=`` buffer is checked against them;
the effect branch (written inputs, ``out`` given, returned outputs) is a constant per body
but for ``out=``; and the body returns the record (the check modes) or the index values and
output shapes and dtypes (``derive``).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from tileops.spec import DTYPES, Scope, evaluate
from tileops.spec import expr as E

from .common import GenError, LazyConflict, ev, shape_text, tuple_code
from .dtypes import is_dtype_expr

if TYPE_CHECKING:  # pragma: no cover
    from tileops.spec.schema import OutputDecl

    from .unify import Body

__all__ = ["emit_outputs"]


def emit_outputs(b: Body) -> None:
    """The end of body ``b``: the outputs' shape and dtype code, the check of each given
    buffer, the branch, and the ``return`` (the record, or ``derive``'s values)."""
    shapes, dtypes = [], []
    ad = b.g.adapter
    written = tuple(n for n, d in b.sig.inputs.items()
                    if not (n in b.presence and not b.presence[n])
                    and _truth(b, d.mutated.node))
    returned = []
    for n, d in b.sig.outputs.items():
        if _truth(b, d.nullable.node):
            shapes.append("None")
            dtypes.append("None")
            continue
        returned.append(n)
        node = b.g.fold(d.shape.node, b.presence, b.bound_set)
        same = next((t for t, form in b.forms.items() if form == node), None)
        if same is not None:  # the output has an input's shape: reuse the Size read
            shapes.append(f"s_{same}")
        else:
            shapes.append(b.expr(E.Tuple(node.items) if isinstance(node, E.List) else node))
            if b.mode in ("exact", "fast") and not _plain_shape(node):
                _check_output_shape(b, n, d, shapes[-1])
        dn = d.dtype.node
        src_dtype = b.sig.inputs[same].dtype.node if same is not None else None
        # an output is allocated like the input it matches only where that input is on the
        # call's device: one declared ``device: any`` may be a CPU tensor beside CUDA ones
        like = same is not None and src_dtype == dn and b.sig.inputs[same].device != "any"
        b.g.like_votes.setdefault(n, set()).add(same if like else None)
        dtypes.append(_output_dtype(b, n, d))
    for i, (n, d) in enumerate(b.sig.outputs.items()):
        if not d.buffer or b.mode == "derive":
            continue
        if shapes[i] == "None":  # no output here: a buffer given for it would go unwritten
            fid = b.fail_id(n, f"{n}: None (nullable where {d.nullable.text})",
                            lambda env, n=n, t=d.nullable.text:
                            f"a buffer was given for {n}, but this call has no {n} output "
                            f"({t!r} holds)", f"signature.outputs.{n}")
            b.check_plain(f"t_{n} is None", fid)
            continue
        attr = ad.device
        if attr is not None and b.device_code != "None":  # a buffer on the call's device
            fid = b.fail_id(n, f"{n}: Tensor[{d.dtype.text}, {d.shape.text}] on the inputs' "
                               f"device",
                            lambda env, n=n, attr=attr, dev=b.device_code:
                            f"the buffer given for {n} is on "
                            f"{getattr(env[f't_{n}'], attr)}, the call's inputs on "
                            f"{ev(dev, env)}: the tensors of one call must share a device",
                            f"signature.outputs.{n}")
            b.check_plain(f"t_{n} is None or t_{n}.{attr} == {b.device_code}", fid)
        b.emit(f"if t_{n} is not None:")
        fid = b.fail_id(n, f"{n}: Tensor[{d.dtype.text}, {d.shape.text}]",
                        lambda env, n=n, sc=shapes[i], dc=dtypes[i]:
                        (ad.problem(n, env[f"t_{n}"])
                         if ad.admit(env[f"t_{n}"], env[f"t_{n}"].shape) is None else
                         f"the buffer given for {n} must be "
                         f"{ad.short(ev(dc, env))}{shape_text(ev(sc, env))}, but is "
                         f"{ad.short(env[f't_{n}'].dtype)}"
                         f"{shape_text(env[f't_{n}'].shape)}"),
                        f"signature.outputs.{n}")
        miss = "raise _Miss" if b.mode == "fast" else f"raise _fail({fid}, locals())"
        # a buffer of another library's type must hold sizes too (as an input: .sizes)
        b.g.namespace.setdefault("_AT", ad.admitted)
        b.g.namespace.setdefault("_admit", ad.admit)
        b.emit(f"    if not ((type(t_{n}) in _AT or _admit(t_{n}, t_{n}.shape) is not None) and "
               f"tuple(t_{n}.shape) == {shapes[i]} and t_{n}.dtype == {dtypes[i]}): {miss}")
    br_given = b.g._name("BR", (written, True, tuple(returned)))
    br_fresh = b.g._name("BR", (written, False, tuple(returned)))
    b.fresh_branch = b.g.namespace[br_fresh]
    given = " or ".join(f"t_{n} is not None" for n in b.g.plan.buffer_outputs)
    branch = f"({br_given} if ({given}) else {br_fresh})" if given else br_fresh
    ins = [f"s_{n}" if not (n in b.presence and not b.presence[n]) else "None"
           for n in b.sig.inputs]
    ids = [f"d_{n}" if not (n in b.presence and not b.presence[n]) else "None"
           for n in b.sig.inputs]
    # the call's device (see Body._devices); None without tensor inputs (outputs go to the
    # default device) or for an adapter without devices
    device = b.device_code
    # an index only absent inputs read has no value in this body: None
    unread = b.g.optional_indices(b.presence)
    for n in b.g.index_names:
        if n in b.g.lazy and n not in unread \
                and b.by.get(n, "").split(".")[0] != b.g.lazy[n][0]:
            raise LazyConflict(n)
    vals = ["None" if n in unread else f"s_{b.g.lazy[n][0]}" if n in b.g.lazy else f"i_{n}"
            for n in b.g.index_names]
    if b.mode == "derive":
        b.emit(f"return {tuple_code(vals)}, {tuple_code(shapes)}, {tuple_code(dtypes)}")
        return
    # the record: one object holding what the check read (see SignatureCall)
    reads = ", ".join(f"{s}, {d}" for s, d in zip(ins, ids, strict=True))
    b.emit(f"return _R({device}, {branch}{', ' + reads if reads else ''})")


def _plain_shape(node: E.Node) -> bool:
    """Whether every axis of an output's folded shape is an index, a constant or a spliced
    Shape index: sizes by construction (the inputs' sizes are checked), nothing to compute."""
    items = node.items if isinstance(node, E.List | E.Tuple) else None
    if items is None:
        return False
    return all(isinstance(it, E.Name | E.Int) and not isinstance(it, E.Bool)
               and (not isinstance(it, E.Int) or it.value >= 0)
               or isinstance(it, E.Starred) and isinstance(it.value, E.Name) for it in items)


def _is_shape(shape: tuple) -> bool:
    return all(type(v) is int and v >= 0 for v in shape)


def _check_output_shape(b: Body, n: str, d: OutputDecl, code: str) -> None:
    """An output axis the signature computes (``H - 3``, ``N // k``, a primitive's result) must
    be a size on the call's values: evaluated in the check, so a call that gives an output a
    negative or fractional axis (or a primitive that refuses these values) is refused here
    rather than when the outputs are derived."""
    b.g.namespace.setdefault("_osz", _is_shape)
    fid = b.fail_id(n, f"{n}: Tensor[{d.dtype.text}, {d.shape.text}]",
                    lambda env, n=n, code=code:
                    f"{n}'s shape would be {shape_text(ev(code, env))}: not a shape (an axis "
                    f"below 0 or not an integer)", f"signature.outputs.{n}")
    b.check(f"_osz({code})", fid)


def _output_dtype(b: Body, n: str, d: OutputDecl) -> str:
    """Code for output ``n``'s dtype: an index's binding, a constant's native object, or a
    computed dtype's table lookup (:mod:`.dtypes`). A lookup that can miss (a combination with
    no result) is bound to ``o_<n>`` and checked, naming the input whose dtype reached it; one
    that cannot is emitted only where it is read (a buffer's check, ``derive``)."""
    node = b.g.fold(d.dtype.node, b.presence, b.bound_set)
    if isinstance(node, E.Name) and (node.id in b.sig.forall or node.id in b.sig.let):
        return f"i_{node.id}"  # an index, or a let the body computed (a dtype's checked there)
    if isinstance(node, E.Str | E.Name):  # a dtype name, or a dtype param folded
        name = node.value if isinstance(node, E.Str) else node.id
        if name not in DTYPES:
            raise GenError(f"dtype of {n} ({d.dtype.text}) is not a dtype")
        return b.g._native(name)
    if not is_dtype_expr(node):
        raise GenError(f"dtype of {n} ({d.dtype.text}) cannot be compiled: an output's dtype "
                       f"is an index, a dtype name, a dtype primitive's call or a conditional "
                       f"between them")
    lk = b.g.dtype_lookup(node)  # type: ignore[arg-type]
    if lk.constant:
        return ast.unparse(lk.code)
    if lk.total and b.mode != "derive" and not d.buffer:
        return ast.unparse(lk.code)  # read by nothing here: derive computes it
    for m in E.names(node):
        if m in b.pending:  # a Shape index a rank reads, not sliced yet
            b.expr(E.Name(m))
    if lk.total or b.mode == "derive":
        return ast.unparse(lk.code)
    if b.mode == "fast":  # a miss (KeyError) hands the call to the exact check
        b.emit(f"o_{n} = {ast.unparse(lk.code)}")
        return f"o_{n}"
    table = lk.code
    assert isinstance(table, ast.Subscript)
    get = ast.Call(ast.Attribute(table.value, "get", ast.Load()), [table.slice], [])
    b.emit(f"o_{n} = {ast.unparse(get)}")
    leaves = [m for m in b.bound if m in E.names(node)]
    arg = b.by[leaves[-1]].split(".")[0] if leaves else next(iter(b.sig.inputs))
    text = d.dtype.text
    ad = b.g.adapter

    def because(env: dict) -> str:
        values = [ev(code, env) for _, code in lk.leaves]
        names = [v if isinstance(v, int) else ad.name_of(v) for v in values]
        at = ", ".join(f"{t} = {v}" for (t, _), v in zip(lk.leaves, names, strict=True))
        return f"the dtype of {n}, {text}, has no value at {at}: {lk.reason(names)}"

    fid = b.fail_id(arg, b.g.expected_inputs.get(arg, arg), because,
                    f"signature.outputs.{n}.dtype")
    b.check_plain(f"o_{n} is not None", fid)
    return f"o_{n}"


def _truth(b: Body, node: E.Node) -> bool:
    """The value of an effect condition (``mutated``, ``nullable``) at this body."""
    v = evaluate(node, Scope(b.g.const, b.sig.types, b.presence))
    return bool(v)
