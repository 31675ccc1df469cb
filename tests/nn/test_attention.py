"""tileops.nn.ScaledDotProductAttention: scaled_dot_product_attention's computation as a layer
(GQA as enable_gqa, FlashAttention's bottom-right mask), forward and gradients in float64
through the reference target, its op rebuilt from its attributes, and bad params refused where
the layer is made. tileops.nn.Attention: the grouped-query attention block around it, against
Hugging Face's LlamaAttention written out in float64 torch (projections, rotate-half RoPE,
causal SDPA with enable_gqa), forward and every parameter's gradient, over a hypothesis space
of shapes; its position hook; its state_dict keys; its refusals."""

import copy
import pickle
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tileops.nn.attention import Attention, ScaledDotProductAttention  # noqa: E402
from tileops.signature import ConstructionError  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _llama_attention import llama_attention  # noqa: E402


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
    layer = ScaledDotProductAttention(is_causal=True)
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
    o = ScaledDotProductAttention(is_causal=True, window=(2, 0))(q, k, v)
    torch.testing.assert_close(o, _sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)


def test_it_has_no_parameters_and_its_op_follows_its_attributes():
    layer = ScaledDotProductAttention(softcap=30.0, layout="bhsd", target="reference")
    assert layer.state_dict() == {} and not list(layer.parameters())
    assert repr(layer) == ("ScaledDotProductAttention(is_causal=False, layout='bhsd', "
                           "softcap=30.0, target='reference')")
    op = layer.op
    assert (op.softcap, op.layout, op.is_causal) == (30.0, "bhsd", False)
    layer.is_causal = True
    assert layer.op is not op and layer.op.is_causal
    for restored in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert restored.op is not layer.op and restored.op.is_causal
        assert restored.op.softcap == 30.0


def test_bad_params_are_refused_where_the_layer_is_made():
    with pytest.raises(ConstructionError) as exc:
        ScaledDotProductAttention(softcap=-1.0)
    assert str(exc.value).splitlines()[0] == (
        "GroupedQueryAttentionFwdOp: construction param softcap does not match the signature")


# --- the block ----------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

nn = torch.nn


def _projections(hidden, heads, kv_heads, d, bias, o_bias, seed=0):
    torch.manual_seed(seed)
    return (nn.Linear(hidden, heads * d, bias=bias, dtype=torch.float64),
            nn.Linear(hidden, kv_heads * d, bias=bias, dtype=torch.float64),
            nn.Linear(hidden, kv_heads * d, bias=bias, dtype=torch.float64),
            nn.Linear(heads * d, hidden, bias=o_bias, dtype=torch.float64))


def _check_block(b, s, hidden, heads, kv_heads, d, bias, o_bias, given_positions, theta=500.0):
    q, k, v, o = _projections(hidden, heads, kv_heads, d, bias, o_bias)
    block = Attention.from_linears(q, k, v, o, heads, kv_heads, rope_theta=theta)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, hidden, generator=g, dtype=torch.float64)
    positions = (torch.randint(0, 4 * s, (b, s), generator=g) if given_positions
                 else torch.arange(s).expand(b, s))
    mine = x.clone().requires_grad_()
    theirs = x.clone().requires_grad_()
    y = block(mine, positions if given_positions else None)
    want = llama_attention(theirs, q, k, v, o, heads, kv_heads, positions, theta)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * dy).sum().backward()
    (want * dy).sum().backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-10)
    for name, ref in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o)):
        layer = getattr(block, name)
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-10, atol=1e-10)
        if ref.bias is not None:
            torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("heads", "kv_heads", "bias", "o_bias", "given_positions"), [
    (4, 2, False, False, False), (4, 1, True, False, True), (2, 2, True, True, True),
])
def test_the_block_is_llamas_attention_forward_and_backward(heads, kv_heads, bias, o_bias,
                                                            given_positions):
    _check_block(2, 7, 16, heads, kv_heads, 8, bias, o_bias, given_positions)


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 9), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3]), d=st.sampled_from([2, 4, 8]),
       hidden=st.sampled_from([5, 16]), bias=st.booleans(), given_positions=st.booleans())
def test_the_block_over_shapes(b, s, kv_heads, group, d, hidden, bias, given_positions):
    _check_block(b, s, hidden, kv_heads * group, kv_heads, d, bias, False, given_positions)


def test_the_block_has_hugging_faces_names_and_copies_the_weights():
    q, k, v, o = _projections(16, 4, 2, 4, True, False)
    block = Attention.from_linears(q, k, v, o, 4, 2)
    assert set(block.state_dict()) == {"q_proj.weight", "q_proj.bias", "k_proj.weight",
                                       "k_proj.bias", "v_proj.weight", "v_proj.bias",
                                       "o_proj.weight"}
    assert block.q_proj.weight.dtype == torch.float64
    assert block.q_proj.weight.data_ptr() != q.weight.data_ptr()
    torch.testing.assert_close(block.k_proj.bias, k.bias)
    assert repr(block).splitlines()[:2] == [
        "Attention(", "  hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4"]
    fresh = Attention(16, 4, 2, bias=True, dtype=torch.float64)
    fresh.load_state_dict(block.state_dict())  # a Hugging Face state_dict loads as is
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), block(x))
    twin = copy.deepcopy(block)
    torch.testing.assert_close(twin(x), block(x))
    torch.testing.assert_close(block.float()(x.float()), fresh(x).float(), rtol=1e-5,
                               atol=1e-5)


def test_the_block_passes_its_attention_params_and_rope_config():
    block = Attention(16, 4, 2, is_causal=False, window=(3, 1), softcap=20.0, scale=0.3,
                      rope_theta=1234.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    op = block.attention.op
    assert (op.is_causal, op.window, op.softcap, op.scale) == (False, (3, 1), 20.0, 0.3)
    assert block.rotary.base == 1234.0 and block.rotary.scaling["factor"] == 8.0
    assert type(block.rotary.op).__name__ == "RopeLlama31FwdOp"


def test_the_position_hook_is_called_or_left_out():
    calls = []

    class Halve(nn.Module):  # a stand-in rotation: any (q, k, position_ids) -> (q, k)
        def forward(self, q, k, position_ids):
            calls.append((q.shape, k.shape, position_ids))
            return q * 0.5, k

    q, k, v, o = _projections(16, 4, 2, 4, False, False)
    hooked = Attention.from_linears(q, k, v, o, 4, 2, rotary=Halve())
    plain = Attention.from_linears(q, k, v, o, 4, 2, rotary=None)
    assert "rotary.weight" not in hooked.state_dict() and isinstance(hooked.rotary, Halve)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    positions = torch.arange(3)
    y = hooked(x, positions)
    assert calls == [((2, 3, 4, 4), (2, 3, 2, 4), positions)]
    want = plain.o_proj(ScaledDotProductAttention(is_causal=True, scale=0.5 * 4 ** -0.5)(
        plain.q_proj(x).view(2, 3, 4, 4), plain.k_proj(x).view(2, 3, 2, 4),
        plain.v_proj(x).view(2, 3, 2, 4)).reshape(2, 3, 16))
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        plain(x), llama_attention(x, q, k, v, o, 4, 2, None, 0.0, rope=False),
        rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError) as exc:
        plain(x, positions)
    assert str(exc.value) == ("Attention: argument position_ids is given, but the block has no "
                              "rotary embedding (rotary=None) to use it")
    assert plain(x).shape == (2, 3, 16)  # the refusal left it usable


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: Attention(32, 4, 3), ValueError,
     "Attention: argument num_heads is 4, not a multiple of num_kv_heads 3; expected each "
     "key/value head to serve the same number of query heads"),
    (lambda: Attention(30, 4), ValueError,
     "Attention: argument hidden_size is 30, not divisible by num_heads 4; give head_dim"),
    (lambda: Attention(32, 0), ValueError,
     "Attention: argument num_heads must be a positive int, seen 0"),
    (lambda: Attention(32, 4, True), ValueError,
     "Attention: argument num_kv_heads must be a positive int, seen True"),
    (lambda: Attention(32, 4, head_dim=2.5), ValueError,
     "Attention: argument head_dim must be a positive int, seen 2.5"),
    (lambda: Attention(32, 4, rotary="llama3"), TypeError,
     "Attention: argument rotary must be True, False, None or a callable rotary(q, k, "
     "position_ids) -> (q, k), seen str"),
    (lambda: Attention.from_linears(nn.Linear(8, 8), nn.Linear(8, 4), nn.Identity(),
                                    nn.Linear(8, 8), 2, 1), TypeError,
     "Attention.from_linears: argument v must be a torch.nn.Linear, seen Identity"),
    (lambda: Attention.from_linears(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4),
                                    nn.Linear(8, 6), 2, 1), ValueError,
     "Attention.from_linears: argument o does not match q (8 -> 2 heads of 4); expected 8 -> "
     "8, seen 8 -> 6"),
    (lambda: Attention.from_linears(nn.Linear(8, 6), nn.Linear(8, 4), nn.Linear(8, 4),
                                    nn.Linear(8, 8), 4, 1), ValueError,
     "Attention.from_linears: argument q has 6 output features, not a multiple of num_heads 4"),
    (lambda: Attention.from_linears(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4),
                                    nn.Linear(8, 8), 2, 1, bias=False), TypeError,
     "Attention.from_linears: argument bias is read from the projections; it cannot be given"),
])
def test_the_block_refuses_what_does_not_fit(build, error, message):
    with pytest.raises(error) as exc:
        build()
    assert str(exc.value) == message


def test_a_call_refuses_an_input_that_is_not_b_s_hidden_and_stays_usable():
    block = Attention(16, 4, 2, dtype=torch.float64)
    for x, seen in ((torch.randn(3, 16, dtype=torch.float64), "a tensor of shape (3, 16)"),
                    (torch.randn(1, 3, 8, dtype=torch.float64), "a tensor of shape (1, 3, 8)"),
                    ([1.0] * 16, "list")):
        with pytest.raises(ValueError) as exc:
            block(x)
        assert str(exc.value) == ("Attention: argument x must be a [B, S, hidden_size] tensor "
                                  f"with hidden_size 16; seen {seen}")
    assert block(torch.randn(1, 3, 16, dtype=torch.float64)).shape == (1, 3, 16)


def _rel(got, want):
    return ((got.double().cpu() - want).norm() / want.norm()).item()


@pytest.mark.cuda
def test_cuda_bf16_block_trains_against_float64():
    """The block on the GPU ops in bfloat16 (Llama's head dim, GQA 8:2) against the float64
    torch block of the same weights: the output, the input gradient and each projection's
    weight gradient within bfloat16's reach."""
    heads, kv_heads, d, hidden, s = 8, 2, 128, 1024, 384
    q, k, v, o = _projections(hidden, heads, kv_heads, d, False, False)
    block = Attention.from_linears(q, k, v, o, heads, kv_heads).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, s, hidden, generator=g, dtype=torch.float64)
    dy = torch.randn(2, s, hidden, generator=g, dtype=torch.float64)
    theirs = x.clone().requires_grad_()
    want = llama_attention(theirs, q, k, v, o, heads, kv_heads,
                            torch.arange(s).expand(2, s), 10000.0)
    (want * dy).sum().backward()
    mine = x.to("cuda", torch.bfloat16).requires_grad_()
    y = block(mine)
    (y * dy.to("cuda", torch.bfloat16)).sum().backward()
    assert _rel(y, want) < 2e-2
    assert _rel(mine.grad, theirs.grad) < 3e-2
    for name, ref in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o)):
        assert _rel(getattr(block, name).weight.grad, ref.weight.grad) < 3e-2, name
