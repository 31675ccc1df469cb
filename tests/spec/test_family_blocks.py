"""Family-level spec pieces: a ``families:`` block's status and workload grids, grid items
expanded into an entry's workloads at load time (values, labels, lines), the errors of a
family block or a grid reference with their file:line, and the shipped norm specs, whose
three entries share one grid and expand to exactly the workloads they wrote out before."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.spec import SpecLoadError, Workload, load_spec_file, load_spec_text
from tileops.spec import validate_spec_file as validate

NORM_YAML = Path(__file__).resolve().parents[2] / "packages/ops/src/tileops/ops/specs/norm.yaml"

# Line numbers in the expected messages refer to BASE as edited.
BASE = """\
families:
  test:
    status: spec-only
    grids:
      g:
        rows:
        - {m: 2, n: 3, dtype_cases: [{T: float16}], label: small}
        - {m: 4, n: 5, dtype_cases: [{T: float16}, {T: bfloat16}], label: big}
Op:
  family: test
  signature:
    forall: {B: Shape, N: Dim, T: "DType[float16 | bfloat16]"}
    params:
      flag: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[*B, N]"}
    outputs:
      y: {dtype: T, shape: "[*B, N]"}
    let: {L: "N + 1"}
  workloads:
  - grid: g
    map: {B: "[m]", N: n}
  - {B: [1], N: 1, dtype_cases: [{T: float16}], label: one}
"""
MAP = 'map: {B: "[m]", N: n}'
ROWS = ("        - {m: 2, n: 3, dtype_cases: [{T: float16}], label: small}\n"
        "        - {m: 4, n: 5, dtype_cases: [{T: float16}, {T: bfloat16}], label: big}\n")


def edit(*pairs: str) -> str:
    text = BASE
    for old, new in zip(pairs[::2], pairs[1::2], strict=True):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def load_error(text: str) -> str:
    with pytest.raises(SpecLoadError) as exc:
        load_spec_text(text, "op.yaml")
    (d,) = exc.value.diagnostics
    return f"[{d.rule}] {d}"


# --- what a family block gives its entries ----------------------------------------------------


def test_a_grid_item_expands_in_place_into_one_workload_per_row() -> None:
    spec = load_spec_text(BASE, "op.yaml")
    assert spec.entries["Op"].workloads == (
        Workload(label="small", values={"B": [2], "N": 3}, dtype_cases=({"T": "float16"},)),
        Workload(label="big", values={"B": [4], "N": 5},
                 dtype_cases=({"T": "float16"}, {"T": "bfloat16"})),
        Workload(label="one", values={"B": [1], "N": 1}, dtype_cases=({"T": "float16"},)),
    )
    assert validate(spec) == []


def test_the_family_is_kept_with_the_file_and_its_status_is_the_entries() -> None:
    spec = load_spec_text(BASE, "op.yaml")
    assert spec.entries["Op"].status == "spec-only"
    (row, _) = spec.families["test"].grids["g"].rows
    assert (row.label, row.values, row.dtype_cases) == ("small", {"m": 2, "n": 3},
                                                         ({"T": "float16"},))
    # an entry's own status wins over its family's
    own = load_spec_text(edit("  family: test\n", "  family: test\n  status: planned\n"), "op.yaml")
    assert own.entries["Op"].status == "planned"


def test_an_item_adds_values_some_dtype_cases_and_a_label_template() -> None:
    text = edit(
        ", dtype_cases: [{T: float16}], label: small}", ", label: small}",
        ", dtype_cases: [{T: float16}, {T: bfloat16}], label: big}", ", label: big}",
        "      x: {dtype: T, shape: \"[*B, N]\"}\n",
        "      x: {dtype: T, shape: \"[*B, N]\"}\n      w: {dtype: T, shape: \"[N]\", optional: true}\n",
        MAP, 'map: {B: "[m, 2 * m]", N: "n + 1"}\n    flag: true\n    some: [w]\n'
             "    dtype_cases: [{T: bfloat16}]\n    label: \"{label}-m{m}-n{n}\"")
    spec = load_spec_text(text, "op.yaml")
    assert spec.entries["Op"].workloads[:2] == (
        Workload(label="small-m2-n3", values={"B": [2, 4], "N": 4, "flag": True},
                 dtype_cases=({"T": "bfloat16"},), some=("w",)),
        Workload(label="big-m4-n5", values={"B": [4, 8], "N": 6, "flag": True},
                 dtype_cases=({"T": "bfloat16"},), some=("w",)),
    )
    assert validate(spec) == []


def test_each_path_of_an_expanded_workload_is_on_the_line_that_wrote_it() -> None:
    lines = load_spec_text(BASE, "op.yaml").lines
    assert {p: n for p, n in lines.items() if p.startswith("Op.workloads[1]")} == {
        "Op.workloads[1]": 21,  # the grid item
        "Op.workloads[1].B": 22, "Op.workloads[1].N": 22,  # its map
        "Op.workloads[1].label": 8, "Op.workloads[1].dtype_cases": 8,  # the grid row
        "Op.workloads[1].dtype_cases[0]": 8, "Op.workloads[1].dtype_cases[0].T": 8,
        "Op.workloads[1].dtype_cases[1]": 8, "Op.workloads[1].dtype_cases[1].T": 8,
    }
    assert lines["Op.workloads[2]"] == 23  # the written row after the item, renumbered
    assert not any(p.startswith("Op.workloads[0].map") for p in lines)


def test_the_validator_places_errors_of_expanded_workloads_where_their_values_are_written() -> None:
    text = edit("{T: float16}, {T: bfloat16}], label: big}", "{T: float32}], label: big}",
                MAP, 'map: {B: "[m]", N: n}\n    flag: 3')
    assert [str(d) for d in validate(load_spec_text(text, "op.yaml"))] == [
        "op.yaml:23: in Op.workloads[0].flag: flag = 3 is not Bool: expected true or false",
        "op.yaml:23: in Op.workloads[1].flag: flag = 3 is not Bool: expected true or false",
        "op.yaml:8: in Op.workloads[1].dtype_cases[0]: T = 'float32' is not in"
        " DType[float16 | bfloat16]",
    ]
    text = edit(MAP, 'map: {B: m, N: n}')
    assert [str(d) for d in validate(load_spec_text(text, "op.yaml"))][0] == (
        "op.yaml:22: in Op.workloads[0].B: B = 2 is not Shape: expected a list of non-negative"
        " integers")


# --- errors in a family block or a grid reference ---------------------------------------------

ERRORS = [
    pytest.param(
        edit("  - grid: g\n", "  - grid: h\n"),
        "[schema] op.yaml:21: in Op.workloads[0].grid: unknown grid 'h' of family test; its"
        " grids: g",
        id="unknown-grid",
    ),
    pytest.param(
        edit("Op:\n  family: test", "Op:\n  family: other\n  status: planned"),
        "[schema] op.yaml:22: in Op.workloads[0].grid: unknown grid 'g': family other declares"
        " no grids (families.other.grids)",
        id="grid-of-a-family-without-a-block",
    ),
    pytest.param(
        edit(MAP, 'map: {B: "[m]", N: 3}'),
        "[schema] op.yaml:22: in Op.workloads[0].map: map does not read grid g's variable 'n';"
        " every variable of a grid feeds an index or a param of the entry",
        id="unmapped-variable",
    ),
    pytest.param(
        edit(MAP, 'map: {B: "[m]", N: n, Q: m}'),
        "[schema] op.yaml:22: in Op.workloads[0].map.Q: map feeds 'Q', which is not an index or"
        " a param of Op",
        id="map-to-an-unknown-index",
    ),
    pytest.param(
        edit(MAP, 'map: {B: "[m]", N: n, L: m}'),
        "[schema] op.yaml:22: in Op.workloads[0].map.L: map feeds 'L', which is not an index or"
        " a param of Op (let values are computed, not given)",
        id="map-to-a-let",
    ),
    pytest.param(
        edit(MAP, 'map: {B: "[mm]", N: n}'),
        "[schema] op.yaml:22: in Op.workloads[0].map.B: '[mm]': unknown name 'mm'; the"
        " variables of grid g are m, n",
        id="map-reads-an-unknown-variable",
    ),
    pytest.param(
        edit(MAP, 'map: {B: "[m", N: n}'),
        "[schema] op.yaml:22: in Op.workloads[0].map.B: cannot parse '[m' at column 1: '[' was"
        " never closed",
        id="map-expression-syntax",
    ),
    pytest.param(
        edit(MAP, "map: {B: [m], N: n}"),
        "[schema] op.yaml:22: in Op.workloads[0].map.B: expected an expression string, got a"
        " YAML list; quote it: '[m]'",
        id="map-expression-a-yaml-list",
    ),
    pytest.param(
        edit(MAP, 'map: {B: "[m // (n - 3)]", N: n}'),
        "[schema] op.yaml:22: in Op.workloads[0].map.B: '[m // (n - 3)]' for row 'small' of"
        " grid g: m // (n - 3): division by zero",
        id="map-fails-on-a-row",
    ),
    pytest.param(
        edit(f"    {MAP}\n", ""),
        "[schema] op.yaml:21: in Op.workloads[0]: missing required field 'map'",
        id="no-map",
    ),
    pytest.param(
        edit(MAP, MAP + "\n    N: 4"),
        "[schema] op.yaml:23: in Op.workloads[0].N: N is given by map and as a value; give it"
        " once",
        id="value-given-twice",
    ),
    pytest.param(
        edit(MAP, MAP + "\n    dtype_cases: [{T: float16}]"),
        "[schema] op.yaml:23: in Op.workloads[0].dtype_cases: grid g's row 'small' gives"
        " dtype_cases already; give them in the rows or in the item, not both",
        id="dtype-cases-given-twice",
    ),
    pytest.param(
        edit(MAP, MAP + '\n    label: "x-{k}"'),
        "[schema] op.yaml:23: in Op.workloads[0].label: label template 'x-{k}': 'k' is not the"
        " row's label or a variable of grid g (m, n)",
        id="label-names-an-unknown-variable",
    ),
    pytest.param(
        edit(MAP, MAP + '\n    label: "x-{m:03d}"'),
        "[schema] op.yaml:23: in Op.workloads[0].label: label template 'x-{m:03d}': a"
        " placeholder is a bare name ({label} or a grid variable), without a conversion or a"
        " format",
        id="label-with-a-format",
    ),
    pytest.param(
        edit(MAP, MAP + '\n    label: "x-{m"'),
        "[schema] op.yaml:23: in Op.workloads[0].label: label template 'x-{m': expected '}'"
        " before end of string",
        id="label-unclosed",
    ),
    pytest.param(
        edit("{m: 2, n: 3,", "{m: [2], n: 3,", MAP, 'map: {B: "m", N: n}\n    label: "{label}-{m}"'),
        "[schema] op.yaml:23: in Op.workloads[0].label: label template '{label}-{m}': m of row"
        " 'small' is [2]; a label reads only numbers and strings",
        id="label-reads-a-list",
    ),
    pytest.param(
        edit("families:\n", "families:\n  gemm: {status: implemented}\n"),
        "[schema] op.yaml:2: in families.gemm: no entry of this file has family 'gemm' (the"
        " entries' families: test)",
        id="family-block-for-no-entry",
    ),
    pytest.param(
        edit("families:\n", "families:\n  test: {status: implemented}\n"),
        "[yaml] op.yaml:3: in families.test: duplicate key 'test' (first written at line 2);"
        " YAML would silently keep only the last one",
        id="duplicate-family",
    ),
    pytest.param(
        edit("    grids:\n", "    grids:\n      g: {rows: [{m: 1, n: 1, label: a}]}\n"),
        "[yaml] op.yaml:6: in families.test.grids.g: duplicate key 'g' (first written at line"
        " 5); YAML would silently keep only the last one",
        id="duplicate-grid",
    ),
    pytest.param(
        edit("    grids:\n", "    grids:\n      h: {rows: [{m: 1, n: 1, label: a}]}\n"),
        "[schema] op.yaml:5: in families.test.grids.h: grid h of family test is expanded by no"
        " workload item",
        id="grid-expanded-by-no-item",
    ),
    pytest.param(
        edit("{m: 4, n: 5,", "{m: 4,"),
        "[schema] op.yaml:8: in families.test.grids.g.rows[1]: row 'big' gives the variables m,"
        " but the first row gives m, n; every row of a grid gives the same variables",
        id="rows-of-different-variables",
    ),
    pytest.param(
        edit("{m: 2, n: 3,", '{m: 2, n: 3, "a-b": 1,'),
        "[schema] op.yaml:7: in families.test.grids.g.rows[0].a-b: grid variable 'a-b' is not a"
        " name an expression can read",
        id="variable-not-a-name",
    ),
    pytest.param(
        edit("{m: 2, n: 3, dtype_cases: [{T: float16}], label: small}",
             "{m: 2, n: 3, dtype_cases: [{T: float16}]}"),
        "[schema] op.yaml:7: in families.test.grids.g.rows[0]: missing required field 'label'",
        id="row-without-a-label",
    ),
    pytest.param(
        edit("        rows:\n" + ROWS, "        rows: []\n"),
        "[schema] op.yaml:6: in families.test.grids.g.rows: a grid has rows: a list of at least"
        " one row of plain values",
        id="grid-without-rows",
    ),
    pytest.param(
        edit("    grids:\n      g:\n", "    grids:\n    - g:\n"),
        "[schema] op.yaml:4: in families.test.grids: grids is a mapping of grid name -> {rows:"
        " [...]}",
        id="grids-not-a-mapping",
    ),
    pytest.param(
        "families: [test]\n" + BASE.split("\n", 8)[8],
        "[schema] op.yaml:1: in families: families is a mapping of family name -> what the"
        " entries of that family share (status, grids)",
        id="families-not-a-mapping",
    ),
    pytest.param(
        edit("    status: spec-only", "    staus: spec-only"),
        "[schema] op.yaml:3: in families.test: unknown field 'staus'; expected one of: status,"
        " grids, doc",
        id="family-field-misspelt",
    ),
    pytest.param(
        edit("    status: spec-only", "    status: done"),
        "[schema] op.yaml:3: in families.test.status: invalid value 'done'; expected one of:"
        " 'implemented', 'spec-only', 'planned'",
        id="family-status-invalid",
    ),
]


@pytest.mark.parametrize(("text", "expected"), ERRORS)
def test_errors_in_a_family_block_or_a_grid_reference(text: str, expected: str) -> None:
    assert load_error(text) == expected


# --- a grid item is its rows written out ------------------------------------------------------

ENTRY = {
    "family": "test",
    "status": "planned",
    "signature": {
        "forall": {"B": "Shape", "N": "Dim", "T": "DType[float16 | bfloat16]"},
        "params": {"flag": {"type": "bool", "default": False}},
        "inputs": {"x": {"dtype": "T", "shape": "[*B, N]"}},
        "outputs": {"y": {"dtype": "T", "shape": "[*B, N]"}},
    },
}
DTYPE_CASES = st.sampled_from([[{"T": "float16"}], [{"T": "bfloat16"}, {"T": "float16"}]])


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20), DTYPE_CASES),
                     min_size=1, max_size=6))
def test_a_grid_item_loads_as_its_rows_written_out(rows) -> None:
    grid = [{"m": m, "n": n, "dtype_cases": dc, "label": f"r{i}"}
            for i, (m, n, dc) in enumerate(rows)]
    item = {"grid": "g", "map": {"B": "[m, n]", "N": "2 * n + 1"}, "flag": True,
            "label": "{label}-{m}"}
    written = [{"B": [m, n], "N": 2 * n + 1, "flag": True, "dtype_cases": dc,
                "label": f"r{i}-{m}"} for i, (m, n, dc) in enumerate(rows)]
    with_grid = yaml.safe_dump({"families": {"test": {"grids": {"g": {"rows": grid}}}},
                                "Op": {**ENTRY, "workloads": [item]}})
    out = yaml.safe_dump({"Op": {**ENTRY, "workloads": written}})
    assert load_spec_text(with_grid).entries == load_spec_text(out).entries


# --- the shipped norm specs ---------------------------------------------------------------------

# The workloads of the three norm entries as they were written out before the family block:
# (label, values, x's dtype T of each case, some), and since then each entry's row of a float32
# weight beside bfloat16 x. The grid must expand to exactly these.
TODAY = {
    "RMSNormFwdOp": [
        ("m1-n4096", {"B": [1], "normalized_shape": [4096]}, ("bfloat16",), ("weight",)),
        ("m128-n4096", {"B": [128], "normalized_shape": [4096]}, ("bfloat16",), ("weight",)),
        ("m2048-n4096", {"B": [2048], "normalized_shape": [4096]}, ("bfloat16", "float16"), ("weight",)),
        ("m32768-n4096", {"B": [32768], "normalized_shape": [4096]}, ("bfloat16", "float16"), ("weight",)),
        ("m1-n8192", {"B": [1], "normalized_shape": [8192]}, ("bfloat16",), ("weight",)),
        ("m128-n8192", {"B": [128], "normalized_shape": [8192]}, ("bfloat16",), ("weight",)),
        ("m2048-n8192", {"B": [2048], "normalized_shape": [8192]}, ("bfloat16", "float16"), ("weight",)),
        ("m32768-n8192", {"B": [32768], "normalized_shape": [8192]}, ("bfloat16", "float16"), ("weight",)),
        ("m1-n16384", {"B": [1], "normalized_shape": [16384]}, ("bfloat16",), ("weight",)),
        ("m128-n16384", {"B": [128], "normalized_shape": [16384]}, ("bfloat16",), ("weight",)),
        ("m2048-n16384", {"B": [2048], "normalized_shape": [16384]}, ("bfloat16", "float16"), ("weight",)),
        ("m32768-n16384", {"B": [32768], "normalized_shape": [16384]}, ("bfloat16", "float16"), ("weight",)),
        ("odd-n4097", {"B": [16384], "normalized_shape": [4097]}, ("bfloat16",), ("weight",)),
        ("tiny-n7", {"B": [3], "normalized_shape": [7]}, ("bfloat16", "float32"), ("weight",)),
        ("fp32-weight-n7", {"B": [3], "normalized_shape": [7]}, ("bfloat16",), ("weight",)),
        ("batch-dims-fp32", {"B": [4, 512], "normalized_shape": [4096]}, ("float32",), ("weight",)),
        ("no-weight", {"B": [2048], "normalized_shape": [4096]}, ("bfloat16",), ()),
        ("wide-n65536", {"B": [64], "normalized_shape": [65536]}, ("bfloat16",), ("weight",)),
        ("decode-eps", {"B": [1], "normalized_shape": [4096], "eps": 1e-06}, ("bfloat16",), ("weight",)),
    ],
    "FusedAddRMSNormFwdOp": [
        ("m1-n4096", {"B": [1], "N": 4096}, ("bfloat16",), ("weight",)),
        ("m128-n4096", {"B": [128], "N": 4096}, ("bfloat16",), ("weight",)),
        ("m2048-n4096", {"B": [2048], "N": 4096}, ("bfloat16", "float16"), ("weight",)),
        ("m32768-n4096", {"B": [32768], "N": 4096}, ("bfloat16", "float16"), ("weight",)),
        ("m1-n8192", {"B": [1], "N": 8192}, ("bfloat16",), ("weight",)),
        ("m128-n8192", {"B": [128], "N": 8192}, ("bfloat16",), ("weight",)),
        ("m2048-n8192", {"B": [2048], "N": 8192}, ("bfloat16", "float16"), ("weight",)),
        ("m32768-n8192", {"B": [32768], "N": 8192}, ("bfloat16", "float16"), ("weight",)),
        ("m1-n16384", {"B": [1], "N": 16384}, ("bfloat16",), ("weight",)),
        ("m128-n16384", {"B": [128], "N": 16384}, ("bfloat16",), ("weight",)),
        ("m2048-n16384", {"B": [2048], "N": 16384}, ("bfloat16", "float16"), ("weight",)),
        ("m32768-n16384", {"B": [32768], "N": 16384}, ("bfloat16", "float16"), ("weight",)),
        ("odd-n4097", {"B": [16384], "N": 4097}, ("bfloat16",), ("weight",)),
        ("tiny-n7", {"B": [3], "N": 7}, ("bfloat16", "float32"), ("weight",)),
        ("fp32-weight-n7", {"B": [3], "N": 7}, ("bfloat16",), ("weight",)),
        ("inplace-m32768-n8192", {"B": [32768], "N": 8192, "inplace": True}, ("bfloat16",), ("weight",)),
        ("inplace-decode", {"B": [1], "N": 4096, "inplace": True}, ("bfloat16",), ("weight",)),
    ],
    "LayerNormFwdOp": [
        ("m1-n4096", {"B": [1], "normalized_shape": [4096]}, ("bfloat16",), ("weight", "bias")),
        ("m128-n4096", {"B": [128], "normalized_shape": [4096]}, ("bfloat16",), ("weight", "bias")),
        ("m2048-n4096", {"B": [2048], "normalized_shape": [4096]}, ("bfloat16", "float16"), ("weight", "bias")),
        ("m32768-n4096", {"B": [32768], "normalized_shape": [4096]}, ("bfloat16", "float16"), ("weight", "bias")),
        ("m1-n8192", {"B": [1], "normalized_shape": [8192]}, ("bfloat16",), ("weight", "bias")),
        ("m128-n8192", {"B": [128], "normalized_shape": [8192]}, ("bfloat16",), ("weight", "bias")),
        ("m2048-n8192", {"B": [2048], "normalized_shape": [8192]}, ("bfloat16", "float16"), ("weight", "bias")),
        ("m32768-n8192", {"B": [32768], "normalized_shape": [8192]}, ("bfloat16", "float16"), ("weight", "bias")),
        ("m1-n16384", {"B": [1], "normalized_shape": [16384]}, ("bfloat16",), ("weight", "bias")),
        ("m128-n16384", {"B": [128], "normalized_shape": [16384]}, ("bfloat16",), ("weight", "bias")),
        ("m2048-n16384", {"B": [2048], "normalized_shape": [16384]}, ("bfloat16", "float16"), ("weight", "bias")),
        ("m32768-n16384", {"B": [32768], "normalized_shape": [16384]}, ("bfloat16", "float16"), ("weight", "bias")),
        ("odd-n4097", {"B": [16384], "normalized_shape": [4097]}, ("bfloat16",), ("weight", "bias")),
        ("tiny-n7", {"B": [3], "normalized_shape": [7]}, ("bfloat16", "float32"), ("weight", "bias")),
        ("fp32-weight-n7", {"B": [3], "normalized_shape": [7]}, ("bfloat16",), ("weight", "bias")),
        ("weight-only", {"B": [2048], "normalized_shape": [4096]}, ("bfloat16",), ("weight",)),
        ("no-affine", {"B": [2048], "normalized_shape": [4096]}, ("float32",), ()),
    ],
}


def test_the_norm_entries_share_one_grid_and_expand_to_their_written_out_workloads() -> None:
    spec = load_spec_file(NORM_YAML)
    assert list(spec.families) == ["norm"]
    assert list(spec.families["norm"].grids) == ["rows-by-hidden"]
    forward = [n for n in spec.entries if n.endswith("FwdOp")]
    assert forward == list(TODAY)
    # each forward's gradient is its own entry, on the same grid
    assert [spec.entries[n].backward.op for n in forward] == [
        "RMSNormBwdOp", "FusedAddRMSNormBwdOp", "LayerNormBwdOp"]
    for name, expected in TODAY.items():
        entry = spec.entries[name]
        assert entry.status == "implemented"
        assert [(w.label, w.values, tuple(c["T"] for c in w.dtype_cases), w.some)
                for w in entry.workloads] == expected, name
        # the weight's dtype W is x's, but in fp32-weight-n7: float32 beside bfloat16
        assert [(w.label, c["W"]) for w in entry.workloads for c in w.dtype_cases
                if c["W"] != c["T"]] == [("fp32-weight-n7", "float32")], name
        assert all(set(c) == {"T", "W"} for w in entry.workloads for c in w.dtype_cases)
    assert validate(spec) == []


def _wide_grid(rows: int, items: int) -> str:
    grid = "".join(f"        - {{m: {i + 1}, n: 3, dtype_cases: [{{T: float16}}], label: r{i}}}\n"
                   for i in range(rows))
    item = '  - grid: g\n    map: {B: "[m]", N: n}\n    label: "{label}-%d"\n'
    return edit(ROWS, grid, '  - grid: g\n    map: {B: "[m]", N: n}\n',
                "".join(item % j for j in range(items)))


def test_a_large_grid_loads_in_well_under_a_second() -> None:
    import time

    text = _wide_grid(1500, 2)  # 3000 workloads: the line table is placed once, not per row
    load_spec_text(_wide_grid(1, 1), "op.yaml")  # the loader made (PyYAML imported) first
    t = time.perf_counter()
    entry = load_spec_text(text, "op.yaml").entries["Op"]
    assert time.perf_counter() - t < 1.0
    assert len(entry.workloads) == 3001


def test_an_entry_expanding_to_more_workloads_than_the_bound_is_refused() -> None:
    assert load_error(_wide_grid(1500, 3)) == (
        "[schema] op.yaml:1525: in Op.workloads[2]: Op expands to more than 4096 workloads (each is a "
        "test and a benchmark case); split the grid or use it in fewer items")


def test_a_grid_variable_is_a_name_an_expression_can_read() -> None:
    text = edit("{m: 2, n: 3,", "{m: 2, n: 3, lambda: 1,", "{m: 4, n: 5,", "{m: 4, n: 5, lambda: 1,")
    assert load_error(text) == ("[schema] op.yaml:7: in families.test.grids.g.rows[0].lambda: grid "
                                "variable 'lambda' is not a name an expression can read")


def test_every_unused_family_block_and_grid_is_reported() -> None:
    text = edit("families:\n", "families:\n  other:\n    status: spec-only\n",
                "        rows:\n", "        rows:\n        - {m: 1, n: 1, label: lone}\n      h:\n"
                "        rows:\n")
    with pytest.raises(SpecLoadError) as exc:
        load_spec_text(text, "op.yaml")
    assert [str(d) for d in exc.value.diagnostics] == [
        "op.yaml:2: in families.other: no entry of this file has family 'other' (the entries' "
        "families: test)",
        "op.yaml:10: in families.test.grids.h: grid h of family test is expanded by no workload "
        "item",
    ]
