"""The hot-path check's peephole pass: what cannot change its outcome is left out.

The fast ``check`` of a point is written like ``check_exact`` (every binding, every rank
check) and then simplified here, on its parsed statements (``ast``), never by matching text.
The pass only removes statements, so each kept one keeps its generated lines and the source
a point prints reads like the code it runs; the kept statements, as parsed, are what a caller
fusing the check into its own code receives (``FastBody``).
"""

from __future__ import annotations

import ast

__all__ = ["simplify_fast"]


def simplify_fast(lines: list[str]) -> tuple[list[str], list[ast.stmt]]:
    """The hot-path check's statements (``lines``: ``try:``, one statement per line, the
    closing ``return``) with what cannot change its outcome left out, decided on the parsed
    statements (the lines are our own generated code). Returns the kept lines (each kept
    statement keeps its lines as generated) and the kept statements as parsed, the closing
    ``return`` last. Only statements of the body itself are candidates, never the ones
    nested in a conditional block (``if t_out is not None: ...``):

    - a binding that cannot fail and that no later statement reads (an axis or a slice of a
      shape read after its rank check, a dtype read, another index; a let, a solved axis or a
      primitive may fail and is always kept), repeated until none is left, since a dropped
      binding can leave the one it read unread too;
    - a rank check ``len(s_x) >= r`` when a later statement starts by reading ``s_x[-r]`` or
      ``s_x[r - 1]``: on a shorter shape that read raises (a miss), on any other the rank
      check passes.
    """
    tree = ast.parse("\n".join(lines) + "\nexcept Exception:\n    pass\n")
    body = tree.body[0].body  # type: ignore[attr-defined]
    kept = [(st, lines[st.lineno - 1:st.end_lineno]) for st in body]
    while True:
        dead = next((k for k, (st, _) in enumerate(kept)
                     if (name := _infallible_binding(st)) is not None
                     and not any(_reads(later, name) for later, _ in kept[k + 1:])), None)
        if dead is None:
            break
        del kept[dead]
    out, statements = [lines[0]], []
    for k, (st, text) in enumerate(kept):
        rank = _rank_check(st)
        if rank is not None and any(_starts_with_read(later, *rank) for later, _ in kept[k + 1:]):
            continue
        out += text
        statements.append(st)
    return out, statements


def _name(node: ast.AST, prefix: str) -> str | None:
    return node.id if isinstance(node, ast.Name) and node.id.startswith(prefix) else None


def _infallible_binding(st: ast.stmt) -> str | None:
    """``i_X`` when ``st`` is ``i_X = s_y[...]`` (an index or slice of constants, ``len`` and
    arithmetic: the rank was checked before), ``i_X = d_y`` or ``i_X = i_Y``."""
    if not (isinstance(st, ast.Assign) and len(st.targets) == 1):
        return None
    target = _name(st.targets[0], "i_")
    v = st.value
    if target is None:
        return None
    if _name(v, "d_") or _name(v, "i_"):
        return target
    if isinstance(v, ast.Subscript) and _name(v.value, "s_") and not any(
            isinstance(n, ast.Subscript) for n in ast.walk(v.slice)):
        return target
    return None


def _reads(st: ast.stmt, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(st))


def _rank_check(st: ast.stmt) -> tuple[str, int] | None:
    """``(s_x, r)`` when ``st`` is ``if not (len(s_x) >= r): raise _Miss`` with ``r > 0``."""
    if not (isinstance(st, ast.If) and not st.orelse and len(st.body) == 1
            and isinstance(st.body[0], ast.Raise)):
        return None
    t = st.test
    if not (isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not)):
        return None
    c = t.operand
    if not (isinstance(c, ast.Compare) and len(c.ops) == 1 and isinstance(c.ops[0], ast.GtE)
            and isinstance(c.left, ast.Call) and _name(c.left.func, "len") == "len"
            and len(c.left.args) == 1 and _name(c.left.args[0], "s_")):
        return None
    r = c.comparators[0]
    if not (isinstance(r, ast.Constant) and type(r.value) is int and r.value > 0):
        return None
    return c.left.args[0].id, r.value  # type: ignore[attr-defined]


def _starts_with_read(st: ast.stmt, shape: str, r: int) -> bool:
    """Whether the first thing ``st`` evaluates is ``shape[-r]`` or ``shape[r - 1]``."""
    if isinstance(st, ast.Assign):
        node: ast.AST = st.value
    elif isinstance(st, ast.If):
        node = st.test
    else:
        return False
    while True:  # down the operand evaluated first
        if isinstance(node, ast.UnaryOp):
            node = node.operand
        elif isinstance(node, ast.Compare | ast.BinOp):
            node = node.left
        elif isinstance(node, ast.BoolOp):
            node = node.values[0]
        else:
            break
    if not (isinstance(node, ast.Subscript) and _name(node.value, "s_") == shape):
        return False
    try:
        index = ast.literal_eval(node.slice)
    except ValueError:
        return False
    return type(index) is int and index in (-r, r - 1)
