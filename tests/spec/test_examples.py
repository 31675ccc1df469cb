"""The design documents' examples, written as specs (tests/spec/specs/): they validate
cleanly, each construct is really there in the loaded Structs, and their workloads evaluate
to the values PyTorch would give."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tileops.spec import (
    AdtValue,
    OpEntry,
    Scope,
    check_paths,
    eval_shape,
    evaluate,
    load_spec_file,
    load_types_file,
)
from tileops.spec import expr as E
from tileops.spec.evaluate import family_case
from tileops.spec.kinds import AdtK, DTypeK, MaybeK, ShapeK, kind_from_expr

SPECS = Path(__file__).parent / "specs"
SPEC = load_spec_file(SPECS / "examples.yaml")
TYPES, _ = load_types_file(SPECS / "types.yaml")
ENTRIES = SPEC.entries


def test_the_examples_validate_cleanly() -> None:
    loaded, diags = check_paths([SPECS])
    assert [str(d) for d in diags] == []
    assert [Path(s.path).name for s in loaded] == ["examples.yaml"]
    assert list(loaded[0].entries) == [
        "GemmFwdOp", "RMSNormFwdOp", "ReluFwdOp", "AttentionFwdOp", "MaxPool2dFwdOp",
        "MoEGroupedGemmFwdOp", "VarlenAttentionFwdOp", "GemmReluFwdOp",
    ]


# --- a workload row as evaluation values -----------------------------------------------------


def _value(v: Any, kind) -> Any:
    if isinstance(kind, MaybeK):
        return None if v is None else _value(v, kind.inner)
    if isinstance(kind, AdtK):
        ((ctor, fields),) = v.items()
        return AdtValue(ctor, dict(fields))
    if isinstance(v, list):
        return tuple(v)
    return v


def row_scope(name: str, label: str, dtypes: dict[str, str] | None = None,
              some: tuple[str, ...] | None = None) -> tuple[Scope, dict[str, Any]]:
    """The values of one workload row (params defaulted, let computed) and a Scope over them."""
    entry = ENTRIES[name]
    sig = entry.signature
    (row,) = [r for r in entry.workloads if r.label == label]
    adts = set(TYPES.adts)
    values: dict[str, Any] = {}
    for n, p in sig.params.items():
        kind = kind_from_expr(p.type.node, adts)
        values[n] = _value(row.values.get(n, p.default), kind)
    for n, ex in {**sig.forall, **sig.data}.items():
        if n in row.values:
            values[n] = _value(row.values[n], kind_from_expr(ex.node, adts))
    values.update(dtypes if dtypes is not None else (row.dtype_cases or [{}])[0])
    present = {n: n in (row.some if some is None else some) for n, d in sig.inputs.items()
               if d.optional.node != E.Bool(False)}
    scope = Scope(values, sig.types, present)
    for n, ex in sig.let.items():  # the examples write let in dependency order
        values[n] = evaluate(ex.node, scope)
    return scope, values


def shape(name: str, tensor: str, scope: Scope) -> tuple[int, ...]:
    sig = ENTRIES[name].signature
    decl = sig.inputs.get(tensor) or sig.outputs[tensor]
    return eval_shape(decl.shape.node, scope)


# --- GEMM: the type family Mat ---------------------------------------------------------------


def test_gemm_declares_mat_and_applies_it() -> None:
    sig = ENTRIES["GemmFwdOp"].signature
    mat = sig.types["Mat"]
    assert list(mat.params) == ["t", "R", "C"]
    assert mat.discriminants == ("t",)
    assert [(c.when, c.is_.text) for c in mat.cases] == [(False, "[R, C]"), (True, "[C, R]")]
    assert sig.inputs["a"].shape.node == E.Subscript(
        E.Name("Mat"), (E.Name("trans_a"), E.Name("M"), E.Name("K")))
    assert kind_from_expr(sig.forall["T"].node) == DTypeK(("float16", "bfloat16"))
    assert sig.params["trans_a"].default is False


@pytest.mark.parametrize(("trans_b", "b_shape"), [(False, (4096, 1024)), (True, (1024, 4096))])
def test_gemm_shapes_follow_the_family_case(trans_b: bool, b_shape) -> None:
    scope = Scope({"M": 1, "N": 1024, "K": 4096, "trans_a": False, "trans_b": trans_b},
                  ENTRIES["GemmFwdOp"].signature.types)
    assert shape("GemmFwdOp", "a", scope) == (1, 4096)
    assert shape("GemmFwdOp", "b", scope) == b_shape
    assert shape("GemmFwdOp", "c", scope) == (1, 1024)
    mat = ENTRIES["GemmFwdOp"].signature.types["Mat"]
    assert family_case(mat, {"t": trans_b}) == E.parse("[C, R]" if trans_b else "[R, C]")


def test_gemm_workload_and_roofline() -> None:
    scope, values = row_scope("GemmFwdOp", "square-8k")
    assert values["T"] == "bfloat16"
    assert shape("GemmFwdOp", "a", scope) == (8192, 8192)
    assert evaluate(ENTRIES["GemmFwdOp"].roofline.flops.node, scope) == 2 * 8192**3
    scope, values = row_scope("GemmFwdOp", "decode")
    assert values["trans_b"] is True
    assert shape("GemmFwdOp", "b", scope) == (4096, 4096)


# --- RMSNorm: rank polymorphism -------------------------------------------------------------


def test_rmsnorm_splices_two_shapes() -> None:
    sig = ENTRIES["RMSNormFwdOp"].signature
    assert sig.inputs["x"].shape.node == E.List(
        (E.Starred(E.Name("B")), E.Starred(E.Name("normalized_shape"))))
    assert kind_from_expr(sig.forall["B"].node) == ShapeK()
    assert kind_from_expr(sig.params["normalized_shape"].type.node) == ShapeK()
    assert kind_from_expr(sig.params["eps"].type.node) == MaybeK(kind_from_expr(E.parse("float")))
    assert sig.inputs["weight"].optional.node == E.Bool(True)
    assert [r.text for r in sig.shape_rules] == ["len(normalized_shape) > 0",
                                                  "not present(eps) or eps.value > 0"]


def test_rmsnorm_workloads() -> None:
    rf = ENTRIES["RMSNormFwdOp"].roofline.flops.node
    scope, values = row_scope("RMSNormFwdOp", "llama-8b-prefill")
    assert values["eps"] == 1e-6
    assert shape("RMSNormFwdOp", "x", scope) == (2048, 4096)
    assert shape("RMSNormFwdOp", "weight", scope) == (4096,)
    assert evaluate(rf, scope) == 4 * 2048 * 4096  # weight present
    for rule in ENTRIES["RMSNormFwdOp"].signature.shape_rules:
        assert evaluate(rule.node, scope) is True
    scope, values = row_scope("RMSNormFwdOp", "qk-norm")
    assert values["eps"] is None
    assert shape("RMSNormFwdOp", "y", scope) == (4, 2048, 128)
    assert evaluate(rf, scope) == 3 * 4 * 2048 * 128  # no weight


# --- an activation: the inplace effect --------------------------------------------------------


def test_relu_mutates_its_input_when_inplace_and_returns_it() -> None:
    sig = ENTRIES["ReluFwdOp"].signature
    assert sig.inputs["input"].mutated.node == E.Name("inplace")
    assert sig.outputs["output"].alias == "input"
    assert sig.outputs["output"].nullable.node == E.Bool(False)
    assert not sig.outputs["output"].buffer
    scope, values = row_scope("ReluFwdOp", "tiny-inplace")
    assert evaluate(sig.inputs["input"].mutated.node, scope) is True
    scope, values = row_scope("ReluFwdOp", "square")
    assert evaluate(sig.inputs["input"].mutated.node, scope) is False


# --- attention: the causal refinement -------------------------------------------------------


def test_attention_refinement() -> None:
    sig = ENTRIES["AttentionFwdOp"].signature
    causal = sig.shape_rules[0]
    assert causal.node == E.BoolOp("or", (
        E.UnaryOp("not", E.Name("is_causal")),
        E.Compare(E.Name("S_q"), ("<=",), (E.Name("S_kv"),)),
    ))
    scope, values = row_scope("AttentionFwdOp", "prefill-causal")
    assert values["is_causal"] is True
    assert all(evaluate(r.node, scope) for r in sig.shape_rules)
    assert evaluate(ENTRIES["AttentionFwdOp"].roofline.flops.node, scope) == (
        4 * 32 * 4096 * 4096 * 128 // 2)
    # the refinement rejects a causal call with more queries than keys, and only that
    for is_causal, s_q, s_kv, ok in [(True, 2, 1, False), (False, 2, 1, True), (True, 1, 2, True)]:
        assert evaluate(causal.node, Scope({"is_causal": is_causal, "S_q": s_q,
                                            "S_kv": s_kv})) is ok


# --- MaxPool2d: let and pool.out ------------------------------------------------------------


def test_maxpool_lets_use_pool_out() -> None:
    sig = ENTRIES["MaxPool2dFwdOp"].signature
    assert list(sig.let)[-2:] == ["H_out", "W_out"]
    h_out = sig.let["H_out"].node
    assert isinstance(h_out, E.Call)
    assert h_out.func == "pool.out"
    assert sig.let["sH"].node.kwargs == (("fallback", E.Name("kH")),)
    assert sig.outputs["output"].shape.names() == ["N", "C", "H_out", "W_out"]


@pytest.mark.parametrize(
    ("label", "h_out", "out_shape"),
    [
        # floor((112 + 2*1 - 1*(3-1) - 1) / 2) + 1 = floor(111 / 2) + 1 = 56
        ("resnet-stem", 56, (32, 64, 56, 56)),
        # ceil((55 + 0 - 2 - 1) / 2) + 1 = 26 + 1 = 27; (27-1)*2 = 52 < 55, so it stays
        ("alexnet-ceil", 27, (32, 64, 27, 27)),
    ],
)
def test_maxpool_workloads_match_pytorch(label: str, h_out: int, out_shape) -> None:
    scope, values = row_scope("MaxPool2dFwdOp", label)
    assert values["H_out"] == h_out
    assert values["W_out"] == h_out
    assert shape("MaxPool2dFwdOp", "output", scope) == out_shape
    assert all(evaluate(r.node, scope) for r in ENTRIES["MaxPool2dFwdOp"].signature.shape_rules)
    rf = ENTRIES["MaxPool2dFwdOp"].roofline
    assert evaluate(rf.flops.node, scope) == 32 * 64 * h_out * h_out * 9
    size = 2 if values["T"] == "float16" else 4
    assert evaluate(rf.bytes.node, scope) == size * 32 * 64 * (
        values["H_in"] * values["W_in"] + h_out * h_out)


def test_maxpool_stride_defaults_to_the_kernel() -> None:
    scope, values = row_scope("MaxPool2dFwdOp", "resnet-stem")
    values.update(stride=None, padding=0)
    for n, ex in ENTRIES["MaxPool2dFwdOp"].signature.let.items():
        values[n] = evaluate(ex.node, scope)
    assert (values["sH"], values["H_out"]) == (3, 37)  # floor((112 - 3) / 3) + 1


# --- MoE: an ADT parameter and a family over its constructors --------------------------------


def test_moe_layout_is_an_adt_and_the_families_match_its_constructors() -> None:
    sig = ENTRIES["MoEGroupedGemmFwdOp"].signature
    assert kind_from_expr(sig.params["layout"].type.node, set(TYPES.adts)) == AdtK(
        "MGroupedLayout")
    assert [c.when for c in sig.types["Meta"].cases] == ["contiguous", "masked"]
    assert sig.types["Rows"].cases[1].is_.text == "[E * layout.max_m]"
    assert list(TYPES.adts["MGroupedLayout"].constructors) == ["contiguous", "masked"]


@pytest.mark.parametrize(
    ("label", "metadata", "c"),
    [("contiguous", (9,), (4096, 4096)), ("masked", (8,), (8 * 64, 4096))],
)
def test_moe_shapes_per_layout(label: str, metadata, c) -> None:
    scope, values = row_scope("MoEGroupedGemmFwdOp", label)
    assert isinstance(values["layout"], AdtValue)
    assert values["layout"].constructor == label
    assert shape("MoEGroupedGemmFwdOp", "metadata", scope) == metadata
    assert shape("MoEGroupedGemmFwdOp", "c", scope) == c


# --- varlen attention: data indices and a generator ------------------------------------------


def test_varlen_metadata_is_generated_from_data() -> None:
    sig = ENTRIES["VarlenAttentionFwdOp"].signature
    assert list(sig.data) == ["q_lens"]
    assert sig.inputs["cu_seqlens"].values.node == E.Call("prefix_sum", (E.Name("q_lens"),))
    scope, values = row_scope("VarlenAttentionFwdOp", "two-seqs")
    gen = Scope(values, sig.types, generators=True)
    cu = evaluate(sig.inputs["cu_seqlens"].values.node, gen)
    assert cu == [0, 128, 384]
    assert (len(cu),) == shape("VarlenAttentionFwdOp", "cu_seqlens", scope)
    assert cu[-1] == values["Z"]


# --- a composite op ---------------------------------------------------------------------------


def test_composite_op_names_its_stages() -> None:
    entry: OpEntry = ENTRIES["GemmReluFwdOp"]
    assert entry.composition is not None
    assert [(s.name, s.op) for s in entry.composition.stages] == [
        ("gemm", "GemmFwdOp"), ("act", "ReluFwdOp")]
    assert all(s.op in ENTRIES for s in entry.composition.stages)
    scope, _ = row_scope("GemmReluFwdOp", "square-4k")
    assert evaluate(entry.roofline.flops.node, scope) == 2 * 4096**3 + 4096**2


# --- every workload row of every example instantiates ---------------------------------------


@pytest.mark.parametrize(
    ("name", "label"),
    [(n, r.label) for n, e in ENTRIES.items() for r in e.workloads],
)
def test_every_output_shape_evaluates(name: str, label: str) -> None:
    scope, _ = row_scope(name, label)
    for out in ENTRIES[name].signature.outputs:
        dims = shape(name, out, scope)
        assert dims and all(isinstance(d, int) and d > 0 for d in dims)
