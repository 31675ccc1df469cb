"""The expression language: parsing, printing, the round-trip guarantee, names() and walk()."""

from __future__ import annotations

import keyword
import string

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tileops.spec import expr as E
from tileops.spec.bounds import MAX_INT
from tileops.spec.expr import (
    Attr,
    BinOp,
    Bool,
    BoolOp,
    Call,
    Compare,
    Ellipsis_,
    ExprSyntaxError,
    Float,
    IfExp,
    Int,
    List,
    Name,
    NoneLit,
    Starred,
    Str,
    Subscript,
    Tuple,
    UnaryOp,
    names,
    parse,
    unparse,
    walk,
)

a, b, c = Name("a"), Name("b"), Name("c")

# --- every construct: text -> AST -> canonical text ---------------------------------------------

# (text as a spec writes it, the AST, the canonical printed text)
CONSTRUCTS = [
    ("M", Name("M"), "M"),
    ("4096", Int(4096), "4096"),
    ("1_000", Int(1000), "1000"),
    ("1.0e-6", Float(1e-6), "1e-06"),
    ("0.5", Float(0.5), "0.5"),
    ("'tight'", Str("tight"), "'tight'"),
    ('"tight"', Str("tight"), "'tight'"),
    ("True", Bool(True), "True"),
    ("False", Bool(False), "False"),
    ("None", NoneLit(), "None"),
    ("...", Ellipsis_(), "..."),
    ("layout.max_m", Attr(Name("layout"), "max_m"), "layout.max_m"),
    ("eps.value", Attr(Name("eps"), "value"), "eps.value"),
    (
        "Mat[trans_a, M, K]",
        Subscript(Name("Mat"), (Name("trans_a"), Name("M"), Name("K"))),
        "Mat[trans_a, M, K]",
    ),
    (
        "DType[float16 | bfloat16]",
        Subscript(Name("DType"), (BinOp("|", Name("float16"), Name("bfloat16")),)),
        "DType[float16 | bfloat16]",
    ),
    ("x[1]", Subscript(Name("x"), (Int(1),)), "x[1]"),
    ("tuple[int, ...]", Subscript(Name("tuple"), (Name("int"), Ellipsis_())), "tuple[int, ...]"),
    ("x[(a, b),]", Subscript(Name("x"), (Tuple((a, b)),)), "x[(a, b),]"),
    ("x[(a, b)]", Subscript(Name("x"), (a, b)), "x[a, b]"),
    (
        "pool.out(H_in, kH, sH, pH, dH, ceil_mode)",
        Call("pool.out", tuple(Name(n) for n in ("H_in", "kH", "sH", "pH", "dH", "ceil_mode"))),
        "pool.out(H_in, kH, sH, pH, dH, ceil_mode)",
    ),
    (
        "per_axis(stride, 0, 2, fallback=kH)",
        Call("per_axis", (Name("stride"), Int(0), Int(2)), (("fallback", Name("kH")),)),
        "per_axis(stride, 0, 2, fallback=kH)",
    ),
    ("prefix_sum(q_lens)", Call("prefix_sum", (Name("q_lens"),)), "prefix_sum(q_lens)"),
    ("broadcast(*S)", Call("broadcast", (Starred(Name("S")),)), "broadcast(*S)"),
    ("f()", Call("f"), "f()"),
    (
        "[*B, *normalized_shape]",
        List((Starred(Name("B")), Starred(Name("normalized_shape")))),
        "[*B, *normalized_shape]",
    ),
    ("[]", List(()), "[]"),
    (
        "[N, 2 * H + 1]",
        List((Name("N"), BinOp("+", BinOp("*", Int(2), Name("H")), Int(1)))),
        "[N, 2 * H + 1]",
    ),
    ("(64, 128, 256)", Tuple((Int(64), Int(128), Int(256))), "(64, 128, 256)"),
    ("(a,)", Tuple((a,)), "(a,)"),
    ("()", Tuple(()), "()"),
    ("(*a, b)", Tuple((Starred(a), b)), "(*a, b)"),
    ("-3", UnaryOp("-", Int(3)), "-3"),
    ("not a", UnaryOp("not", a), "not a"),
    ("(-2) ** 3", BinOp("**", UnaryOp("-", Int(2)), Int(3)), "(-2) ** 3"),
    ("-2 ** 3", UnaryOp("-", BinOp("**", Int(2), Int(3))), "-2 ** 3"),
    ("2 ** -1", BinOp("**", Int(2), UnaryOp("-", Int(1))), "2 ** (-1)"),
    ("a - (b - c)", BinOp("-", a, BinOp("-", b, c)), "a - (b - c)"),
    ("a - b - c", BinOp("-", BinOp("-", a, b), c), "a - b - c"),
    ("a // b % c", BinOp("%", BinOp("//", a, b), c), "a // b % c"),
    ("a / b", BinOp("/", a, b), "a / b"),
    ("'a' | 'b'", BinOp("|", Str("a"), Str("b")), "'a' | 'b'"),
    ("a and b and c", BoolOp("and", (a, b, c)), "a and b and c"),
    ("(a and b) and c", BoolOp("and", (BoolOp("and", (a, b)), c)), "(a and b) and c"),
    ("a and (b and c)", BoolOp("and", (a, BoolOp("and", (b, c)))), "a and (b and c)"),
    ("a or b and c", BoolOp("or", (a, BoolOp("and", (b, c)))), "a or (b and c)"),
    (
        "not is_causal or S_q <= S_kv",
        BoolOp("or", (UnaryOp("not", Name("is_causal")),
                      Compare(Name("S_q"), ("<=",), (Name("S_kv"),)))),
        "not is_causal or S_q <= S_kv",
    ),
    ("0 <= pH <= kH // 2", Compare(Int(0), ("<=", "<="), (Name("pH"), BinOp("//", Name("kH"),
                                                                           Int(2)))),
     "0 <= pH <= kH // 2"),
    ("(a < b) < c", Compare(Compare(a, ("<",), (b,)), ("<",), (c,)), "(a < b) < c"),
    ("a == b != c", Compare(a, ("==", "!="), (b, c)), "a == b != c"),
    ("a > b >= c", Compare(a, (">", ">="), (b, c)), "a > b >= c"),
    ("D in (64, 128)", Compare(Name("D"), ("in",), (Tuple((Int(64), Int(128))),)),
     "D in (64, 128)"),
    ("D not in (1,)", Compare(Name("D"), ("not in",), (Tuple((Int(1),)),)), "D not in (1,)"),
    ("4 if present(w) else 3", IfExp(Call("present", (Name("w"),)), Int(4), Int(3)),
     "4 if present(w) else 3"),
    ("  M  ", Name("M"), "M"),
    ("1 .real", Attr(Int(1), "real"), "1 .real"),
]


@pytest.mark.parametrize(("text", "node", "printed"), CONSTRUCTS, ids=[t[0] for t in CONSTRUCTS])
def test_parse_and_print_every_construct(text: str, node: E.Node, printed: str) -> None:
    assert parse(text) == node
    assert unparse(node) == printed
    assert str(node) == printed
    assert parse(printed) == node


def test_nodes_are_frozen_hashable_values() -> None:
    x = parse("Mat[t, M, K]")
    assert hash(x) == hash(parse("Mat[t,M,K]"))
    assert {x, parse("Mat[t, M, K]")} == {x}
    with pytest.raises(AttributeError):
        x.value = Name("Other")  # type: ignore[misc]
    # the tag distinguishes node types with equal fields
    assert Int(1) != Float(1.0)
    assert Name("a") != Str("a")


def test_dotted_name() -> None:
    assert E.dotted_name(parse("pool.out")) == "pool.out"
    assert E.dotted_name(parse("a.b.c")) == "a.b.c"
    assert E.dotted_name(parse("M")) == "M"
    assert E.dotted_name(parse("x[0].b")) is None
    assert E.dotted_name(parse("1")) is None


def test_starred_prints_for_messages_but_does_not_unparse() -> None:
    s = Starred(Name("B"))
    assert str(s) == "*B"
    with pytest.raises(ValueError) as exc:
        unparse(s)
    assert str(exc.value) == (
        "*B is a starred item, not an expression; it prints only inside a list, a tuple or a call"
    )


def test_to_python_ast_is_python_ast() -> None:
    import ast

    tree = E.to_python_ast(parse("a + f(b)"))
    assert isinstance(tree, ast.BinOp)
    assert ast.unparse(ast.fix_missing_locations(tree)) == "a + f(b)"


# --- rejection of what is not in the grammar ----------------------------------------------------

REJECTED = [
    ("lambda x: x", "cannot parse 'lambda x: x' at column 1: lambda is not part of the language"),
    ("a & b", "cannot parse 'a & b' at column 1: operator '&' is not part of the language"),
    ("a ^ b", "cannot parse 'a ^ b' at column 1: operator '^' is not part of the language"),
    ("a << 1", "cannot parse 'a << 1' at column 1: operator '<<' is not part of the language"),
    ("a @ b", "cannot parse 'a @ b' at column 1: operator '@' is not part of the language"),
    ("x[1:2]", "cannot parse 'x[1:2]' at column 3: slices are not part of the language"),
    ("x[:]", "cannot parse 'x[:]' at column 3: slices are not part of the language"),
    ("f(**kw)", "cannot parse 'f(**kw)' at column 5: '**' arguments are not part of the language"),
    ("a is b", "cannot parse 'a is b' at column 1: 'is' comparisons are not part of the language"),
    (
        "a is not None",
        "cannot parse 'a is not None' at column 1: 'is' comparisons are not part of the language",
    ),
    (
        "[i for i in xs]",
        "cannot parse '[i for i in xs]' at column 1: comprehensions are not part of the language",
    ),
    (
        "(i for i in xs)",
        "cannot parse '(i for i in xs)' at column 1: comprehensions are not part of the language",
    ),
    (
        "{k: v for k, v in d}",
        "cannot parse '{k: v for k, v in d}' at column 1: comprehensions are not part of the "
        "language",
    ),
    (
        "{i for i in s}",
        "cannot parse '{i for i in s}' at column 1: comprehensions are not part of the language",
    ),
    ("f'{a}'", "cannot parse \"f'{a}'\" at column 1: f-strings are not part of the language"),
    ("{a: 1}", "cannot parse '{a: 1}' at column 1: dict literals are not part of the language"),
    ("{a}", "cannot parse '{a}' at column 1: set literals are not part of the language"),
    ("(y := 1)", "cannot parse '(y := 1)' at column 2: ':=' is not part of the language"),
    ("await x", "cannot parse 'await x' at column 1: await is not part of the language"),
    ("+a", "cannot parse '+a' at column 1: unary '+' is not part of the language"),
    ("~a", "cannot parse '~a' at column 1: unary '~' is not part of the language"),
    ("1j", "cannot parse '1j' at column 1: complex literals are not part of the language"),
    ("b'x'", "cannot parse \"b'x'\" at column 1: bytes literals are not part of the language"),
    ("1e999", "cannot parse '1e999' at column 1: float literals must be finite"),
    ("x[()]", "cannot parse 'x[()]' at column 3: an empty subscript is not allowed"),
    (
        "x[*a]",
        "cannot parse 'x[*a]' at column 1: a starred item is not allowed inside [...] of a "
        "subscript",
    ),
    ("f(x)(y)", "cannot parse 'f(x)(y)' at column 1: only a name or a dotted name can be called"),
    ("x[0](1)", "cannot parse 'x[0](1)' at column 1: only a name or a dotted name can be called"),
    ("f(a=1, a=2)", "cannot parse 'f(a=1, a=2)' at column 8: keyword argument 'a' is repeated"),
    ("a +", "cannot parse 'a +': invalid syntax"),
    ("(a", "cannot parse '(a' at column 1: '(' was never closed"),
    (
        "*a",
        "cannot parse '*a' at column 1: a starred item is not an expression by itself; it "
        "stands inside [...], (...) or a call's arguments",
    ),
    ("", "cannot parse '': the expression is empty"),
    ("   ", "cannot parse '   ': the expression is empty"),
]


@pytest.mark.parametrize(("text", "message"), REJECTED, ids=[t[0] or "empty" for t in REJECTED])
def test_rejects_what_is_not_in_the_grammar(text: str, message: str) -> None:
    with pytest.raises(ExprSyntaxError) as exc:
        parse(text)
    assert str(exc.value) == message
    assert exc.value.text == text


def test_syntax_error_carries_the_column_and_the_reason() -> None:
    with pytest.raises(ExprSyntaxError) as exc:
        parse("x[1:2]")
    assert exc.value.col == 2
    assert exc.value.reason == "slices are not part of the language"
    assert isinstance(exc.value, ValueError)


def test_rejects_a_non_string() -> None:
    with pytest.raises(ExprSyntaxError) as exc:
        parse(3)  # type: ignore[arg-type]
    assert str(exc.value) == "cannot parse '3': expected a string, got int"


# --- the constructors accept only trees that round-trip -----------------------------------------

BAD_NODES = [
    ("name-keyword", lambda: Name("if"), ValueError,
     "Name.id must be an identifier that is not a Python keyword, got 'if'"),
    ("name-True", lambda: Name("True"), ValueError,
     "Name.id must be an identifier that is not a Python keyword, got 'True'"),
    ("name-not-ident", lambda: Name("a b"), ValueError,
     "Name.id must be an identifier that is not a Python keyword, got 'a b'"),
    ("name-empty", lambda: Name(""), ValueError,
     "Name.id must be an identifier that is not a Python keyword, got ''"),
    # the parser NFKC-normalises identifiers: "ﬁ" would read back as "fi"
    ("name-not-nfkc", lambda: Name("\ufb01"), ValueError,
     "Name.id must be an identifier that is not a Python keyword, got '\ufb01'"),
    ("name-not-str", lambda: Name(1), TypeError, "Name.id is a str, got int"),
    ("int-negative", lambda: Int(-1), ValueError, "Int holds a non-negative int, got -1"),
    ("int-bool", lambda: Int(True), ValueError, "Int holds a non-negative int, got True"),
    ("int-float", lambda: Int(1.0), ValueError, "Int holds a non-negative int, got 1.0"),
    ("float-negative", lambda: Float(-0.5), ValueError,
     "Float holds a non-negative finite float, got -0.5"),
    ("float-neg-zero", lambda: Float(-0.0), ValueError,
     "Float holds a non-negative finite float, got -0.0"),
    ("float-inf", lambda: Float(float("inf")), ValueError,
     "Float holds a non-negative finite float, got inf"),
    ("float-nan", lambda: Float(float("nan")), ValueError,
     "Float holds a non-negative finite float, got nan"),
    ("float-int", lambda: Float(1), ValueError, "Float holds a non-negative finite float, got 1"),
    ("str-not-str", lambda: Str(1), TypeError, "Str holds a str, got int"),
    ("bool-int", lambda: Bool(1), TypeError, "Bool holds a bool, got int"),
    ("attr-keyword", lambda: Attr(a, "not"), ValueError,
     "Attr.attr must be an identifier that is not a Python keyword, got 'not'"),
    ("attr-value-not-node", lambda: Attr("a", "b"), TypeError, "Attr.value is a Node, got str"),
    ("attr-starred", lambda: Attr(Starred(a), "b"), ValueError,
     "Attr.value cannot be the starred item *a: a star stands only before an item of a list or "
     "tuple or a positional argument of a call"),
    ("subscript-empty", lambda: Subscript(a, ()), ValueError,
     "Subscript.index holds at least one item"),
    ("subscript-list", lambda: Subscript(a, [b]), TypeError,
     "Subscript.index is a tuple of Nodes, got list"),
    ("subscript-starred", lambda: Subscript(a, (Starred(b),)), ValueError,
     "Subscript.index cannot be the starred item *b: a star stands only before an item of a "
     "list or tuple or a positional argument of a call"),
    ("call-empty-func", lambda: Call(""), ValueError,
     "each part of Call.func must be an identifier that is not a Python keyword, got ''"),
    ("call-bad-dotted", lambda: Call("pool..out"), ValueError,
     "each part of Call.func must be an identifier that is not a Python keyword, got ''"),
    ("call-keyword-func", lambda: Call("a.if"), ValueError,
     "each part of Call.func must be an identifier that is not a Python keyword, got 'if'"),
    ("call-repeated-kwarg", lambda: Call("f", (), (("x", a), ("x", b))), ValueError,
     "Call.kwargs repeats the keyword 'x'"),
    ("call-kwarg-keyword", lambda: Call("f", (), (("in", a),)), ValueError,
     "a keyword of Call.kwargs must be an identifier that is not a Python keyword, got 'in'"),
    ("call-kwarg-starred", lambda: Call("f", (), (("x", Starred(a)),)), ValueError,
     "Call.kwargs['x'] cannot be the starred item *a: a star stands only before an item of a "
     "list or tuple or a positional argument of a call"),
    ("call-kwarg-shape", lambda: Call("f", (), (("x",),)), TypeError,
     "Call.kwargs is a tuple of (name, Node), got an item ('x',)"),
    ("starred-starred", lambda: Starred(Starred(a)), ValueError,
     "Starred.value cannot be the starred item *a: a star stands only before an item of a list "
     "or tuple or a positional argument of a call"),
    ("list-not-tuple", lambda: List([a]), TypeError, "List.items is a tuple of Nodes, got list"),
    ("tuple-item-not-node", lambda: Tuple((1,)), TypeError, "Tuple.items is a Node, got int"),
    ("unary-plus", lambda: UnaryOp("+", a), ValueError, "UnaryOp.op is one of -, not, got '+'"),
    ("unary-starred", lambda: UnaryOp("-", Starred(a)), ValueError,
     "UnaryOp.operand cannot be the starred item *a: a star stands only before an item of a "
     "list or tuple or a positional argument of a call"),
    ("binop-and", lambda: BinOp("&", a, b), ValueError,
     "BinOp.op is one of +, -, *, /, //, %, **, |, got '&'"),
    ("binop-starred", lambda: BinOp("+", a, Starred(b)), ValueError,
     "BinOp.right cannot be the starred item *b: a star stands only before an item of a list "
     "or tuple or a positional argument of a call"),
    ("boolop-one-value", lambda: BoolOp("and", (a,)), ValueError,
     "BoolOp.values holds at least two values, got 1"),
    ("boolop-xor", lambda: BoolOp("xor", (a, b)), ValueError,
     "BoolOp.op is one of and, or, got 'xor'"),
    ("compare-no-ops", lambda: Compare(a, (), ()), ValueError,
     "Compare needs one operator per comparator and at least one of each, got 0 operators and "
     "0 comparators"),
    ("compare-unpaired", lambda: Compare(a, ("<", "<"), (b,)), ValueError,
     "Compare needs one operator per comparator and at least one of each, got 2 operators and "
     "1 comparators"),
    ("compare-is", lambda: Compare(a, ("is",), (b,)), ValueError,
     "each of Compare.ops is one of ==, !=, <, <=, >, >=, in, not in, got 'is'"),
    ("ifexp-starred", lambda: IfExp(Starred(a), b, c), ValueError,
     "IfExp.test cannot be the starred item *a: a star stands only before an item of a list or "
     "tuple or a positional argument of a call"),
]


@pytest.mark.parametrize(("make", "error", "message"), [t[1:] for t in BAD_NODES],
                         ids=[t[0] for t in BAD_NODES])
def test_constructors_reject_trees_that_cannot_round_trip(make, error, message) -> None:
    with pytest.raises(error) as exc:
        make()
    assert str(exc.value) == message


# --- the round-trip property over random trees --------------------------------------------------

_HEAD = string.ascii_letters + "_"
IDENT = st.builds(
    str.__add__, st.sampled_from(_HEAD), st.text(_HEAD + string.digits, max_size=5)
).filter(lambda s: not keyword.iskeyword(s))
DOTTED = st.lists(IDENT, min_size=1, max_size=3).map(".".join)

LEAVES = st.one_of(
    st.builds(Name, IDENT),
    st.builds(Int, st.integers(min_value=0, max_value=MAX_INT)),
    st.builds(Float, st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)),
    st.builds(Str, st.text(max_size=6)),
    st.builds(Bool, st.booleans()),
    st.just(NoneLit()),
    st.just(Ellipsis_()),
)


def _compound(children: st.SearchStrategy[E.Node]) -> st.SearchStrategy[E.Node]:
    items = st.lists(st.one_of(children, st.builds(Starred, children)), max_size=3).map(tuple)
    kwargs = st.dictionaries(IDENT, children, max_size=2).map(lambda d: tuple(d.items()))
    pairs = st.lists(
        st.tuples(st.sampled_from(sorted(E.COMPARE_OPERATORS)), children), min_size=1, max_size=3
    )
    compare = st.builds(
        lambda left, ps: Compare(left, tuple(o for o, _ in ps), tuple(x for _, x in ps)),
        children,
        pairs,
    )
    return st.one_of(
        st.builds(Attr, children, IDENT),
        st.builds(Subscript, children, st.lists(children, min_size=1, max_size=3).map(tuple)),
        st.builds(Call, DOTTED, items, kwargs),
        st.builds(List, items),
        st.builds(Tuple, items),
        st.builds(UnaryOp, st.sampled_from(["-", "not"]), children),
        st.builds(BinOp, st.sampled_from(sorted(E.BINARY_OPERATORS)), children, children),
        st.builds(
            BoolOp,
            st.sampled_from(["and", "or"]),
            st.lists(children, min_size=2, max_size=4).map(tuple),
        ),
        compare,
        st.builds(IfExp, children, children, children),
    )


EXPRS = st.recursive(LEAVES, _compound, max_leaves=20)


# generating deep random trees is slow by Hypothesis' measure, not a problem of the code
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EXPRS)
def test_parse_of_print_is_identity(e: E.Node) -> None:
    text = unparse(e)
    assert parse(text) == e, text
    assert unparse(parse(text)) == text  # the printed form is canonical


def _preorder(e: E.Node) -> list[E.Node]:
    """Every node, pre-order, found generically from the struct fields (independent of walk)."""
    out = [e]
    for f in msgspec.structs.fields(e):
        v = getattr(e, f.name)
        for x in v if isinstance(v, tuple) else (v,):
            if isinstance(x, tuple):  # a (keyword, value) pair of Call.kwargs
                x = x[1]
            if isinstance(x, E.Node):
                out += _preorder(x)
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EXPRS)
def test_walk_and_names_visit_every_node(e: E.Node) -> None:
    assert list(walk(e)) == _preorder(e)
    assert names(e) == list(dict.fromkeys(n.id for n in walk(e) if isinstance(n, Name)))


# --- names() and walk() -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[*B, *normalized_shape]", ["B", "normalized_shape"]),
        ("Mat[trans_a, M, K]", ["Mat", "trans_a", "M", "K"]),
        ("not is_causal or S_q <= S_kv", ["is_causal", "S_q", "S_kv"]),
        ("pool.out(H_in, kH, sH, pH, dH, ceil_mode)", ["H_in", "kH", "sH", "pH", "dH",
                                                        "ceil_mode"]),
        ("per_axis(stride, 0, 2, fallback=kH)", ["stride", "kH"]),
        ("layout.max_m * E", ["layout", "E"]),
        ("M * N + M", ["M", "N"]),
        ("4 if present(w) else x", ["w", "x"]),
        ("(a, -b)[c]", ["a", "b", "c"]),
        ("1 + 2.0", []),
    ],
)
def test_names(text: str, expected: list[str]) -> None:
    assert names(parse(text)) == expected


def test_walk_is_preorder_over_every_child() -> None:
    e = parse("f(*a, k=b) + (c if d < e else [g.h, x[i]]) and not j")
    kinds = [type(n).__name__ for n in walk(e)]
    assert kinds == [
        "BoolOp",
        "BinOp", "Call", "Starred", "Name", "Name",
        "IfExp", "Compare", "Name", "Name", "Name",
        "List", "Attr", "Name", "Subscript", "Name", "Name",
        "UnaryOp", "Name",
    ]
    assert [n.id for n in walk(e) if isinstance(n, Name)] == list("abdecgxij")
