"""The prefill attention ops on the CPU (the reference target): the calling convention against
``scaled_dot_product_attention``, FlashAttention's bottom-right mask, windows, the softcap, the
log-sum-exp, rows that see no key, the layouts, the refusals by their exact text, the
reference against an independent per-row float64 computation over a space of calls
(hypothesis), and the packed (varlen) op against the dense one a sequence at a time. The harness covers every spec workload, the bad-input corpus, compile and fake
tensors."""

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tileops.ops import (  # noqa: E402
    SPEC_DIR,
    GroupedQueryAttentionBwdOp,
    GroupedQueryAttentionFwdOp,
    GroupedQueryAttentionVarlenFwdOp,
    MultiHeadAttentionFwdOp,
)
from tileops.ops.attention import visible, window_bounds  # noqa: E402
from tileops.signature import ConstructionError, SignatureCallError  # noqa: E402
from tileops.spec import check_paths  # noqa: E402


def _qkv(b, s_q, s_kv, h, h_kv, d, d_v=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, s_kv, h_kv, d, generator=g, dtype=dtype)
    v = torch.randn(b, s_kv, h_kv, d_v or d, generator=g, dtype=dtype)
    return q, k, v


def _sdpa(q, k, v, **kw):
    """torch's attention on the [B, S, H, D] tensors, transposed as it takes them."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), enable_gqa=True, **kw)
    return out.transpose(1, 2)


def test_grouped_query_call_matches_sdpa_with_enable_gqa():
    q, k, v = _qkv(2, 33, 33, 8, 2, 16)
    o = GroupedQueryAttentionFwdOp(is_causal=True)(q, k, v)
    assert isinstance(o, torch.Tensor)  # the output alone, as torch's attention
    torch.testing.assert_close(o, _sdpa(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)
    op = GroupedQueryAttentionFwdOp(is_causal=True, return_lse=True)
    assert op.returned_outputs == ("o", "lse")
    o2, lse = op(q, k, v)  # the log-sum-exp when asked
    assert lse.shape == (2, 8, 33) and torch.equal(o2, o)
    o = GroupedQueryAttentionFwdOp()(q, k, v)
    torch.testing.assert_close(o, _sdpa(q, k, v), rtol=1e-12, atol=1e-12)


def test_causal_mask_is_bottom_right_aligned():
    """With S_q < S_kv the last query row sees every key (FlashAttention's alignment), where
    torch's is_causal would align the first row with the first key."""
    q, k, v = _qkv(1, 5, 12, 2, 2, 8)
    o = MultiHeadAttentionFwdOp(is_causal=True)(q, k, v)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=12 - 5)
    torch.testing.assert_close(o, _sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(o, _sdpa(q, k, v, is_causal=True))


def test_window_sees_left_and_right_of_the_diagonal():
    q, k, v = _qkv(2, 20, 20, 4, 4, 8)
    o = MultiHeadAttentionFwdOp(window=(3, 2))(q, k, v)
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    mask = (j >= i - 3) & (j <= i + 2)
    torch.testing.assert_close(o, _sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)
    # is_causal bounds the right side at 0; an int window is both sides
    assert window_bounds(True, (3, 2)) == (3, 0)
    assert window_bounds(True, None) == (-1, 0)
    assert window_bounds(False, 4) == (4, 4)
    assert window_bounds(True, (-1, -1)) == (-1, 0)
    # a one-value tuple is both sides, as the signature's per-axis type (and torch's int
    # lists) take it; a list as a tuple
    assert window_bounds(False, (3,)) == (3, 3) and window_bounds(False, [3, 1]) == (3, 1)
    torch.testing.assert_close(MultiHeadAttentionFwdOp(window=(2,))(q, k, v),
                               MultiHeadAttentionFwdOp(window=2)(q, k, v), rtol=0, atol=0)


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf():
    """300 rows over 100 keys with a (16, 0) window: row i sits at key i - 200, so the first
    200 rows see no key."""
    q, k, v = _qkv(1, 300, 100, 2, 1, 8)
    o, lse = GroupedQueryAttentionFwdOp(window=(16, 0), return_lse=True)(q, k, v)
    assert torch.equal(o[:, :200], torch.zeros_like(o[:, :200]))
    assert bool(torch.isneginf(lse[..., :200]).all())
    assert bool(torch.isfinite(lse[..., 200:]).all()) and bool(torch.isfinite(o).all())
    assert torch.equal(visible(300, 100, 16, 0).any(dim=1), torch.arange(300) >= 200)


@pytest.mark.parametrize(("b", "s_q", "s_kv"), [(1, 3, 0), (0, 3, 5), (2, 0, 5)])
@pytest.mark.parametrize("h_kv", [1, 2, 4])
def test_empty_batches_queries_or_keys_train(b, s_q, s_kv, h_kv):
    """An empty batch, query or key axis: output 0 (no key is seen), and every gradient of its
    input's shape, zero (grouped heads included, where the key gradients are summed over
    each group)."""
    q, k, v = (t.requires_grad_() for t in _qkv(b, s_q, s_kv, 4, h_kv, 8))
    o = GroupedQueryAttentionFwdOp()(q, k, v)
    assert o.shape == (b, s_q, 4, 8) and not o.any()
    (o * 2).sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()


@pytest.mark.parametrize(("op", "h", "h_kv"), [(MultiHeadAttentionFwdOp, 0, 0),
                                              (GroupedQueryAttentionFwdOp, 0, 2)])
def test_no_query_heads_train_as_torch(op, h, h_kv):
    """No query heads (none at all, or none over two key heads): an empty output and
    gradients of every input's shape, zero, as torch's attention gives (the gradients'
    reference divided the heads by the key heads)."""
    q, k, v = (t.requires_grad_() for t in _qkv(2, 3, 5, h, h_kv, 8))
    o = op()(q, k, v)
    assert o.shape == (2, 3, h, 8)
    o.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _sdpa(q, k, v).sum().backward()
    for t, g in zip((q, k, v), grads, strict=True):
        assert torch.equal(g, t.grad)


def _math_attention(q, k, v, causal=False, softcap=None):
    """torch's attention as its math backend computes it, on the [B, S, H, D] tensors; with a
    softcap (which SDPA does not take), its definition: softmax of the capped, masked scores
    times v."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if softcap is None:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal).transpose(1, 2)
    s = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~visible(s.shape[-2], s.shape[-1], -1, 0), -math.inf)
    return (torch.softmax(s, -1) @ vh).transpose(1, 2)


def _same_non_finite(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("causal", [False, True])
def test_an_inf_or_nan_input_reaches_the_output_and_gradients_as_torchs(which, value, causal):
    """An inf or NaN in q, k or v: the NaN and inf of the output (dense, packed, the softcap's
    eager contender) and of every gradient are those of torch's math attention (a row with an
    inf score, or whose scores are all -inf, is NaN throughout). The references subtracted the
    rows' log-sum-exp only where finite, so such a row came out inf, or 0."""
    g = torch.Generator().manual_seed(1)
    for seed in range(4):
        q, k, v = _qkv(2, 4, 4, 2, 2, 8, seed=seed)
        # the last query row and the first key: every row sees that key and that row every
        # key, so no mask hides the value (torch's backends differ on a non-finite score a
        # row does not see)
        {"q": q, "k": k, "v": v}[which][0, -1 if which == "q" else 0, 0, 3] = value
        dout = torch.randn(2, 4, 2, 8, generator=g, dtype=torch.float64)
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        theirs = [t.clone().requires_grad_() for t in (q, k, v)]
        o = MultiHeadAttentionFwdOp(is_causal=causal)(*ours)
        want = _math_attention(*theirs, causal=causal)
        assert _same_non_finite(o, want)
        for got, exp in zip(torch.autograd.grad(o, ours, dout),
                            torch.autograd.grad(want, theirs, dout), strict=True):
            assert _same_non_finite(got, exp)
        cu = torch.tensor([0, 4], dtype=torch.int32)
        packed = GroupedQueryAttentionVarlenFwdOp(is_causal=causal)(q[0], k[0], v[0], cu, cu)
        assert _same_non_finite(packed, want[0].detach())
        capped = GroupedQueryAttentionFwdOp(is_causal=causal, softcap=5.0)
        want = _math_attention(q, k, v, causal=causal, softcap=5.0)
        assert _same_non_finite(capped(q, k, v), want)
        assert _same_non_finite(capped.eager()(q, k, v), want)


def test_lse_softcap_and_scale():
    q, k, v = _qkv(2, 7, 9, 4, 2, 8)
    op = GroupedQueryAttentionFwdOp(scale=0.3, softcap=2.0, return_lse=True)
    o, lse = op(q, k, v)
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float64  # float32 for narrower
    kk = k.repeat_interleave(2, dim=2)
    vv = v.repeat_interleave(2, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3
    s = 2.0 * torch.tanh(s / 2.0)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), rtol=1e-12, atol=1e-12)
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv)
    torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)


def test_lse_is_float32_for_narrower_inputs():
    q, k, v = _qkv(1, 4, 4, 2, 2, 8, dtype=torch.bfloat16)
    o, lse = MultiHeadAttentionFwdOp(return_lse=True)(q, k, v)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_bhsd_layout_is_the_transposed_call():
    q, k, v = _qkv(2, 11, 13, 4, 2, 8, d_v=4)
    o, lse = GroupedQueryAttentionFwdOp(is_causal=True, return_lse=True)(q, k, v)
    t = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    o2, lse2 = GroupedQueryAttentionFwdOp(is_causal=True, layout="bhsd", return_lse=True)(*t)
    assert o2.shape == (2, 4, 11, 4)
    torch.testing.assert_close(o2, o.transpose(1, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse2, lse)


@pytest.mark.parametrize("kw", [dict(is_causal=True, window=(4, 0)), dict(softcap=5.0),
                                dict(window=(2, 3)), dict(is_causal=True)])
def test_eager_contender_is_the_reference(kw):
    """The eager function (scaled_dot_product_attention, or the math where it has no form)
    computes the op, in float64; S_q < S_kv, where torch's own causal mask would differ."""
    q, k, v = _qkv(2, 6, 10, 4, 2, 8)
    op = GroupedQueryAttentionFwdOp(**kw, return_lse=True)
    got, want = op.eager()(q, k, v), op(q, k, v)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    alone = GroupedQueryAttentionFwdOp(**kw)  # without return_lse: the output alone
    torch.testing.assert_close(alone.eager()(q, k, v), want[0], rtol=1e-10, atol=1e-10)


def test_backward_eager_contender_is_the_backward():
    q, k, v = _qkv(2, 6, 10, 4, 2, 8)
    fwd = GroupedQueryAttentionFwdOp(is_causal=True, softcap=4.0, return_lse=True)
    o, lse = fwd(q, k, v)
    dout, dlse = torch.randn_like(o), torch.randn_like(lse)
    bwd = GroupedQueryAttentionBwdOp(is_causal=True, softcap=4.0)
    for douts in ((dout,), (dout, dlse), (None, dlse)):  # o's, both, the log-sum-exp's alone
        want = bwd(q, k, v, o, lse, *douts)
        got = bwd.eager()(q, k, v, o, lse, *douts)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)  # no dv without dout
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# --- refusals, by their text ------------------------------------------------------------------


_SPEC = check_paths([SPEC_DIR / "attention.yaml", SPEC_DIR / "types.yaml"])[0][0]


def _spec_line(path: str) -> str:
    """The ``spec:`` line of an error raised at ``path`` of the shipped entry."""
    return f"  spec:     {SPEC_DIR / 'attention.yaml'}:{_SPEC.lines[path]} ({path})"


def test_heads_that_do_not_group_are_refused():
    q, k, v = _qkv(2, 5, 7, 4, 3, 16)
    with pytest.raises(SignatureCallError) as exc:
        GroupedQueryAttentionFwdOp()(q, k, v)
    assert str(exc.value).splitlines() == [
        "GroupedQueryAttentionFwdOp: argument q does not match the signature",
        "  expected: H_kv > 0 and H % H_kv == 0",
        "  seen:     q: f64[2, 5, 4, 16]",
        "  because:  refinement 'H_kv > 0 and H % H_kv == 0' does not hold (H_kv = 3, H = 4)",
        "  call:     q: f64[2, 5, 4, 16], k: f64[2, 7, 3, 16], v: f64[2, 7, 3, 16]",
        "  bound:    T = float64, B = 2, S_q = 5, H = 4, D = 16, S_kv = 7, H_kv = 3, D_v = 16",
        _spec_line("GroupedQueryAttentionFwdOp.signature.shape_rules[0]"),
    ]


def test_head_dims_that_differ_are_refused():
    q, _, v = _qkv(2, 5, 7, 4, 2, 16)
    k = torch.randn(2, 7, 2, 8, dtype=torch.float64)
    with pytest.raises(SignatureCallError) as exc:
        GroupedQueryAttentionFwdOp()(q, k, v)
    lines = str(exc.value).splitlines()
    assert lines[:4] == [
        "GroupedQueryAttentionFwdOp: argument k does not match the signature",
        "  expected: k: Tensor[T, [B, S_kv, H_kv, D]]  (declared Seq[layout, B, S_kv, H_kv, D])",
        "  seen:     k: f64[2, 7, 2, 8]",
        "  because:  D bound to 16 by q.shape[3], but k.shape[3] is 8",
    ]


def test_multi_head_keys_must_have_every_head():
    q, k, v = _qkv(2, 5, 7, 4, 2, 16)
    with pytest.raises(SignatureCallError) as exc:
        MultiHeadAttentionFwdOp()(q, k, v)
    assert str(exc.value).splitlines()[3] == \
        "  because:  H bound to 4 by q.shape[2], but k.shape[2] is 2"


def test_causal_with_more_rows_than_keys_is_refused():
    q, k, v = _qkv(2, 9, 7, 4, 2, 16)
    with pytest.raises(SignatureCallError) as exc:
        GroupedQueryAttentionFwdOp(is_causal=True)(q, k, v)
    assert str(exc.value).splitlines()[1:4] == [
        "  expected: not is_causal or S_q <= S_kv",
        "  seen:     q: f64[2, 9, 4, 16]",
        "  because:  refinement 'not is_causal or S_q <= S_kv' does not hold (is_causal = True,"
        " S_q = 9, S_kv = 7)",
    ]


def test_batch_and_key_lengths_must_agree():
    q, k, v = _qkv(2, 5, 7, 4, 2, 16)
    with pytest.raises(SignatureCallError) as exc:
        GroupedQueryAttentionFwdOp()(q, k, v[:, :6])
    assert str(exc.value).splitlines()[3] == \
        "  because:  S_kv bound to 7 by k.shape[1], but v.shape[1] is 6"
    with pytest.raises(SignatureCallError) as exc:
        GroupedQueryAttentionFwdOp()(q, k[:1], v[:1])
    assert str(exc.value).splitlines()[3] == \
        "  because:  B bound to 2 by q.shape[0], but k.shape[0] is 1"


@pytest.mark.parametrize(("kw", "line", "rule"), [
    (dict(softcap=0.0), 4, "not present(softcap) or softcap.value > 0.0 and finite(softcap.value)"),
    # an infinite cap is inf * tanh(s / inf) = inf * 0: NaN scores, refused with NaN
    (dict(softcap=float("inf")), 4,
     "not present(softcap) or softcap.value > 0.0 and finite(softcap.value)"),
    (dict(scale=-1.0), 3, "not present(scale) or scale.value > 0.0"),
    (dict(window=(-2, 0)), 5, "not present(window) or per_axis(window, 0, 2) >= -1 and "
                              "per_axis(window, 1, 2) >= -1"),
])
def test_params_outside_their_range_are_refused_at_construction(kw, line, rule):
    with pytest.raises(ConstructionError) as exc:
        GroupedQueryAttentionFwdOp(**kw)
    lines = str(exc.value).splitlines()
    assert lines[1] == f"  expected: {rule}"
    assert lines[3] == f"  because:  refinement '{rule}' does not hold"
    assert lines[-1] == _spec_line(f"GroupedQueryAttentionFwdOp.signature.shape_rules[{line}]")


# --- the reference over a space of calls -------------------------------------------------------


def _per_row(q, k, v, scale, left, right, softcap):
    """Attention one query row at a time, from the definition (float64, [B, S, H, D])."""
    b, s_q, h, _ = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    o = torch.zeros(b, s_q, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, h, s_q), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // h_kv)
            for i in range(s_q):
                diag = i + s_kv - s_q
                keys = [j for j in range(s_kv) if (left < 0 or j >= diag - left)
                        and (right < 0 or j <= diag + right)]
                if not keys:
                    continue
                s = k[bi, keys, kh] @ q[bi, i, hi] * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                o[bi, i, hi] = torch.softmax(s, 0) @ v[bi, keys, kh]
    return o, lse


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), s_q=st.integers(1, 9), s_kv=st.integers(0, 9),
       h_kv=st.integers(1, 2), groups=st.integers(1, 3), d=st.integers(1, 4),
       causal=st.booleans(), left=st.integers(-1, 4), right=st.integers(-1, 4),
       windowed=st.booleans(), softcap=st.none() | st.floats(0.5, 4.0),
       scale=st.none() | st.floats(0.1, 2.0), seed=st.integers(0, 2 ** 16))
def test_reference_matches_the_per_row_definition(b, s_q, s_kv, h_kv, groups, d, causal, left,
                                                  right, windowed, softcap, scale, seed):
    if causal and s_q > s_kv:
        s_kv = s_q  # the refinement
    q, k, v = _qkv(b, s_q, s_kv, h_kv * groups, h_kv, d, seed=seed)
    window = (left, right) if windowed else None
    op = GroupedQueryAttentionFwdOp(is_causal=causal, window=window, softcap=softcap,
                                    scale=scale, return_lse=True)
    o, lse = op(q, k, v)
    lo, hi = window_bounds(causal, window)
    want_o, want_lse = _per_row(q, k, v, scale if scale is not None else d ** -0.5, lo, hi,
                                softcap)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)


# --- varlen -----------------------------------------------------------------------------------


def _packed(lens_q, lens_k, h, h_kv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), h_kv, d, generator=g, dtype=torch.float64)

    def offsets(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    return q, k, v, offsets(lens_q), offsets(lens_k)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1,
                     max_size=4),
       causal=st.booleans(), window=st.none() | st.tuples(st.integers(-1, 3),
                                                           st.integers(-1, 3)),
       softcap=st.none() | st.just(3.0), seed=st.integers(0, 2 ** 16))
def test_varlen_is_the_dense_op_a_sequence_at_a_time(lens, causal, window, softcap, seed):
    """Each packed sequence (empty ones, more queries than keys under is_causal included) is
    what the dense op computes on its rows alone, with the same mask (is_causal as the
    window's right bound of 0, which the dense op takes for any lengths)."""
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, 4, seed)
    o, lse = GroupedQueryAttentionVarlenFwdOp(is_causal=causal, window=window, softcap=softcap,
                                              return_lse=True)(q, k, v, cq, ck)
    dense = GroupedQueryAttentionFwdOp(window=window_bounds(causal, window), softcap=softcap,
                                       return_lse=True)
    for b in range(len(lens)):
        q0, q1, k0, k1 = cq[b].item(), cq[b + 1].item(), ck[b].item(), ck[b + 1].item()
        if q1 == q0:
            continue
        want_o, want_lse = dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        torch.testing.assert_close(o[q0:q1], want_o[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, q0:q1], want_lse[0], rtol=1e-12, atol=1e-12)


def test_varlen_offsets_are_refused_by_length_and_dtype():
    q, k, v, cq, ck = _packed([3, 2], [4, 4], 4, 2, 8)
    op = GroupedQueryAttentionVarlenFwdOp()
    with pytest.raises(SignatureCallError) as exc:
        op(q, k, v, cq, ck[:2])
    assert str(exc.value).splitlines()[1:4] == [
        "  expected: cu_seqlens_k: Tensor[int32, [B + 1]]",
        "  seen:     cu_seqlens_k: i32[2]",
        "  because:  cu_seqlens_k.shape[0] must be B + 1 = 3, but is 2",
    ]
    with pytest.raises(SignatureCallError) as exc:
        op(q, k, v, cq[:0], ck[:0])
    assert str(exc.value).splitlines()[3] == \
        "  because:  cu_seqlens_q.shape[0] is 0, but B + 1 has no solution B >= 0 there"
    with pytest.raises(SignatureCallError) as exc:
        op(q, k, v, cq.long(), ck)
    assert str(exc.value).splitlines()[3] == \
        "  because:  cu_seqlens_q.dtype must be int32, but is int64"


def test_varlen_eager_contender_is_the_reference():
    q, k, v, cq, ck = _packed([3, 0, 5, 2], [4, 2, 5, 0], 4, 2, 8)
    for kw in (dict(is_causal=True), dict(window=(1, 1)), dict(softcap=2.0)):
        op = GroupedQueryAttentionVarlenFwdOp(**kw, return_lse=True)
        got, want = op.eager()(q, k, v, cq, ck), op(q, k, v, cq, ck)
        torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], want[1].float(), rtol=1e-6, atol=1e-6)


def test_varlen_roofline_counts_each_sequence_from_the_offsets():
    """The spec's formula sees the totals only (every sequence at the mean length);
    given the call's inputs the op counts each sequence as the dense op counts it, halved
    under is_causal only where the sequence's lengths are equal."""
    lens_q, lens_k = [5, 0, 3, 8], [5, 2, 6, 8]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, 8)
    for causal in (False, True):
        op = GroupedQueryAttentionVarlenFwdOp(is_causal=causal)
        op(q, k, v, cq, ck)
        floor, traffic = op.eval_roofline()
        assert floor == 2 * 4 * 16 * 21 * 16 // 4  # Z_q != Z_kv: not halved under is_causal
        want = 0
        for lq, lk in zip(lens_q, lens_k, strict=True):
            dense = GroupedQueryAttentionFwdOp(is_causal=causal and lq <= lk)
            if lq:
                dense(q[None, :lq], k[None, :lk], v[None, :lk])
                want += dense.eval_roofline()[0]
        assert op.eval_roofline(q, k, v, cq, ck) == (want, traffic)
        meta = [t.to("meta") for t in (q, k, v, cq, ck)]
        assert op.eval_roofline(*meta) == (floor, traffic)


# --- on a GPU: a training step through the in-tree kernels ----------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(window=(64, 16), softcap=30.0),
                                dict(is_causal=True, layout="bhsd")])
def test_a_training_step_on_the_gpu_matches_float64(kw):
    """The forward kernel, then the gradients' kernel through the op's autograd node, against
    the same step in float64 on the reference target (GQA 8:2, lengths off the tile, an
    upstream gradient of the log-sum-exp too)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, 333, 8, 128), (2, 401, 2, 128), (2, 401, 2, 128)]
    if kw.get("layout") == "bhsd":
        shapes = [(b, h, s, d) for b, s, h, d in shapes]
    leaves = [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16)
              .requires_grad_() for s in shapes]
    o, lse = GroupedQueryAttentionFwdOp(**kw, return_lse=True)(*leaves)
    dout, dlse = torch.randn_like(o), torch.randn_like(lse)
    got = torch.autograd.grad([o, lse], leaves, [dout, dlse])
    wide = [t.detach().double().cpu().requires_grad_() for t in leaves]
    want_o, want_lse = GroupedQueryAttentionFwdOp(**kw, return_lse=True, target="reference")(*wide)
    want = torch.autograd.grad([want_o, want_lse], wide, [dout.double().cpu(),
                                                          dlse.double().cpu()])
    torch.testing.assert_close(o.double().cpu(), want_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-4, atol=2e-3)
    for name, a, b in zip("qkv", got, want, strict=True):
        err = (a.double().cpu() - b).abs().max().item()
        assert err <= 2e-2 * b.abs().max().item(), f"d{name} is {err:.3g} off"


@pytest.mark.cuda
def test_the_log_sum_exp_alone_on_the_gpu_is_finite_and_matches_float64():
    """o unused, an inf in v: the gradients' kernel is handed zeros for dout, o and v (the
    op's glue), so dq and dk are the log-sum-exp's, finite, and v has no gradient."""
    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(2, 333, 8, 128), (2, 401, 2, 128), (2, 401, 2, 128)]
    ts = [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes]
    ts[2][0, 17, 1, 3] = math.inf
    leaves = [t.requires_grad_() for t in ts]
    _, lse = GroupedQueryAttentionFwdOp(is_causal=True, return_lse=True)(*leaves)
    dlse = torch.randn_like(lse)
    got = torch.autograd.grad(lse, leaves, dlse, allow_unused=True)
    assert got[2] is None
    wide = [t.detach().double().cpu().requires_grad_() for t in leaves]
    _, want_lse = GroupedQueryAttentionFwdOp(is_causal=True, return_lse=True,
                                             target="reference")(*wide)
    want = torch.autograd.grad(want_lse, wide, dlse.double().cpu(), allow_unused=True)
    assert want[2] is None
    for name, a, b in zip("qk", got[:2], want[:2], strict=True):
        assert a.isfinite().all(), f"d{name} is not finite"
        err = (a.double().cpu() - b).abs().max().item()
        assert err <= 2e-2 * b.abs().max().item(), f"d{name} is {err:.3g} off"


class _Recorded:
    """A CPU stand-in of a slot's kernel: records which kernel ran under which call spec and
    fills its outputs, so the family base's plumbing is checked without a GPU."""

    devices = ("cpu",)
    general = True
    specs: list = []

    def __call__(self, *tensors):
        assert all(t.is_contiguous() and not t.data_ptr() % 16 for t in tensors[:3])
        type(self).specs.append((id(self), self.spec))
        for t in tensors[-self.n_out:]:
            if t is not None:
                t.fill_(1.5)


def test_the_forward_and_gradient_hand_their_slot_one_call_spec_and_lay_out_their_inputs():
    from tileops.kernels.attention import AttentionFwdInterface
    from tileops.kernels.attention_bwd import AttentionBwdInterface
    from tileops.runtime import Kernel

    class Fwd(_Recorded, Kernel, AttentionFwdInterface):
        n_out, specs = 2, []

    class Bwd(_Recorded, Kernel, AttentionBwdInterface):
        n_out, specs = 3, []

    q, k, v = _qkv(2, 5, 7, 4, 2, 64, dtype=torch.float16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided: laid out before the kernel
    fwd = GroupedQueryAttentionFwdOp(is_causal=True, window=(3, -1), softcap=2.0,
                                     return_lse=True, kernel_map={AttentionFwdInterface: Fwd})
    o, lse = fwd(q, k, v)
    fwd(q, k, v)  # the cached call: the same kernel
    assert torch.equal(o, torch.full_like(o, 1.5)) and lse.dtype == torch.float32
    assert len(Fwd.specs) == 2 and Fwd.specs[0] == Fwd.specs[1]
    spec = Fwd.specs[0][1]
    assert (spec.batch, spec.seq_q, spec.seq_kv, spec.heads, spec.heads_kv, spec.dim,
            spec.dim_v, spec.dtype, spec.layout.value) == (2, 5, 7, 4, 2, 64, 64, "float16",
                                                           "bshd")
    assert (spec.window_left, spec.window_right, spec.softcap) == (3, 0, 2.0)
    assert spec.scale == pytest.approx(1 / 8)
    bwd = GroupedQueryAttentionBwdOp(is_causal=True, window=(3, -1), softcap=2.0,
                                     kernel_map={AttentionBwdInterface: Bwd})
    dq, dk, dv = bwd(q, k, v, o, lse, torch.ones_like(o), torch.zeros_like(lse))
    assert torch.equal(dq, torch.full_like(dq, 1.5)) and dk.shape == k.shape
    assert [sp for _, sp in Bwd.specs] == [spec]


def _bwd_spec(**kw):
    from tileops.kernels import attention as A

    fields = dict(device=torch.device("cuda", 0), batch=2, seq_q=100, seq_kv=100, heads=8,
                  heads_kv=2, dim=128, dim_v=128, dtype="bfloat16",
                  layout=A.AttentionLayout.BSHD, scale=0.125, window_left=-1,
                  window_right=0, softcap=None)
    fields.update(kw)
    return A.AttentionFwdSpec(**fields)


@pytest.mark.parametrize(("arch", "chosen"), [((9, 0), "AttentionBwdTmaKernel"),
                                               ((8, 0), "AttentionBwdKernel"),
                                               ((8, 9), "AttentionBwdKernel")])
def test_the_ops_backward_takes_the_tma_plan_on_hopper_only(monkeypatch, arch, chosen):
    from tileops.kernels import attention_bwd as AB
    from tileops.ops.attention import AttentionBwdOp
    from tileops.runtime import kernel as runtime_kernel

    dev = torch.device("cuda", 6)
    monkeypatch.setitem(runtime_kernel._ARCH_CACHE, dev, arch)
    candidates = AttentionBwdOp.kernel_types[AB.AttentionBwdInterface]
    assert runtime_kernel.select(AB.AttentionBwdInterface, candidates,
                                 _bwd_spec(device=dev)).__name__ == chosen
    # a head-dim pair neither serves is refused by both, each naming why
    with pytest.raises(runtime_kernel.NoKernelError, match="64/64, 128/128") as refused:
        runtime_kernel.select(AB.AttentionBwdInterface, candidates,
                              _bwd_spec(device=dev, dim=96, dim_v=96))
    assert "AttentionBwdKernel" in str(refused.value)


@pytest.mark.parametrize(("cu_q", "cu_k", "message"), [
    ([0, 5, 3, 8], [0, 4, 6, 8], "cu_seqlens_q[2] is 3, below cu_seqlens_q[1] = 5"),
    ([0, 4, 6, 8], [0, 4, 2, 30], "cu_seqlens_k[2] is 2, below cu_seqlens_k[1] = 4"),
    ([1, 4, 6, 8], [0, 4, 6, 8], "cu_seqlens_q[0] is 1: the offsets start at 0"),
    ([0, 4, 6, 7], [0, 4, 6, 8], "cu_seqlens_q[3] is 7: the offsets end at the packed length"),
    ([0, 4, 6, 8], [0, 4, 6, 30], "cu_seqlens_k[3] is 30: the offsets end at the packed"),
])
def test_varlen_offsets_that_do_not_rise_from_0_to_the_length_are_refused(cu_q, cu_k, message):
    """The reference reads the offsets where they hold data and refuses those that start
    elsewhere than 0, fall, or end elsewhere than the packed length (it returned a result for
    each); the op serves the next call."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(8, 2, 8, generator=g, dtype=torch.float64)
    op = GroupedQueryAttentionVarlenFwdOp()
    i32 = torch.int32
    with pytest.raises(ValueError, match=re.escape(message)):
        op(q, k, k, torch.tensor(cu_q, dtype=i32), torch.tensor(cu_k, dtype=i32))
    good = torch.tensor([0, 4, 6, 8], dtype=i32)
    assert op(q, k, k, good, good).shape == (8, 4, 8)
