"""``SignatureCall``: the frozen record of one call that passed the checks, with the traffic
derived from the effects, the roofline, the effect branch and the symbolic variant's hook."""

from __future__ import annotations

import ast
import copy
import math
import re

import pytest

torch = pytest.importorskip("torch")

from tileops.signature import (  # noqa: E402
    DTypeAdapter,
    SignatureCall,
    SignatureCallError,
    SignaturePlan,
    Stage,
    torch_adapter,
)
from tileops.spec import load_spec_text  # noqa: E402

EFFECTS = """\
ScaleOp:
  family: misc
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[float16 | float32]"}
    params:
      inplace: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[*S]", mutated: inplace}
      acc: {dtype: float32, shape: "[*S]", mutated: true, write_only: true}
      state: {dtype: float32, shape: "[*S]", optional: true, mutated: true}
    outputs:
      y: {dtype: T, shape: "[*S]", alias: x}
      out: {dtype: float32, shape: "[*S]", buffer: true}
"""

bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32


def t(*shape: int, dtype: torch.dtype = f16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@pytest.fixture(scope="module")
def scale() -> SignaturePlan:
    spec = load_spec_text(EFFECTS, "effects.yaml")
    return SignaturePlan("ScaleOp", spec.entries["ScaleOp"], spec=spec)


# --- the record ----------------------------------------------------------------------------------


def test_gemm_record_fields(example_plan) -> None:
    point = example_plan("GemmFwdOp").construct()
    a, b = t(128, 4096, dtype=bf), t(4096, 512, dtype=bf)
    call = point.check(a, b)
    assert isinstance(call, SignatureCall)
    assert call.op == "GemmFwdOp"
    assert call.point is point
    # index values with DType indices as spec names; construction params included
    assert call.indices == {"trans_a": False, "trans_b": False,
                            "M": 128, "N": 512, "K": 4096, "T": "bfloat16"}
    assert call.tensors == {"a": ((128, 4096), "bfloat16"), "b": ((4096, 512), "bfloat16"),
                            "c": ((128, 512), "bfloat16")}
    assert call.input_dtypes == (bf, bf) and call.output_dtypes == (bf,)
    assert call.device == torch.device("cpu")
    assert call.branch == ((), False, ("c",))
    assert (call.written_inputs, call.out_given, call.returned_outputs) == ((), False, ("c",))
    assert call.stages == ()
    assert call.compact() == "a: bf16[128, 4096], b: bf16[4096, 512]"
    assert call.traffic == {"a": (128 * 4096 * 2, 0), "b": (4096 * 512 * 2, 0),
                            "c": (0, 128 * 512 * 2)}


def test_record_is_frozen(example_plan) -> None:
    call = example_plan("GemmFwdOp").construct().check(t(2, 3), t(3, 4))
    with pytest.raises(AttributeError):
        call.values = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        call.device = "cuda"  # type: ignore[misc]


def test_stages_of_a_composite_call(example_plan) -> None:
    gemm = example_plan("GemmFwdOp").construct()
    parent = gemm.check(t(2, 3), t(3, 4))
    subs = (gemm.check(t(2, 3), t(3, 5)), gemm.check(t(2, 5), t(5, 4)))
    parent.add_stage("up", subs[:1])
    parent.add_stage("down", subs[1:])
    assert parent.stages == (Stage("up", subs[:1]), Stage("down", subs[1:]))
    assert [s.calls[0].indices["N"] for s in parent.stages] == [5, 4]


def test_records_do_not_share_stages(example_plan) -> None:
    gemm = example_plan("GemmFwdOp").construct()
    first = gemm.check(t(2, 3), t(3, 4))
    first.add_stage("s", ())
    assert gemm.check(t(2, 3), t(3, 4)).stages == ()


def test_shape_index_is_sliced_on_read(example_plan) -> None:
    point = example_plan("RMSNormFwdOp").construct(normalized_shape=[64])
    call = point.check(t(2, 3, 64))
    assert call.indices["B"] == (2, 3)
    assert call.indices["normalized_shape"] == (64,)
    assert call.tensors["y"] == ((2, 3, 64), "float16")
    assert point.check(t(64)).indices["B"] == ()


# --- effects and traffic --------------------------------------------------------------------------


def test_traffic_out_of_place(scale) -> None:
    call = scale.construct(inplace=False).check(t(4, 8), t(4, 8, dtype=f32))
    assert call.branch == (("acc",), False, ("y", "out"))
    assert call.traffic == {
        "x": (64, 0),    # read only
        "acc": (0, 128),  # write_only: written, never read
        "y": (0, 64),    # a fresh output
        "out": (0, 128),
    }


def test_traffic_inplace_counts_the_aliased_output_once(scale) -> None:
    call = scale.construct(inplace=True).check(t(4, 8), t(4, 8, dtype=f32))
    assert call.written_inputs == ("x", "acc")
    assert call.returned_outputs == ("y", "out")
    assert call.traffic == {
        "x": (64, 64),    # mutated: read and written
        "acc": (0, 128),
        "out": (0, 128),  # y is x: its write is x's, not counted again
    }
    assert call.roofline() == (0, 64 + 64 + 128 + 128)


def test_optional_mutated_input_changes_the_branch(scale) -> None:
    point = scale.construct(inplace=False)
    without = point.check(t(4, 8), t(4, 8, dtype=f32))
    with_state = point.check(t(4, 8), t(4, 8, dtype=f32), t(4, 8, dtype=f32))
    assert without.written_inputs == ("acc",)
    assert with_state.written_inputs == ("acc", "state")
    assert with_state.traffic["state"] == (128, 128)
    assert "state" not in without.traffic
    assert without.tensors["state"] is None and without.input_shapes[2] is None


def test_out_buffer_given(scale) -> None:
    point = scale.construct()
    x, acc = t(4, 8), t(4, 8, dtype=f32)
    call = point.check(x, acc, out=t(4, 8, dtype=f32))
    assert call.out_given is True
    assert call.branch == (("acc",), True, ("y", "out"))
    assert point.check(x, acc, out=None).out_given is False
    with pytest.raises(SignatureCallError, match=r"the buffer given for out must be "
                                                 r"f32\[4, 8\], but is f32\[8, 4\]"):
        point.check(x, acc, out=t(8, 4, dtype=f32))


def test_branch_objects_are_shared(scale) -> None:
    # one branch key object per (point, branch): cheap to use as a dict key
    point = scale.construct()
    x, acc = t(4, 8), t(4, 8, dtype=f32)
    assert point.check(x, acc).branch is point.check(t(2, 2), t(2, 2, dtype=f32)).branch


def test_relu_inplace_counts_the_input_once(example_plan) -> None:
    point = example_plan("ReluFwdOp").construct(inplace=True)
    call = point.check(t(3, 4, dtype=bf))
    assert call.written_inputs == ("input",)
    assert call.traffic == {"input": (24, 24)}
    assert call.roofline() == (12, 48)


# --- roofline --------------------------------------------------------------------------------------


def test_gemm_roofline(example_plan) -> None:
    call = example_plan("GemmFwdOp").construct(trans_b=True).check(t(128, 4096, dtype=bf),
                                                                  t(512, 4096, dtype=bf))
    flops, nbytes = call.roofline()
    assert flops == 2 * 128 * 512 * 4096
    assert nbytes == sum(r + w for r, w in call.traffic.values())
    assert nbytes == 2 * (128 * 4096 + 512 * 4096 + 128 * 512)


@pytest.mark.parametrize(("dtype", "itemsize"), [(f32, 4), (bf, 2)])
def test_maxpool_roofline_uses_the_bytes_formula(example_plan, dtype, itemsize) -> None:
    point = example_plan("MaxPool2dFwdOp").construct(kernel_size=3, stride=2, padding=1)
    call = point.check(t(2, 3, 16, 15, dtype=dtype))
    h_out, w_out = (16 + 2 - 2 - 1) // 2 + 1, (15 + 2 - 2 - 1) // 2 + 1
    assert call.indices["H_out"] == h_out and call.indices["W_out"] == w_out
    assert call.roofline() == (2 * 3 * h_out * w_out * 3 * 3,
                               itemsize * 2 * 3 * (16 * 15 + h_out * w_out))
    assert "nbytes = _isz[i_T] * i_N * i_C" in point.source()


def test_rmsnorm_roofline_depends_on_presence(example_plan) -> None:
    point = example_plan("RMSNormFwdOp").construct(normalized_shape=[4096], eps=1e-6)
    x, w = t(2, 3, 4096, dtype=bf), t(4096, dtype=bf)
    with_weight, without = point.check(x, w), point.check(x)
    assert with_weight.roofline()[0] == 4 * 6 * 4096
    assert without.roofline()[0] == 3 * 6 * 4096
    assert with_weight.roofline()[1] == 2 * (2 * 6 * 4096 + 4096)
    assert without.roofline()[1] == 2 * (2 * 6 * 4096)


def test_moe_layout_selects_the_metadata_and_output_shapes(example_plan) -> None:
    from tileops.spec import AdtValue

    plan = example_plan("MoEGroupedGemmFwdOp")
    masked = plan.construct(layout=AdtValue("masked", {"max_m": 64}))
    a, b = t(100, 32, dtype=bf), t(8, 16, 32, dtype=bf)
    call = masked.check(a, b, t(8, dtype=torch.int32))
    assert call.tensors["c"] == ((8 * 64, 16), "bfloat16")
    contiguous = plan.construct(layout=AdtValue(
        "contiguous", {"packing": "tight", "metadata_kind": "offsets", "alignment": 1}))
    call = contiguous.check(a, b, t(9, dtype=torch.int32))
    assert call.tensors["c"] == ((100, 16), "bfloat16")
    with pytest.raises(SignatureCallError, match=r"metadata.shape\[0\] must be E \+ 1 = 9"):
        contiguous.check(a, b, t(8, dtype=torch.int32))


# --- the symbolic variant ----------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[bool, str]] = []

    def __call__(self, cond: object, message) -> None:
        self.calls.append((bool(cond), message()))


def test_symbolic_check_routes_size_comparisons_through_the_adapter(examples) -> None:
    rec = Recorder()
    adapter = DTypeAdapter("torch", torch_adapter().natives, check=rec)
    plan = SignaturePlan("GemmFwdOp", examples.entries["GemmFwdOp"], spec=examples,
                         adapter=adapter)
    point = plan.construct()
    a, b = t(128, 4096, dtype=bf), t(4096, 512, dtype=bf)
    point.check(a, b)
    assert rec.calls == []  # the plain check never calls the hook
    call = point.check_symbolic(a, b)
    where = plan.where("signature.inputs.b")
    assert rec.calls == [(True, "GemmFwdOp: argument b: expected b: Tensor[T, [K, N]]  "
                                f"(declared Mat[trans_b, K, N]) ({where})")]
    assert call.indices["K"] == 4096
    # a size mismatch is the hook's to decide (torch._check would raise, or assert at run
    # time under tracing); this hook only records it
    rec.calls.clear()
    call = point.check_symbolic(a, t(2048, 512, dtype=bf))
    assert [ok for ok, _ in rec.calls] == [False]
    assert call.indices["N"] == 512


def test_symbolic_refinement_goes_through_the_hook(examples) -> None:
    rec = Recorder()
    adapter = DTypeAdapter("torch", torch_adapter().natives, check=rec)
    plan = SignaturePlan("AttentionFwdOp", examples.entries["AttentionFwdOp"], spec=examples,
                         adapter=adapter)
    q, kv = t(1, 8, 2, 64), t(1, 4, 2, 64)
    plan.construct(is_causal=True).check_symbolic(q, kv, kv)

    def msg(arg: str, expected: str, path: str) -> str:
        return f"AttentionFwdOp: argument {arg}: expected {expected} ({plan.where(path)})"

    k = msg("k", "k: Tensor[T, [B, S_kv, H, D]]", "signature.inputs.k")
    v = msg("v", "v: Tensor[T, [B, S_kv, H, D]]", "signature.inputs.v")
    assert rec.calls == [
        (True, k), (True, k), (True, k),  # k's B, H, D (S_kv binds)
        (True, v), (True, v), (True, v), (True, v),  # all four axes of v
        (False, msg("q", "not is_causal or S_q <= S_kv", "signature.shape_rules[0]")),
        (True, msg("q", "D in (64, 128, 256)", "signature.shape_rules[1]")),
    ]


def test_torch_adapter_hook_is_torch_check(example_plan) -> None:
    point = example_plan("GemmFwdOp").construct()
    with pytest.raises(RuntimeError, match="GemmFwdOp: argument b"):
        point.check_symbolic(t(2, 3), t(4, 5))


def test_generated_traffic_matches_prod(example_plan) -> None:
    call = example_plan("AttentionFwdOp").construct().check(t(2, 5, 3, 64), t(2, 7, 3, 64),
                                                            t(2, 7, 3, 64))
    assert call.traffic == {"q": (math.prod((2, 5, 3, 64)) * 2, 0),
                            "k": (math.prod((2, 7, 3, 64)) * 2, 0),
                            "v": (math.prod((2, 7, 3, 64)) * 2, 0),
                            "o": (0, math.prod((2, 5, 3, 64)) * 2),
                            "lse": (0, 2 * 3 * 5 * 4)}


# --- the record's layout and the hot-path check ----------------------------------------------------


def test_record_is_one_object_of_the_points_class(example_plan) -> None:
    point = example_plan("RMSNormFwdOp").construct(normalized_shape=[64])
    x, w = t(2, 3, 64), t(64)
    call = point.check(x, w)
    assert type(call) is point.record_type and isinstance(call, SignatureCall)
    assert type(call).__struct_fields__ == ("device", "branch", "s_x", "d_x", "s_weight",
                                            "d_weight", "stages")
    # the shape objects the check read are stored as they are, not copied
    assert call.s_x == x.shape and call.d_weight is f16 and call.s_weight == (64,)
    assert call.input_shapes == ((2, 3, 64), (64,)) and call.input_dtypes == (f16, f16)
    without = point.check(x)
    assert (without.s_weight, without.d_weight) == (None, None)
    assert without.input_shapes == ((2, 3, 64), None)
    assert point.derive(call) == (call.values, call.output_shapes, call.output_dtypes)
    assert call.output_shapes == ((2, 3, 64),) and call.output_dtypes == (f16,)


CASES = {
    "GemmFwdOp": ({}, [((4, 8), (8, 2)), ((4, 8), (9, 2)), ((4, 8, 1), (8, 2)), ((4,), (4, 2)),
                       ((0, 8), (8, 0))]),
    "RMSNormFwdOp": ({"normalized_shape": [8]},
                     [((2, 8), (8,)), ((8,), None), ((), None), ((2, 8), (7,)),
                      ((2, 8), (1, 8)), ((2, 7), None)]),
    "MaxPool2dFwdOp": ({"kernel_size": 3, "stride": 2, "padding": 1},
                       [((2, 3, 16, 15),), ((3, 16, 15),), ((2, 3, 1, 1),), ((2, 3, 0, 4),)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hot_path_check_agrees_with_the_exact_check(example_plan, name) -> None:
    params, calls = CASES[name]
    point = example_plan(name).construct(**params)
    for shapes in calls:
        for dtype in (bf, f32):
            args = [None if s is None else t(*s, dtype=dtype) for s in shapes]
            try:
                want = point.check_exact(*args)
            except SignatureCallError as exc:
                with pytest.raises(SignatureCallError) as got:
                    point.check(*args)
                assert str(got.value) == str(exc)
                assert got.value.bound == exc.bound
            else:
                assert point.check(*args) == want


def test_hot_path_check_binds_only_what_a_later_check_reads(example_plan) -> None:
    source = example_plan("RMSNormFwdOp").construct(normalized_shape=[8]).source()
    fast = source.split("def check(")[1].split("def check_symbolic(")[0]
    assert "s_weight == (8,)" in fast  # every axis known: one comparison
    assert "len(s_x)" not in fast  # s_x[-1] raises on a 0-d x: the rank check is implied
    assert "len(s_x) >= 1" in source.split("def check_exact(")[1]


def test_fast_bodies_are_the_hot_path_checks_statements(example_plan) -> None:
    # what a caller fusing the check into its own code gets: per presence combination, the
    # statements and the record as nodes, what they read and what they bind
    point = example_plan("RMSNormFwdOp").construct(normalized_shape=[8])
    x, w = torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    bodies = {tuple(b.presence.items()): b for b in point.fast_bodies}
    assert set(bodies) == {(("weight", False),), (("weight", True),)}
    for (presence,), body in bodies.items():
        given = {"x", "weight"} if presence[1] else {"x"}
        assert {f"{p}_{n}" for n in given for p in "sd"} <= body.binds
        assert body.reads - {"t_x", "t_weight", "len", "tuple", "type"} <= set(point.namespace)
        # the nodes alone, under try, in a function of one's own: the hot path's record
        miss = ast.ExceptHandler(ast.Name("Exception", ast.Load()), None,
                                 [ast.Return(ast.Constant(None))])
        fn = ast.FunctionDef("fused", ast.arguments([], [ast.arg("t_x"), ast.arg("t_weight")],
                                                    None, [], [], None, []),
                             [ast.Try([*body.statements, ast.Return(body.record)], [miss], [],
                                      [])], [], None)
        if "type_params" in ast.FunctionDef._fields:
            fn.type_params = []
        ns = dict(point.namespace)
        module = ast.fix_missing_locations(ast.Module([copy.deepcopy(fn)], []))
        exec(compile(module, "<fused>", "exec"), ns)
        weight = w if presence[1] else None
        assert ns["fused"](x, weight) == point.check(x, weight)
        assert ns["fused"](torch.empty(2, 7, dtype=torch.bfloat16), weight) is None  # a miss
    assert point.fast_bodies[0].statements[0].lineno is not None  # as parsed, positions kept


def test_hot_path_simplification_reads_the_parsed_statements() -> None:
    from tileops.signature.simplify import simplify_fast

    head = ["try:", "    s_x = t_x.shape", "    if not (len(s_x) >= 2): raise _Miss",
            "    i_A = s_x[0]", "    i_B = s_x[-2]"]
    tail = ["    if t_out is not None:", "        i_C = s_x[1]", "    return _R(s_x)"]
    # i_B: read by nothing after it, dropped; the rank check stays: no statement starts by
    # reading s_x[-2] or s_x[1] (i_A is read first), and a nested block is not the body
    lines = [*head, "    if not (i_A == s_x[1]): raise _Miss", *tail]
    assert simplify_fast(lines)[0] == [*head[:4], lines[5], *tail]
    # a statement that starts by reading s_x[1] implies the rank check
    lines = [*head, "    if not (s_x[1] == i_A): raise _Miss", *tail]
    assert simplify_fast(lines)[0] == [*head[:2], head[3], lines[5], *tail]
    # a binding that may fail (a division) is kept though nothing reads it
    lines = [*head[:4], "    i_D = i_A // s_x[0]", "    return _R(s_x)"]
    kept, statements = simplify_fast(lines)
    assert kept == lines
    # and the statements kept, as parsed (the closing return among them)
    assert [ast.dump(st) for st in statements] == [ast.dump(ast.parse(line.strip()).body[0])
                                                   for line in lines[1:]]


SHAPE_ONLY = """\
SpreadOp:
  family: misc
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[float16 | float32]"}
    inputs:
      dy: {dtype: T, shape: "[1]"}
      x: {dtype: T, shape: "[*S]", shape_only: true}
    outputs:
      dx: {dtype: T, shape: "[*S]"}
"""


def test_a_shape_only_input_counts_no_traffic_and_explain_says_so() -> None:
    from tileops.signature import explain

    spec = load_spec_text(SHAPE_ONLY, "spread.yaml")
    plan = SignaturePlan("SpreadOp", spec.entries["SpreadOp"], spec=spec)
    # x's elements are never read: a stand-in of its shape (one element, strides 0) serves
    stand_in = torch.empty((), dtype=f16).expand(64, 32)
    call = plan.construct().check(t(1), stand_in)
    assert call.traffic == {"dy": (2, 0), "x": (0, 0), "dx": (0, 64 * 32 * 2)}
    assert "reads only the shape of x" in explain(plan)


def _op_point(signature: str, file: str, roofline: str | None = None, **params):
    """The construction point of a one-entry spec ``Op`` whose signature block is
    ``signature`` (YAML), and ``roofline``'s flops formula where given."""
    import textwrap


    text = ("Op:\n  family: misc\n  status: spec-only\n  signature:\n"
            + textwrap.indent(textwrap.dedent(signature), "    ")
            + (f'  roofline:\n    flops: "{roofline}"\n' if roofline else ""))
    spec = load_spec_text(text, file)
    return SignaturePlan("Op", spec.entries["Op"], spec=spec).construct(**params)


#: buffer output names that were once the check's own parameters: builtins it calls, its
#: globals and parameters, an input's generated name
_HOSTILE_BUFFER_NAMES = ["len", "type", "locals", "_R", "_AT", "_fail", "_SCE", "_NO", "_kw",
                         "_rest", "check_exact", "t_x", "s_x", "i_N", "y"]


@pytest.mark.parametrize("name", _HOSTILE_BUFFER_NAMES)
def test_an_out_buffer_of_any_valid_name_is_checked_as_any_other(name) -> None:
    """A buffer output's name is a keyword of the call, never a name the generated check
    binds: with the buffer absent, given, and of the wrong shape, the checks behave as for
    ``y``, and a missing required input is still refused by the op's signature."""
    point = _op_point(f"""\
        forall: {{N: Dim}}
        inputs:
          x: {{dtype: float32, shape: "[N]"}}
        outputs:
          {name}: {{dtype: float32, shape: "[N]", buffer: true}}
        """, "buffers.yaml")
    x, buf, bad = torch.empty(4), torch.empty(4), torch.empty(5)
    for check in (point.check, point.check_exact):
        assert check(x).out_given is False
        assert check(x, **{name: buf}).out_given is True
        with pytest.raises(SignatureCallError, match=rf"argument {name} does not match"):
            check(x, **{name: bad})
        with pytest.raises(TypeError, match=r"Op\.check\(x, \*, .*\): required input x not "):
            check()


@pytest.mark.parametrize(("need", "refused"), [(True, True), (False, False)])
def test_an_input_optional_under_a_predicate_may_be_left_out_only_where_it_holds(need, refused):
    """``optional: "not need"``: at a point where the predicate is false the input is
    required, and leaving it out is refused naming it, the predicate and the params' values;
    where it holds (or the input is given) the call passes."""
    point = _op_point("""\
        forall: {N: Dim}
        params: {need: {type: bool, default: false}}
        inputs:
          x: {dtype: float32, shape: "[N]"}
          w: {dtype: float32, shape: "[N]", optional: "not need"}
        outputs:
          y: {dtype: float32, shape: "[N]"}
        """, "optional.yaml", need=need)
    x = torch.empty(3)
    for check in (point.check, point.check_exact):
        assert check(x, torch.empty(3)) is not None
        if refused:
            with pytest.raises(SignatureCallError) as info:
                check(x)
            assert info.value.argument == "w"
            assert ("w is required here: it may be left out only where 'not need' holds, and "
                    "it does not (need = True)") in str(info.value)
        else:
            assert check(x) is not None


def test_a_buffer_on_another_device_or_for_an_absent_output_is_refused() -> None:
    """An out= buffer must be on the call's device (torch refuses a cross-device out= too),
    and a buffer for an output the call does not have (nullable here) is refused, not
    dropped unwritten; a buffer for an output the call has is taken."""
    signature = """\
        forall: {N: Dim}
        params: {flag: {type: bool, default: false}}
        inputs:
          x: {dtype: float32, shape: "[N]"}
        outputs:
          y: {dtype: float32, shape: "[N]", buffer: true}
          z: {dtype: float32, shape: "[N]", nullable: "not flag", buffer: true}
        """
    point = _op_point(signature, "buffers.yaml")
    x = torch.empty(3)
    for check in (point.check, point.check_exact):
        with pytest.raises(SignatureCallError, match="the buffer given for y is on meta, the "
                                                     "call's inputs on cpu"):
            check(x, y=torch.empty(3, device="meta"))
        with pytest.raises(SignatureCallError, match="a buffer was given for z, but this call "
                                                     "has no z output"):
            check(x, z=torch.empty(3))
        assert check(x, y=torch.empty(3)).out_given
    assert _op_point(signature, "buffers.yaml", flag=True).check(x, z=torch.empty(3)).out_given


@pytest.mark.parametrize(("shape", "params", "bad", "because"), [
    ("[N, H - 3]", {}, (4, 0), "y's shape would be [4, -3]: not a shape"),
    ("[N, k]", {"k": -1}, (4, 2), "y's shape would be [4, -1]: not a shape"),
    ("[N, H ** -1]", {}, (4, 2), "y's shape would be [4, 0.5]: not a shape"),
    ("[N // H]", {}, (4, 0), "these sizes failed: a division by zero"),
])
def test_an_output_axis_the_signature_computes_is_checked_on_the_call(shape, params, bad,
                                                                      because):
    """An output axis computed from the call's sizes or a param must be a size: a call that
    makes it negative, fractional or incomputable is refused by the check (each form of it),
    naming the output, not left to fail when the outputs are derived."""
    point = _op_point(f"""\
        forall: {{N: Dim, H: Dim}}
        params: {{k: {{type: int, default: 1}}}}
        inputs:
          x: {{dtype: float32, shape: "[N, H]"}}
        outputs:
          y: {{dtype: float32, shape: "{shape}"}}
        """, "outputs.yaml", **params)
    for check in (point.check, point.check_exact):
        with pytest.raises(SignatureCallError, match=re.escape(because)):
            check(torch.empty(*bad))
    if shape == "[N, H - 3]":  # a call the computed axis holds on
        assert point.check(torch.empty(4, 4)).output_shapes == ((4, 1),)


@pytest.mark.parametrize(("shape", "params"), [("[N - N + 3]", {}), ("[0 * N + 3]", {}),
                                               ("[k * N]", {"k": 0})])
def test_an_axis_whose_factor_is_0_is_refused_at_construction(shape, params) -> None:
    """An index read off an axis that does not depend on it (its affine factor folds to 0)
    has no value: refused where the point is constructed, naming the axis, rather than every
    call failing on a division by zero."""
    from tileops.spec import SpecError

    with pytest.raises(SpecError, match=r"does not depend on N \(its factor is 0"):
        _op_point(f"""\
            forall: {{N: Dim}}
            params: {{k: {{type: int, default: 1}}}}
            inputs:
              x: {{dtype: float32, shape: "{shape}"}}
            outputs:
              y: {{dtype: float32, shape: "[N]"}}
            """, "zero.yaml", **params)


def test_an_axis_whose_factor_read_from_the_call_is_0_is_refused_by_name() -> None:
    point = _op_point("""\
        forall: {N: Dim, K: Dim}
        inputs:
          a: {dtype: float32, shape: "[K]"}
          x: {dtype: float32, shape: "[K * N]"}
        outputs:
          y: {dtype: float32, shape: "[N]"}
        """, "zero.yaml")
    assert point.check(torch.empty(2), torch.empty(6)).output_shapes == ((3,),)
    for check in (point.check, point.check_exact):
        with pytest.raises(SignatureCallError, match=r"K \* N does not depend on N for these "
                                                     r"sizes \(its factor is 0\)"):
            check(torch.empty(0), torch.empty(0))


@pytest.mark.parametrize(("k", "why"), [(float("inf"), "cannot convert float infinity"),
                                        (float("nan"), "cannot convert float NaN"),
                                        (-1.0, "give -4 flops and 32 bytes")])
def test_a_roofline_with_no_count_is_refused_naming_the_op(k, why) -> None:
    """A float param of inf or nan (or one that makes a count negative) in a roofline formula
    is refused by the op's name and the formula's value, not a bare OverflowError."""
    signature = """\
        forall: {N: Dim}
        params: {k: {type: float}}
        inputs:
          x: {dtype: float32, shape: "[N]"}
        outputs:
          y: {dtype: float32, shape: "[N]"}
        """
    point = _op_point(signature, "roofline.yaml", roofline="k * N", k=k)
    with pytest.raises(ValueError, match=rf"^Op: the roofline's formulas .*{re.escape(why)}"):
        point.roofline(point.check(torch.empty(4)))
    good = _op_point(signature, "roofline.yaml", roofline="k * N", k=2.0)
    assert good.roofline(good.check(torch.empty(4))) == (8, 32)
