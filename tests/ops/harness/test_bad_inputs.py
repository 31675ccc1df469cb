"""The bad-input corpus derived from each op's signature (see ``_corpus``), on CPU.

Every refusal must be the caller's error (a TypeError or ValueError raised by the checks, not
a RuntimeError from a kernel or from torch), name the op and the argument in its first line,
state the expected and the seen value where it has them, and leave the op usable: on a fresh
instance and after a good call (when the hot path is installed), ``last_call`` is unchanged
and the next good call succeeds and matches float64. The valid variants (views, a rank the
spec admits) must work and match float64.
"""

import re

import pytest

torch = pytest.importorskip("torch")

from tileops.ops.workloads import as_outputs, clone_inputs, make_inputs  # noqa: E402
from tileops.signature import SignatureCallError  # noqa: E402

from ._corpus import Refusal, refusals, valid_calls  # noqa: E402
from ._harness import (  # noqa: E402
    OPS,
    check_outputs,
    defect_marks,
    presence,
    spec_outputs,
)

REFUSALS = refusals()
VALID = valid_calls()


def _word(word: str, text: str) -> bool:
    """``word`` in ``text`` as a whole word (``float16`` is not in ``bfloat16``)."""
    return re.search(rf"(?<![\w.]){re.escape(word)}(?![\w])", text) is not None


def _states(text: str, groups: tuple[tuple[str, ...], ...]) -> bool:
    # axis positions (x.shape[-1], x.shape[0:-1]) are not values
    text = re.sub(r"\.shape\[[^\]]*\]", ".shape", text)
    return not groups or any(all(_word(w, text) for w in g) for g in groups)


def _refuse(op, refusal: Refusal, good) -> None:
    args, kwargs = refusal.make(clone_inputs(good))
    with pytest.raises((TypeError, ValueError)) as info:
        op(*args, **kwargs)
    exc = info.value
    msg = str(exc)
    header = msg.splitlines()[0] if msg else ""
    name = type(op).__name__
    assert _word(name, header), f"the refusal does not name {name}: {msg}"
    # the generated check's own variables (i_B, len(i_S)) are never what a message names
    assert not re.search(r"\bi_[A-Z]|\blen\(", msg), f"the refusal names check internals: {msg}"
    if refusal.culprits:
        assert any(_word(c, header) for c in refusal.culprits), \
            f"the refusal does not name {' or '.join(refusal.culprits)}: {msg}"
    if refusal.structured:
        assert isinstance(exc, SignatureCallError), f"not a SignatureCallError: {msg}"
        assert _states(exc.because, refusal.stated), \
            f"the refusal does not state {refusal.stated}: {msg}"
    else:
        assert _states(msg, refusal.stated), f"the refusal does not state {refusal.stated}: {msg}"


def _good_call(op, good, refs, expected) -> None:
    given = clone_inputs(good)
    check_outputs(op, given, clone_inputs(good), as_outputs(op(*given)), refs, expected)


@pytest.mark.parametrize(
    "refusal", [pytest.param(r, id=r.id, marks=defect_marks(r)) for r in REFUSALS])
def test_refused_and_the_op_stays_usable(refusal):
    case = refusal.case
    cls = OPS[case.op]
    op = cls(**case.params)
    good = make_inputs(case, "cpu")
    refs = op.fp64_reference(*good)
    expected = spec_outputs(cls._signature, case.values, presence(case))
    _refuse(op, refusal, good)  # the first call of a fresh instance: nothing bound
    assert op.last_call is None
    _good_call(op, good, refs, expected)
    record = op.last_call
    _refuse(op, refusal, good)  # after a good call: the hot path's miss
    assert op.last_call is record
    _good_call(op, good, refs, expected)


@pytest.mark.parametrize("valid", VALID, ids=lambda v: v.id)
def test_valid_variant_works(valid):
    case = valid.case
    cls = OPS[case.op]
    op = cls(**case.params)
    inputs = valid.make(make_inputs(case, "cpu"))
    before = clone_inputs(inputs)
    refs = op.fp64_reference(*inputs)
    outs = as_outputs(op(*inputs))
    check_outputs(op, inputs, before, outs, refs,
                  spec_outputs(cls._signature, valid.values, presence(case)))
