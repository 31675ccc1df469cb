"""The expression language of TileOPs specs: one grammar, an AST of typed nodes, a printer.

Every expression a spec writes -- a shape (``[*B, *normalized_shape]``, ``Mat[trans_a, M, K]``,
``[N, 2 * H + 1]``), a predicate (``not is_causal or S_q <= S_kv``), a formula
(``2 * M * N * K``), a kind (``DType[float16 | bfloat16]``) or a generator
(``prefix_sum(q_lens)``) -- is valid Python expression syntax. :func:`parse` hands the text to
the standard :mod:`ast` parser, accepts only a closed set of node types, and converts the tree
into the frozen node classes below. :func:`unparse` converts back and lets :func:`ast.unparse`
print, so the printer and the parser cannot drift: ``parse(unparse(e)) == e`` for every
expression ``e`` the node constructors accept (property-tested over random trees). Nothing is
ever ``eval``-ed.

What keeps that guarantee total:

- The constructors reject trees no text can produce: a name that is not an identifier or is
  a Python keyword (``Name('if')``, ``Name('True')``; ``Bool`` and ``NoneLit`` exist for
  those), a negative or non-int ``Int`` (``-3`` is ``UnaryOp('-', Int(3))``), a negative,
  signed-zero or non-finite ``Float``, an unknown operator, a ``BoolOp`` of fewer than two
  values, a ``Compare`` whose operators and operands do not pair up, an empty subscript, a
  repeated keyword argument, and a :class:`Starred` anywhere but an item of a ``List`` or
  ``Tuple`` or a positional argument of a ``Call``. A bare ``Starred`` is an item, not an
  expression: :func:`unparse` refuses it (``str()`` still prints ``*x`` for messages).
- Nesting is kept as written, never flattened: ``a and b and c`` is one ``BoolOp`` of three
  values, while ``(a and b) and c`` is a ``BoolOp`` whose first value is a ``BoolOp``. The
  printer parenthesises a nested ``BoolOp`` or ``Compare`` and Python's parser does not
  flatten parentheses, so both shapes round-trip. Likewise ``(-2) ** 3`` (the power of a
  negation) and ``-2 ** 3`` (the negation of a power) are distinct trees with distinct texts.
- A subscript whose only index is a tuple prints with a trailing comma (``x[(a, b),]``),
  which Python reads back as a one-element index; ``x[a, b]`` is a two-element index.

The grammar (informally)::

    expr     := expr 'if' expr 'else' expr | expr ('and'|'or') expr | 'not' expr
              | expr cmp expr (cmp expr)*            cmp: == != < <= > >= in 'not in'
              | expr binop expr                      binop: + - * / // % ** |
              | '-' expr | atom
    atom     := NAME | INT | FLOAT | STRING | True | False | None | '...'
              | atom '.' NAME                        (attribute: layout.max_m, pool.out)
              | atom '[' expr (',' expr)* ']'        (family / kind application, index)
              | atom '(' args ')'                    (primitive call; keyword args allowed)
              | '[' items ']' | '(' items ')'        (shape list, tuple)
    items    := (expr | '*' expr) (',' ...)*         (a star splices a Shape: [*B, N])
"""

from __future__ import annotations

import ast
import keyword
import math
import unicodedata
from collections.abc import Iterator

import msgspec

from .bounds import MAX_EXPR_CHARS, MAX_EXPR_DEPTH, MAX_INT, int_in_range

__all__ = [
    "Attr",
    "BinOp",
    "BoolOp",
    "Bool",
    "Call",
    "Compare",
    "Ellipsis_",
    "ExprSyntaxError",
    "Float",
    "IfExp",
    "Int",
    "List",
    "Name",
    "Node",
    "NoneLit",
    "Starred",
    "Str",
    "Subscript",
    "Tuple",
    "UnaryOp",
    "children",
    "dotted_name",
    "is_name",
    "names",
    "parse",
    "unparse",
    "walk",
]


class ExprSyntaxError(ValueError):
    """An expression text that is not in the grammar. ``col`` is 0-based within the text."""

    def __init__(self, text: str, message: str, col: int | None = None) -> None:
        self.text = text
        self.col = col
        self.reason = message
        where = f" at column {col + 1}" if col is not None else ""
        super().__init__(f"cannot parse {text!r}{where}: {message}")


class Node(msgspec.Struct, frozen=True, tag=True, tag_field="node"):
    """Base of every AST node. Frozen, hashable, compared by value."""

    def __str__(self) -> str:
        return unparse(self)


# --- constructor checks: only trees that some text parses to are accepted -----------------


def is_name(value: object) -> bool:
    """Whether ``value`` can be a name of the language: an identifier that is not a Python
    keyword and is NFKC-normal (the parser NFKC-normalises identifiers, so a non-normal one
    could never come back). Every name a spec declares (an op, a family, a type family, an
    index, a tensor, an ADT, a constructor, a field) is held to it."""
    return (
        isinstance(value, str)
        and value.isidentifier()
        and not keyword.iskeyword(value)
        and unicodedata.normalize("NFKC", value) == value
    )


def _check_ident(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{what} is a str, got {type(value).__name__}")
    if not is_name(value):
        raise ValueError(f"{what} must be an identifier that is not a Python keyword, got {value!r}")


def _check_node(value: object, what: str, starred: bool = False) -> None:
    if not isinstance(value, Node):
        raise TypeError(f"{what} is a Node, got {type(value).__name__}")
    if isinstance(value, Starred) and not starred:
        raise ValueError(
            f"{what} cannot be the starred item {value}: a star stands only before an item of "
            f"a list or tuple or a positional argument of a call"
        )


def _check_nodes(values: object, what: str, starred: bool = False) -> None:
    if not isinstance(values, tuple):
        raise TypeError(f"{what} is a tuple of Nodes, got {type(values).__name__}")
    for v in values:
        _check_node(v, what, starred)


def _check_op(op: object, table: dict[str, type], what: str) -> None:
    if op not in table:
        raise ValueError(f"{what} is one of {', '.join(table)}, got {op!r}")


class Name(Node, frozen=True):
    id: str

    def __post_init__(self) -> None:
        _check_ident(self.id, "Name.id")


class Int(Node, frozen=True):
    """A non-negative integer literal (``-3`` is ``UnaryOp('-', Int(3))``)."""

    value: int

    def __post_init__(self) -> None:
        v = self.value
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"Int holds a non-negative int, got {v!r}")
        if not int_in_range(v):
            raise ValueError(f"Int holds an int of at most {MAX_INT} (2**63 - 1), got one of "
                             f"{v.bit_length()} bits")


class Float(Node, frozen=True):
    """A non-negative finite float literal (``-0.5`` is ``UnaryOp('-', Float(0.5))``)."""

    value: float

    def __post_init__(self) -> None:
        v = self.value
        # -0.0 prints as "-0.0", which reads back as a negation, so it is rejected too.
        if not (isinstance(v, float) and math.isfinite(v) and math.copysign(1.0, v) > 0):
            raise ValueError(f"Float holds a non-negative finite float, got {v!r}")


class Str(Node, frozen=True):
    value: str

    def __post_init__(self) -> None:
        if not isinstance(self.value, str):
            raise TypeError(f"Str holds a str, got {type(self.value).__name__}")


class Bool(Node, frozen=True):
    value: bool

    def __post_init__(self) -> None:
        if not isinstance(self.value, bool):
            raise TypeError(f"Bool holds a bool, got {type(self.value).__name__}")


class NoneLit(Node, frozen=True):
    pass


class Ellipsis_(Node, frozen=True):  # noqa: N801 - `Ellipsis` is a builtin
    """``...`` as in ``tuple[int, ...]``."""


class Attr(Node, frozen=True):
    value: Node
    attr: str

    def __post_init__(self) -> None:
        _check_node(self.value, "Attr.value")
        _check_ident(self.attr, "Attr.attr")


class Subscript(Node, frozen=True):
    """``base[i, j, ...]``: a type-family application (``Mat[t, M, K]``), a kind
    (``DType[float16 | bfloat16]``) or an index (``x.shape[1]``)."""

    value: Node
    index: tuple[Node, ...]

    def __post_init__(self) -> None:
        _check_node(self.value, "Subscript.value")
        _check_nodes(self.index, "Subscript.index")
        if not self.index:
            raise ValueError("Subscript.index holds at least one item")


class Call(Node, frozen=True):
    """A primitive call. ``func`` is the dotted callee name (``pool.out``)."""

    func: str
    args: tuple[Node, ...] = ()
    kwargs: tuple[tuple[str, Node], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.func, str):
            raise TypeError(f"Call.func is a str, got {type(self.func).__name__}")
        for part in self.func.split("."):
            _check_ident(part, "each part of Call.func")
        _check_nodes(self.args, "Call.args", starred=True)
        if not isinstance(self.kwargs, tuple):
            raise TypeError(f"Call.kwargs is a tuple of (name, Node), got "
                            f"{type(self.kwargs).__name__}")
        seen: set[str] = set()
        for kw in self.kwargs:
            if not (isinstance(kw, tuple) and len(kw) == 2):
                raise TypeError(f"Call.kwargs is a tuple of (name, Node), got an item {kw!r}")
            _check_ident(kw[0], "a keyword of Call.kwargs")
            _check_node(kw[1], f"Call.kwargs[{kw[0]!r}]")
            if kw[0] in seen:
                raise ValueError(f"Call.kwargs repeats the keyword {kw[0]!r}")
            seen.add(kw[0])


class Starred(Node, frozen=True):
    """``*B`` inside a shape list, tuple or call: splice a Shape."""

    value: Node

    def __post_init__(self) -> None:
        _check_node(self.value, "Starred.value")

    def __str__(self) -> str:
        return f"*{unparse(self.value)}"


class List(Node, frozen=True):
    items: tuple[Node, ...]

    def __post_init__(self) -> None:
        _check_nodes(self.items, "List.items", starred=True)


class Tuple(Node, frozen=True):
    items: tuple[Node, ...]

    def __post_init__(self) -> None:
        _check_nodes(self.items, "Tuple.items", starred=True)


class UnaryOp(Node, frozen=True):
    op: str  # "-" | "not"
    operand: Node

    def __post_init__(self) -> None:
        _check_op(self.op, _UNARY_R, "UnaryOp.op")
        _check_node(self.operand, "UnaryOp.operand")


class BinOp(Node, frozen=True):
    op: str  # "+" "-" "*" "/" "//" "%" "**" "|"
    left: Node
    right: Node

    def __post_init__(self) -> None:
        _check_op(self.op, _BINOPS_R, "BinOp.op")
        _check_node(self.left, "BinOp.left")
        _check_node(self.right, "BinOp.right")


class BoolOp(Node, frozen=True):
    """``a and b and c`` (one node of three values); never fewer than two values."""

    op: str  # "and" | "or"
    values: tuple[Node, ...]

    def __post_init__(self) -> None:
        _check_op(self.op, _BOOLOPS_R, "BoolOp.op")
        _check_nodes(self.values, "BoolOp.values")
        if len(self.values) < 2:
            raise ValueError(f"BoolOp.values holds at least two values, got {len(self.values)}")


class Compare(Node, frozen=True):
    """``a < b <= c``: ``ops[i]`` sits between operand ``i`` and operand ``i + 1``."""

    left: Node
    ops: tuple[str, ...]  # "==" "!=" "<" "<=" ">" ">=" "in" "not in"
    comparators: tuple[Node, ...]

    def __post_init__(self) -> None:
        _check_node(self.left, "Compare.left")
        if not isinstance(self.ops, tuple):
            raise TypeError(f"Compare.ops is a tuple of str, got {type(self.ops).__name__}")
        for op in self.ops:
            _check_op(op, _CMPOPS_R, "each of Compare.ops")
        _check_nodes(self.comparators, "Compare.comparators")
        if not self.ops or len(self.ops) != len(self.comparators):
            raise ValueError(
                f"Compare needs one operator per comparator and at least one of each, got "
                f"{len(self.ops)} operators and {len(self.comparators)} comparators"
            )


class IfExp(Node, frozen=True):
    test: Node
    body: Node
    orelse: Node

    def __post_init__(self) -> None:
        _check_node(self.test, "IfExp.test")
        _check_node(self.body, "IfExp.body")
        _check_node(self.orelse, "IfExp.orelse")


# --- tables between the AST and Python's ast --------------------------------------------------

_BINOPS: dict[type, str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.BitOr: "|",
}
_CMPOPS: dict[type, str] = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
}
_BOOLOPS: dict[type, str] = {ast.And: "and", ast.Or: "or"}
_UNARY: dict[type, str] = {ast.USub: "-", ast.Not: "not"}

_BINOPS_R = {v: k for k, v in _BINOPS.items()}
_CMPOPS_R = {v: k for k, v in _CMPOPS.items()}
_BOOLOPS_R = {v: k for k, v in _BOOLOPS.items()}
_UNARY_R = {v: k for k, v in _UNARY.items()}

BINARY_OPERATORS = frozenset(_BINOPS_R)
COMPARE_OPERATORS = frozenset(_CMPOPS_R)


def dotted_name(node: Node) -> str | None:
    """``pool.out`` for ``Attr(Name('pool'), 'out')``; None if ``node`` is not a dotted name."""
    if isinstance(node, Name):
        return node.id
    if isinstance(node, Attr):
        head = dotted_name(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def parse(text: str) -> Node:
    """Parse one expression. Raises :class:`ExprSyntaxError` naming the offending construct."""
    if not isinstance(text, str):
        raise ExprSyntaxError(repr(text), f"expected a string, got {type(text).__name__}")
    source = text.strip()
    if not source:
        raise ExprSyntaxError(text, "the expression is empty")
    if len(source) > MAX_EXPR_CHARS:
        raise ExprSyntaxError(_clip(source), f"the expression is {len(source)} characters "
                              f"long; at most {MAX_EXPR_CHARS} are allowed (split it into lets)")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        col = (exc.offset - 1) if exc.offset else None
        msg = exc.msg or "invalid syntax"
        if msg == "too many nested parentheses":  # Python's tokenizer stops at 200 levels
            msg = f"the expression nests deeper than {MAX_EXPR_DEPTH} levels (split it into lets)"
        if source.startswith("*"):
            col, msg = 0, ("a starred item is not an expression by itself; it stands inside "
                           "[...], (...) or a call's arguments")
        raise ExprSyntaxError(text, msg, col) from None
    _check_depth(tree.body, source)
    return _from_py(tree.body, source)


def _clip(source: str) -> str:
    """The start of a text too long to quote whole in a message."""
    return source if len(source) <= 60 else source[:60] + "..."


def _check_depth(root: ast.expr, src: str) -> None:
    """Refuse a tree deeper than MAX_EXPR_DEPTH, walked without recursion (the conversion,
    printer and evaluator that follow are recursive)."""
    stack: list[tuple[ast.AST, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_EXPR_DEPTH:
            raise ExprSyntaxError(_clip(src), f"the expression nests deeper than "
                                  f"{MAX_EXPR_DEPTH} levels (split it into lets)",
                                  getattr(node, "col_offset", None))
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node)
                     if isinstance(child, ast.expr | ast.keyword))


def _reject(src: str, node: ast.AST, what: str) -> ExprSyntaxError:
    return ExprSyntaxError(src, what, getattr(node, "col_offset", None))


def _from_py(node: ast.AST, src: str) -> Node:  # noqa: C901 - one case per node type
    if isinstance(node, ast.Name):
        return Name(node.id)
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None:
            return NoneLit()
        if v is Ellipsis:
            return Ellipsis_()
        if isinstance(v, bool):
            return Bool(v)
        if isinstance(v, int):
            if not int_in_range(v):
                raise ExprSyntaxError(_clip(src), f"an integer literal is at most {MAX_INT} "
                                      f"(2**63 - 1)", node.col_offset)
            return Int(v)
        if isinstance(v, float):
            if not math.isfinite(v):
                raise _reject(src, node, "float literals must be finite")
            return Float(v)
        if isinstance(v, str):
            return Str(v)
        raise _reject(src, node, f"{type(v).__name__} literals are not part of the language")
    if isinstance(node, ast.Attribute):
        return Attr(_from_py(node.value, src), node.attr)
    if isinstance(node, ast.Subscript):
        sl = node.slice
        if isinstance(sl, ast.Slice):
            raise _reject(src, sl, "slices are not part of the language")
        if isinstance(sl, ast.Tuple):
            if not sl.elts:
                raise _reject(src, sl, "an empty subscript is not allowed")
            index = tuple(_from_py(e, src) for e in sl.elts)
        else:
            index = (_from_py(sl, src),)
        if any(isinstance(i, Starred) for i in index):
            raise _reject(src, node, "a starred item is not allowed inside [...] of a subscript")
        return Subscript(_from_py(node.value, src), index)
    if isinstance(node, ast.Call):
        func = dotted_name(_from_py(node.func, src))
        if func is None:
            raise _reject(src, node.func, "only a name or a dotted name can be called")
        kwargs = []
        for kw in node.keywords:
            if kw.arg is None:
                raise _reject(src, kw.value, "'**' arguments are not part of the language")
            if any(k == kw.arg for k, _ in kwargs):
                raise _reject(src, kw, f"keyword argument {kw.arg!r} is repeated")
            kwargs.append((kw.arg, _from_py(kw.value, src)))
        return Call(func, tuple(_from_py(a, src) for a in node.args), tuple(kwargs))
    if isinstance(node, ast.Starred):
        return Starred(_from_py(node.value, src))
    if isinstance(node, ast.List):
        return List(tuple(_from_py(e, src) for e in node.elts))
    if isinstance(node, ast.Tuple):
        return Tuple(tuple(_from_py(e, src) for e in node.elts))
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.UAdd):
            raise _reject(src, node, "unary '+' is not part of the language")
        op = _UNARY.get(type(node.op))
        if op is None:
            raise _reject(src, node, "unary '~' is not part of the language")
        return UnaryOp(op, _from_py(node.operand, src))
    if isinstance(node, ast.BinOp):
        op = _BINOPS.get(type(node.op))
        if op is None:
            sym = {ast.BitAnd: "&", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>",
                   ast.MatMult: "@"}.get(
                type(node.op), type(node.op).__name__
            )
            raise _reject(src, node, f"operator {sym!r} is not part of the language")
        return BinOp(op, _from_py(node.left, src), _from_py(node.right, src))
    if isinstance(node, ast.BoolOp):
        return BoolOp(_BOOLOPS[type(node.op)], tuple(_from_py(v, src) for v in node.values))
    if isinstance(node, ast.Compare):
        ops = []
        for o in node.ops:
            name = _CMPOPS.get(type(o))
            if name is None:
                raise _reject(src, node, "'is' comparisons are not part of the language")
            ops.append(name)
        return Compare(
            _from_py(node.left, src),
            tuple(ops),
            tuple(_from_py(c, src) for c in node.comparators),
        )
    if isinstance(node, ast.IfExp):
        return IfExp(
            _from_py(node.test, src), _from_py(node.body, src), _from_py(node.orelse, src)
        )
    what = {
        ast.Lambda: "lambda is",
        ast.ListComp: "comprehensions are",
        ast.GeneratorExp: "comprehensions are",
        ast.DictComp: "comprehensions are",
        ast.SetComp: "comprehensions are",
        ast.Dict: "dict literals are",
        ast.Set: "set literals are",
        ast.JoinedStr: "f-strings are",
        ast.NamedExpr: "':=' is",
        ast.Await: "await is",
    }.get(type(node), f"{type(node).__name__} is")
    raise _reject(src, node, f"{what} not part of the language")


def to_python_ast(node: Node) -> ast.expr:
    """The Python :mod:`ast` expression for ``node`` (used by the printer and by code
    generators, which rename :class:`Name` nodes before unparsing)."""
    return _to_py(node)


def _to_py(node: Node) -> ast.expr:  # noqa: C901 - one case per node type
    if isinstance(node, Name):
        return ast.Name(node.id, ast.Load())
    if isinstance(node, Int | Float | Str | Bool):
        return ast.Constant(node.value)
    if isinstance(node, NoneLit):
        return ast.Constant(None)
    if isinstance(node, Ellipsis_):
        return ast.Constant(Ellipsis)
    if isinstance(node, Attr):
        return ast.Attribute(_to_py(node.value), node.attr, ast.Load())
    if isinstance(node, Subscript):
        if len(node.index) == 1 and not isinstance(node.index[0], Tuple):
            sl: ast.expr = _to_py(node.index[0])
        else:
            sl = ast.Tuple([_to_py(i) for i in node.index], ast.Load())
        return ast.Subscript(_to_py(node.value), sl, ast.Load())
    if isinstance(node, Call):
        parts = node.func.split(".")
        func: ast.expr = ast.Name(parts[0], ast.Load())
        for p in parts[1:]:
            func = ast.Attribute(func, p, ast.Load())
        return ast.Call(
            func,
            [_to_py(a) for a in node.args],
            [ast.keyword(k, _to_py(v)) for k, v in node.kwargs],
        )
    if isinstance(node, Starred):
        return ast.Starred(_to_py(node.value), ast.Load())
    if isinstance(node, List):
        return ast.List([_to_py(i) for i in node.items], ast.Load())
    if isinstance(node, Tuple):
        return ast.Tuple([_to_py(i) for i in node.items], ast.Load())
    if isinstance(node, UnaryOp):
        return ast.UnaryOp(_UNARY_R[node.op](), _to_py(node.operand))
    if isinstance(node, BinOp):
        return ast.BinOp(_to_py(node.left), _BINOPS_R[node.op](), _to_py(node.right))
    if isinstance(node, BoolOp):
        return ast.BoolOp(_BOOLOPS_R[node.op](), [_to_py(v) for v in node.values])
    if isinstance(node, Compare):
        return ast.Compare(
            _to_py(node.left),
            [_CMPOPS_R[o]() for o in node.ops],
            [_to_py(c) for c in node.comparators],
        )
    if isinstance(node, IfExp):
        return ast.IfExp(_to_py(node.test), _to_py(node.body), _to_py(node.orelse))
    raise TypeError(f"not an expression node: {node!r}")


def unparse(node: Node) -> str:
    """Print ``node`` in the canonical spelling; ``parse(unparse(node)) == node``.

    A bare :class:`Starred` is refused (ValueError): it is an item, not an expression."""
    if isinstance(node, Starred):
        raise ValueError(
            f"{node} is a starred item, not an expression; it prints only inside a list, a "
            f"tuple or a call"
        )
    return ast.unparse(ast.fix_missing_locations(_to_py(node)))


def walk(node: Node) -> Iterator[Node]:
    """Every node of the tree, pre-order."""
    yield node
    for child in children(node):
        yield from walk(child)


def children(node: Node) -> tuple[Node, ...]:
    """The direct subexpressions of ``node``, in order (a call's keyword values after its
    arguments)."""
    if isinstance(node, Attr | Starred):
        return (node.value,)
    if isinstance(node, Subscript):
        return (node.value, *node.index)
    if isinstance(node, Call):
        return (*node.args, *(v for _, v in node.kwargs))
    if isinstance(node, List | Tuple):
        return node.items
    if isinstance(node, UnaryOp):
        return (node.operand,)
    if isinstance(node, BinOp):
        return (node.left, node.right)
    if isinstance(node, BoolOp):
        return node.values
    if isinstance(node, Compare):
        return (node.left, *node.comparators)
    if isinstance(node, IfExp):
        return (node.test, node.body, node.orelse)
    return ()


def names(node: Node) -> list[str]:
    """The free index names ``node`` refers to, in order of first appearance.

    The root of an attribute chain counts (``layout`` in ``layout.max_m``); callee names and
    keyword names do not (they are primitives, checked against the primitive table).
    """
    seen: dict[str, None] = {}
    _collect(node, seen)
    return list(seen)


def _collect(node: Node, seen: dict[str, None]) -> None:
    if isinstance(node, Name):
        seen.setdefault(node.id, None)
    elif isinstance(node, Attr):
        _collect(node.value, seen)
    elif isinstance(node, Subscript):
        _collect(node.value, seen)
        for i in node.index:
            _collect(i, seen)
    elif isinstance(node, Call):
        for a in node.args:
            _collect(a, seen)
        for _, v in node.kwargs:
            _collect(v, seen)
    elif isinstance(node, Starred):
        _collect(node.value, seen)
    elif isinstance(node, List | Tuple):
        for i in node.items:
            _collect(i, seen)
    elif isinstance(node, UnaryOp):
        _collect(node.operand, seen)
    elif isinstance(node, BinOp):
        _collect(node.left, seen)
        _collect(node.right, seen)
    elif isinstance(node, BoolOp):
        for v in node.values:
            _collect(v, seen)
    elif isinstance(node, Compare):
        _collect(node.left, seen)
        for c in node.comparators:
            _collect(c, seen)
    elif isinstance(node, IfExp):
        _collect(node.test, seen)
        _collect(node.body, seen)
        _collect(node.orelse, seen)
