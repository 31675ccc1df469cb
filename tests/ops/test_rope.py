"""The RoPE family on the CPU: the references against independent float64 forms of the
published formulas, the frequency schedules (Llama 3.1, YaRN, LongRoPE) against per-element
transcriptions of their papers' code, the op's plumbing to the kernel slot (the aux tables,
the cache, LongRoPE's switch) through a torch stand-in for the kernel that reads the call
spec and tensors as the TileLang program does, the construction tensors' rules and the
errors for bad input.
"""

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tileops.ops as O
from tileops.kernels.rope import FreqSource, RopeInterface, RopeLayout, RopeStyle, aux_layout
from tileops.runtime import Kernel
from tileops.signature import ConstructionError, SignatureCallError

F64 = torch.float64
FACTORS = {"short_factor": [1.0 + 0.05 * i for i in range(16)],
           "long_factor": [1.0 + 0.9 * i for i in range(16)]}


# --- independent forms of the rotation ------------------------------------------------------------


def hf_rope(q, k, pos, inv, scale=1.0, interleaved=False, rd=None, bhsd=False):
    """transformers' apply_rotary_pos_emb (rotate_half) and GPT-J's rotate_every_two, in
    float64, with the cos/sin of the full rotated width."""
    rd = rd or q.shape[-1]
    freqs = pos[..., None].to(F64) * inv  # [B, S, rd / 2]
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    cos, sin = (cos[:, None], sin[:, None]) if bhsd else (cos[:, :, None], sin[:, :, None])

    def rot(x):
        x = x.to(F64)
        r, rest = x[..., :rd], x[..., rd:]
        if interleaved:
            turned = torch.stack((-r[..., 1::2], r[..., 0::2]), -1).flatten(-2)
        else:
            turned = torch.cat((-r[..., rd // 2:], r[..., : rd // 2]), -1)
        return torch.cat((r * cos + turned * sin, rest), -1)

    return rot(q), rot(k)


def base_inv(base, rd):
    return torch.tensor([1.0 / base ** (2 * j / rd) for j in range(rd // 2)], dtype=F64)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 9), h=st.integers(1, 5), hk=st.integers(1, 3),
       half=st.integers(1, 8), extra=st.integers(0, 3), interleaved=st.booleans(),
       bhsd=st.booleans(), given_pos=st.booleans())
def test_reference_is_the_published_rotation(b, s, h, hk, half, extra, interleaved, bhsd,
                                             given_pos):
    rd, d = 2 * half, 2 * (half + extra)
    layout = "bhsd" if bhsd else "bshd"
    cls = O.RopeNonNeoxFwdOp if interleaved else O.RopeNeoxFwdOp
    op = cls(rotary_dim=rd, layout=layout, base=500.0)
    sq, sk = ((b, h, s, d), (b, hk, s, d)) if bhsd else ((b, s, h, d), (b, s, hk, d))
    q, k = torch.randn(sq, dtype=F64), torch.randn(sk, dtype=F64)
    pos = torch.randint(0, 10**6, (b, s)) if given_pos else None
    got = op.fp64_reference(q, k, pos)
    p = pos if given_pos else torch.arange(s).expand(b, s)
    want = hf_rope(q, k, p, base_inv(500.0, rd), interleaved=interleaved, rd=rd, bhsd=bhsd)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-9)
    # the gradient is the transposed rotation: it undoes the forward
    bwd = (O.RopeNonNeoxBwdOp if interleaved else O.RopeNeoxBwdOp)(rotary_dim=rd,
                                                                    layout=layout, base=500.0)
    back = bwd.fp64_reference(*got, pos)
    torch.testing.assert_close(back[0], q, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(back[1], k, rtol=1e-9, atol=1e-9)


# --- the schedules --------------------------------------------------------------------------------


def llama31_inv(base, rd, factor, lo, hi, orig):
    """Meta's apply_scaling, element by element."""
    out = []
    for f in base_inv(base, rd).tolist():
        wavelen = 2 * math.pi / f
        if wavelen < orig / hi:
            out.append(f)
        elif wavelen > orig / lo:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=F64)


def yarn_inv(base, rd, factor, orig, beta_fast, beta_slow):
    """YaRN's find_correction_range and linear ramp mask, element by element."""
    def dim(rot):
        return rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim(beta_fast)), 0), min(math.ceil(dim(beta_slow)), rd - 1)
    out = []
    for j in range(rd // 2):
        ramp = min(max((j - low) / ((high - low) or 0.001), 0.0), 1.0)
        extra = 1 - ramp
        f = base ** (2 * j / rd)
        out.append((1 / (factor * f)) * (1 - extra) + (1 / f) * extra)
    return torch.tensor(out, dtype=F64)


def test_llama31_schedule():
    op = O.RopeLlama31FwdOp()
    torch.testing.assert_close(op.inv_freq(128, False),
                               llama31_inv(500000.0, 128, 8.0, 1.0, 4.0, 8192), rtol=1e-14,
                               atol=0)
    assert op.attention_scale() == 1.0


@pytest.mark.parametrize(("factor", "attention", "scale"), [
    (4.0, None, 0.1 * math.log(4.0) + 1), (1.0, None, 1.0), (16.0, 0.5, 0.5)])
def test_yarn_schedule(factor, attention, scale):
    op = O.RopeYarnFwdOp(factor=factor, attention_factor=attention)
    torch.testing.assert_close(op.inv_freq(64, False),
                               yarn_inv(10000.0, 64, factor, 4096, 32.0, 1.0), rtol=1e-14,
                               atol=0)
    assert op.attention_scale() == pytest.approx(scale, rel=1e-15)


@pytest.mark.parametrize(("cls", "param"), [
    (cls, param) for cls in (O.RopeYarnFwdOp, O.RopeYarnBwdOp, O.RopeLongRopeFwdOp,
                             O.RopeLongRopeBwdOp)
    for param in ("factor", "beta_fast", "attention_factor")
    if param in cls._signature.entry.signature.params])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_scaling_params_that_are_not_finite_are_refused_by_name(cls, param, value):
    """A scaling param of inf or NaN: refused at construction, naming the op and the param
    (an infinite factor gave NaN tables, an infinite beta_fast a ValueError from math.log)."""
    kw = FACTORS if "LongRope" in cls.__name__ else {}
    with pytest.raises(ConstructionError) as exc:
        cls(**kw, **{param: value})
    first = str(exc.value).splitlines()[0]
    assert first.startswith(f"{cls.__name__}: construction param ") and param in first


@pytest.mark.parametrize("cls", [O.RopeYarnFwdOp, O.RopeYarnBwdOp])
def test_yarn_betas_far_from_the_context_clamp_the_ramp(cls):
    """Betas far above and below the context's rotations (the quotient in the correction
    range overflowed to a log of 0 or an int of inf): the ramp clamped to the whole rotated
    width, as with betas merely outside it."""
    far = cls(beta_fast=1e308, beta_slow=1e-308)
    near = cls(beta_fast=1e6, beta_slow=1e-6)
    torch.testing.assert_close(far.inv_freq(64, False), near.inv_freq(64, False), rtol=0,
                               atol=0)
    torch.testing.assert_close(near.inv_freq(64, False),
                               yarn_inv(10000.0, 64, 4.0, 4096, 1e6, 1e-6), rtol=1e-14, atol=0)


def test_longrope_s_attention_factor_when_given_scales_cos_and_sin():
    # a given factor stands for the formula of max_position / original_max_position
    q, k = torch.randn(1, 3, 2, 32, dtype=F64), torch.randn(1, 3, 1, 32, dtype=F64)
    pos = torch.tensor([[0, 5000, 7]])
    one = O.RopeLongRopeFwdOp(**FACTORS, attention_factor=1.0)(q, k, pos)
    scaled = O.RopeLongRopeFwdOp(**FACTORS, attention_factor=1.5)
    assert scaled.attention_scale() == 1.5
    got = scaled(q, k, pos)
    torch.testing.assert_close(got[0], 1.5 * one[0], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(got[1], 1.5 * one[1], rtol=1e-14, atol=1e-14)
    # and its gradient: the transposed rotation, scaled alike
    qq = q.clone().requires_grad_()
    (g,) = torch.autograd.grad(scaled(qq, k, pos)[0].sum(), qq)
    qq1 = q.clone().requires_grad_()
    (g1,) = torch.autograd.grad(O.RopeLongRopeFwdOp(**FACTORS, attention_factor=1.0)(
        qq1, k, pos)[0].sum(), qq1)
    torch.testing.assert_close(g, 1.5 * g1, rtol=1e-14, atol=1e-14)
    with pytest.raises(Exception, match="attention_factor.value > 0"):
        O.RopeLongRopeFwdOp(**FACTORS, attention_factor=0.0)


@pytest.mark.parametrize(("top", "long"), [(4095, False), (4096, True)])
def test_longrope_chooses_its_table_by_the_largest_position(top, long):
    """Phi-3: the long factors once max(position) + 1 exceeds original_max_position."""
    op = O.RopeLongRopeFwdOp(**FACTORS)
    q, k = torch.randn(1, 3, 2, 32, dtype=F64), torch.randn(1, 3, 1, 32, dtype=F64)
    pos = torch.tensor([[0, top, 7]])
    ext = torch.tensor(FACTORS["long_factor" if long else "short_factor"], dtype=F64)
    inv = 1.0 / (ext * 10000.0 ** (torch.arange(0, 32, 2, dtype=F64) / 32))
    scale = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))
    want = hf_rope(q, k, pos, inv, scale)
    got = op.fp64_reference(q, k, pos)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)


# --- the op's plumbing to the slot, through a torch stand-in for the kernel ----------------------


class TorchRope(Kernel, RopeInterface):
    """What the TileLang program computes, in float64 torch, read from the same spec and
    tensors: inv_freq from base, aux's table(s) (the second when maxpos + 1 > switch_at), the
    cached cos/sin of positions below cache_length, mscale, sin negated for the gradient."""

    devices = ("cpu",)
    general = True
    calls: list = []

    def __call__(self, q, k, pos, maxpos, aux, q_out, k_out):
        s = self.spec
        type(self).calls.append((s, aux))
        bhsd = s.layout is RopeLayout.BHSD
        b, seq = q.shape[0], q.shape[2 if bhsd else 1]
        half = s.rotary_dim // 2
        p = torch.arange(seq).expand(b, seq) if pos is None else pos
        p = p.to(F64)
        tables, cos_at, _ = aux_layout(s)
        if s.freq is FreqSource.BASE:
            inv = s.base ** (-torch.arange(0, s.rotary_dim, 2, dtype=F64) / s.rotary_dim)
        else:
            top = None if s.freq is not FreqSource.SWITCH else (
                int(pos.max()) if maxpos is None else int(maxpos[0]))
            sel = int(top is not None and top + 1 > s.switch_at)
            inv = aux[sel * half:(sel + 1) * half]
        ang = p[..., None] * inv
        cos, sin = ang.cos() * s.mscale, ang.sin() * s.mscale
        if s.cache_length:
            L = s.cache_length
            table_c = aux[cos_at:cos_at + L * half].view(L, half)
            table_s = aux[cos_at + L * half:cos_at + 2 * L * half].view(L, half)
            inside = (p >= 0) & (p < L)
            idx = p.clamp(0, L - 1).long()
            cos = torch.where(inside[..., None], table_c[idx], cos)
            sin = torch.where(inside[..., None], table_s[idx], sin)
        if s.inverse:
            sin = -sin
        interleaved = s.style is RopeStyle.INTERLEAVED
        for x, o in ((q, q_out), (k, k_out)):
            o.copy_(_rotate_with(x, cos, sin, s.rotary_dim, interleaved, bhsd).to(o.dtype))


def _rotate_with(x, cos, sin, rd, interleaved, bhsd):
    cos = cos[:, None] if bhsd else cos[:, :, None]
    sin = sin[:, None] if bhsd else sin[:, :, None]
    x = x.to(F64)
    r, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        a, b = r[..., 0::2], r[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
    else:
        a, b = r[..., : rd // 2], r[..., rd // 2:]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), -1)
    return torch.cat((out, rest), -1)


PLUMBING = [
    (O.RopeNeoxFwdOp, {}, None),
    (O.RopeNeoxFwdOp, {"cache_length": 5, "layout": "bhsd"}, "mixed"),
    (O.RopeNonNeoxFwdOp, {"rotary_dim": 8, "inplace": True}, "mixed"),
    (O.RopeLlama31FwdOp, {"cache_length": 4}, "mixed"),
    (O.RopeYarnFwdOp, {"interleaved": True}, None),
    (O.RopeLongRopeFwdOp, {**FACTORS, "original_max_position": 64}, "mixed"),
    (O.RopeLongRopeFwdOp, {**FACTORS, "original_max_position": 64}, None),
    (O.RopeLongRopeFwdOp, {**FACTORS, "original_max_position": 64}, "small"),
    (O.RopeNeoxBwdOp, {"cache_length": 3}, "mixed"),
    (O.RopeYarnBwdOp, {}, "mixed"),
]


@pytest.mark.parametrize(("cls", "params", "pos"), PLUMBING,
                         ids=[f"{c.__name__}-{'-'.join(p)}-{q}" for c, p, q in PLUMBING])
def test_the_op_feeds_the_slot_what_the_kernel_reads(cls, params, pos):
    op = cls(target="tileops", kernel_map={"rope": TorchRope}, **params)
    bhsd = params.get("layout") == "bhsd"
    b, s, h, hk, d = 2, 70, 3, 1, 32
    sq, sk = ((b, h, s, d), (b, hk, s, d)) if bhsd else ((b, s, h, d), (b, s, hk, d))
    q, k = torch.randn(sq), torch.randn(sk)
    p = None
    if pos == "mixed":  # inside and past the cached table, past original_max_position
        p = torch.randint(0, 1000, (b, s))
        p[:, ::3] = torch.randint(0, 5, (b, (s + 2) // 3))
    elif pos == "small":
        p = torch.randint(0, 60, (b, s))
    ref = op.fp64_reference(q, k, p)
    q0 = q.clone()
    TorchRope.calls.clear()
    outs = op(q, k, p)
    spec, aux = TorchRope.calls[-1]
    assert spec.freq is op.freq_source(p is not None)
    assert (aux is None) == (spec.freq is FreqSource.BASE and not spec.cache_length)
    for g, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)
    assert (outs[0] is q) == bool(params.get("inplace"))
    if not params.get("inplace"):
        assert torch.equal(q, q0)
    # the aux tensor is built once per (device, rotary_dim, table) and reused
    op(q0.clone(), k.clone(), p)
    assert TorchRope.calls[-1][1] is aux


def test_in_place_on_a_strided_view_writes_back():
    qkv = torch.randn(2, 6, 5, 16)
    q, k = qkv[:, :, :3], qkv[:, :, 3:4]
    ref = O.RopeNeoxFwdOp().fp64_reference(q, k)
    v = qkv[:, :, 4:].clone()
    op = O.RopeNeoxFwdOp(inplace=True, target="tileops", kernel_map={"rope": TorchRope})
    out = op(q, k)
    assert out[0] is q and out[1] is k
    torch.testing.assert_close(qkv[:, :, :3].double(), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[:, :, 3:4].double(), ref[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, :, 4:], v)


# --- construction tensors -------------------------------------------------------------------------


def test_longrope_factors_are_stored_at_construction():
    op = O.RopeLongRopeFwdOp(**FACTORS)
    assert op.short_factor.dtype == F64 and op.short_factor.tolist() == FACTORS["short_factor"]
    assert op.long_factor.tolist() == FACTORS["long_factor"]
    given = torch.tensor(FACTORS["short_factor"], dtype=torch.float32)
    op = O.RopeLongRopeFwdOp(short_factor=given)
    assert op.short_factor is not given  # a copy: the caller's tensor is not the op's state
    assert op.long_factor is None  # no rescaling (ones at the call's rotary_dim / 2)


def test_longrope_factors_follow_the_call_device_and_are_written_back():
    op = O.RopeLongRopeFwdOp(**FACTORS)
    cpu = op.short_factor
    q, k = torch.randn(1, 2, 2, 32), torch.randn(1, 2, 1, 32)
    op(q, k)
    assert op.short_factor is cpu  # on the call's device already: untouched
    mq, mk = q.to("meta"), k.to("meta")
    op(mq, mk)  # the reference target serves meta tensors
    assert op.short_factor.device.type == "meta" and op.long_factor.device.type == "meta"
    assert op.short_factor.dtype == F64  # the factors keep their float64 (module docstring)
    moved = op.short_factor
    op(mq, mk)
    assert op.short_factor is moved  # converted once, then kept


def test_longrope_factors_are_kept_across_a_binding_reset():
    op = O.RopeLongRopeFwdOp(short_factor=[1.0] * 7, long_factor=[2.0] * 7)
    short, long = op.short_factor, op.long_factor
    with pytest.raises(ValueError, match=r"RopeLongRopeFwdOp: short_factor must hold "
                                         r"rotary_dim / 2 = 16 factors, got 7"):
        op(torch.randn(1, 2, 2, 32), torch.randn(1, 2, 1, 32))
    assert op.serving_target is None  # the failing call bound the target: reset
    assert op.short_factor is short and op.long_factor is long
    assert op(torch.randn(1, 2, 2, 14), torch.randn(1, 2, 1, 14))[0].shape == (1, 2, 2, 14)


def test_longrope_factors_travel_with_copies_and_the_gradient():
    op = O.RopeLongRopeFwdOp(**FACTORS)
    for other in (copy.deepcopy(op), pickle.loads(pickle.dumps(op))):
        assert other.long_factor.tolist() == FACTORS["long_factor"]
    q = torch.randn(1, 3, 2, 32, dtype=F64, requires_grad=True)
    k = torch.randn(1, 3, 1, 32, dtype=F64, requires_grad=True)
    pos = torch.tensor([[1, 5000, 9]])
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, pos), (q, k))
    assert op._backward_op(()).long_factor is op.long_factor


@pytest.mark.parametrize(("value", "message"), [
    ([[1.0, 2.0]], r"RopeLongRopeFwdOp: short_factor must be a 1-D sequence of numbers, got a "
                   r"tensor of shape \(1, 2\) and dtype torch.float64"),
    ([1.0, 0.0], r"RopeLongRopeFwdOp: short_factor must be positive, got 0.0 in it"),
])
def test_bad_factors_are_refused_at_construction(value, message):
    with pytest.raises(ValueError, match=message):
        O.RopeLongRopeFwdOp(short_factor=value)


# --- bad input ------------------------------------------------------------------------------------


def test_positions_must_be_int64():
    op = O.RopeNeoxFwdOp()
    with pytest.raises(SignatureCallError, match=r"position_ids.dtype must be int64, but is "
                                                  r"int32"):
        op(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 1, 8), torch.zeros(1, 2, dtype=torch.int32))


def test_rotary_dim_must_be_even_and_inside_the_head():
    op = O.RopeNeoxFwdOp(rotary_dim=10)
    with pytest.raises(SignatureCallError, match=r"rotary_dim.value <= D"):
        op(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 1, 8))


def test_q_and_k_must_agree_on_the_tokens():
    op = O.RopeNeoxFwdOp()
    with pytest.raises(SignatureCallError, match=r"argument k does not match"):
        op(torch.randn(1, 2, 2, 8), torch.randn(1, 3, 1, 8))


def test_in_tree_kernels_refuse_float64_by_name():
    op = O.RopeNeoxFwdOp(target="tileops", kernel_map={"rope": TorchRope})
    with pytest.raises(TypeError, match=r"RopeNeoxFwdOp: the in-tree RoPE kernels serve "
                                        r"bfloat16, float16, float32, not float64"):
        op(torch.randn(1, 2, 2, 8, dtype=F64), torch.randn(1, 2, 1, 8, dtype=F64))


def test_longrope_refuses_an_original_context_of_one_where_the_context_grows():
    """The attention factor divides by ln(original_max_position): 1 is refused at
    construction where max_position is larger (a bare ZeroDivisionError at the call), and
    served where the context does not grow (factor 1)."""
    with pytest.raises(ConstructionError) as exc:
        O.RopeLongRopeFwdOp(max_position=10, original_max_position=1)
    assert "original_max_position > 1 or max_position == original_max_position" in str(exc.value)
    q = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    out = O.RopeLongRopeFwdOp(max_position=1, original_max_position=1)(q, q.clone())
    assert out[0].shape == q.shape


@pytest.mark.parametrize("how", ["fake", "meta", "export"])
def test_a_traced_call_leaves_nothing_a_real_call_reads(how):
    """The frequency tables, the aux tensor and the construction tensors a fake, meta or
    exported call makes serve that call only: a real call after it computes as a fresh op
    does (a fake table kept by the first turned every later output into garbage)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 5, 4, 16, generator=g), torch.randn(1, 5, 2, 16, generator=g)
    pos = torch.arange(5)[None]
    for make in (O.RopeNeoxFwdOp, lambda: O.RopeLongRopeFwdOp(
            short_factor=[1.0] * 8, long_factor=[2.0] * 8, max_position=64,
            original_max_position=8)):
        want = [t.clone() for t in make()(q, k, pos)]
        op = make()
        if how == "export":
            class M(torch.nn.Module):
                def forward(self, q, k, p, op=op):
                    return op(q, k, p)

            torch.export.export(M(), (q, k, pos))
        else:
            with FakeTensorMode(allow_non_fake_inputs=True):
                dev = "meta" if how == "meta" else "cpu"
                op(torch.empty(1, 5, 4, 16, device=dev), torch.empty(1, 5, 2, 16, device=dev),
                   pos.to(dev))
        for got, ref in zip(op(q, k, pos), want, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("rotary_dim", [0, 3, -2])
def test_a_rotary_dim_no_head_takes_is_refused_where_the_op_is_made(rotary_dim):
    """rotary_dim must be positive and even whatever the heads: refused at construction by
    name (it was accepted and each call blamed q)."""
    from tileops.signature import ConstructionError

    with pytest.raises(ConstructionError) as err:
        O.RopeNeoxFwdOp(rotary_dim=rotary_dim)
    assert str(err.value).startswith("RopeNeoxFwdOp: construction param rotary_dim")
