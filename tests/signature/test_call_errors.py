"""Call errors: one test per failure kind, each pinning the whole message.

Every call error has the same structure: the op and the argument, what the signature
expected (in spec notation, with the declared form when a family or param folded it), what
was seen, why, the whole call in compact form, every index bound so far, and the spec's
``file:line`` with the entry path. The spec is written here so its lines are fixed.
"""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")

from tileops.signature import ConstructionError, SignatureCallError, SignaturePlan  # noqa: E402
from tileops.spec import SpecError, load_spec_text  # noqa: E402

SPEC = """\
GemmFwdOp:
  family: gemm
  status: implemented
  signature:
    types:
      Mat:
        params: {t: Bool, R: Dim, C: Dim}
        match: t
        cases:
        - {when: false, is: "[R, C]"}
        - {when: true, is: "[C, R]"}
    forall: {M: Dim, N: Dim, K: Dim, T: "DType[float16 | bfloat16]"}
    params:
      trans_a: {type: bool, default: false}
      trans_b: {type: bool, default: false}
    inputs:
      a: {dtype: T, shape: "Mat[trans_a, M, K]"}
      b: {dtype: T, shape: "Mat[trans_b, K, N]"}
    outputs:
      c: {dtype: T, shape: "[M, N]"}
  roofline:
    flops: "2 * M * N * K"

GatherPadOp:
  family: misc
  status: spec-only
  signature:
    forall: {S: Shape, H: Dim, T: "DType[float16 | float32]"}
    params:
      groups: {type: int, default: 2}
    inputs:
      x: {dtype: T, shape: "[*S, 2 * H + 1]"}
      y: {dtype: T, shape: "[*S, H + 3]"}
      index: {dtype: int32, shape: "[H, 2]"}
      bias: {dtype: T, shape: "[H]", optional: true}
    outputs:
      out: {dtype: T, shape: "[*S, H]", buffer: true}
    shape_rules:
    - "H % groups == 0"

PoolOp:
  family: pool
  status: spec-only
  signature:
    forall: {N: Dim, H: Dim, T: "DType[float32]"}
    params:
      kernel: {type: int, default: 3}
    inputs:
      x: {dtype: T, shape: "[N, H]"}
    outputs:
      y: {dtype: T, shape: "[N, H_out]"}
    let:
      H_out: "H - kernel + 1"
    shape_rules:
    - "H_out > 0"
"""

bf, f16, f32, i32, i64 = torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64


def T(*shape: int, dtype: torch.dtype = bf) -> torch.Tensor:  # noqa: N802
    return torch.empty(shape, dtype=dtype)


def X(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:  # noqa: N802
    return torch.empty(shape, dtype=dtype)


@pytest.fixture(scope="module")
def points():
    spec = load_spec_text(SPEC, "errors.yaml")
    return {
        "gemm": SignaturePlan("GemmFwdOp", spec.entries["GemmFwdOp"], spec=spec).construct(),
        "pad": SignaturePlan("GatherPadOp", spec.entries["GatherPadOp"], spec=spec).construct(),
        "pool": SignaturePlan("PoolOp", spec.entries["PoolOp"], spec=spec).construct(),
    }


CASES = [
    # rank mismatch
    pytest.param(
        "gemm", lambda: (T(128, 4096, 1), T(4096, 512),), lambda: {},
        """\
        GemmFwdOp: argument a does not match the signature
          expected: a: Tensor[T, [M, K]]  (declared Mat[trans_a, M, K])
          seen:     a: bf16[128, 4096, 1]
          because:  a has 3 dims, but [M, K] has 2
          call:     a: bf16[128, 4096, 1], b: bf16[4096, 512]
          bound:    T = bfloat16
          spec:     errors.yaml:17 (GemmFwdOp.signature.inputs.a)""",
        id="rank",
    ),
    # a dim bound earlier (K from a) differs in b
    pytest.param(
        "gemm", lambda: (T(128, 4096), T(2048, 512),), lambda: {},
        """\
        GemmFwdOp: argument b does not match the signature
          expected: b: Tensor[T, [K, N]]  (declared Mat[trans_b, K, N])
          seen:     b: bf16[2048, 512]
          because:  K bound to 4096 by a.shape[1], but b.shape[0] is 2048
          call:     a: bf16[128, 4096], b: bf16[2048, 512]
          bound:    T = bfloat16, M = 128, K = 4096
          spec:     errors.yaml:18 (GemmFwdOp.signature.inputs.b)""",
        id="bound_dim",
    ),
    # the dtype is not in the declared set of T
    pytest.param(
        "gemm", lambda: (T(128, 4096, dtype=f32), T(4096, 512),), lambda: {},
        """\
        GemmFwdOp: argument a does not match the signature
          expected: a: Tensor[T, [M, K]]  (declared Mat[trans_a, M, K])
          seen:     a: f32[128, 4096]
          because:  a.dtype is float32, but T must be one of float16, bfloat16
          call:     a: f32[128, 4096], b: bf16[4096, 512]
          bound:    (nothing)
          spec:     errors.yaml:17 (GemmFwdOp.signature.inputs.a)""",
        id="dtype_set",
    ),
    # the dtype differs from the T bound by a
    pytest.param(
        "gemm", lambda: (T(128, 4096), T(4096, 512, dtype=f16),), lambda: {},
        """\
        GemmFwdOp: argument b does not match the signature
          expected: b: Tensor[T, [K, N]]  (declared Mat[trans_b, K, N])
          seen:     b: f16[4096, 512]
          because:  T bound to bfloat16 by a.dtype, but b.dtype is float16
          call:     a: bf16[128, 4096], b: f16[4096, 512]
          bound:    T = bfloat16, M = 128, K = 4096
          spec:     errors.yaml:18 (GemmFwdOp.signature.inputs.b)""",
        id="dtype_bound",
    ),
    # a required input is None: what a bound is listed
    pytest.param(
        "gemm", lambda: (T(128, 4096), None,), lambda: {},
        """\
        GemmFwdOp: argument b does not match the signature
          expected: b: Tensor[T, [K, N]]  (declared Mat[trans_b, K, N])
          seen:     b: None
          because:  b is required, got None
          call:     a: bf16[128, 4096], b: None
          bound:    T = bfloat16, M = 128, K = 4096
          spec:     errors.yaml:18 (GemmFwdOp.signature.inputs.b)""",
        id="none",
    ),
    # a required input is not a tensor
    pytest.param(
        "gemm", lambda: ([[1.0]], T(4096, 512),), lambda: {},
        """\
        GemmFwdOp: argument a does not match the signature
          expected: a: Tensor[T, [M, K]]  (declared Mat[trans_a, M, K])
          seen:     a: list
          because:  a must be a tensor (an object with .shape and .dtype), got list
          call:     a: list, b: bf16[4096, 512]
          bound:    (nothing)
          spec:     errors.yaml:17 (GemmFwdOp.signature.inputs.a)""",
        id="not_tensor",
    ),
    # a fixed (literal) dim
    pytest.param(
        "pad", lambda: (X(4, 9), X(4, 7), X(4, 3, dtype=i32),), lambda: {},
        """\
        GatherPadOp: argument index does not match the signature
          expected: index: Tensor[int32, [H, 2]]
          seen:     index: i32[4, 3]
          because:  index.shape[1] must be 2, but is 3
          call:     x: f32[4, 9], y: f32[4, 7], index: i32[4, 3], bias: None
          bound:    T = float32, H = 4, S = [4]
          spec:     errors.yaml:34 (GatherPadOp.signature.inputs.index)""",
        id="fixed_dim",
    ),
    # a constant dtype (int32)
    pytest.param(
        "pad", lambda: (X(4, 9), X(4, 7), X(4, 2, dtype=i64),), lambda: {},
        """\
        GatherPadOp: argument index does not match the signature
          expected: index: Tensor[int32, [H, 2]]
          seen:     index: i64[4, 2]
          because:  index.dtype must be int32, but is int64
          call:     x: f32[4, 9], y: f32[4, 7], index: i64[4, 2], bias: None
          bound:    T = float32, H = 4, S = [4]
          spec:     errors.yaml:34 (GatherPadOp.signature.inputs.index)""",
        id="const_dtype",
    ),
    # 2 * H + 1 = 8 has no solution; H is not listed as bound
    pytest.param(
        "pad", lambda: (X(4, 8), X(4, 7), X(4, 2, dtype=i32),), lambda: {},
        """\
        GatherPadOp: argument x does not match the signature
          expected: x: Tensor[T, [*S, 2 * H + 1]]
          seen:     x: f32[4, 8]
          because:  x.shape[-1] is 8, but 2 * H + 1 has no solution H >= 0 there
          call:     x: f32[4, 8], y: f32[4, 7], index: i32[4, 2], bias: None
          bound:    T = float32
          spec:     errors.yaml:32 (GatherPadOp.signature.inputs.x)""",
        id="affine",
    ),
    # the *S part of y differs from S bound by x
    pytest.param(
        "pad", lambda: (X(4, 9), X(5, 7), X(4, 2, dtype=i32),), lambda: {},
        """\
        GatherPadOp: argument y does not match the signature
          expected: y: Tensor[T, [*S, H + 3]]
          seen:     y: f32[5, 7]
          because:  S is [4] (bound by x.shape[0:-1]), but that part of the shape is [5]
          call:     x: f32[4, 9], y: f32[5, 7], index: i32[4, 2], bias: None
          bound:    T = float32, H = 4, S = [4]
          spec:     errors.yaml:33 (GatherPadOp.signature.inputs.y)""",
        id="splice",
    ),
    # an axis after a part of known length (S bound by x) is named from the end, as
    # the axis the call passed, never by the check's own variables
    pytest.param(
        "pad", lambda: (X(4, 9), X(4, 6), X(4, 2, dtype=i32),), lambda: {},
        """\
        GatherPadOp: argument y does not match the signature
          expected: y: Tensor[T, [*S, H + 3]]
          seen:     y: f32[4, 6]
          because:  y.shape[-1] must be H + 3 = 7, but is 6
          call:     x: f32[4, 9], y: f32[4, 6], index: i32[4, 2], bias: None
          bound:    T = float32, H = 4, S = [4]
          spec:     errors.yaml:33 (GatherPadOp.signature.inputs.y)""",
        id="after_known_part",
    ),
    # a refinement over a call-time index and a param
    pytest.param(
        "pad", lambda: (X(4, 11), X(4, 8), X(5, 2, dtype=i32),), lambda: {},
        """\
        GatherPadOp: argument x does not match the signature
          expected: H % groups == 0
          seen:     x: f32[4, 11]
          because:  refinement 'H % groups == 0' does not hold (H = 5, groups = 2)
          call:     x: f32[4, 11], y: f32[4, 8], index: i32[5, 2], bias: None
          bound:    T = float32, H = 5, S = [4]
          spec:     errors.yaml:39 (GatherPadOp.signature.shape_rules[0])""",
        id="refinement",
    ),
    # a given optional input is checked like any other
    pytest.param(
        "pad", lambda: (X(4, 9), X(4, 7), X(4, 2, dtype=i32), X(5),), lambda: {},
        """\
        GatherPadOp: argument bias does not match the signature
          expected: bias: Tensor[T, [H]]
          seen:     bias: f32[5]
          because:  H bound to 4 by x.shape[-1], but bias.shape[0] is 5
          call:     x: f32[4, 9], y: f32[4, 7], index: i32[4, 2], bias: f32[5]
          bound:    T = float32, H = 4, S = [4]
          spec:     errors.yaml:35 (GatherPadOp.signature.inputs.bias)""",
        id="optional",
    ),
    # an out= buffer of the wrong shape
    pytest.param(
        "pad", lambda: (X(4, 9), X(4, 7), X(4, 2, dtype=i32),), lambda: {'out': X(4, 5)},
        """\
        GatherPadOp: argument out does not match the signature
          expected: out: Tensor[T, [*S, H]]
          seen:     out: f32[4, 5]
          because:  the buffer given for out must be f32[4, 4], but is f32[4, 5]
          call:     x: f32[4, 9], y: f32[4, 7], index: i32[4, 2], bias: None, out: f32[4, 5]
          bound:    T = float32, H = 4, S = [4]
          spec:     errors.yaml:37 (GatherPadOp.signature.outputs.out)""",
        id="out",
    ),
    # an out= buffer of the wrong dtype
    pytest.param(
        "pad", lambda: (X(4, 9), X(4, 7), X(4, 2, dtype=i32),), lambda: {'out': X(4, 4, dtype=f16)},
        """\
        GatherPadOp: argument out does not match the signature
          expected: out: Tensor[T, [*S, H]]
          seen:     out: f16[4, 4]
          because:  the buffer given for out must be f32[4, 4], but is f16[4, 4]
          call:     x: f32[4, 9], y: f32[4, 7], index: i32[4, 2], bias: None, out: f16[4, 4]
          bound:    T = float32, H = 4, S = [4]
          spec:     errors.yaml:37 (GatherPadOp.signature.outputs.out)""",
        id="out_dtype",
    ),
    # a required input None after a Shape index was sliced
    pytest.param(
        "pad", lambda: (X(4, 9), None, X(4, 2, dtype=i32),), lambda: {},
        """\
        GatherPadOp: argument y does not match the signature
          expected: y: Tensor[T, [*S, H + 3]]
          seen:     y: None
          because:  y is required, got None
          call:     x: f32[4, 9], y: None, index: i32[4, 2], bias: None
          bound:    T = float32, H = 4, S = [4]
          spec:     errors.yaml:33 (GatherPadOp.signature.inputs.y)""",
        id="required_none_p",
    ),
    # a refinement over a let: the argument is the input the let's index came from
    pytest.param(
        "pool", lambda: (X(2, 2),), lambda: {},
        """\
        PoolOp: argument x does not match the signature
          expected: H_out > 0
          seen:     x: f32[2, 2]
          because:  refinement 'H_out > 0' does not hold (H_out = 0)
          call:     x: f32[2, 2]
          bound:    T = float32, N = 2, H = 2, H_out = 0
          spec:     errors.yaml:55 (PoolOp.signature.shape_rules[0])""",
        id="refinement_through_let",
    ),
]


@pytest.mark.parametrize(("point", "args", "kwargs", "message"), CASES)
def test_call_error_message(points, point, args, kwargs, message) -> None:
    with pytest.raises(SignatureCallError) as info:
        points[point].check(*args(), **kwargs())
    assert type(info.value) is SignatureCallError
    assert str(info.value) == textwrap.dedent(message)


def test_call_error_fields(points) -> None:
    # The parts of the message are also attributes, for tools that format their own.
    with pytest.raises(SignatureCallError) as info:
        points["gemm"].check(T(128, 4096), T(2048, 512))
    e = info.value
    assert (e.op, e.argument) == ("GemmFwdOp", "b")
    assert e.expected == "b: Tensor[T, [K, N]]  (declared Mat[trans_b, K, N])"
    assert e.seen == "b: bf16[2048, 512]"
    assert e.because == "K bound to 4096 by a.shape[1], but b.shape[0] is 2048"
    assert e.call == "a: bf16[128, 4096], b: bf16[2048, 512]"
    assert e.bound == {"T": "bfloat16", "M": 128, "K": 4096}
    assert e.spec == "errors.yaml:18 (GemmFwdOp.signature.inputs.b)"
    assert isinstance(e, ValueError)


def test_error_types_are_distinct() -> None:
    # a bad call (the caller's fault) and a bad spec (the author's fault) are distinct types;
    # a bad construction is a bad call
    assert issubclass(ConstructionError, SignatureCallError)
    assert not issubclass(SpecError, SignatureCallError)
    assert not issubclass(SignatureCallError, SpecError)


def test_the_symbolic_check_keeps_the_static_checks(points) -> None:
    # rank and dtype are static under tracing: check_symbolic raises the same error for them
    with pytest.raises(SignatureCallError, match="a has 3 dims, but \\[M, K\\] has 2"):
        points["gemm"].check_symbolic(T(128, 4096, 1), T(4096, 512))
    with pytest.raises(SignatureCallError, match="T bound to bfloat16 by a.dtype"):
        points["gemm"].check_symbolic(T(128, 4096), T(4096, 512, dtype=f16))


def test_arithmetic_failing_on_the_given_sizes_is_a_call_error() -> None:
    torch = pytest.importorskip("torch")
    from tileops.spec import load_spec_text

    spec = load_spec_text(
        "DivOp:\n"
        "  family: t\n"
        "  status: spec-only\n"
        "  signature:\n"
        "    forall: {M: Dim, N: Dim}\n"
        "    inputs:\n"
        '      x: {dtype: float32, shape: "[M, N]"}\n'
        "    outputs:\n"
        '      y: {dtype: float32, shape: "[M, Q]"}\n'
        '    let: {Q: "ceil_div(M, N)"}\n', "div.yaml")
    point = SignaturePlan("DivOp", spec.entries["DivOp"], spec=spec).construct()
    assert point.check(torch.empty(4, 2)).output_shapes == ((4, 2),)
    with pytest.raises(SignatureCallError) as info:
        point.check(torch.empty(4, 0))
    assert info.value.argument == "x"
    assert info.value.because == "let Q = ceil_div(M, N) fails on these sizes: ceil_div by zero"
    assert info.value.bound == {"M": 4, "N": 0}
    assert info.value.spec == "div.yaml:10 (DivOp.signature.let.Q)"


@pytest.mark.parametrize(("point", "call", "message"), [
    ("pad", lambda c: c(X(4, 9)),
     "GatherPadOp.check(x, y, index, bias=None, *, out=None): required inputs y, index not "
     "given"),
    ("pad", lambda c: c(X(4, 9), X(4, 7), X(4, 2, dtype=i32), None, X(4)),
     "GatherPadOp.check(x, y, index, bias=None, *, out=None) takes 4 inputs, got 5: 1 extra "
     "positional argument after bias"),
    ("pad", lambda c: c(X(4, 9), y=X(4, 7)),
     "GatherPadOp.check(x, y, index, bias=None, *, out=None): unexpected keyword argument 'y' "
     "(inputs are passed by position: y is input 2); keywords: out"),
    ("pool", lambda c: c(X(2, 2), scale=2),
     "PoolOp.check(x): unexpected keyword argument 'scale'; keywords: none"),
    ("pool", lambda c: c(), "PoolOp.check(x): required input x not given"),
])
def test_a_wrong_number_of_arguments_names_the_op_and_its_signature(points, point, call,
                                                                     message) -> None:
    """The engine used on its own: a check called with an input missing, one too many or a
    keyword it does not take says so by the op's names, not by the generated parameters'
    (t_x), in every mode."""
    p = points[point]
    for check in (p.check, p.check_exact, p.check_symbolic):
        with pytest.raises(TypeError) as info:
            call(check)
        assert str(info.value) == message
