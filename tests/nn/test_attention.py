"""tileops.nn.Attention: scaled_dot_product_attention's computation as a layer (GQA as
enable_gqa, FlashAttention's bottom-right mask), forward and gradients in float64 through
the reference target, its op rebuilt from its attributes, and bad params refused where the
layer is made."""

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tileops.nn.attention import Attention  # noqa: E402
from tileops.signature import ConstructionError  # noqa: E402


def _qkv(s_q=9, s_kv=9, h=4, h_kv=2, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, s, n, d, generator=g, dtype=torch.float64, requires_grad=True)
            for s, n in ((s_q, h), (s_kv, h_kv), (s_kv, h_kv))]


def _sdpa(q, k, v, **kw):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), enable_gqa=True, **kw)
    return out.transpose(1, 2)


def test_forward_and_gradients_are_sdpas():
    q, k, v = _qkv()
    layer = Attention(is_causal=True)
    o = layer(q, k, v)
    want = _sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), dout)
    for g, w in zip(got, torch.autograd.grad(want, (q, k, v), dout), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_the_causal_mask_is_bottom_right_and_the_window_bounds_it():
    q, k, v = _qkv(s_q=4, s_kv=10)
    mask = torch.ones(4, 10, dtype=torch.bool).tril(diagonal=6)
    mask &= ~torch.ones(4, 10, dtype=torch.bool).tril(diagonal=6 - 3)  # window (2, 0)
    o = Attention(is_causal=True, window=(2, 0))(q, k, v)
    torch.testing.assert_close(o, _sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)


def test_it_has_no_parameters_and_its_op_follows_its_attributes():
    layer = Attention(softcap=30.0, layout="bhsd", target="reference")
    assert layer.state_dict() == {} and not list(layer.parameters())
    assert repr(layer) == ("Attention(is_causal=False, layout='bhsd', softcap=30.0, "
                           "target='reference')")
    op = layer.op
    assert (op.softcap, op.layout, op.is_causal) == (30.0, "bhsd", False)
    layer.is_causal = True
    assert layer.op is not op and layer.op.is_causal
    for restored in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert restored.op is not layer.op and restored.op.is_causal
        assert restored.op.softcap == 30.0


def test_bad_params_are_refused_where_the_layer_is_made():
    with pytest.raises(ConstructionError) as exc:
        Attention(softcap=-1.0)
    assert str(exc.value).splitlines()[0] == (
        "GroupedQueryAttentionFwdOp: construction param softcap does not match the signature")
