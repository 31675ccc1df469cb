"""tileops.nn's activations and SwiGLUMLP: torch.nn's constructors and behaviour, on the
ops (the reference target on the CPU)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tileops.nn as tnn


@pytest.mark.parametrize(("ours", "theirs"), [
    (tnn.SiLU(), nn.SiLU()), (tnn.ReLU(), nn.ReLU()), (tnn.GELU(), nn.GELU()),
    (tnn.GELU(approximate="tanh"), nn.GELU(approximate="tanh")),
])
def test_activations_are_torchs(ours, theirs):
    assert isinstance(ours, type(theirs))
    x = torch.randn(4, 33, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x))
    assert repr(ours) == repr(theirs)
    twin = pickle.loads(pickle.dumps(ours))
    torch.testing.assert_close(twin(x), theirs(x))


def test_inplace_layers_write_their_input():
    x = torch.randn(3, 5)
    want = F.relu(x)
    assert tnn.ReLU(inplace=True)(x) is x
    torch.testing.assert_close(x, want)
    layer = tnn.SiLU(inplace=True)
    assert layer.op.inplace is True and "inplace=True" in repr(layer)


def test_a_changed_attribute_rebuilds_the_op():
    layer = tnn.GELU()
    layer.approximate = "tanh"
    x = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.gelu(x, approximate="tanh"))
    assert layer.op.approximate == "tanh"


class _LlamaMLP(nn.Module):  # Hugging Face's LlamaMLP, as torch modules
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=torch.float64)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=torch.float64)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=torch.float64)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_swiglu_mlp_matches_llamas_mlp_forward_and_backward():
    torch.manual_seed(0)
    ref = _LlamaMLP(16, 40)
    mlp = tnn.SwiGLUMLP.from_mlp(ref)
    assert set(mlp.state_dict()) == set(ref.state_dict())
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.testing.assert_close(mlp(x), ref(x2))
    mlp(x).sum().backward()
    ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(mlp.gate_proj.weight.grad, ref.gate_proj.weight.grad)
    torch.testing.assert_close(mlp.up_proj.weight.grad, ref.up_proj.weight.grad)
    twin = copy.deepcopy(mlp)
    torch.testing.assert_close(twin(x2.detach()), ref(x2.detach()))
    op = mlp.swiglu
    mlp.float()  # a move builds a fresh op, which binds its target again
    assert mlp.swiglu is not op and mlp.swiglu.serving_target is None


def test_swiglu_mlp_from_mlp_refuses_what_does_not_chain():
    ref = _LlamaMLP(16, 40)
    ref.down_proj = nn.Linear(32, 16, bias=False)
    with pytest.raises(ValueError, match=r"^SwiGLUMLP.from_mlp: the projections do not chain: "
                                         r"gate_proj 16 -> 40, up_proj 16 -> 40, down_proj "
                                         r"32 -> 16$"):
        tnn.SwiGLUMLP.from_mlp(ref)
    ref.down_proj = nn.ReLU()
    with pytest.raises(TypeError, match=r"^SwiGLUMLP.from_mlp: mlp.down_proj must be a "
                                        r"torch.nn.Linear, seen ReLU$"):
        tnn.SwiGLUMLP.from_mlp(ref)
