"""tileops.nn.CrossEntropyLoss: torch.nn.CrossEntropyLoss's constructor and behaviour over
(N, C) logits and class indices, on the ops (the reference target on the CPU), and its
refusals of what the op does not compute."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tileops.nn as tnn


def _inputs(n=6, c=11, seed=0, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64)
    t = torch.randint(0, c, (n,), generator=g)
    t[2] = ignore_index
    return x, t


@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"},
                                {"label_smoothing": 0.2}, {"ignore_index": 3}])
def test_the_loss_and_its_gradient_are_torchs(kw):
    ours, theirs = tnn.CrossEntropyLoss(**kw), nn.CrossEntropyLoss(**kw)
    assert isinstance(ours, nn.CrossEntropyLoss)
    assert repr(ours) == repr(theirs)
    x, t = _inputs(ignore_index=kw.get("ignore_index", -100))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got, want = ours(xa, t), theirs(xb, t)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = torch.rand(want.shape, dtype=torch.float64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-12, atol=1e-12)


def test_the_op_keywords_and_the_repr():
    layer = tnn.CrossEntropyLoss(lse_square_scale=1e-2, softcap=3.0)
    assert repr(layer) == "CrossEntropyLoss(lse_square_scale=0.01, softcap=3.0)"
    x, t = _inputs()
    z = 3.0 * torch.tanh(x / 3.0)
    valid = t != -100
    want = (F.cross_entropy(z, t, reduction="none")
            + torch.where(valid, 1e-2 * torch.logsumexp(z, -1) ** 2, 0.0)).sum() / valid.sum()
    torch.testing.assert_close(layer(x, t), want, rtol=1e-12, atol=1e-12)


def test_inplace_grad_leaves_the_gradient_in_the_logits():
    layer = tnn.CrossEntropyLoss(inplace_grad=True)
    assert repr(layer) == "CrossEntropyLoss(inplace_grad=True)" and layer.op.inplace_grad
    x, t = _inputs()
    leaf = x.clone().requires_grad_(True)
    z = leaf * 1.0
    layer(z, t).backward()
    xe = x.clone().requires_grad_(True)
    F.cross_entropy(xe, t).backward()
    torch.testing.assert_close(leaf.grad, xe.grad)
    torch.testing.assert_close(z.detach(), xe.grad)


@pytest.mark.parametrize("saved", [False, True])
def test_inplace_grad_over_logits_a_node_saved_gives_them_a_gradient_of_their_own(saved):
    """Logits a node saved for its own backward (a tanh's output) are left as they were: the
    gradient has a tensor of its own and every gradient is torch's; logits no node saved (a
    product's) hold their gradient after the backward."""
    layer = tnn.CrossEntropyLoss(inplace_grad=True)
    x, t = _inputs()
    w0 = torch.randn(11, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def make(a, b):
        z = a @ b.T
        return torch.tanh(z) if saved else z

    xa, wa = x.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    xb, wb = x.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    z = make(xa, wa)
    before = z.detach().clone()
    layer(z, t).backward()
    zb = make(xb, wb)
    zb.retain_grad()
    F.cross_entropy(zb, t).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-12, atol=1e-12)
    if saved:
        assert torch.equal(z.detach(), before)
    else:
        torch.testing.assert_close(z.detach(), zb.grad, rtol=1e-12, atol=1e-12)


def test_a_bfloat16_input_gives_a_float32_loss():
    x, t = _inputs()
    loss = tnn.CrossEntropyLoss()(x.bfloat16(), t)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(x.bfloat16().double(), t).float())


def test_pickle_copy_and_a_changed_attribute():
    layer = tnn.CrossEntropyLoss(label_smoothing=0.1)
    x, t = _inputs()
    want = F.cross_entropy(x, t, label_smoothing=0.1)
    for twin in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        torch.testing.assert_close(twin(x, t), want)
    layer.reduction = "sum"
    torch.testing.assert_close(layer(x, t), F.cross_entropy(x, t, label_smoothing=0.1,
                                                            reduction="sum"))
    assert layer.op.reduction == "sum"


def test_what_the_op_does_not_compute_is_refused():
    with pytest.raises(ValueError) as info:
        tnn.CrossEntropyLoss(weight=torch.ones(5))
    assert str(info.value) == ("CrossEntropyLoss: weight= (a weight per class) is not "
                               "supported; expected None, got a tensor of shape (5,)")
    with pytest.raises(ValueError) as info:
        tnn.CrossEntropyLoss(reduce=False)
    assert str(info.value) == ("CrossEntropyLoss: reduce= is deprecated in torch and not "
                               "supported; expected None, got False (use reduction=)")
    layer = tnn.CrossEntropyLoss()
    with pytest.raises(ValueError) as info:
        layer(torch.randn(2, 3, 5), torch.zeros(2, 5, dtype=torch.long))
    assert str(info.value) == ("CrossEntropyLoss: input must be (N, C) logits, got shape "
                               "(2, 3, 5); flatten the positions into N rows")
    with pytest.raises(ValueError) as info:
        layer(torch.randn(2, 5), torch.rand(2, 5))
    assert str(info.value) == ("CrossEntropyLoss: target must be int64 class indices; class "
                               "probabilities (torch.float32) are not supported")
    with pytest.raises(Exception, match="label_smoothing"):
        tnn.CrossEntropyLoss(label_smoothing=2.0)  # the op's construction check


# --- FusedLinearCrossEntropyLoss ----------------------------------------------------------------

from tileops.nn.loss import FusedLinearCrossEntropyLoss  # noqa: E402


def _head(b=2, s=5, h=4, v=9, seed=0, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (b, s), generator=g)
    target[0, 1] = ignore_index
    return hidden, weight, target


@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"},
                                {"label_smoothing": 0.2}, {"ignore_index": 3}])
def test_the_fused_loss_and_its_gradients_are_torchs_of_the_logits(kw):
    layer = FusedLinearCrossEntropyLoss(**kw)
    hidden, weight, target = _head(ignore_index=kw.get("ignore_index", -100))
    ha, wa = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    hb, wb = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got = layer(ha, wa, target)
    want = F.cross_entropy((hb @ wb.T).flatten(0, 1), target.flatten(), **kw)
    want = want.reshape(target.shape) if kw.get("reduction") == "none" else want
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = torch.rand(want.shape, dtype=torch.float64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(ha.grad, hb.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw", [{}, {"reduction": "none"}, {"label_smoothing": 0.2}])
def test_the_fused_loss_of_hidden_states_of_no_width_is_torchs(kw):
    """H = 0 with leading axes: zero logits, torch's loss of them, and zero-width gradients
    (the leading axes were flattened with a -1, ambiguous among 0 elements)."""
    hidden, weight, target = _head(h=0)
    got = FusedLinearCrossEntropyLoss(**kw)(hidden.requires_grad_(True), weight, target)
    want = F.cross_entropy(torch.zeros(10, 9, dtype=torch.float64), target.flatten(), **kw)
    want = want.reshape(target.shape) if kw.get("reduction") == "none" else want
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.sum().backward()
    assert hidden.grad.shape == hidden.shape


def test_the_fused_loss_repr_pickle_and_a_changed_attribute():
    layer = FusedLinearCrossEntropyLoss(softcap=3.0)
    assert repr(layer) == "FusedLinearCrossEntropyLoss(softcap=3.0)"
    assert repr(FusedLinearCrossEntropyLoss()) == "FusedLinearCrossEntropyLoss()"
    hidden, weight, target = _head()
    z = 3.0 * torch.tanh((hidden @ weight.T) / 3.0)
    want = F.cross_entropy(z.flatten(0, 1), target.flatten())
    for twin in (layer, pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        torch.testing.assert_close(twin(hidden, weight, target), want, rtol=1e-12, atol=1e-12)
    layer.reduction = "sum"
    assert layer.op.reduction == "sum"
    torch.testing.assert_close(layer(hidden, weight, target),
                               F.cross_entropy(z.flatten(0, 1), target.flatten(),
                                               reduction="sum"), rtol=1e-12, atol=1e-12)


def test_the_fused_loss_refuses_mismatched_shapes():
    layer = FusedLinearCrossEntropyLoss()
    hidden, weight, target = _head()
    with pytest.raises(ValueError) as info:
        layer(hidden, weight[:, :3], target)
    assert str(info.value) == ("FusedLinearCrossEntropyLoss: hidden must be (..., H) and "
                               "weight (V, H), got shapes (2, 5, 4) and (9, 3)")
    with pytest.raises(ValueError) as info:
        layer(hidden, weight, target[:, :4])
    assert str(info.value) == ("FusedLinearCrossEntropyLoss: target must have hidden's "
                               "leading shape (2, 5), got (2, 4)")
    with pytest.raises(Exception, match="label_smoothing"):
        FusedLinearCrossEntropyLoss(label_smoothing=2.0)  # the op's construction check


def test_the_fused_loss_under_autocast_is_the_loss_of_autocasts_logits():
    """Under autocast, lm_head's product runs in autocast's dtype (a float32 weight beside
    bfloat16 hidden states is the usual mixed-precision setup): the fused loss takes the same
    operands, and its gradients come back in the parameters' dtypes."""
    hidden, weight, target = _head(h=16, v=33)
    hidden, weight = hidden.float().requires_grad_(), weight.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = FusedLinearCrossEntropyLoss()(hidden.bfloat16(), weight, target)
        want = F.cross_entropy((hidden @ weight.T).flatten(0, 1).float(), target.flatten())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    got.backward()
    assert weight.grad.dtype == hidden.grad.dtype == torch.float32


@pytest.mark.parametrize("layer", [tnn.CrossEntropyLoss(), FusedLinearCrossEntropyLoss()])
def test_an_argument_that_is_not_a_tensor_is_refused_by_name(layer):
    hidden, weight, target = _head()
    args = [(hidden @ weight.T).flatten(0, 1), target.flatten()] \
        if isinstance(layer, tnn.CrossEntropyLoss) \
        else [hidden, weight, target]
    names = ["input", "target"] if isinstance(layer, tnn.CrossEntropyLoss) \
        else ["hidden", "weight", "target"]
    for i, name in enumerate(names):
        bad = list(args)
        bad[i] = bad[i].tolist()
        with pytest.raises(TypeError) as info:
            layer(*bad)
        assert str(info.value) == (f"{type(layer).__name__}: argument {name} expected a "
                                   "tensor, seen list")
    layer(*args)
