"""Loading YAML into spec Structs: file:line and the entry path in every error, duplicate
keys, the YAML 1.1 traps, schema errors in plain words, workloads and types.yaml."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from tileops.spec import (
    Expr,
    SpecLoadError,
    load_spec_file,
    load_spec_text,
    load_types_file,
    load_types_text,
)
from tileops.spec import expr as E

SPECS = Path(__file__).parent / "specs"

BASE = """\
Op:
  family: test
  status: spec-only
  signature:
    forall: {M: Dim, T: "DType[float16]"}
    params:
      flag: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[M]"}
    outputs:
      y: {dtype: T, shape: "[M]"}
  workloads:
  - {M: 2, label: small}
"""


def edit(*pairs: str) -> str:
    text = BASE
    for old, new in zip(pairs[::2], pairs[1::2], strict=True):
        assert old in text, old
        text = text.replace(old, new)
    return text


def load_error(text: str) -> SpecLoadError:
    with pytest.raises(SpecLoadError) as exc:
        load_spec_text(text, "op.yaml")
    assert len(exc.value.diagnostics) == 1
    return exc.value


# --- what loads ---------------------------------------------------------------------------------


def test_a_spec_loads_into_frozen_structs() -> None:
    spec = load_spec_text(BASE, "op.yaml")
    assert spec.path == "op.yaml"
    entry = spec.entries["Op"]
    assert entry.family == "test"
    assert entry.status == "spec-only"
    sig = entry.signature
    assert sig.forall["M"] == Expr("Dim")
    assert sig.forall["T"].node == E.Subscript(E.Name("DType"), (E.Name("float16"),))
    assert sig.params["flag"].default is False
    assert not sig.params["flag"].required
    assert sig.inputs["x"].shape.text == "[M]"
    assert sig.inputs["x"].optional == Expr("False")  # the defaults of effect fields
    assert sig.inputs["x"].mutated == Expr("False")
    assert sig.outputs["y"].alias is None
    with pytest.raises(AttributeError):
        entry.family = "other"  # type: ignore[misc]


def test_the_line_table_names_every_written_path() -> None:
    spec = load_spec_text(BASE, "op.yaml")
    assert spec.lines["Op"] == 1
    assert spec.lines["Op.status"] == 3
    assert spec.lines["Op.signature.inputs.x"] == 9
    assert spec.lines["Op.signature.inputs.x.shape"] == 9
    assert spec.lines["Op.workloads[0]"] == 13
    assert spec.line_of("Op.signature.outputs.y.shape") == 11
    # an unwritten path takes the line of its nearest written ancestor
    assert spec.line_of("Op.signature.outputs.y.alias") == 11
    assert spec.line_of("Nope") is None


def test_yaml_scalars_become_expressions() -> None:
    spec = load_spec_text(edit('x: {dtype: T, shape: "[M]"}',
                               'x: {dtype: T, shape: "[M]", mutated: true}'))
    # a YAML boolean or a non-negative int is an expression too
    assert spec.entries["Op"].signature.inputs["x"].mutated.node == E.Bool(True)
    assert spec.entries["Op"].signature.inputs["x"].mutated.text == "True"


def test_an_empty_file_has_no_entries() -> None:
    assert load_spec_text("", "empty.yaml").entries == {}
    assert load_spec_text("# only a comment\n", "empty.yaml").entries == {}


def test_workload_rows_split_reserved_keys_from_values() -> None:
    spec = load_spec_text(edit(
        "- {M: 2, label: small}",
        "- {M: 2, flag: true, label: small, dtype_cases: [{T: float16}], some: [x], "
        "layout: {masked: {max_m: 64}}, S: [1, 2]}",
    ))
    (row,) = spec.entries["Op"].workloads
    assert row.label == "small"
    assert row.dtype_cases == ({"T": "float16"},)
    assert row.some == ("x",)
    assert row.values == {"M": 2, "flag": True, "layout": {"masked": {"max_m": 64}},
                          "S": [1, 2]}
    # values are plain Python containers, not the loader's located ones
    assert type(row.values["S"]) is list
    assert type(row.values["layout"]) is dict


def test_float_written_with_a_dot_is_a_number() -> None:
    spec = load_spec_text(edit("{M: 2,", "{M: 2, eps: 1.0e-6,"))
    assert spec.entries["Op"].workloads[0].values["eps"] == 1e-6


def test_quoted_trap_words_are_strings() -> None:
    spec = load_spec_text(edit("{M: 2,", "{M: 2, a: 'no', b: \"1e-6\", c: 'on',"))
    values = spec.entries["Op"].workloads[0].values
    assert (values["a"], values["b"], values["c"]) == ("no", "1e-6", "on")


def test_plain_numbers_stay_numbers() -> None:
    spec = load_spec_text(edit("{M: 2,", "{M: 0, a: 10, b: 0x10, c: 1_000, d: -7,"))
    values = spec.entries["Op"].workloads[0].values
    assert (values["M"], values["a"], values["b"], values["c"], values["d"]) == \
        (0, 10, 16, 1000, -7)


def test_what_is_not_a_regular_utf8_file_is_refused_by_name(tmp_path: Path) -> None:
    """A FIFO would block and a device never end: refused before any read; bytes that are not
    UTF-8 and characters YAML forbids are diagnostics with the line, not tracebacks."""
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"Op:\n  family: \xff\xfe\n")
    control = tmp_path / "control.yaml"
    control.write_bytes(b"Op:\n  family: a\x07b\n")
    for p, message in [
        (fifo, "not a regular file (a spec is read from a file, not a FIFO, device or socket)"),
        (zero, "not a regular file (a spec is read from a file, not a FIFO, device or socket)"),
        (binary, "2: byte 14 (b'\\xff') is not UTF-8; a spec file is UTF-8 text"),
        (control, "2: the file holds the character '\\x07', which YAML does not allow (a "
                  "control character)"),
    ]:
        with pytest.raises(SpecLoadError) as exc:
            load_spec_file(p)
        assert str(exc.value) == f"{p}:{message}" if message[0].isdigit() else \
            str(exc.value) == f"{p}: {message}"


def test_load_spec_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "norm.yaml"
    p.write_text(edit("status: spec-only", "status: spec-onl"), encoding="utf-8")
    with pytest.raises(SpecLoadError) as exc:
        load_spec_file(p)
    assert str(exc.value) == (
        f"{p}:3: in Op.status: invalid value 'spec-onl'; expected one of: 'implemented', "
        f"'spec-only', 'planned'"
    )


# --- errors: each names file:line, the entry path and what to write ------------------------------

ERRORS = [
    pytest.param(
        edit("  status: spec-only", "  status: spec-only\n  stauts: x"),
        "op.yaml:4: in Op: unknown field 'stauts'; expected one of: family, status, signature, "
        "ref_api, doc, workloads, roofline, composition, backward",
        id="unknown-field-entry",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', 'x: {dtype: T, shape: "[M]", optinal: true}'),
        "op.yaml:9: in Op.signature.inputs.x: unknown field 'optinal'; expected one of: dtype, "
        "shape, optional, mutated, write_only, values, device, shape_only, doc",
        id="unknown-field-input",
    ),
    pytest.param(
        edit("    forall:", "    foral: {}\n    forall:"),
        "op.yaml:5: in Op.signature: unknown field 'foral'; expected one of: forall, params, "
        "inputs, outputs, types, let, shape_rules, data",
        id="unknown-field-signature",
    ),
    pytest.param(
        edit("default: false}", "default: false, kwonly: true}"),
        "op.yaml:7: in Op.signature.params.flag: unknown field 'kwonly'; expected one of: type, "
        "default, kw_only, doc",
        id="unknown-field-param",
    ),
    pytest.param(
        edit('y: {dtype: T, shape: "[M]"}', 'y: {dtype: T, shape: "[M]", aliased: x}'),
        "op.yaml:11: in Op.signature.outputs.y: unknown field 'aliased'; expected one of: "
        "dtype, shape, nullable, returned, alias, buffer, doc",
        id="unknown-field-output",
    ),
    pytest.param(
        edit("    forall:", "    types:\n      Mat:\n        params: {t: Bool}\n        match: t\n"
             "        cases:\n        - {when: true, is: \"[M]\", si: 1}\n    forall:"),
        "op.yaml:10: in Op.signature.types.Mat.cases[0]: unknown field 'si'; expected one of: "
        "when, is",
        id="unknown-field-family-case",
    ),
    pytest.param(
        BASE + "  roofline: {flops: M, byte: M}\n",
        "op.yaml:14: in Op.roofline: unknown field 'byte'; expected one of: flops, bytes, doc",
        id="unknown-field-roofline",
    ),
    pytest.param(
        edit("  family: test\n", ""),
        "op.yaml:1: in Op: missing required field 'family'",
        id="missing-field-entry",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', 'x: {shape: "[M]"}'),
        "op.yaml:9: in Op.signature.inputs.x: missing required field 'dtype'",
        id="missing-field-input",
    ),
    pytest.param(
        BASE + "  composition: {stages: [{name: a}]}\n",
        "op.yaml:14: in Op.composition.stages[0]: missing required field 'op'",
        id="missing-field-stage",
    ),
    pytest.param(
        BASE + '  roofline: {bytes: "M"}\n',
        "op.yaml:14: in Op.roofline: missing required field 'flops'",
        id="missing-field-roofline",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', 'x: {dtype: T, shape: "[M"}'),
        "op.yaml:9: in Op.signature.inputs.x.shape: cannot parse '[M' at column 1: '[' was never "
        "closed",
        id="bad-expression-syntax",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', 'x: {dtype: T, shape: "[m for m in M]"}'),
        "op.yaml:9: in Op.signature.inputs.x.shape: cannot parse '[m for m in M]' at column 1: "
        "comprehensions are not part of the language",
        id="bad-expression-construct",
    ),
    pytest.param(
        edit("M: Dim,", 'M: "Dim[",'),
        "op.yaml:5: in Op.signature.forall.M: cannot parse 'Dim[' at column 4: '[' was never "
        "closed",
        id="bad-expression-forall",
    ),
    pytest.param(
        edit("    outputs:", '    shape_rules: ["M >"]\n    outputs:'),
        "op.yaml:10: in Op.signature.shape_rules[0]: cannot parse 'M >': invalid syntax",
        id="bad-expression-shape-rule",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', "x: {dtype: T, shape: [M]}"),
        "op.yaml:9: in Op.signature.inputs.x.shape: expected an expression string, got a YAML "
        "list; quote it: '[M]'",
        id="expression-as-yaml-list",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', "x: {dtype: T, shape: 1.5}"),
        "op.yaml:9: in Op.signature.inputs.x.shape: expected an expression string, got float 1.5",
        id="expression-as-float",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', "x: {dtype: T, shape: {M: 1}}"),
        "op.yaml:9: in Op.signature.inputs.x.shape: expected an expression string, got a mapping",
        id="expression-as-mapping",
    ),
    pytest.param(
        edit("status: spec-only", "status: done"),
        "op.yaml:3: in Op.status: invalid value 'done'; expected one of: 'implemented', "
        "'spec-only', 'planned'",
        id="bad-status",
    ),
    pytest.param(
        edit('y: {dtype: T, shape: "[M]"}', 'y: {dtype: T, shape: "[M]", alias: 3}'),
        "op.yaml:11: in Op.signature.outputs.y.alias: expected string or null, got integer",
        id="wrong-type-alias",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', 'x: {dtype: T, shape: "[M]", write_only: "yes"}'),
        "op.yaml:9: in Op.signature.inputs.x.write_only: expected boolean, got string",
        id="wrong-type-write-only",
    ),
    pytest.param(
        edit("  workloads:\n  - {M: 2, label: small}", "  workloads: {M: 2}"),
        "op.yaml:12: in Op.workloads: workloads is a list of rows",
        id="workloads-not-a-list",
    ),
    pytest.param(
        edit("- {M: 2, label: small}", "- 3"),
        "op.yaml:13: in Op.workloads[0]: a workload row is a mapping, got int",
        id="workload-row-not-a-mapping",
    ),
    pytest.param(
        edit("{M: 2, label: small}", "{M: 2}"),
        "op.yaml:13: in Op.workloads[0]: missing required field 'label'",
        id="workload-without-label",
    ),
    pytest.param(
        edit("{M: 2, label: small}", "{M: 2, label: 3}"),
        "op.yaml:13: in Op.workloads[0].label: expected string, got integer",
        id="workload-label-not-a-string",
    ),
    pytest.param(
        edit("{M: 2, label: small}", "{M: 2, label: s, dtype_cases: {T: float16}}"),
        "op.yaml:13: in Op.workloads[0].dtype_cases: expected list, got mapping",
        id="workload-dtype-cases-not-a-list",
    ),
    pytest.param(
        edit("{M: 2, label: small}", "{M: 2, label: s, some: x}"),
        "op.yaml:13: in Op.workloads[0].some: expected list, got string",
        id="workload-some-not-a-list",
    ),
    pytest.param(
        "- a\n- b\n",
        "op.yaml:1: a spec file is a mapping of op name -> entry",
        id="file-not-a-mapping",
    ),
    pytest.param("Op: 3\n", "op.yaml:1: in Op: an entry is a mapping, got int",
                 id="entry-not-a-mapping"),
    pytest.param(
        '"my op":\n  family: x\n',
        "op.yaml:1: in my op: an op name is a Python class name, got 'my op'",
        id="op-name-not-an-identifier",
    ),
]


@pytest.mark.parametrize(("text", "message"), ERRORS)
def test_schema_errors(text: str, message: str) -> None:
    err = load_error(text)
    assert str(err) == message
    assert err.diagnostics[0].rule == "schema"


# --- YAML-level errors: duplicate keys, traps, syntax -------------------------------------------

YAML_ERRORS = [
    pytest.param(
        edit("    outputs:", '    outputs:\n      y: {dtype: T, shape: "[M, M]"}'),
        "op.yaml:12: in Op.signature.outputs.y: duplicate key 'y' (first written at line 11); "
        "YAML would silently keep only the last one",
        id="duplicate-key",
    ),
    pytest.param(
        BASE + BASE,
        "op.yaml:14: in Op: duplicate key 'Op' (first written at line 1); YAML would silently "
        "keep only the last one",
        id="duplicate-entry",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', 'x: {dtype: T, dtype: T, shape: "[M]"}'),
        "op.yaml:9: in Op.signature.inputs.x.dtype: duplicate key 'dtype' (first written at "
        "line 9); YAML would silently keep only the last one",
        id="duplicate-key-flow",
    ),
    pytest.param(
        edit("{M: 2,", "{M: 1e-6,"),
        "op.yaml:13: in Op.workloads[0].M: 1e-6 is read by YAML as the string '1e-6', not a "
        "number; write 1.0e-6 (YAML 1.1 needs a dot in the mantissa), or quote it if a string "
        "is meant",
        id="float-trap",
    ),
    pytest.param(
        edit("{M: 2,", "{M: 2, eps: 3E+5,"),
        "op.yaml:13: in Op.workloads[0].eps: 3E+5 is read by YAML as the string '3E+5', not a "
        "number; write 3.0e+5 (YAML 1.1 needs a dot in the mantissa), or quote it if a string "
        "is meant",
        id="float-trap-upper",
    ),
    pytest.param(
        edit("{M: 2,", "{M: 2, layout: {masked: {max_m: 1e3}},"),
        "op.yaml:13: in Op.workloads[0].layout.masked.max_m: 1e3 is read by YAML as the string "
        "'1e3', not a number; write 1.0e3 (YAML 1.1 needs a dot in the mantissa), or quote it if "
        "a string is meant",
        id="float-trap-nested",
    ),
    pytest.param(
        edit("default: false", "default: no"),
        "op.yaml:7: in Op.signature.params.flag.default: 'no' is read by YAML as the boolean "
        "False; write true or false for a boolean, or quote it ('no') for a string",
        id="no-as-bool-param-default",
    ),
    pytest.param(
        edit("{M: 2,", "{M: 2, flag: off,"),
        "op.yaml:13: in Op.workloads[0].flag: 'off' is read by YAML as the boolean False; write "
        "true or false for a boolean, or quote it ('off') for a string",
        id="off-as-bool-param-in-workload",
    ),
    pytest.param(
        edit("{M: 2,", "{M: 2, flag: yes,"),
        "op.yaml:13: in Op.workloads[0].flag: 'yes' is read by YAML as the boolean True; write "
        "true or false for a boolean, or quote it ('yes') for a string",
        id="yes-as-bool-param-in-workload",
    ),
    pytest.param(
        edit("{M: 2,", "{M: 010,"),
        "op.yaml:13: in Op.workloads[0].M: 010 is read by YAML 1.1 as the octal number 8; write "
        "it without the leading 0, or quote it for a string",
        id="octal-int",
    ),
    pytest.param(
        edit("{M: 2,", "{M: 1:30,"),
        "op.yaml:13: in Op.workloads[0].M: 1:30 is read by YAML 1.1 as a base-60 number (90); "
        "write the number itself, or quote it for a string",
        id="base-60-int",
    ),
    pytest.param(
        edit("{M: 2,", "{M: 2, eps: 1:30.5,"),
        "op.yaml:13: in Op.workloads[0].eps: 1:30.5 is read by YAML 1.1 as a base-60 number; "
        "write the number itself, or quote it for a string",
        id="base-60-float",
    ),
    pytest.param(
        edit("family: test", "family: On"),
        "op.yaml:2: in Op.family: 'On' is read by YAML as the boolean True; write true or false "
        "for a boolean, or quote it ('On') for a string",
        id="on-as-string",
    ),
    pytest.param(
        edit("family: test", "family: no"),
        "op.yaml:2: in Op.family: 'no' is read by YAML as the boolean False; write true or false "
        "for a boolean, or quote it ('no') for a string",
        id="no-as-string",
    ),
    pytest.param(
        edit("  - {M: 2, label: small}", "  - {M: 2, label: small, some: [yes]}"),
        "op.yaml:13: in Op.workloads[0].some[0]: 'yes' is read by YAML as the boolean True; "
        "write true or false for a boolean, or quote it ('yes') for a string",
        id="yes-in-a-list",
    ),
    pytest.param(
        "? [a, b]\n: 1\n",
        "op.yaml:1: a mapping key must be a scalar, got a list",
        id="non-scalar-key",
    ),
    pytest.param(
        edit('x: {dtype: T, shape: "[M]"}', 'x: {dtype: T, shape: "[M]"'),
        # libyaml's wording where PyYAML has it (the loader's parser), else PyYAML's own
        "op.yaml:10: YAML syntax: while parsing a flow mapping did not find expected ',' or "
        "'}'" if yaml.__with_libyaml__ else
        "op.yaml:10: YAML syntax: while parsing a flow mapping expected ',' or '}', but got "
        "'<scalar>'",
        id="yaml-syntax",
    ),
]


@pytest.mark.parametrize(("text", "message"), YAML_ERRORS)
def test_yaml_errors(text: str, message: str) -> None:
    err = load_error(text)
    assert str(err) == message
    assert err.diagnostics[0].rule == "yaml"


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "Yes", "NO", "ON", "Off"])
def test_every_yaml11_bool_word_is_caught(word: str) -> None:
    err = load_error(edit("default: false", f"default: {word}"))
    assert err.diagnostics[0].line == 7
    assert err.diagnostics[0].path == "Op.signature.params.flag.default"
    assert f"quote it ('{word}')" in err.diagnostics[0].message


def test_y_and_n_stay_strings() -> None:
    # PyYAML resolves only yes/no/on/off (any case) to booleans, not the single letters
    spec = load_spec_text(edit("{M: 2,", "{M: 2, a: y, b: n,"))
    assert spec.entries["Op"].workloads[0].values["a"] == "y"
    assert spec.entries["Op"].workloads[0].values["b"] == "n"


@pytest.mark.parametrize("word", ["true", "false", "True", "FALSE"])
def test_true_and_false_are_booleans(word: str) -> None:
    spec = load_spec_text(edit("default: false", f"default: {word}"))
    assert spec.entries["Op"].signature.params["flag"].default is (word.lower() == "true")


# --- types.yaml ---------------------------------------------------------------------------------


def test_types_file_loads_adts_with_constructors_and_lines() -> None:
    types, lines = load_types_file(SPECS / "types.yaml")
    layout = types.adts["MGroupedLayout"]
    assert list(layout.constructors) == ["contiguous", "masked"]
    contiguous = layout.constructors["contiguous"]
    assert contiguous.python == "tileops.ops.moe.ContiguousLayoutSpec"
    assert contiguous.fields["alignment"] == Expr("Dim")
    assert contiguous.fields["packing"] == Expr("'tight' | 'aligned'")
    assert contiguous.invariant is not None
    assert contiguous.invariant.names() == ["packing", "alignment"]
    assert layout.constructors["masked"].invariant is None
    assert lines["adts.MGroupedLayout"] == 4
    assert lines["adts.MGroupedLayout.constructors.masked.fields"] == 16
    assert msgspec.structs.asdict(layout.constructors["masked"])["python"] == (
        "tileops.ops.moe.MaskedLayoutSpec"
    )


def test_types_file_errors_have_lines_and_paths() -> None:
    text = (SPECS / "types.yaml").read_text(encoding="utf-8")
    bad = text.replace("        fields: {max_m: Dim}", "        fields: {max_m: Dim}\n        feilds: {}")
    with pytest.raises(SpecLoadError) as exc:
        load_types_text(bad, "types.yaml")
    assert str(exc.value) == (
        "types.yaml:17: in adts.MGroupedLayout.constructors.masked: unknown field 'feilds'; "
        "expected one of: python, fields, invariant, doc"
    )
    with pytest.raises(SpecLoadError) as exc:
        load_types_text(text.replace("alignment: Dim", "alignment: Dim\n          packing: Dim"),
                        "types.yaml")
    assert str(exc.value) == (
        "types.yaml:13: in adts.MGroupedLayout.constructors.contiguous.fields.packing: duplicate "
        "key 'packing' (first written at line 10); YAML would silently keep only the last one"
    )


def test_empty_types_file() -> None:
    types, lines = load_types_text("", "types.yaml")
    assert types.adts == {}


def test_a_files_workloads_are_bounded_together() -> None:
    """Each entry may expand to MAX_WORKLOADS, but the validator instantiates every workload
    of the file: many entries each using a large grid are refused by the file's bound, in
    well under a second, at the entry that passes it."""
    import time

    from tileops.spec.bounds import MAX_FILE_WORKLOADS

    rows = "".join(f"        - {{n: {i + 1}, label: r{i}}}\n" for i in range(1000))
    entry = (
        "Op{k}:\n  family: misc\n  signature:\n    forall: {{N: Dim, T: \"DType[float32]\"}}\n"
        "    inputs:\n      x: {{dtype: T, shape: \"[N]\"}}\n    outputs:\n"
        "      y: {{dtype: T, shape: \"[N]\"}}\n  workloads:\n"
        + "".join(f"  - {{{{grid: g, map: {{{{N: n}}}}, label: \"k{j}-{{{{label}}}}\"}}}}\n"
                  for j in range(3)))
    n = MAX_FILE_WORKLOADS // 3000 + 1
    text = ("families:\n  misc:\n    status: spec-only\n    grids:\n      g:\n        rows:\n"
            + rows + "".join(entry.format(k=k) for k in range(n)))
    start = time.perf_counter()
    with pytest.raises(SpecLoadError) as exc:
        load_spec_text(text, "many.yaml")
    assert time.perf_counter() - start < 1.0
    (d,) = exc.value.diagnostics
    assert str(d).startswith(f"many.yaml:{text.count(chr(10), 0, text.index(f'Op{n - 1}:')) + 9}"
                             f": in Op{n - 1}.workloads: the file's entries expand to more than "
                             f"{MAX_FILE_WORKLOADS} workloads")
    # one entry fewer is a file of its bound
    fewer = text[:text.index(f"Op{n - 1}:")]
    assert sum(len(e.workloads) for e in load_spec_text(fewer, "many.yaml").entries.values()) \
        == 3000 * (n - 1)


def test_a_yaml_trap_is_its_entrys_error_and_hides_no_other() -> None:
    """Every trap of an entry is reported, the entry is not converted, and the file's other
    entries load (or report their own errors) as they would without it."""
    from tileops.spec.loader import load_spec_entries

    good = BASE
    trapped = BASE.replace("Op:", "Bad:").replace("{M: 2,", "{M: 010, flag: yes,").replace(
        "status: spec-only", "status: spec-only\n  status: planned")
    broken = BASE.replace("Op:", "Broken:").replace("status: spec-only", "status: spec-onl")
    spec, errors = load_spec_entries(good + trapped + broken, "op.yaml")
    assert list(spec.entries) == ["Op"]
    assert [(d.rule, d.path) for d in errors] == [
        ("yaml", "Bad.status"), ("yaml", "Bad.workloads[0].M"), ("yaml", "Bad.workloads[0].flag"),
        ("schema", "Broken.status")]
    # outside the entries, a trap is the file's error
    with pytest.raises(SpecLoadError) as exc:
        load_spec_entries("families: {misc: {status: yes}}\n" + good, "op.yaml")
    assert [d.path for d in exc.value.diagnostics] == ["families.misc.status"]
