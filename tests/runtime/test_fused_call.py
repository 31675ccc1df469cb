"""The fused call (fastpath.py): after a call succeeds through ``Op._run_call``, plain calls of
the instance run one generated function with that call's decisions folded in. Every rule of
the general path must hold on it; whatever it was not built for goes to ``_run_call``."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from tileops.runtime import CallSpec, Kernel, KernelInterface, Op, SpecSet, register_builder
from tileops.signature import SignatureCallError

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")


class ScaleSpec(CallSpec, frozen=True):
    n: int
    dtype: torch.dtype


class ScaleIface(KernelInterface):
    slot = "scale"
    call_spec = ScaleSpec


class ScaleKernel(Kernel, ScaleIface):
    devices = ("cpu", "meta")
    general = True
    fail = False

    def __call__(self, x, bias, y, alpha):
        if ScaleKernel.fail:
            raise RuntimeError("kernel failed")
        y.copy_(x * alpha if bias is None else x * alpha + bias)


class FusedScaleOp(Op, specs=SPECS, entry="ScaleOp"):
    kernel_types = {ScaleIface: (ScaleKernel,)}

    def forward(self, call, x, bias, y):
        self.kernel(ScaleIface, ScaleSpec(call.device, x.shape[-1], x.dtype))(x, bias, y,
                                                                               self.alpha)


class FusedAddOp(Op, specs=SPECS, entry="AddOp"):
    kernel_types = {ScaleIface: (ScaleKernel,)}

    def forward(self, call, a, b, out):
        torch.add(a, b, out=out)


class FusedNegOp(Op, specs=SPECS, entry="NegOp"):
    kernel_types = {ScaleIface: (ScaleKernel,)}

    def forward(self, call, x, y):
        torch.neg(x, out=y)


@pytest.fixture(autouse=True)
def _kernels_succeed():
    yield
    ScaleKernel.fail = False


class Counting:
    """Counts the calls that reach ``op._run_call`` (the general path)."""

    def __init__(self, op: Op) -> None:
        self.n = 0
        general = op._run_call

        def run(inputs, kwargs):
            self.n += 1
            return general(inputs, kwargs)

        op._run_call = run  # type: ignore[method-assign]


def test_a_plain_call_after_a_success_runs_the_fused_call() -> None:
    op = FusedScaleOp(alpha=3.0)
    assert op._fast is None
    x = torch.randn(2, 5)
    op(x)
    assert op._fast is not None and "def fast(op, t_x, t_bias)" in op._fast_source
    general = Counting(op)
    first = op.last_call
    x2, b = torch.randn(4, 5), torch.randn(5)
    torch.testing.assert_close(op(x2), x2 * 3.0)
    torch.testing.assert_close(op(x2, b), x2 * 3.0 + b)  # the other presence body
    assert general.n == 0
    call = op.last_call
    assert call is not first and type(call) is type(first)
    assert call.tensors == {"x": ((4, 5), "float32"), "bias": ((5,), "float32"),
                            "y": ((4, 5), "float32")}
    assert call.branch == first.branch and call.device == torch.device("cpu")


def test_what_it_was_not_built_for_goes_to_the_general_path() -> None:
    op = FusedAddOp()
    a = torch.ones(3)
    op(a, a)
    general = Counting(op)
    buf = torch.empty(3)
    assert op(a, a, out=buf) is buf  # out=: the general path
    assert op(a, b=a).shape == (3,)  # an input by keyword
    with pytest.raises(TypeError) as got:
        op(a, a, a)  # too many inputs: the same error as a first call's
    with pytest.raises(TypeError) as expected:
        FusedAddOp()(a, a, a)
    assert str(got.value) == str(expected.value)
    with pytest.raises(TypeError, match="input 'a' given twice"):
        op(a, a=a)
    assert general.n == 4
    op(a, a)
    assert general.n == 4


def test_a_failing_check_raises_the_exact_error_and_keeps_the_last_call() -> None:
    fresh, warm = FusedScaleOp(), FusedScaleOp()
    warm(torch.ones(2, 3))
    before = warm.last_call
    bad = (torch.ones(2, 3), torch.ones(4))
    with pytest.raises(SignatureCallError) as expected:
        fresh(*bad)
    with pytest.raises(SignatureCallError) as got:
        warm(*bad)
    assert str(got.value) == str(expected.value)
    with pytest.raises(SignatureCallError, match="T must be one of"):
        warm(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(SignatureCallError, match="x is required"):
        warm(None)
    assert warm.last_call is before and warm._fast is not None


@pytest.mark.parametrize("targeted", [False, True], ids=["in-tree", "target"])
def test_an_input_on_another_device_is_refused_on_the_fused_call(new_target, targeted) -> None:
    if targeted:
        name = new_target()
        register_builder(name, FusedScaleOp, lambda op, call: lambda x, bias, y: y.copy_(x))
        make = lambda: FusedScaleOp(alpha=1.0, target=name)  # noqa: E731
    else:
        make = lambda: FusedScaleOp(alpha=1.0)  # noqa: E731
    x, bias = torch.ones(2, 3), torch.zeros(3)
    op = make()
    op(x, bias)  # a first good call builds the fused call
    assert op._fast is not None and "t_bias.device == dev_x" in op._fast_source
    before = op.last_call
    general = Counting(op)
    with pytest.raises(SignatureCallError) as got:
        op(x, bias.to("meta"))
    with pytest.raises(SignatureCallError) as expected:
        make()(x, bias.to("meta"))  # a fresh instance: the general path's exact check
    assert str(got.value) == str(expected.value)
    assert got.value.because == ("bias is on meta, x on cpu: the tensors of one call must "
                                 "share a device")
    assert general.n == 1  # the fused call's miss went to the general path, which refused
    assert op.last_call is before and op._fast is not None
    torch.testing.assert_close(op(x, bias), x)  # a third good call works, fused
    assert general.n == 1 and op.last_call is not before


def test_a_failing_kernel_keeps_the_last_call_and_the_binding() -> None:
    op = FusedScaleOp()
    op(torch.ones(2, 3))
    before, entries = op.last_call, dict(op._entries_by_call)
    ScaleKernel.fail = True
    with pytest.raises(RuntimeError, match="kernel failed"):
        op(torch.ones(2, 3))
    assert op.last_call is before
    assert op.serving_target == "tileops" and op._entries_by_call == entries
    ScaleKernel.fail = False
    op(torch.ones(2, 3))
    assert op.last_call is not before


def test_forward_only_holds_on_the_fused_call() -> None:
    op = FusedScaleOp()
    op(torch.ones(2, 3))
    x = torch.ones(2, 3, requires_grad=True)
    before = op.last_call
    with pytest.raises(RuntimeError, match=r"forward-only .* x requires grad"):
        op(x)
    with pytest.raises(RuntimeError, match=r"forward-only .* bias requires grad"):
        op(torch.ones(2, 3), torch.ones(3, requires_grad=True))
    assert op.last_call is before
    with torch.no_grad():
        op(x)
    assert op.last_call is not before


def test_a_reset_drops_the_fused_call_and_the_next_call_rebinds(new_target) -> None:
    name = new_target()
    built = []
    register_builder(name, FusedScaleOp, lambda o, c: built.append(c) or
                     (lambda x, bias, y: y.copy_(x)))
    op = FusedScaleOp(target=name)
    op(torch.ones(2, 3))
    assert op._fast is not None
    op._reset_binding()
    assert op._fast is None and op.serving_target is None
    op(torch.ones(2, 3))
    assert op.serving_target == name and len(built) == 2 and op._fast is not None


def test_target_kernels_on_the_fused_call_keep_their_keys(new_target) -> None:
    name = new_target()
    built = []

    def builder(op, call):
        built.append(call.compact())
        k = len(built)
        return lambda x, bias, y: y.fill_(k)

    register_builder(name, FusedScaleOp, builder)
    op = FusedScaleOp(target=name)
    calls = [torch.ones(2, 3), torch.ones(2, 3, device="meta"), torch.ones(2, 3),
             torch.ones(4, 3), torch.ones(2, 3, dtype=torch.float16), torch.ones(2, 3),
             torch.ones(4, 3)]
    for x in calls:
        y = op(x)
        assert y.device == x.device and y.dtype == x.dtype and y.shape == x.shape
    assert len(built) == 4
    cpu, meta, f32, f16 = torch.device("cpu"), torch.device("meta"), torch.float32, torch.float16
    assert list(op._target_kernels) == [
        (cpu, (f32, None), ((2, 3), None)),
        (meta, (f32, None), ((2, 3), None)),
        (cpu, (f32, None), ((4, 3), None)),
        (cpu, (f16, None), ((2, 3), None)),
    ]
    # the kernel that ran is the one built for the call's key
    assert op(torch.ones(2, 3)).flatten()[0] == 1
    assert op(torch.ones(4, 3)).flatten()[0] == 3


def test_a_non_contiguous_input_gets_a_contiguous_output() -> None:
    op = FusedScaleOp(alpha=2.0)
    op(torch.ones(3, 4))
    x = torch.randn(4, 3).t()
    assert not x.is_contiguous()
    y = op(x)
    assert y.is_contiguous() and y.shape == (3, 4)
    torch.testing.assert_close(y, x * 2.0)


def test_an_aliased_output_is_the_written_input() -> None:
    op = FusedNegOp(inplace=True)
    x = torch.ones(3)
    assert op(x) is x
    x2 = torch.ones(4)
    assert op(x2) is x2 and op._fast is not None
    assert torch.equal(x2, -torch.ones(4))


def test_ops_without_a_fused_call() -> None:
    class TableOp(Op, specs=SPECS, entry="ScaleOp"):
        kernel_types = {ScaleIface: (ScaleKernel,)}
        construction_tensors = {"table": None}

        def __init__(self, **kw):
            super().__init__(**kw)
            self.table = torch.zeros(2)

        def forward(self, call, x, bias, y):
            y.copy_(x)

    op = TableOp()
    op(torch.ones(2))
    assert op._fast is None  # construction-time tensors: the general path syncs them


def test_the_fused_call_is_built_from_the_checks_parsed_statements() -> None:
    op = FusedScaleOp(alpha=3.0)
    op(torch.ones(2, 5))
    source = op._fast_source
    assert ast.unparse(ast.parse(source)) == source  # the unparsed module it was compiled from
    # each presence body's try block: the check's statements, then ``call = <record>``
    tries = [[ast.dump(st) for st in node.body] for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Try)]
    namespace = op._point.namespace
    for body in op._point.fast_bodies:
        record = ast.Assign([ast.Name("call", ast.Store())], body.record)
        assert [*map(ast.dump, body.statements), ast.dump(record)] in tries
        # the check's globals, and none the fused call does not read
        assert all(op._fast.__globals__[n] is namespace[n] for n in body.reads if n in namespace)
    assert len(tries) == 2
    assert "check_exact" in namespace and "check_exact" not in op._fast.__globals__


@pytest.mark.parametrize(("change", "error"), [
    ({"reads": {"nowhere"}}, "FusedScaleOp: the signature's check reads 'nowhere', which is "
                             "neither in its point's namespace, an input nor a builtin"),
    ({"binds": {"kernel"}}, "FusedScaleOp: the signature's check binds ['d_x', 'kernel', "
                            "'s_x']; the fused call needs ['d_x', 's_x'] and keeps ['call', "
                            "'dev', 'kernel', 'm', 'op', 'outputs', 't_bias', 't_x', 'y'] for "
                            "itself"),
])
def test_a_check_the_fused_call_cannot_place_fails_the_build(monkeypatch, change, error) -> None:
    op = FusedScaleOp(alpha=5.0)  # a point of its own: its bodies are replaced below
    point = op._point
    without = next(b for b in point.fast_bodies if not b.presence["bias"])
    broken = dataclasses.replace(without, **{k: getattr(without, k) | v for k, v in change.items()})
    monkeypatch.setattr(point, "fast_bodies",
                        tuple(broken if b is without else b for b in point.fast_bodies))
    with pytest.raises(RuntimeError) as got:
        op(torch.ones(2, 5))
    assert str(got.value) == error
    assert op._fast is None


def test_instances_that_agree_share_the_compiled_code_not_its_globals(new_target) -> None:
    name = new_target()
    built: list[Op] = []

    def builder(op, call):
        built.append(op)
        k = len(built)
        return lambda x, bias, y: y.fill_(k)

    register_builder(name, FusedScaleOp, builder)
    a, b = FusedScaleOp(target=name), FusedScaleOp(target=name)
    x = torch.ones(2, 3)
    assert a(x)[0, 0] == 1 and b(x)[0, 0] == 2
    assert a._fast.__code__ is b._fast.__code__ and a._fast_source == b._fast_source
    # each has its own builder binding and kernel memo: b's kernel is never a's
    assert a(x)[0, 0] == 1 and b(x)[0, 0] == 2 and a(x)[0, 0] == 1
    assert a._fast.__globals__ is not b._fast.__globals__
