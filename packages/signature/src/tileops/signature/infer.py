"""Output inference, the effect branch and the record: how every body of a point ends.

After the checks of a presence combination have bound every index, each output's shape and
dtype follow from its declaration (folded at the point: an output declared with an input's
shape reuses that input's ``torch.Size``); a given ``out=`` buffer is checked against them;
the effect branch (written inputs, ``out`` given, returned outputs) is a constant per body
but for ``out=``; and the body returns the record (the check modes) or the index values and
output shapes and dtypes (``derive``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tileops.spec import Scope, evaluate
from tileops.spec import expr as E

from .common import LazyConflict, ev, shape_text, tuple_code
from .sizes import shape_problem

if TYPE_CHECKING:  # pragma: no cover
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
        dn = d.dtype.node
        src_dtype = b.sig.inputs[same].dtype.node if same is not None else None
        b.g.like_votes.setdefault(n, set()).add(same if src_dtype == dn else None)
        if isinstance(dn, E.Name) and dn.id in b.sig.forall:
            dtypes.append(f"i_{dn.id}")
        else:
            name = dn.id if isinstance(dn, E.Name) and dn.id not in b.g.const \
                else b.g.const[dn.id]  # type: ignore[union-attr]
            dtypes.append(b.g._native(name))
    for i, (n, d) in enumerate(b.sig.outputs.items()):
        if not d.buffer or shapes[i] == "None" or b.mode == "derive":
            continue
        b.emit(f"if t_{n} is not None:")
        fid = b.fail_id(n, f"{n}: Tensor[{d.dtype.text}, {d.shape.text}]",
                        lambda env, n=n, sc=shapes[i], dc=dtypes[i]:
                        (shape_problem(n, env[f"t_{n}"].shape)
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
    for n in b.g.index_names:
        if n in b.g.lazy and b.by.get(n, "").split(".")[0] != b.g.lazy[n][0]:
            raise LazyConflict(n)
    vals = [f"s_{b.g.lazy[n][0]}" if n in b.g.lazy else f"i_{n}" for n in b.g.index_names]
    if b.mode == "derive":
        b.emit(f"return {tuple_code(vals)}, {tuple_code(shapes)}, {tuple_code(dtypes)}")
        return
    # the record: one object holding what the check read (see SignatureCall)
    reads = ", ".join(f"{s}, {d}" for s, d in zip(ins, ids, strict=True))
    b.emit(f"return _R({device}, {branch}{', ' + reads if reads else ''})")


def _truth(b: Body, node: E.Node) -> bool:
    """The value of an effect condition (``mutated``, ``nullable``) at this body."""
    v = evaluate(node, Scope(b.g.const, b.sig.types, b.presence))
    return bool(v)
