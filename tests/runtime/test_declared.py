"""What an op class gets from its entry instead of writing it (runtime/declared.py): the
generated constructor, docstring and repr; the declared reference serving the ``reference``
target and ``fp64_reference``; contenders; index readers; and memoised kernel entries."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from tileops.runtime import REFERENCE, CallSpec, Kernel, KernelInterface, Op, SpecSet, targets
from tileops.signature import ConstructionError, SignatureCallError

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")


class ScaleOp(Op, specs=SPECS):
    """alpha * x + bias, declared once."""

    def reference(self, call, x, bias):
        y = x.float() if x.dtype != torch.float64 else x
        y = y * self.alpha
        return (y if bias is None else y + bias.to(y.dtype),)

    def eager(self):
        alpha = self.alpha
        return lambda x, bias=None: x * alpha + (0 if bias is None else bias)

    peers = {"absent": lambda op: None, "double": lambda op: (lambda x, bias=None: 2 * x)}


class BareScaleOp(Op, specs=SPECS, entry="ScaleOp"):
    """Declares nothing: no reference, no contenders."""


class DerivingOp(Op, specs=SPECS, entry="ScaleOp"):
    def derive(self) -> None:
        self.twice = 2 * self.alpha


def test_generated_constructor_signature_follows_the_manifest():
    sig = inspect.signature(ScaleOp.__init__)
    params = list(sig.parameters.values())
    assert [p.name for p in params] == ["self", "alpha", "target", "kernel_map", "tune",
                                        "unknown"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[1:5])
    assert sig.parameters["alpha"].default == 2.0
    assert sig.parameters["tune"].default is False
    op = ScaleOp(alpha=3.0)
    assert op.alpha == 3.0 and ScaleOp().alpha == 2.0
    with pytest.raises(TypeError):
        ScaleOp(3.0)  # keyword-only


def test_required_and_unknown_params_get_the_construction_checks_errors():
    class RowStatsOp(Op, specs=SPECS):
        pass

    assert repr(inspect.signature(RowStatsOp.__init__).parameters["width"].default) == \
        "<required>"
    with pytest.raises(ConstructionError, match="width is required"):
        RowStatsOp()
    with pytest.raises(ConstructionError, match="has no construction param 'alfa'"):
        ScaleOp(alfa=1.0)


def test_repr_and_docstrings():
    assert repr(ScaleOp(alpha=0.5)) == "ScaleOp(alpha=0.5)"
    assert repr(ScaleOp(target=REFERENCE)) == "ScaleOp(alpha=2.0, target='reference')"
    doc = ScaleOp.__init__.__doc__
    assert "alpha (float): default 2.0." in doc
    assert "bias: T, optional, shape [N]" in doc and "x: T, shape [*B, N]" in doc
    assert ScaleOp.__doc__ == "alpha * x + bias, declared once."  # the class's own stays
    assert BareScaleOp.__doc__.startswith("Declares nothing")


def test_derive_runs_once_at_construction():
    assert DerivingOp(alpha=1.5).twice == 3.0


def test_declared_reference_serves_the_reference_target():
    assert targets.builder_for(REFERENCE, ScaleOp) is not None
    assert targets.builder_for(REFERENCE, BareScaleOp) is None
    op = ScaleOp(alpha=3.0)
    x, bias = torch.randn(4, 8), torch.randn(8)
    y = op(x, bias)
    assert op.serving_target == REFERENCE
    assert torch.equal(y, x * 3.0 + bias)


def test_fp64_reference_checks_then_widens():
    op = ScaleOp(alpha=3.0)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    (y,) = op.fp64_reference(x, None)
    assert y.dtype == torch.float64 and torch.equal(y, x.double() * 3.0)
    assert op.last_call is None  # a reference is not a call of the op
    with pytest.raises(Exception, match="ScaleOp"):
        op.fp64_reference(x, torch.randn(9))  # the signature's own check
    with pytest.raises(NotImplementedError, match="BareScaleOp declares no reference"):
        BareScaleOp().reference(None, x, None)


def test_contenders_are_the_eager_function_then_available_peers():
    op = ScaleOp(alpha=3.0)
    c = op.contenders()
    assert list(c) == ["torch", "double"]
    x = torch.ones(2, 3)
    assert torch.equal(c["torch"](x), x * 3.0)
    assert BareScaleOp().contenders() == {}


class Iface(KernelInterface):
    slot = "scale"


class Spec(CallSpec, frozen=True, kw_only=True):
    n: int


class CpuKernel(Kernel, Iface):
    devices = ("cpu",)
    general = True
    built = 0

    def __init__(self, spec) -> None:
        super().__init__(spec)
        type(self).built += 1

    def __call__(self, x, y, alpha):
        torch.mul(x, alpha, out=y)


class KeyedScaleOp(Op, specs=SPECS, entry="ScaleOp"):
    kernel_types = {Iface: (CpuKernel,)}
    made = 0

    def derive(self) -> None:
        self._read_n = self.index_reader("N")

    def forward(self, call, x, bias, y):
        (n,) = self._read_n(call)

        def spec():
            type(self).made += 1
            return Spec(device=call.device, n=n)

        self.kernel_for((call.device, n), Iface, spec)(x, y, self.alpha)


def test_kernel_for_builds_the_spec_only_on_a_miss_and_readers_read_solved_indices():
    op = KeyedScaleOp()
    x = torch.randn(3, 5)
    for _ in range(3):
        assert torch.equal(op(x), x * 2.0)
    assert KeyedScaleOp.made == 1 and CpuKernel.built == 1
    op(torch.randn(2, 7))
    assert KeyedScaleOp.made == 2
    call = op.last_call
    assert op.index_reader("N")(call) == (7,) and op.index_reader("B", "N")(call) == ((2,), 7)
    with pytest.raises(LookupError, match="KeyedScaleOp: Q is not an index of its signature"):
        op.index_reader("Q")
    op._reset_binding()  # the memo is binding state: gone with the binding
    op(torch.randn(2, 7))
    assert KeyedScaleOp.made == 3


def test_a_wrong_number_of_inputs_is_named_by_the_ops_signature():
    op = ScaleOp()
    x = torch.randn(2, 3)
    with pytest.raises(TypeError) as info:
        op()
    assert str(info.value).splitlines()[0] == \
        "ScaleOp(x, bias=None): required input x not given; inputs:"
    with pytest.raises(TypeError) as info:
        op(x, None, x)
    assert str(info.value).splitlines()[0] == (
        "ScaleOp(x, bias=None) takes 2 inputs, got 3: 1 extra positional argument after bias; "
        "inputs:")
    assert "bias: Tensor[T, [N]]" in str(info.value) and "(optional)" in str(info.value)
    # a keyword call without x: x is None in its place, which the check itself names
    with pytest.raises(SignatureCallError, match="because:  x is required, got None"):
        op(bias=torch.randn(3))
    with pytest.raises(TypeError, match=r"^ScaleOp\(x, bias=None\): required input x"):
        op.fp64_reference()
    with pytest.raises(TypeError, match=r"^ScaleOp\(x, bias=None\) takes 2 inputs, got 3"):
        op.fp64_reference(x, None, x)
    assert torch.equal(op(x), x * 2.0)  # and the op stays usable
