"""An op class's generated members (plan, ``__init__``, ``__call__``, docstring, gradient) are
built on the class's first use, all at once, and are then plain attributes (lazy.py); what
must fail at definition still does. (That importing the shipped ops builds almost none of them
is tests/ops/test_import_cost.py.)"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tileops.runtime import Op, SpecSet
from tileops.runtime.lazy import is_deferred
from tileops.signature import SignaturePlan
from tileops.spec import load_spec_text

SPECS_DIR = Path(__file__).parent / "specs"
SPECS = SpecSet.load(SPECS_DIR / "ops.yaml")
GRAD = SpecSet.load(SPECS_DIR / "grad.yaml")
MEMBERS = ("_signature", "_gradient", "__init__", "__call__", "__doc__")


def _scale_class() -> type[Op]:
    class ScaleOp(Op, specs=SPECS):
        def reference(self, call, x, bias):  # served by the reference target
            return (x * self.alpha,)

    return ScaleOp


def _deferred(cls: type) -> list[str]:
    return [m for m in MEMBERS if is_deferred(cls, m)]


def test_definition_defers_every_generated_member() -> None:
    cls = _scale_class()
    assert _deferred(cls) == list(MEMBERS)
    assert cls._param_names == ("alpha",)  # read at definition, from the entry


def test_construction_builds_them_all_and_leaves_plain_attributes() -> None:
    cls = _scale_class()
    op = cls(alpha=3.0)
    assert _deferred(cls) == []
    assert isinstance(cls.__dict__["_signature"], SignaturePlan)
    assert callable(cls.__dict__["__init__"]) and callable(cls.__dict__["__call__"])
    assert cls.__dict__["_gradient"] is None  # the entry declares no backward
    x = torch.arange(4.0)
    assert torch.equal(op(x), x * 3.0)
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"


@pytest.mark.parametrize("member", MEMBERS)
def test_any_member_read_first_builds_the_rest(member: str) -> None:
    cls = _scale_class()
    getattr(cls, member)
    assert _deferred(cls) == []
    assert cls.__doc__.startswith("ScaleOp")
    assert cls.__doc__ == cls.__init__.__doc__
    assert "alpha (float): default 2.0." in cls.__doc__


def test_a_gradient_is_built_with_the_class() -> None:
    class ScaleGradOp(Op, specs=GRAD):
        pass

    assert is_deferred(ScaleGradOp, "_gradient")
    gradient = ScaleGradOp._gradient
    assert gradient is not None and gradient.op_name == "ScaleGradBwdOp"
    assert ScaleGradOp.__dict__["_gradient"] is gradient


def test_threads_constructing_a_new_class_share_one_plan() -> None:
    cls = _scale_class()
    plans: list[object] = []
    start = threading.Barrier(8)

    def construct() -> None:
        start.wait()
        plans.append(cls()._signature)

    threads = [threading.Thread(target=construct) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(plans) == 8 and all(p is plans[0] for p in plans)
    assert plans[0] is cls._signature


def test_a_subclass_without_an_entry_builds_its_base_and_runs_as_before() -> None:
    base = _scale_class()

    class Mine(base):  # not an entry: inherits the base's generated __init__ and __call__
        pass

    assert Mine._signature is None
    assert _deferred(base) == list(MEMBERS)
    with pytest.raises(TypeError, match="has no spec entry"):
        Mine()
    assert _deferred(base) == []  # the base's __init__, read through the subclass, was built


def test_a_param_that_is_not_an_identifier_is_still_refused_at_definition() -> None:
    # the validator refuses such a name in a file; an unvalidated set reaches the class
    text = (SPECS_DIR / "ops.yaml").read_text().replace("alpha: {type: float",
                                                         "lambda: {type: float")
    specs = SpecSet([load_spec_text(text, "ops.yaml")])
    with pytest.raises(TypeError, match="construction param 'lambda' is not an identifier"):
        class ScaleOp(Op, specs=specs):
            pass
