"""The construction check and the construction-point cache.

``plan.construct(**params)`` checks every construction param against its kind (bool, int,
float, Shape, PerAxis, enum, DType, Maybe, ADT) and the refinements that read only params,
and returns the cached :class:`ConstructionPoint` of those values. A failure is a
:class:`ConstructionError` (a :class:`SignatureCallError`: the caller's fault) with the same
fixed message structure as a call error; a bad spec is a :class:`SpecError`.
"""

from __future__ import annotations

import threading

import pytest

from tileops.signature import (
    ConstructionError,
    DTypeAdapter,
    SignatureCallError,
    SignaturePlan,
)
from tileops.spec import (
    AdtValue,
    Expr,
    InputDecl,
    OpEntry,
    OutputDecl,
    ParamDecl,
    Signature,
    SpecError,
    load_spec_text,
    load_types_text,
)

TYPES = """\
adts:
  MGroupedLayout:
    constructors:
      contiguous:
        python: tileops.ops.moe.ContiguousLayoutSpec
        fields:
          packing: "'tight' | 'aligned'"
          alignment: Dim
        invariant: "(packing == 'tight') == (alignment == 1)"
      masked:
        python: tileops.ops.moe.MaskedLayoutSpec
        fields: {max_m: Dim}
"""

SPEC = """\
KindsOp:
  family: misc
  status: spec-only
  signature:
    forall: {N: Dim, T: "DType[float16 | float32]"}
    params:
      layout: {type: MGroupedLayout}
      flag: {type: bool, default: false}
      count: {type: int, default: 1}
      alpha: {type: float, default: 1.0}
      dims: {type: "list[int]", default: [1]}
      kernel: {type: "int | tuple[int, int]", default: 1}
      mode: {type: "'sum' | 'mean'", default: sum}
      acc: {type: "float16 | float32", default: float32}
      limit: {type: "int | None", default: null}
    let:
      k0: "per_axis(kernel, 0, 2)"
    inputs:
      x: {dtype: T, shape: "[N]"}
    outputs:
      y: {dtype: T, shape: "[N]"}
    shape_rules:
    - "count > 0"
    - "k0 <= 8"
    - "not present(limit) or limit.value >= count"
"""

MASKED = AdtValue("masked", {"max_m": 4})
M_TEXT = "layout=AdtValue(constructor='masked', fields={'max_m': 4})"


class MaskedLayoutSpec:
    """A user-facing ADT class: matched to its constructor by ``module.qualname``."""

    __module__ = "tileops.ops.moe"

    def __init__(self, max_m: int) -> None:
        self.max_m = max_m

    def __repr__(self) -> str:
        return f"MaskedLayoutSpec(max_m={self.max_m})"


class Unrelated:
    def __repr__(self) -> str:
        return "Unrelated()"


@pytest.fixture(scope="module")
def plan() -> SignaturePlan:
    types, _ = load_types_text(TYPES, "types.yaml")
    spec = load_spec_text(SPEC, "kinds.yaml")
    return SignaturePlan("KindsOp", spec.entries["KindsOp"], spec=spec, adts=types.adts,
                         adapter=_FAKE)


def message(argument: str, expected: str, seen: str, because: str, call: str, spec: str) -> str:
    return "\n".join([
        f"KindsOp: construction param {argument} does not match the signature",
        f"  expected: {expected}",
        f"  seen:     {seen}",
        f"  because:  {because}",
        f"  call:     {call}",
        "  bound:    (nothing)",
        f"  spec:     kinds.yaml:{spec}",
    ])


BAD = [
    # (params, argument, expected, seen, because, spec line (entry path))
    pytest.param(dict(flag=1), "flag", "flag: Bool", "1 (int)", "flag must be True or False",
                 "8 (KindsOp.signature.params.flag)", id="bool"),
    pytest.param(dict(count=1.5), "count", "count: Int", "1.5 (float)", "count must be an int",
                 "9 (KindsOp.signature.params.count)", id="int"),
    pytest.param(dict(count=True), "count", "count: Int", "True (bool)", "count must be an int",
                 "9 (KindsOp.signature.params.count)", id="int-not-bool"),
    pytest.param(dict(alpha="x"), "alpha", "alpha: Float", "'x' (str)",
                 "alpha must be a number", "10 (KindsOp.signature.params.alpha)", id="float"),
    pytest.param(dict(dims=[1, -1]), "dims", "dims: Shape", "[1, -1] (list)",
                 "dims[1] is -1, not a size: a size is a non-negative int",
                 "11 (KindsOp.signature.params.dims)", id="shape"),
    pytest.param(dict(kernel=(1, 2, 3)), "kernel", "kernel: PerAxis[2]", "(1, 2, 3) (tuple)",
                 "kernel must be an int or a tuple of 2 ints",
                 "12 (KindsOp.signature.params.kernel)", id="per-axis"),
    pytest.param(dict(mode="max"), "mode", "mode: 'sum' | 'mean'", "'max' (str)",
                 "mode must be one of 'sum', 'mean'", "13 (KindsOp.signature.params.mode)",
                 id="enum"),
    pytest.param(dict(acc="int8"), "acc", "acc: DType[float16 | float32]", "'int8' (str)",
                 "acc must be one of float16, float32", "14 (KindsOp.signature.params.acc)",
                 id="dtype"),
    pytest.param(dict(limit="x"), "limit", "limit: Maybe[Int]", "'x' (str)",
                 "limit must be an int, or None", "15 (KindsOp.signature.params.limit)",
                 id="maybe"),
    # ints past the spec's arithmetic: refused by name, a huge one shown by its size
    pytest.param(dict(count=2**63), "count", "count: Int", f"{2**63} (int)",
                 "count holds an int of 64 bits: the integers a spec computes with are at most "
                 "2**63 - 1 in magnitude", "9 (KindsOp.signature.params.count)",
                 id="int-past-int64"),
    pytest.param(dict(kernel=(1, 2**64)), "kernel", "kernel: PerAxis[2]",
                 f"(1, {2**64}) (tuple)", "kernel holds an int of 65 bits: the integers a spec "
                 "computes with are at most 2**63 - 1 in magnitude",
                 "12 (KindsOp.signature.params.kernel)", id="per-axis-past-int64"),
    pytest.param(dict(limit=2**70), "limit", "limit: Maybe[Int]", f"{2**70} (int)",
                 "limit holds an int of 71 bits: the integers a spec computes with are at most "
                 "2**63 - 1 in magnitude, or None", "15 (KindsOp.signature.params.limit)",
                 id="maybe-past-int64"),
]


@pytest.mark.parametrize(("params", "argument", "expected", "seen", "because", "spec"), BAD)
def test_wrong_kind(plan, params, argument, expected, seen, because, spec) -> None:
    with pytest.raises(ConstructionError) as info:
        plan.construct(layout=MASKED, **params)
    shown = ", ".join(f"{k}={list(v) if isinstance(v, tuple) else repr(v)}"
                      if not isinstance(v, int | float) else f"{k}={v}"
                      for k, v in params.items())
    assert str(info.value) == message(argument, expected, seen, because,
                                      f"{M_TEXT}, {shown}", spec)


def test_a_huge_int_param_is_refused_by_its_size(plan) -> None:
    """An int of thousands of digits is shown by its size (Python refuses to print one past
    4300 digits, and printing it is slow before that)."""
    with pytest.raises(ConstructionError) as info:
        plan.construct(layout=MASKED, count=-(10**5000))
    lines = str(info.value).splitlines()
    assert lines[2:4] == [
        "  seen:     <an int of 16610 bits> (int)",
        "  because:  count holds an int of 16610 bits: the integers a spec computes with are at "
        "most 2**63 - 1 in magnitude"]
    assert "count=<an int of 16610 bits>" in lines[4]


def test_a_float_param_takes_any_real_number_and_refuses_an_int_past_floats(plan) -> None:
    np = pytest.importorskip("numpy")
    assert plan.construct(layout=MASKED, alpha=np.float32(0.5)).params["alpha"] == 0.5
    with pytest.raises(ConstructionError) as info:
        plan.construct(layout=MASKED, alpha=10**400)
    assert str(info.value).splitlines()[3] == (
        "  because:  alpha is an int of 1329 bits, past the largest float (about 1.8e308)")
    with pytest.raises(ConstructionError) as info:
        plan.construct(layout=MASKED, alpha=np.bool_(True))
    assert str(info.value).splitlines()[3] == "  because:  alpha must be a number"
    # an int stays an int (torch's Scalar keeps the type: an int bound keeps an integer
    # tensor's dtype, a float one promotes it); one past int64 is a float
    for given, held in ((3, 3), (np.int16(-2), -2), (2**70, float(2**70)), (1.0, 1.0)):
        got = plan.construct(layout=MASKED, alpha=given).params["alpha"]
        assert got == held and type(got) is type(held)


ADT_BAD = [
    pytest.param(AdtValue("blocked", {}), "layout", "layout: MGroupedLayout",
                 "AdtValue(constructor='blocked', fields={}) (AdtValue)",
                 "'blocked' is not a constructor of MGroupedLayout", id="unknown-constructor"),
    pytest.param(AdtValue("masked", {}), "layout", "layout: MGroupedLayout",
                 "AdtValue(constructor='masked', fields={}) (AdtValue)",
                 "masked has fields max_m", id="missing-field"),
    pytest.param(AdtValue("masked", {"max_m": -1}), "layout.max_m", "layout.max_m: Dim",
                 "-1 (int)", "layout.max_m is a Dim and must be >= 0", id="field-kind"),
    pytest.param(AdtValue("contiguous", {"packing": "tight", "alignment": 2}), "layout",
                 "layout: MGroupedLayout",
                 "AdtValue(constructor='contiguous', fields={'packing': 'tight', "
                 "'alignment': 2}) (AdtValue)",
                 "contiguous breaks its invariant \"(packing == 'tight') == (alignment == 1)\"",
                 id="invariant"),
    pytest.param(Unrelated(), "layout", "layout: MGroupedLayout", "Unrelated() (Unrelated)",
                 "layout must be a MGroupedLayout: one of tileops.ops.moe.ContiguousLayoutSpec, "
                 "tileops.ops.moe.MaskedLayoutSpec", id="unrelated-class"),
    pytest.param(MaskedLayoutSpec(-3), "layout.max_m", "layout.max_m: Dim", "-3 (int)",
                 "layout.max_m is a Dim and must be >= 0", id="class-field-kind"),
]


class EmptyMaskedLayoutSpec:
    """At the masked constructor's path, but without its field."""

    __module__ = "tileops.ops.moe"
    __qualname__ = "MaskedLayoutSpec"

    def __repr__(self) -> str:
        return "MaskedLayoutSpec()"


ADT_BAD.append(pytest.param(EmptyMaskedLayoutSpec(), "layout", "layout: MGroupedLayout",
                            "MaskedLayoutSpec() (EmptyMaskedLayoutSpec)",
                            "masked has fields max_m", id="class-missing-field"))


@pytest.mark.parametrize(("value", "argument", "expected", "seen", "because"), ADT_BAD)
def test_wrong_adt(plan, value, argument, expected, seen, because) -> None:
    with pytest.raises(ConstructionError) as info:
        plan.construct(layout=value, flag=True)
    # an ADT field is reported at the line of its param, with the whole call
    assert str(info.value) == message(argument, expected, seen, because,
                                      f"layout={value!r}, flag=True",
                                      "7 (KindsOp.signature.params.layout)")


def test_adt_from_a_python_class(plan) -> None:
    # module.qualname names the constructor; its fields are read as attributes
    point = plan.construct(layout=MaskedLayoutSpec(8))
    assert point.params["layout"] == AdtValue("masked", {"max_m": 8})
    assert point is plan.construct(layout=AdtValue("masked", {"max_m": 8}))


def test_accepted_values_are_normalised(plan) -> None:
    point = plan.construct(layout=MASKED, flag=True, count=3, alpha=2, dims=[2, 3],
                           kernel=[2, 2], mode="mean", acc="float16", limit=5)
    assert point.params == {"layout": MASKED, "flag": True, "count": 3, "alpha": 2.0,
                            "dims": (2, 3), "kernel": (2, 2), "mode": "mean",
                            "acc": "float16", "limit": 5}
    # a DType param also takes the library's own dtype object
    assert plan.construct(layout=MASKED, acc=_FAKE.native("float16")).params["acc"] == "float16"


def test_unknown_param(plan) -> None:
    with pytest.raises(ConstructionError) as info:
        plan.construct(layout=MASKED, bogus=1)
    assert str(info.value) == message(
        "bogus", "one of: layout, flag, count, alpha, dims, kernel, mode, acc, limit", "1",
        "KindsOp has no construction param 'bogus'", f"{M_TEXT}, bogus=1",
        "6 (KindsOp.signature.params)")


def test_missing_required_param(plan) -> None:
    with pytest.raises(ConstructionError) as info:
        plan.construct(flag=True)
    assert str(info.value) == message(
        "layout", "layout: MGroupedLayout", "nothing", "layout is required (it has no default)",
        "flag=True", "7 (KindsOp.signature.params.layout)")


@pytest.mark.parametrize(("params", "argument", "rule", "seen", "line"), [
    pytest.param(dict(count=0), "count", "count > 0", "count = 0", 23, id="param"),
    # through a let: the message names the param the let reads
    pytest.param(dict(kernel=9), "kernel", "k0 <= 8", "k0 = 9", 24, id="through-let"),
    # present() of a Maybe param is decided at construction
    pytest.param(dict(limit=0, count=1), "limit, count",
                 "not present(limit) or limit.value >= count", "limit = 0, count = 1", 25,
                 id="maybe-present"),
])
def test_param_only_refinement_fails_at_construction(plan, params, argument, rule, seen,
                                                    line) -> None:
    with pytest.raises(ConstructionError) as info:
        plan.construct(layout=MASKED, **params)
    call = ", ".join([M_TEXT, *(f"{k}={v}" for k, v in params.items())])
    assert str(info.value) == message(argument, rule, seen,
                                      f"refinement {rule!r} does not hold", call,
                                      f"{line} (KindsOp.signature.shape_rules[{line - 23}])")


def test_construction_error_is_a_call_error(plan) -> None:
    with pytest.raises(SignatureCallError):
        plan.construct(layout=MASKED, flag="yes")
    with pytest.raises(ValueError):
        plan.construct(layout=MASKED, flag="yes")


# --- the construction-point cache -------------------------------------------------------------


def test_same_params_same_point(plan) -> None:
    a = plan.construct(layout=MASKED)
    assert plan.construct(layout=MASKED) is a
    assert plan.construct(layout=MASKED, flag=False, count=1) is a  # the defaults, spelt out
    assert plan.construct(layout=AdtValue("masked", {"max_m": 4})) is a
    assert plan.construct(layout=MASKED, dims=(1,)) is a  # a Shape as list or tuple
    assert plan.construct(layout=MASKED, flag=True) is not a
    assert plan.construct(layout=MASKED, flag=True) is plan.construct(layout=MASKED, flag=True)


def test_threads_constructing_one_point_get_one_object() -> None:
    types, _ = load_types_text(TYPES, "types.yaml")
    spec = load_spec_text(SPEC, "kinds.yaml")
    for _ in range(5):  # a fresh plan each round: the first construction races
        plan = SignaturePlan("KindsOp", spec.entries["KindsOp"], spec=spec, adts=types.adts,
                             adapter=_FAKE)
        barrier = threading.Barrier(8)
        got: list[object] = []

        def build(plan: SignaturePlan = plan, barrier: threading.Barrier = barrier,
                  got: list[object] = got) -> None:
            barrier.wait()
            got.append(plan.construct(layout=AdtValue("masked", {"max_m": 16})))

        threads = [threading.Thread(target=build) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 8
        assert len({id(p) for p in got}) == 1


# --- bad specs ----------------------------------------------------------------------------------


def _entry(**inputs: InputDecl) -> OpEntry:
    return OpEntry(family="x", status="spec-only", signature=Signature(
        forall={"S": Expr("Shape"), "H": Expr("Dim"), "T": Expr("DType[float32]")},
        inputs=inputs, outputs={"y": OutputDecl(dtype=Expr("T"), shape=Expr("[*S, H]"))}))


def test_plan_of_an_invalid_entry_raises_spec_error() -> None:
    # H is only read by an optional input, and the output's shape reads it: no value for the
    # calls without r
    entry = _entry(x=InputDecl(dtype=Expr("T"), shape=Expr("[*S]")),
                   r=InputDecl(dtype=Expr("T"), shape=Expr("[H]"), optional=Expr("True")))
    with pytest.raises(SpecError) as info:
        SignaturePlan("BadOp", entry)
    assert not isinstance(info.value, SignatureCallError)
    assert [d.rule for d in info.value.diagnostics] == ["solvable"]
    assert "'[*S, H]' reads H, which only the optional input r gives" in str(info.value)


def test_spec_error_from_a_loaded_file_names_file_and_line() -> None:
    spec = load_spec_text(SPEC.replace('shape: "[N]"}\n    outputs', 'shape: "[M]"}\n    outputs'),
                          "bad.yaml")
    types, _ = load_types_text(TYPES, "types.yaml")
    with pytest.raises(SpecError, match=r"bad\.yaml:\d+: in KindsOp\.signature"):
        SignaturePlan("KindsOp", spec.entries["KindsOp"], spec=spec, adts=types.adts)


def test_optional_input_before_a_required_one() -> None:
    entry = _entry(r=InputDecl(dtype=Expr("T"), shape=Expr("[*S, H]"), optional=Expr("True")),
                   x=InputDecl(dtype=Expr("T"), shape=Expr("[*S, H]")))
    # the validator refuses the order (a positional call could not leave r out) ...
    with pytest.raises(SpecError, match="input x is required but comes after the optional "
                                        "input r; optional inputs come last"):
        SignaturePlan("OptFirstOp", entry, adapter=_FAKE)
    # ... and the generator, given it unvalidated, still writes a valid Python signature that
    # checks the required input after the optional one as required
    point = SignaturePlan("OptFirstOp", entry, adapter=_FAKE, validate=False).construct()
    # S is sliced from r when r is given, from x otherwise
    assert point.check(_T(2, 3, 4), _T(2, 3, 4)).indices == {"S": (2, 3), "H": 4,
                                                              "T": "float32"}
    call = point.check(None, _T(5, 4))
    assert call.indices == {"S": (5,), "H": 4, "T": "float32"}
    assert call.tensors["y"] == ((5, 4), "float32")
    with pytest.raises(SignatureCallError, match="x is required, got None"):
        point.check(_T(2, 3, 4))
    with pytest.raises(SignatureCallError, match=r"S is \[2, 4\] \(bound by r.shape\[0:-1\]\)"):
        point.check(_T(2, 4, 4), _T(2, 3, 4))


class _T:
    def __init__(self, *shape: int, dtype: str = "float32") -> None:
        self.shape, self.dtype = shape, _FAKE.native(dtype)


class _Dtype:
    def __init__(self, name: str) -> None:
        self.name = name


_FAKE = DTypeAdapter("fake", {n: _Dtype(n) for n in ("float16", "float32")})


def test_shape_index_sliced_at_a_runtime_offset_in_one_branch() -> None:
    # S comes from r (at a constant offset) when r is given, else from x after *R (at an
    # offset known only at run time); the record must hold S itself in both branches
    entry = OpEntry(family="x", status="spec-only", signature=Signature(
        forall={"R": Expr("Shape"), "S": Expr("Shape"), "T": Expr("DType[float32]")},
        inputs={"r": InputDecl(dtype=Expr("T"), shape=Expr("[*S, 1]"), optional=Expr("True")),
                "w": InputDecl(dtype=Expr("T"), shape=Expr("[*R]")),
                "x": InputDecl(dtype=Expr("T"), shape=Expr("[*R, *S]"))},
        outputs={"y": OutputDecl(dtype=Expr("T"), shape=Expr("[*S]"))}))
    # (the validator refuses an optional input before required ones; the generator still
    # handles the order, which is what this exercises)
    point = SignaturePlan("TwoShapesOp", entry, adapter=_FAKE, validate=False).construct()
    for r in (None, _T(4, 5, 1)):
        call = point.check(r, _T(2), _T(2, 4, 5))
        assert call.indices == {"R": (2,), "S": (4, 5), "T": "float32"}
        assert call.tensors["y"] == ((4, 5), "float32")


def test_a_nan_param_reuses_its_construction_point() -> None:
    entry = OpEntry(family="x", status="spec-only", signature=Signature(
        forall={"N": Expr("Dim"), "T": Expr("DType[float32]")},
        params={"alpha": ParamDecl(type=Expr("float"))},
        inputs={"x": InputDecl(dtype=Expr("T"), shape=Expr("[N]"))},
        outputs={"y": OutputDecl(dtype=Expr("T"), shape=Expr("[N]"))}))
    plan = SignaturePlan("NanOp", entry, adapter=_FAKE)
    assert plan.construct(alpha=float("nan")) is plan.construct(alpha=float("nan"))
    assert plan.construct(alpha=1.0) is not plan.construct(alpha=float("nan"))
