"""Specs are input: every hostile spec is accepted or refused within a second, with a
``file:line`` error, never a hang, ``RecursionError`` or ``MemoryError`` (the bounds of
:mod:`tileops.spec.bounds`). The ``bounds`` rule's cases are here too."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.spec import EvalError, ExprSyntaxError, Scope, SpecError, evaluate, parse_expr
from tileops.spec.bounds import (
    MAX_EXPR_CHARS,
    MAX_EXPR_DEPTH,
    MAX_INT,
    MAX_SEQUENCE,
    MAX_SPEC_BYTES,
    int_in_range,
)
from tileops.spec.evaluate import BoundError
from tileops.spec.loader import load_spec_file, load_spec_text

from .validate_base import FLOPS, OUT, ROW, diagnostics, edit, shown

#: Generous for a 2-core CI machine: every case here takes milliseconds on a laptop.
SECOND = 1.0


def timed(fn: Callable[[], object]) -> object:
    """``fn()``'s result or the SpecError it raised, asserting it came within SECOND."""
    start = time.perf_counter()
    try:
        result: object = fn()
    except SpecError as err:
        result = err
    elapsed = time.perf_counter() - start
    assert elapsed < SECOND, f"took {elapsed:.2f} s"
    return result


# --- the `bounds` rule: constant parts of an expression ---------------------------------------

PASSING = {
    "bounds": [
        ("largest-int", edit(FLOPS, 'flops: "M * 2 ** 62 + (2 ** 62 - 1) * 2"')),
        ("negative-power", edit(FLOPS, 'flops: "M * 2 ** -1000"')),
    ],
}

FAILING = [
    pytest.param(
        edit(FLOPS, 'flops: "9 ** 9 ** 9 ** 9"'),
        [("bounds", "op.yaml:15: in Op.roofline.flops: '9 ** 9 ** 9 ** 9': 9 ** 9 ** 9: "
                    "9 ** 387420489 exceeds 9223372036854775807 (2**63 - 1), the largest "
                    "integer a spec may compute")],
        id="bounds:power-tower",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M * (2 ** 62 + 2 ** 62)"'),
        [("bounds", "op.yaml:15: in Op.roofline.flops: 'M * (2 ** 62 + 2 ** 62)': "
                    "2 ** 62 + 2 ** 62: the value exceeds 9223372036854775807 (2**63 - 1), "
                    "the largest integer a spec may compute")],
        id="bounds:sum",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "10.0 ** 400 * M"'),
        [("bounds", "op.yaml:15: in Op.roofline.flops: '10.0 ** 400 * M': 10.0 ** 400: "
                    "the result is too large for a float")],
        id="bounds:float-overflow",
    ),
    pytest.param(
        edit(OUT, '    let: {P: "M + 2 ** 64"}\n' + OUT),
        [("bounds", "op.yaml:10: in Op.signature.let.P: 'M + 2 ** 64': 2 ** 64: 2 ** 64 "
                    "exceeds 9223372036854775807 (2**63 - 1), the largest integer a spec may "
                    "compute"),
         ("workload", "op.yaml:14: in Op.workloads[0].dtype_cases[0]: workload 'small': let "
                      "P = M + 2 ** 64: 2 ** 64: 2 ** 64 exceeds 9223372036854775807 "
                      "(2**63 - 1), the largest integer a spec may compute")],
        id="bounds:let",
    ),
]


@pytest.mark.parametrize("text", [pytest.param(t, id=f"{r}:{n}")
                                  for r, cases in PASSING.items() for n, t in cases])
def test_passing(text: str) -> None:
    assert timed(lambda: shown(diagnostics(text))) == []


@pytest.mark.parametrize(("text", "expected"), FAILING)
def test_failing(text: str, expected: list[tuple[str, str]]) -> None:
    assert timed(lambda: shown(diagnostics(text))) == expected


def test_a_row_that_computes_beyond_the_bounds_is_a_workload_error() -> None:
    text = edit(OUT, '    let: {P: "M ** 99999999"}\n' + OUT)
    assert timed(lambda: shown(diagnostics(text))) == [(
        "workload", "op.yaml:14: in Op.workloads[0].dtype_cases[0]: workload 'small': let P = "
        "M ** 99999999: M ** 99999999: 2 ** 99999999 exceeds 9223372036854775807 (2**63 - 1), "
        "the largest integer a spec may compute")]


# --- hostile texts: refused by the loader or the parser, at their line ------------------------


def _alias_bomb() -> str:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, cur in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _deep_block(depth: int) -> str:
    return "".join(f"{' ' * i}k{i}:\n" for i in range(depth)) + " " * depth + "v\n"


HOSTILE = [
    pytest.param(_alias_bomb(), "op.yaml:6: with its aliases expanded, the YAML here has more "
                 "than 200000 nodes", id="alias-bomb"),
    pytest.param("a: &a [1, *a]\n", "op.yaml:1: an alias names a node that contains it",
                 id="recursive-alias"),
    pytest.param("a: " + "[" * 10_000 + "]" * 10_000 + "\n",
                 "op.yaml:1: the YAML nests deeper than 64 levels", id="deep-flow-list"),
    pytest.param("a: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n",
                 "op.yaml:1: the YAML nests deeper than 64 levels", id="deep-flow-mapping"),
    pytest.param(_deep_block(100), "op.yaml:64: the YAML nests deeper than 64 levels",
                 id="deep-block"),
    pytest.param("a: &a [[[[[[[[[[1]]]]]]]]]]\n"
                 + "".join(f"b{i}: &b{i} [*{'a' if i == 0 else f'b{i - 1}'}]\n"
                           for i in range(60)),
                 "op.yaml:55: with its aliases expanded, the YAML here nests deeper than 64 "
                 "levels", id="deep-through-aliases"),
    pytest.param("a: 1\n" + "#" * MAX_SPEC_BYTES + "\n",
                 "op.yaml:2: the file is 262150 bytes; a spec file is at most 262144",
                 id="file-size"),
    pytest.param("a: " + "9" * 10_000 + "\n",
                 "op.yaml:1: in a: an integer is at most 9223372036854775807 (2**63 - 1), got "
                 "9999999999999999999999999999999999999999...", id="huge-yaml-int"),
    pytest.param(edit(ROW, "{M: 9223372036854775808, N: 3,"),
                 "op.yaml:13: in Op.workloads[0].M: an integer is at most 9223372036854775807 "
                 "(2**63 - 1), got 9223372036854775808", id="workload-int"),
    pytest.param(edit(FLOPS, 'flops: "' + "9" * 5000 + '"'),
                 "op.yaml:15: in Op.roofline.flops: cannot parse '" + "9" * 60 + "...': the "
                 "expression is 5000 characters long; at most 1000 are allowed (split it into "
                 "lets)", id="huge-constant"),
    pytest.param(edit(FLOPS, 'flops: "M * ' + "9" * 40 + '"'),
                 "op.yaml:15: in Op.roofline.flops: cannot parse 'M * " + "9" * 40 + "' at "
                 "column 5: an integer literal is at most 9223372036854775807 (2**63 - 1)",
                 id="big-literal"),
    pytest.param(edit(FLOPS, 'flops: "' + "-" * 10_000 + 'M"'),
                 "op.yaml:15: in Op.roofline.flops: cannot parse '" + "-" * 60 + "...': the "
                 "expression is 10001 characters long; at most 1000 are allowed (split it into "
                 "lets)", id="10k-deep-expression"),
    pytest.param(edit(FLOPS, 'flops: "' + " * ".join(["M"] * 60) + '"'),
                 "op.yaml:15: in Op.roofline.flops: cannot parse '" + ("M * " * 15)[:60]
                 + "...' at column 41: the expression nests deeper than 50 levels (split it "
                 "into lets)", id="long-chain"),
    pytest.param(edit(OUT, '    let: {P: "' + "[" * 60 + "M" + "]" * 60 + '"}\n' + OUT),
                 "op.yaml:10: in Op.signature.let.P: cannot parse '" + "[" * 60 + "...' at "
                 "column 51: the expression nests deeper than 50 levels (split it into lets)",
                 id="deep-list-expression"),
]


@pytest.mark.parametrize(("text", "message"), HOSTILE)
def test_hostile_spec_is_refused_at_its_line(text: str, message: str) -> None:
    err = timed(lambda: load_spec_text(text, "op.yaml"))
    assert isinstance(err, SpecError)
    assert str(err) == message


def test_a_file_too_large_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("a: 1\n" * (MAX_SPEC_BYTES // 5 + 1), encoding="utf-8")
    err = timed(lambda: load_spec_file(big))
    assert str(err) == f"{big}: the file is {big.stat().st_size} bytes; a spec file is at most " \
                       f"{MAX_SPEC_BYTES}"


def test_an_expression_at_the_bounds_is_accepted() -> None:
    chain = " + ".join(["M"] * MAX_EXPR_DEPTH)  # a left-leaning chain of depth 50
    assert len(chain) <= MAX_EXPR_CHARS
    assert timed(lambda: shown(diagnostics(edit(FLOPS, f'flops: "{chain}"')))) == []
    assert evaluate(parse_expr(str(MAX_INT)), Scope({})) == MAX_INT


# --- the evaluator (what op construction uses) ------------------------------------------------


@pytest.mark.parametrize(("text", "values", "message"), [
    ("9 ** 9 ** 9", {}, "9 ** 9 ** 9: 9 ** 387420489 exceeds 9223372036854775807 (2**63 - 1), "
     "the largest integer a spec may compute"),
    ("M ** N", {"M": -3, "N": 10**9}, "M ** N: -3 ** 1000000000 exceeds 9223372036854775807 "
     "(2**63 - 1), the largest integer a spec may compute"),
    ("M * M", {"M": 2**40}, "M * M: the value exceeds 9223372036854775807 (2**63 - 1), the "
     "largest integer a spec may compute"),
    ("S * N", {"S": (1, 2), "N": 10**12}, "S * N: '*' multiplies numbers; a tuple cannot be "
     "repeated"),
    ("m * N", {"m": "ab", "N": 10**12}, "m * N: '*' multiplies numbers; a str cannot be "
     "repeated"),
    ("X ** 0.5", {"X": -8}, "X ** 0.5: the value is a complex number"),
    ("X * 1.0e308", {"X": 10.0}, "X * 1e+308: the value is inf, not a finite number"),
    ("prod(S)", {"S": (2**32, 2**32)}, "prod(S): the value exceeds 9223372036854775807 "
     "(2**63 - 1), the largest integer a spec may compute"),
    ("[*S, *S, *S]", {"S": tuple(range(MAX_SEQUENCE // 2))}, "[*S, *S, *S]: the value has "
     "6291456 items; at most 4194304 are allowed"),
])
def test_the_evaluator_refuses_before_computing(text: str, values: dict, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(BoundError) as info:
        evaluate(parse_expr(text), Scope(values))
    assert time.perf_counter() - start < SECOND
    assert str(info.value) == message


@pytest.mark.parametrize(("text", "message"), [
    ("arange(N)", "arange(N): arange would build 1000000000000 items; at most 4194304 are "
     "allowed"),
    ("full(N, 1)", "full(N, 1): full would build 1000000000000 items; at most 4194304 are "
     "allowed"),
    ("balanced_sizes(N, N)", "balanced_sizes(N, N): balanced_sizes would build 1000000000000 "
     "items; at most 4194304 are allowed"),
])
def test_generators_refuse_a_length_beyond_the_bound(text: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(EvalError) as info:
        evaluate(parse_expr(text), Scope({"N": 10**12}, generators=True))
    assert time.perf_counter() - start < SECOND
    assert str(info.value) == message


# --- spaces of inputs -------------------------------------------------------------------------

_LEAF = st.sampled_from(["M", "N", "2", "9", "3.5", "0", "S"])
_WRAP = st.sampled_from(["-({})", "({})", "[{}]", "not ({})", "({}) ** ({})", "({}) * ({})",
                         "({}) + ({})", "({}) // ({})", "max({}, {})", "prod([{}])",
                         "({}) if ({}) else ({})", "[*S, {}]", "({}) < ({})"])


@st.composite
def _texts(draw) -> str:
    """Random expression texts from a few to thousands of levels deep."""
    text = draw(_LEAF)
    for _ in range(draw(st.integers(0, 300))):
        form = draw(_WRAP)
        args = [text] + [draw(_LEAF) for _ in range(form.count("{}") - 1)]
        if draw(st.booleans()):
            args.reverse()
        text = form.format(*args)
        if len(text) > 4 * MAX_EXPR_CHARS:
            break
    return text


@settings(max_examples=100, deadline=None)
@given(_texts())
def test_random_expressions_are_bounded(text: str) -> None:
    """Any expression, however deep, parses or is refused by name, and its value is within
    the bounds or refused, each well within the time bound."""
    start = time.perf_counter()
    try:
        node = parse_expr(text)
    except ExprSyntaxError as err:
        assert err.reason.startswith(("the expression is", "the expression nests deeper"))
    else:
        try:
            v = evaluate(node, Scope({"M": 7, "N": 2**31, "S": (3, 4)}))
        except EvalError:
            pass
        else:
            assert not isinstance(v, int) or int_in_range(v)
    assert time.perf_counter() - start < SECOND
