"""The base spec every validator case edits, and the helpers the validator tests share.

Line numbers in the expected messages of the cases refer to :data:`BASE` as edited.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tileops.spec import Diagnostic, load_spec_text, load_types_file, validate_spec_file

SPECS = Path(__file__).parent / "specs"
TYPES, _ = load_types_file(SPECS / "types.yaml")
TYPES_TEXT = (SPECS / "types.yaml").read_text(encoding="utf-8")

# A valid entry every case edits. Line numbers in the expected messages refer to it.
BASE = """\
Op:
  family: test
  status: spec-only
  signature:
    forall: {M: Dim, N: Dim, T: "DType[float16 | bfloat16]"}
    params:
      flag: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[M, N]"}
    outputs:
      y: {dtype: T, shape: "[M, N]"}
  workloads:
  - {M: 2, N: 3, dtype_cases: [{T: float16}], label: small}
  roofline:
    flops: "M * N"
"""

X = 'x: {dtype: T, shape: "[M, N]"}'
Y = 'y: {dtype: T, shape: "[M, N]"}'
OUT = "    outputs:"
FORALL = "    forall:"
FLAG = "flag: {type: bool, default: false}"
FLOPS = 'flops: "M * N"'
ROW = "{M: 2, N: 3,"
LAYOUT = "layout: {type: MGroupedLayout}"

MAT = (
    "    types:\n"
    "      Mat:\n"
    "        params: {t: Bool, R: Dim, C: Dim}\n"
    "        match: t\n"
    "        cases:\n"
)


def edit(*pairs: str) -> str:
    text = BASE
    for old, new in zip(pairs[::2], pairs[1::2], strict=True):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def mat(*cases: str, use: str = 'x: {dtype: T, shape: "Mat[flag, M, N]"}') -> tuple[str, ...]:
    """Edits that declare the family Mat with ``cases`` and use it for x."""
    body = "".join(f"        - {c}\n" for c in cases)
    return (FORALL, MAT + body + FORALL, X, use)


def diagnostics(text: str) -> list[Diagnostic]:
    return validate_spec_file(load_spec_text(text, "op.yaml"), TYPES.adts)


def shown(diags: list[Diagnostic]) -> list[tuple[str, str]]:
    return [(d.rule, str(d)) for d in diags]



def types_edit(old: str, new: str) -> str:
    assert old in TYPES_TEXT, old
    return TYPES_TEXT.replace(old, new, 1)


def passing_params(passing: dict[str, list[tuple[str, str]]]) -> list:
    """``{rule: [(name, text), ...]}`` as pytest params with the ids ``rule:name``."""
    return [pytest.param(text, id=f"{rule}:{name}") for rule, cases in passing.items()
            for name, text in cases]
