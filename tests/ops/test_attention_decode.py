"""Decode attention over a KV cache, on the CPU through the public ops (the ``reference``
target): the signature's refusals of every shape relation (exact text), the reference's
refusals of lengths and pages outside the cache (exact text), and numerics against float64
at the edges the spec workloads name (length 0 and 1, lengths off the page, mixed lengths,
a softcap, the default scale), a paged cache against the same keys contiguous, and the torch
contender against the reference. The generic harness covers the workloads, the bad-input
corpus, compile and fake tensors."""

import math

import pytest

torch = pytest.importorskip("torch")

from tileops.ops import (  # noqa: E402
    GroupedQueryAttentionDecodePagedWithKVCacheFwdOp as Paged,
)
from tileops.ops import (  # noqa: E402
    GroupedQueryAttentionDecodeWithKVCacheFwdOp as GQA,
)
from tileops.ops import (  # noqa: E402
    MultiHeadAttentionDecodePagedWithKVCacheFwdOp as MHAPaged,
)
from tileops.ops import (  # noqa: E402
    MultiHeadAttentionDecodeWithKVCacheFwdOp as MHA,
)
from tileops.runtime import REFERENCE  # noqa: E402
from tileops.signature import SignatureCallError  # noqa: E402

BF16, I32 = torch.bfloat16, torch.int32


def _t(*shape, dtype=BF16):
    return torch.zeros(shape, dtype=dtype)


def _lens(*values):
    return torch.tensor(values, dtype=I32)


def _message_lines(exc) -> list[str]:
    """The refusal's lines but the last (``spec:``, which names the file's path and line)."""
    lines = str(exc.value).splitlines()
    assert lines[-1].lstrip().startswith("spec:")
    return lines[:-1]


# --- the signature: every shape relation, refused by name before any kernel --------------------

GQA_CALL = "q: bf16[2, {h}, 64], k_cache: bf16[2, 10, 4, {d}], v_cache: bf16[2, 10, 4, {d}]"


def test_query_heads_not_a_multiple_of_the_kv_heads():
    with pytest.raises(SignatureCallError) as exc:
        GQA(target=REFERENCE)(_t(2, 6, 64), _t(2, 10, 4, 64), _t(2, 10, 4, 64), _lens(1, 2))
    assert _message_lines(exc) == [
        "GroupedQueryAttentionDecodeWithKVCacheFwdOp: argument q does not match the signature",
        "  expected: H_kv > 0 and H % H_kv == 0",
        "  seen:     q: bf16[2, 6, 64]",
        "  because:  refinement 'H_kv > 0 and H % H_kv == 0' does not hold (H_kv = 4, H = 6)",
        "  call:     " + GQA_CALL.format(h=6, d=64) + ", cache_seqlens: i32[2]",
        "  bound:    T = bfloat16, B = 2, H = 6, D = 64, S = 10, H_kv = 4",
    ]


def test_head_widths_differ():
    with pytest.raises(SignatureCallError) as exc:
        GQA(target=REFERENCE)(_t(2, 8, 64), _t(2, 10, 4, 32), _t(2, 10, 4, 32), _lens(1, 2))
    lines = _message_lines(exc)
    assert lines[0] == ("GroupedQueryAttentionDecodeWithKVCacheFwdOp: argument k_cache does not "
                        "match the signature")
    assert lines[3] == "  because:  D bound to 64 by q.shape[2], but k_cache.shape[3] is 32"


def test_values_differ_from_the_keys():
    with pytest.raises(SignatureCallError) as exc:
        GQA(target=REFERENCE)(_t(2, 8, 64), _t(2, 10, 4, 64), _t(2, 11, 4, 64), _lens(1, 2))
    assert _message_lines(exc)[3] == \
        "  because:  S bound to 10 by k_cache.shape[1], but v_cache.shape[1] is 11"


def test_lengths_are_one_a_sequence_in_int32():
    op = GQA(target=REFERENCE)
    with pytest.raises(SignatureCallError) as exc:
        op(_t(2, 8, 64), _t(2, 10, 4, 64), _t(2, 10, 4, 64), _lens(1, 2, 3))
    assert _message_lines(exc)[3] == \
        "  because:  B bound to 2 by q.shape[0], but cache_seqlens.shape[0] is 3"
    with pytest.raises(SignatureCallError) as exc:
        op(_t(2, 8, 64), _t(2, 10, 4, 64), _t(2, 10, 4, 64), torch.tensor([1, 2]))
    assert _message_lines(exc)[3] == "  because:  cache_seqlens.dtype must be int32, but is int64"


def test_mha_needs_as_many_kv_heads_as_query_heads():
    with pytest.raises(SignatureCallError) as exc:
        MHA(target=REFERENCE)(_t(2, 8, 64), _t(2, 10, 4, 64), _t(2, 10, 4, 64), _lens(1, 2))
    assert _message_lines(exc)[3] == \
        "  because:  H bound to 8 by q.shape[1], but k_cache.shape[2] is 4"


def test_page_size_in_range():
    with pytest.raises(SignatureCallError) as exc:
        Paged(target=REFERENCE)(_t(2, 8, 64), _t(4, 48, 4, 64), _t(4, 48, 4, 64), _lens(1, 2),
                                _t(2, 2, dtype=I32))
    lines = _message_lines(exc)
    assert lines[1:4] == [
        "  expected: PS in (16, 32, 64, 128, 256)",
        "  seen:     k_cache: bf16[4, 48, 4, 64]",
        "  because:  refinement 'PS in (16, 32, 64, 128, 256)' does not hold (PS = 48)",
    ]


def test_block_table_rows_are_the_batch():
    with pytest.raises(SignatureCallError) as exc:
        Paged(target=REFERENCE)(_t(2, 8, 64), _t(4, 16, 4, 64), _t(4, 16, 4, 64), _lens(1, 2),
                                _t(3, 2, dtype=I32))
    assert _message_lines(exc)[3] == \
        "  because:  B bound to 2 by q.shape[0], but block_table.shape[0] is 3"


def test_scale_and_softcap_positive():
    from tileops.signature import ConstructionError

    with pytest.raises(ConstructionError) as exc:
        GQA(scale=-1.0)
    assert _message_lines(exc)[3] == \
        "  because:  refinement 'not present(scale) or scale.value > 0.0' does not hold"
    with pytest.raises(ConstructionError) as exc:
        Paged(softcap=0.0)
    assert _message_lines(exc)[3] == \
        "  because:  refinement 'not present(softcap) or softcap.value > 0.0 and finite(softcap.value)' does not hold"


# --- the data: lengths and pages, checked by the reference --------------------------------------


def test_a_length_past_the_cache_is_refused():
    op = GQA(target=REFERENCE)
    with pytest.raises(ValueError) as exc:
        op(_t(2, 8, 64), _t(2, 10, 4, 64), _t(2, 10, 4, 64), _lens(3, 11))
    assert str(exc.value) == ("GroupedQueryAttentionDecodeWithKVCacheFwdOp: cache_seqlens[1] is "
                              "11, outside [0, 10] (the cache holds S = 10 keys a sequence)")
    with pytest.raises(ValueError) as exc:
        op(_t(2, 8, 64), _t(2, 10, 4, 64), _t(2, 10, 4, 64), _lens(-1, 2))
    assert str(exc.value).startswith(
        "GroupedQueryAttentionDecodeWithKVCacheFwdOp: cache_seqlens[0] is -1, outside [0, 10]")
    op(_t(2, 8, 64), _t(2, 10, 4, 64), _t(2, 10, 4, 64), _lens(3, 10))  # still usable


def test_a_paged_length_past_the_table_is_refused():
    with pytest.raises(ValueError) as exc:
        Paged(target=REFERENCE)(_t(2, 8, 64), _t(4, 16, 4, 64), _t(4, 16, 4, 64), _lens(3, 33),
                                _t(2, 2, dtype=I32))
    assert str(exc.value) == (
        "GroupedQueryAttentionDecodePagedWithKVCacheFwdOp: cache_seqlens[1] is 33, outside "
        "[0, 32] (the cache holds max_pages * page_size = 32 keys a sequence)")


def test_a_page_read_outside_the_pool_is_refused_and_one_not_read_is_ignored():
    op = Paged(target=REFERENCE)
    q, k, v = _t(2, 8, 64), _t(4, 16, 4, 64), _t(4, 16, 4, 64)
    with pytest.raises(ValueError) as exc:
        op(q, k, v, _lens(3, 20), torch.tensor([[0, 1], [2, 4]], dtype=I32))
    assert str(exc.value) == (
        "GroupedQueryAttentionDecodePagedWithKVCacheFwdOp: block_table[1, 1] is 4, not a page of "
        "the pool [0, 4) (sequence 1 has 20 keys, in its first 2 pages)")
    # entries past a sequence's pages are never read, whatever they hold
    assert op(q, k, v, _lens(3, 16), torch.tensor([[0, -1], [2, 99]], dtype=I32)).shape == \
        (2, 8, 64)


# --- numerics against float64 -------------------------------------------------------------------


def _attention64(q, k, v, lens, scale, softcap=None):
    """The definition, one sequence and head at a time, in float64: (B, H, D)."""
    b, h, d = q.shape
    g = h // k.shape[2]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        for j in range(h):
            if n == 0:
                continue
            s = k[i, :n, j // g].double() @ q[i, j].double() * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[i, j] = torch.softmax(s, 0) @ v[i, :n, j // g].double()
    return out


def _rel(a, b):
    return (a.double() - b).norm().item() / max(b.norm().item(), 1e-30)


def _random(b, s, h, hk, d, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype)
            for shape in ((b, h, d), (b, s, hk, d), (b, s, hk, d))]


@pytest.mark.parametrize("dtype, tol", [(BF16, 1e-2), (torch.float16, 2e-3),
                                        (torch.float64, 1e-12)])
def test_mixed_lengths_match_float64(dtype, tol):
    """Lengths 0 and 1, lengths off every tile and the full cache in one batch; float64 is
    served by the reference target."""
    q, k, v = _random(6, 77, 8, 2, 64, dtype)
    lens = _lens(77, 0, 1, 33, 64, 5)
    out = GQA(target=REFERENCE)(q, k, v, lens)
    ref = _attention64(q, k, v, lens, 1 / math.sqrt(64))
    assert out.dtype == dtype
    assert _rel(out, ref) < tol
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # an empty sequence: exactly 0
    # one key: the softmax is 1, the output that key's value (rounded once)
    torch.testing.assert_close(out[2].double(), v[2, 0].double().repeat_interleave(4, 0),
                               rtol=0, atol=0)


def test_mha_softcap_and_scale_match_float64():
    q, k, v = _random(3, 40, 4, 4, 32)
    lens = _lens(40, 17, 2)
    out = MHA(scale=0.3, softcap=5.0, target=REFERENCE)(q, k, v, lens)
    assert _rel(out, _attention64(q, k, v, lens, 0.3, 5.0)) < 1e-2


def _paged_from(k, v, page, lens, seed=1):
    """The contiguous cache ``k``, ``v`` (B, S, H_kv, D) laid out in shuffled pages of
    ``page`` tokens (S a multiple of it), and its block table; pages past each sequence's
    length are left out of the pool and their table entries set to -1."""
    b, s = k.shape[:2]
    mp = s // page
    used = [-(-int(n) // page) for n in lens]
    order = torch.randperm(sum(used), generator=torch.Generator().manual_seed(seed))
    table = torch.full((b, mp), -1, dtype=I32)
    kp = torch.empty(sum(used), page, *k.shape[2:], dtype=k.dtype)
    vp = torch.empty_like(kp)
    n = 0
    for i in range(b):
        for j in range(used[i]):
            p = int(order[n])
            n += 1
            table[i, j] = p
            kp[p] = k[i, j * page:(j + 1) * page]
            vp[p] = v[i, j * page:(j + 1) * page]
    return kp, vp, table


@pytest.mark.parametrize("page", [16, 32])
def test_paged_matches_the_same_keys_contiguous(page):
    q, k, v = _random(4, 96, 8, 2, 64)
    lens = _lens(96, 17, 0, 48)
    kp, vp, table = _paged_from(k, v, page, lens)
    paged = Paged(target=REFERENCE)(q, kp, vp, lens, table)
    contiguous = GQA(target=REFERENCE)(q, k, v, lens)
    torch.testing.assert_close(paged, contiguous, rtol=0, atol=0)
    assert _rel(paged, _attention64(q, k, v, lens, 1 / 8)) < 1e-2


@pytest.mark.parametrize("paged", [False, True])
def test_what_lies_past_a_length_is_not_read(paged):
    """A cache made by torch.empty may hold NaN or inf past a sequence's length, in its last
    page or in pages of other sequences: the output is that of the cache zeroed there (a
    zero-length sequence gives 0), as the kernels zero-fill those keys and values."""
    q, k, v = _random(3, 64, 4, 2, 64)
    lens = _lens(37, 0, 64)
    clean = GQA(target=REFERENCE)(q, k, v, lens)
    k, v = k.clone(), v.clone()
    k[0, 37:], v[0, 37:], k[1], v[1] = math.nan, math.inf, math.nan, math.nan
    if paged:
        kp, vp, table = _paged_from(k, v, 16, lens)
        # and a page no sequence's table names
        kp, vp = (torch.cat([c, torch.full_like(c[:1], math.nan)]) for c in (kp, vp))
        got = Paged(target=REFERENCE)(q, kp, vp, lens, table)
    else:
        got = GQA(target=REFERENCE)(q, k, v, lens)
    torch.testing.assert_close(got, clean, rtol=0, atol=0)
    assert not got[1].any()
    # a NaN within a length reaches that sequence's output, as prefill attention's does
    q[2, 0, 0] = math.nan
    got = GQA(target=REFERENCE)(q, k, v, lens)
    assert got[2].isnan().any() and not got[:2].isnan().any()


def test_paged_mha_matches_the_same_keys_contiguous():
    q, k, v = _random(3, 64, 4, 4, 64)
    lens = _lens(64, 33, 1)
    kp, vp, table = _paged_from(k, v, 32, lens)
    out = MHAPaged(target=REFERENCE)(q, kp, vp, lens, table)
    torch.testing.assert_close(out, MHA(target=REFERENCE)(q, k, v, lens), rtol=0, atol=0)
    with pytest.raises(SignatureCallError) as exc:
        MHAPaged(target=REFERENCE)(q, kp[:, :, :2], vp[:, :, :2], lens, table)
    assert _message_lines(exc)[3] == \
        "  because:  H bound to 4 by q.shape[1], but k_cache.shape[2] is 2"


@pytest.mark.parametrize("paged", [False, True])
def test_multi_head_with_no_heads_is_an_empty_output(paged):
    """No heads at all (H = H_kv = 0): an empty output, as torch's attention gives; the
    reference divided the heads by the key heads."""
    op = (MHAPaged if paged else MHA)(target=REFERENCE)
    lens = _lens(32, 5)

    def call(q, k, v):
        if not paged:
            return op(q, k, v, lens)
        kp, vp, table = _paged_from(k, v, 16, lens)
        return op(q, kp, vp, lens, table)

    q, k, v = _random(2, 32, 0, 0, 64)
    out = call(q, k, v)
    assert out.shape == (2, 0, 64) and out.dtype == q.dtype
    # the same instance serves a call with heads after it
    q, k, v = _random(2, 32, 2, 2, 64)
    torch.testing.assert_close(call(q, k, v), GQA(target=REFERENCE)(q, k, v, lens),
                               rtol=0, atol=0)


def test_the_torch_contender_matches_the_reference():
    q, k, v = _random(4, 50, 8, 4, 64, torch.float32)
    lens = _lens(50, 0, 1, 31)
    op = GQA(target=REFERENCE)
    out = op.eager()(q, k, v, lens)
    assert _rel(out, _attention64(q, k, v, lens, 1 / 8)) < 1e-5
    kp, vp, table = _paged_from(torch.cat([k, k[:, :14]], 1), torch.cat([v, v[:, :14]], 1),
                                16, lens)
    paged = Paged(target=REFERENCE)
    assert _rel(paged.eager()(q, kp, vp, lens, table), _attention64(q, k, v, lens, 1 / 8)) < 1e-5
    capped = GQA(softcap=2.0, target=REFERENCE)
    assert _rel(capped.eager()(q, k, v, lens), _attention64(q, k, v, lens, 1 / 8, 2.0)) < 1e-5


def test_peers_are_none_where_sdpa_cannot_express_the_op():
    assert set(GQA(softcap=2.0).contenders()) == {"torch"}
    assert set(Paged().contenders()) == {"torch", "sdpa-flash", "sdpa-cudnn"}


# --- the family base: the call spec and the layout it hands the slot -----------------------------

from tileops.kernels.attention_decode import (  # noqa: E402
    AttentionDecodeInterface,
    AttentionDecodeSpec,
    CacheLayout,
)
from tileops.runtime import Kernel  # noqa: E402

SEEN: list = []


class TorchDecode(Kernel, AttentionDecodeInterface):
    """The slot in plain PyTorch, on CPU: records its spec, asserts the layout the base
    promises and computes the op from the gathered keys."""

    devices = ("cpu",)
    general = True

    def __call__(self, q, k, v, cache_seqlens, block_table, o):
        s = self.spec
        SEEN.append(s)
        for t in (q, k, v, cache_seqlens, block_table, o):
            assert t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0)
        assert (block_table is None) is (s.layout is CacheLayout.CONTIGUOUS)
        if block_table is not None:
            pages = block_table.long().clamp(0, k.shape[0] - 1)
            k = k[pages].flatten(1, 2)
            v = v[pages].flatten(1, 2)
        o.copy_(_attention64(q, k, v, cache_seqlens, s.scale, s.softcap))


KMAP = {"attention_decode_fwd": TorchDecode}


def test_the_call_spec_states_the_calls_facts():
    SEEN.clear()
    q, k, v = _random(3, 40, 8, 2, 64)
    lens = _lens(40, 7, 0)
    out = GQA(softcap=5.0, kernel_map=KMAP)(q, k, v, lens)
    assert SEEN[-1] == AttentionDecodeSpec(
        device=q.device, layout=CacheLayout.CONTIGUOUS, batch=3, heads=8, kv_heads=2,
        head_dim=64, capacity=40, page_size=0, max_pages=0, dtype="bfloat16", scale=0.125,
        softcap=5.0)
    assert _rel(out, _attention64(q, k, v, lens, 0.125, 5.0)) < 1e-2
    kp, vp, table = _paged_from(torch.cat([k, k[:, :8]], 1), torch.cat([v, v[:, :8]], 1), 16,
                                lens)
    Paged(scale=0.5, kernel_map=KMAP)(q, kp, vp, lens, table)
    assert SEEN[-1] == AttentionDecodeSpec(
        device=q.device, layout=CacheLayout.PAGED, batch=3, heads=8, kv_heads=2, head_dim=64,
        capacity=kp.shape[0], page_size=16, max_pages=3, dtype="bfloat16", scale=0.5,
        softcap=None)


def test_strided_inputs_reach_the_slot_contiguous():
    q, k, v = _random(2, 33, 4, 4, 32)
    lens = _lens(33, 5)
    wide = torch.stack([k, v], 2)  # (B, S, 2, H, D): the caches as strided views
    op = MHA(kernel_map=KMAP)
    out = op(q.transpose(0, 1).contiguous().transpose(0, 1), wide[:, :, 0], wide[:, :, 1], lens)
    assert _rel(out, _attention64(q, k, v, lens, 32 ** -0.5)) < 1e-2
    assert SEEN[-1].capacity == 33
    # a contiguous q starting mid-vector (one element into a buffer) is copied too
    flat = torch.cat([torch.zeros(1, dtype=BF16), q.flatten()])
    out = op(flat[1:].view(q.shape), k, v, lens)
    assert _rel(out, _attention64(q, k, v, lens, 32 ** -0.5)) < 1e-2


def test_the_in_tree_kernels_refuse_float32_by_name():
    q, k, v = _random(2, 8, 4, 4, 32, torch.float32)
    with pytest.raises(TypeError) as exc:
        MHA(kernel_map=KMAP)(q, k, v, _lens(8, 1))
    assert str(exc.value) == (
        "MultiHeadAttentionDecodeWithKVCacheFwdOp: the in-tree decode attention kernels serve "
        "bfloat16, float16, not float32; construct the op with target='reference' for float32")
