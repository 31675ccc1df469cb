"""Gradients through tileops.nn's layers: ``torch.autograd.gradcheck`` in float64 on tiny
shapes (the ``reference`` target serves float64), and float32 gradients equal to torch.nn's
layers with the same state, for every combination of what requires grad (the input, the
parameters, both), since the backward op is told which gradients are wanted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import tileops.nn as tnn

# name -> (our layer, torch's layer, the torch computation of our layer's forward); the
# fused add has no torch.nn layer: it is torch's RMSNorm of the sum, returning the sum too
LAYERS = {
    "rmsnorm": (lambda **kw: tnn.RMSNorm(4, eps=1e-5, **kw),
                lambda **kw: nn.RMSNorm(4, eps=1e-5, **kw), None),
    "rmsnorm-2d-no-affine": (lambda **kw: tnn.RMSNorm((2, 4), elementwise_affine=False, **kw),
                             lambda **kw: nn.RMSNorm((2, 4), elementwise_affine=False, **kw),
                             None),
    "layernorm": (lambda **kw: tnn.LayerNorm(4, **kw), lambda **kw: nn.LayerNorm(4, **kw), None),
    "layernorm-no-bias": (lambda **kw: tnn.LayerNorm(4, bias=False, **kw),
                          lambda **kw: nn.LayerNorm(4, bias=False, **kw), None),
    "linear": (lambda **kw: tnn.Linear(4, 3, **kw), lambda **kw: nn.Linear(4, 3, **kw), None),
    "linear-no-bias": (lambda **kw: tnn.Linear(4, 3, bias=False, **kw),
                       lambda **kw: nn.Linear(4, 3, bias=False, **kw), None),
    "fused-add": (lambda **kw: tnn.FusedAddRMSNorm(4, eps=1e-5, **kw),
                  lambda **kw: nn.RMSNorm(4, eps=1e-5, **kw),
                  lambda rms, x, residual: (rms(x + residual), x + residual)),
}
NORMS = [n for n in LAYERS if not n.startswith("linear")]
LINEARS = [n for n in LAYERS if n.startswith("linear")]



def _inputs(name: str, dtype: torch.dtype, lead=(2, 3)) -> tuple[torch.Tensor, ...]:
    layer = LAYERS[name][0]()
    tail = (layer.in_features,) if isinstance(layer, nn.Linear) else layer.normalized_shape
    gen = torch.Generator().manual_seed(0)
    count = 2 if name == "fused-add" else 1
    return tuple(torch.randn(*lead, *tail, generator=gen, dtype=torch.float64).to(dtype)
                 for _ in range(count))


def _randomized(module: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return module


@pytest.mark.parametrize("name", LAYERS)
def test_gradcheck_float64(name):
    layer = _randomized(LAYERS[name][0](dtype=torch.float64))
    names = [k for k, _ in layer.named_parameters()]
    inputs = tuple(t.requires_grad_() for t in _inputs(name, torch.float64))
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())

    def run(*args):
        return functional_call(layer, dict(zip(names, args[len(inputs):], strict=True)),
                               args[:len(inputs)])

    assert torch.autograd.gradcheck(run, (*inputs, *params), eps=1e-6, atol=1e-6)


WANTS = ["input-and-params", "input-only", "params-only"]


def _grads_against_torch(name: str, wants: str, dtype: torch.dtype, rtol: float,
                         atol: float, torch_dtype: torch.dtype) -> None:
    """Our layer's gradients in ``dtype`` against torch's layer on the same values in
    ``torch_dtype``; gradients not wanted stay None on both sides."""
    make_ours, make_theirs, torch_forward = LAYERS[name]
    ours = _randomized(make_ours(dtype=dtype))
    theirs = make_theirs(dtype=torch_dtype)
    theirs.load_state_dict(ours.state_dict())
    for p in (*ours.parameters(), *theirs.parameters()):
        p.requires_grad_(wants != "input-only")
    xs = _inputs(name, dtype)
    ours_in = tuple(x.clone().requires_grad_(wants != "params-only") for x in xs)
    theirs_in = tuple(x.to(torch_dtype).requires_grad_(wants != "params-only") for x in xs)
    out = ours(*ours_in)
    want = torch_forward(theirs, *theirs_in) if torch_forward else theirs(*theirs_in)
    out, want = (out, want) if isinstance(out, tuple) else ((out,), (want,))
    # backward from the outputs that carry a gradient in torch (the fused add's sum does not
    # when only the weight requires grad)
    gen = torch.Generator().manual_seed(2)
    douts = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in want]
    graded = [i for i, w in enumerate(want) if w.requires_grad]
    torch.autograd.backward([out[i] for i in graded], [douts[i].to(dtype) for i in graded])
    torch.autograd.backward([want[i] for i in graded],
                            [douts[i].to(torch_dtype) for i in graded])
    for a, b in zip(ours_in, theirs_in, strict=True):
        if wants == "params-only":
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad.to(torch_dtype), b.grad, rtol=rtol, atol=atol)
    for (k, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        if wants == "input-only":
            assert a.grad is None, k
        else:
            torch.testing.assert_close(a.grad.to(torch_dtype), b.grad, rtol=rtol, atol=atol,
                                       msg=lambda m, k=k: f"{k}: {m}")


# (a layer without parameters has no params-only case)
@pytest.mark.parametrize(("name", "wants"), [
    *((n, w) for n in NORMS for w in WANTS if (n, w) != ("rmsnorm-2d-no-affine", "params-only")),
    *(pytest.param(n, w) for n in LINEARS for w in WANTS),
])
def test_float32_grads_are_torchs(name, wants):
    _grads_against_torch(name, wants, torch.float32, 1e-4, 1e-5, torch.float32)


@pytest.mark.parametrize("wants", WANTS)
@pytest.mark.parametrize("name", LINEARS)
def test_bfloat16_linear_grads_match_float64(name, wants):
    # the GEMM's bfloat16 gradients, each rounded once from a float32 accumulation
    _grads_against_torch(name, wants, torch.bfloat16, 1.6e-2, 1.6e-2, torch.float64)


def test_forward_mode_ad_and_a_batched_backward_are_refused_naming_the_op():
    """Forward-mode AD (a dual tensor) and a batched backward (jacobian(vectorize=True), which
    vmaps the node over the upstream gradients) are refused by the op's name, with the way
    out; the plain jacobian is torch's."""
    import torch.autograd.forward_ad as fwAD

    import tileops.nn as tnn

    layer = tnn.Linear(4, 3).double()
    x = torch.randn(2, 4, dtype=torch.double)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=r"^GemmFwdOp: forward-mode AD"):
        layer(fwAD.make_dual(x, torch.randn_like(x)))
    with pytest.raises(RuntimeError, match=r"^GemmFwdOp: a batched backward .*\(vectorize=False"):
        torch.autograd.functional.jacobian(layer, x, vectorize=True)
    ref = torch.nn.Linear(4, 3).double()
    ref.load_state_dict(layer.state_dict())
    torch.testing.assert_close(torch.autograd.functional.jacobian(layer, x),
                               torch.autograd.functional.jacobian(ref, x))
