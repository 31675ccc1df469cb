"""Fixtures of the signature tests: the design documents' example specs, loaded once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tileops.signature import SignaturePlan
from tileops.spec import SpecFile, TypesFile, load_spec_file, load_types_file

SPECS = Path(__file__).resolve().parents[1] / "spec" / "specs"


@pytest.fixture(scope="session")
def examples() -> SpecFile:
    return load_spec_file(SPECS / "examples.yaml")


@pytest.fixture(scope="session")
def types() -> TypesFile:
    return load_types_file(SPECS / "types.yaml")[0]


@pytest.fixture(scope="session")
def example_plan(examples: SpecFile, types: TypesFile) -> Callable[[str], SignaturePlan]:
    """``example_plan("GemmFwdOp")``: the plan of one example entry (torch adapter)."""
    plans: dict[str, SignaturePlan] = {}

    def make(name: str) -> SignaturePlan:
        if name not in plans:
            plans[name] = SignaturePlan(name, examples.entries[name], spec=examples,
                                        adts=types.adts)
        return plans[name]

    return make
