"""The attention forward kernel on a GPU against float64, called through the slot as the ops
call it (a spec from the sizes, the implementation the slot selects, its entry).

Grid (why each point exists, on its line in CASES): lengths off the tile and aligned ones,
causal over more keys than rows (bottom-right), one query row, rows that see no key (a window
ending before the first key, from the left or only bounded on the right), windows on both
sides and on the left only, a softcap, every served head-dim pair (D 256 writes its output from
registers, 192/128 has a narrower value head), GQA and MQA groupings, both layouts, float16 and
bfloat16, a scale of the caller's. Inputs are fresh standard normal values; the outputs are
poisoned with NaN so an element never written fails.

The varlen kernel runs mixed lengths off the tile, one-row and empty sequences (no query, no
key, neither), more queries than keys under is_causal, a window with a softcap and D 256, each
sequence checked against the float64 reference of its rows alone.

The backward runs on most of the forward's grid, from the forward kernel's output and
log-sum-exp with upstream gradients of both, against torch's autograd of the float64
reference: each gradient within 2e-2 (bfloat16) or 5e-3 (float16) of its largest element
(its products take the probabilities and dS in the storage dtype).

Tolerance: the probabilities are rounded to the storage dtype before the second product (as
FlashAttention's), each a relative error of its epsilon, so an output element is off by at most
about ``eps * max |v|`` plus its own rounding: bfloat16 is held to 1e-2 absolute and relative,
float16 to 2e-3. The log-sum-exp comes from the fp32 scores and sums (``exp2`` within 2 ulp):
2e-3 absolute. Where the reference is -inf (a row that sees no key) the kernel's must be -inf
and its output exactly 0.

``python3 tests/kernels/test_attention_cuda.py --prebuild --workers 15`` compiles every program
these tests use in spawned processes first, so the tests load them from TileLang's disk cache.
"""

import math
import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import attention as A  # noqa: E402
from tileops.kernels import attention_bwd as AB  # noqa: E402
from tileops.runtime import select  # noqa: E402

cuda = pytest.mark.cuda

NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
LSE_ATOL = 2e-3

#: (layout, B, S_q, S_kv, H, H_kv, D, D_v, dtype, left, right, softcap, scale)
CASES = [
    ("bshd", 2, 1000, 1000, 8, 8, 128, 128, torch.bfloat16, -1, -1, None, None),  # off the tile
    ("bshd", 2, 1024, 1024, 8, 2, 128, 128, torch.bfloat16, -1, 0, None, None),  # causal, GQA
    ("bshd", 1, 1000, 3001, 8, 2, 128, 128, torch.float16, -1, 0, None, None),  # S_q < S_kv
    ("bshd", 2, 1, 4096, 8, 8, 128, 128, torch.bfloat16, -1, -1, None, None),  # one row
    ("bshd", 2, 300, 100, 4, 1, 64, 64, torch.bfloat16, 16, 0, None, None),  # 200 rows unseen
    ("bshd", 1, 500, 200, 4, 4, 64, 64, torch.bfloat16, -1, 32, None, None),  # right bound only
    ("bshd", 1, 2048, 2048, 4, 4, 128, 128, torch.bfloat16, 256, 256, None, None),  # both sides
    ("bshd", 1, 777, 777, 4, 2, 64, 64, torch.bfloat16, -1, 0, 30.0, None),  # softcap
    ("bshd", 4, 1024, 1024, 8, 8, 64, 64, torch.bfloat16, -1, 0, None, None),  # D 64 causal
    ("bshd", 1, 1030, 1030, 4, 4, 256, 256, torch.bfloat16, -1, 0, None, None),  # D 256
    ("bshd", 1, 1000, 1000, 4, 4, 192, 128, torch.bfloat16, -1, 0, None, None),  # 192 / 128
    ("bhsd", 2, 1000, 1000, 8, 2, 128, 128, torch.bfloat16, -1, 0, None, None),  # [B, H, S, D]
    ("bhsd", 1, 513, 513, 4, 4, 256, 256, torch.float16, 64, -1, 2.0, None),  # left, capped
    ("bshd", 2, 640, 640, 4, 4, 128, 128, torch.float16, -1, -1, None, 0.3),  # caller's scale
]


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cuda", 0)


def case_spec(case) -> A.AttentionFwdSpec:
    layout, b, s_q, s_kv, h, h_kv, d, d_v, dtype, left, right, softcap, scale = case
    return A.AttentionFwdSpec(
        device=_device(), batch=b, seq_q=s_q, seq_kv=s_kv, heads=h, heads_kv=h_kv, dim=d,
        dim_v=d_v, dtype=NAMES[dtype], layout=A.AttentionLayout(layout),
        scale=scale if scale is not None else 1.0 / math.sqrt(d), window_left=left,
        window_right=right, softcap=softcap)


def _case_id(case) -> str:
    layout, b, s_q, s_kv, h, h_kv, d, d_v, dtype, left, right, softcap, scale = case
    return (f"{layout}-b{b}-sq{s_q}-skv{s_kv}-h{h}x{h_kv}-d{d}x{d_v}-{NAMES[dtype]}"
            f"-w{left},{right}" + (f"-cap{softcap}" if softcap else "")
            + (f"-scale{scale}" if scale else ""))


def _reference(spec: A.AttentionFwdSpec, q, k, v):
    """(o, lse) in float64 from the definition, [B, S, H, D] or [B, H, S, D] as the spec."""
    bshd = spec.layout is A.AttentionLayout.BSHD
    if bshd:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = q.double(), k.double(), v.double()
    g = spec.heads // spec.heads_kv
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    i = torch.arange(spec.seq_q, device=q.device)[:, None] + spec.seq_kv - spec.seq_q
    j = torch.arange(spec.seq_kv, device=q.device)[None, :]
    seen = torch.ones(spec.seq_q, spec.seq_kv, dtype=torch.bool, device=q.device)
    if spec.window_left >= 0:
        seen &= j >= i - spec.window_left
    if spec.window_right >= 0:
        seen &= j <= i + spec.window_right
    o = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float64, device=q.device)
    for bi in range(q.shape[0]):  # one batch entry's scores at a time
        s = q[bi] @ k[bi].transpose(-1, -2) * spec.scale
        if spec.softcap is not None:
            s = spec.softcap * torch.tanh(s / spec.softcap)
        s = s.masked_fill(~seen, -math.inf)
        m = torch.logsumexp(s, dim=-1)
        p = torch.where(seen, torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None]), 0.0)
        o[bi], lse[bi] = p @ v[bi], m
    return (o.transpose(1, 2) if bshd else o), lse


def _entry(spec):
    impl = select(A.AttentionFwdInterface, (A.AttentionFwdKernel,), spec)
    return impl.entry_for(spec, None)


def _inputs(spec, dtype):
    bshd = spec.layout is A.AttentionLayout.BSHD

    def shaped(s, h, d):
        shape = (spec.batch, s, h, d) if bshd else (spec.batch, h, s, d)
        return torch.randn(shape, device="cuda", dtype=dtype)

    q = shaped(spec.seq_q, spec.heads, spec.dim)
    k = shaped(spec.seq_kv, spec.heads_kv, spec.dim)
    v = shaped(spec.seq_kv, spec.heads_kv, spec.dim_v)
    o = torch.full((*q.shape[:-1], spec.dim_v), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((spec.batch, spec.heads, spec.seq_q), float("nan"), device="cuda")
    return q, k, v, o, lse


def _check(got, want, atol, rtol, what):
    got = got.double()
    unseen = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), unseen), f"{what}: -inf where the reference is not"
    ok = torch.isclose(got[~unseen], want[~unseen], rtol=rtol, atol=atol)
    if not bool(ok.all()):
        bad = int((~ok).sum())
        worst = (got[~unseen] - want[~unseen]).abs().max().item()
        raise AssertionError(f"{what}: {bad} of {ok.numel()} elements off (worst {worst:.3g})")


#: the forward's schedules: (OVERLAP, TURNS)
SCHEDULES = [(False, False), (True, False), (True, True)]


@cuda
@pytest.mark.parametrize("overlap,turns", SCHEDULES, ids=["plain", "overlap", "turns"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_matches_float64(case, overlap, turns, monkeypatch):
    """Each case with the plain schedule, with the output product overlapping the next
    tile's softmax (:data:`~tileops.kernels.attention.OVERLAP`) and with the warpgroups also
    taking turns issuing their products (:data:`~tileops.kernels.attention.TURNS`, the
    served schedule): programs of their own."""
    monkeypatch.setattr(A, "OVERLAP", overlap)
    monkeypatch.setattr(A, "TURNS", turns)
    monkeypatch.setattr(A, "PLAIN_UP_TO", 0)  # the schedule named, whatever the key length
    spec = case_spec(case)
    dtype = case[8]
    q, k, v, o, lse = _inputs(spec, dtype)
    _entry(spec)(q, k, v, o, lse)
    want_o, want_lse = _reference(spec, q, k, v)
    assert not bool(torch.isnan(o).any()), "an output element was not written"
    _check(lse, want_lse, LSE_ATOL, 1e-4, "lse")
    rows_unseen = torch.isneginf(want_lse)  # [B, H, S_q]
    if bool(rows_unseen.any()):
        unseen_o = rows_unseen.transpose(1, 2) if spec.layout is A.AttentionLayout.BSHD \
            else rows_unseen
        assert bool((o[unseen_o] == 0).all()), "a row that sees no key is not 0"
    _check(o, want_o, TOL[dtype], TOL[dtype], "o")


#: the persistent forward's schedules: (PERSISTENT, OVERLAP, TURNS); a grid of 5 CTAs, so every
#: CTA walks many work tiles of unequal key-step counts (the rings' phases run on across tiles)
PERSISTENT_SCHEDULES = [(5, False, False), (5, True, True)]


@cuda
@pytest.mark.parametrize("persistent,overlap,turns", PERSISTENT_SCHEDULES,
                         ids=["persistent-plain", "persistent-turns"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_persistent_forward_matches_float64(case, persistent, overlap, turns, monkeypatch):
    """Each case on the persistent grid (:data:`~tileops.kernels.attention.PERSISTENT`), with
    the plain schedule and with the served one (turns): programs of their own, checked as
    :func:`test_forward_matches_float64`'s."""
    monkeypatch.setattr(A, "PERSISTENT", persistent)
    test_forward_matches_float64(case, overlap, turns, monkeypatch)


@cuda
def test_no_key_and_no_row_launch_nothing():
    for s_q, s_kv in ((5, 0), (0, 5)):
        spec = A.AttentionFwdSpec(
            device=_device(), batch=1, seq_q=s_q, seq_kv=s_kv, heads=2, heads_kv=2, dim=64,
            dim_v=64, dtype="bfloat16", layout=A.AttentionLayout.BSHD, scale=0.125,
            window_left=-1, window_right=-1, softcap=None)
        q, k, v, o, lse = _inputs(spec, torch.bfloat16)
        _entry(spec)(q, k, v, o, lse)
        assert bool((o == 0).all()) and bool(torch.isneginf(lse).all())


# --- the backward -------------------------------------------------------------------------

#: the CASES of the head dims the backward serves: off the tile, causal GQA, S_q < S_kv, rows
#: that see no key, a right bound only, both sides, a softcap, D 64, [B, H, S, D], a scale
BWD_CASES = [c for c in CASES if (c[6], c[7]) in AB.BWD_HEAD_DIMS]
GRAD_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _bwd_entry(spec, kernel=AB.AttentionBwdKernel):
    impl = select(AB.AttentionBwdInterface, (kernel,), spec)
    return impl.entry_for(spec, None)


#: the sm_90 backward's schedules: (STATS_TMA, OVERLAP)
BWD_SCHEDULES = [(False, False), (True, False), (True, True)]
#: the implementations and, for AttentionBwdTmaKernel, its schedules
BWD_KERNELS = [pytest.param(AB.AttentionBwdKernel, (False, False), id="dq-rows"),
               pytest.param(AB.AttentionBwdFragmentKernel, (False, False),
                            id="dq-fragment-order"),
               pytest.param(AB.AttentionBwdTmaKernel, (False, False), id="dq-tma"),
               pytest.param(AB.AttentionBwdTmaKernel, (True, False), id="dq-tma-stats-tma"),
               pytest.param(AB.AttentionBwdTmaKernel, (True, True), id="dq-tma-overlap")]


@cuda
@pytest.mark.parametrize("kernel,schedule", BWD_KERNELS)
@pytest.mark.parametrize("case", BWD_CASES, ids=_case_id)
def test_backward_matches_float64_autograd(case, kernel, schedule, monkeypatch):
    """dq, dk, dv of the kernel (from the forward kernel's o and lse, with an upstream
    gradient of both) against torch's autograd of the float64 reference, each held to its
    largest element (the bf16 probabilities and dS of the products). The sm_90 kernel under
    each schedule of its module flags (:data:`~tileops.kernels.attention_bwd.STATS_TMA`,
    :data:`~tileops.kernels.attention_bwd.OVERLAP`): programs of their own."""
    monkeypatch.setattr(AB, "STATS_TMA", schedule[0])
    monkeypatch.setattr(AB, "OVERLAP", schedule[1])
    spec = case_spec(case)
    dtype = case[8]
    q, k, v, o, lse = _inputs(spec, dtype)
    _entry(spec)(q, k, v, o, lse)
    dout = torch.randn_like(o)
    dlse = torch.randn_like(lse)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    _bwd_entry(spec, kernel)(dout, q, k, v, o, lse, dlse, *grads)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want_o, want_lse = _reference(spec, *leaves)
    finite = torch.isfinite(want_lse)
    loss = (want_o * dout.double()).sum() + (want_lse[finite] * dlse.double()[finite]).sum()
    wants = torch.autograd.grad(loss, leaves)
    for name, got, want in zip(("dq", "dk", "dv"), grads, wants, strict=True):
        assert not bool(torch.isnan(got).any()), f"{name}: an element was not written"
        err = (got.double() - want).abs().max().item()
        scale = max(want.abs().max().item(), 1e-6)
        assert err <= GRAD_TOL[dtype] * scale, f"{name}: {err:.3g} off (largest {scale:.3g})"


# --- varlen ---------------------------------------------------------------------------------

#: (lengths of the queries, of the keys, H, H_kv, D, D_v, dtype, left, right, softcap)
VARLEN = [
    # mixed lengths off the tile, sequences of one row, causal GQA
    ([1000, 1, 129, 4096, 37], [1000, 1, 129, 4096, 37], 8, 2, 128, 128, torch.bfloat16,
     -1, 0, None),
    # empty sequences (no query, no key, neither) and more queries than keys under is_causal
    ([0, 300, 1000, 0, 1, 300], [100, 0, 1000, 0, 257, 143], 4, 1, 64, 64, torch.bfloat16,
     -1, 0, None),
    # a window on both sides with a softcap, float16
    ([129, 571, 64], [329, 571, 200], 4, 4, 128, 128, torch.float16, 64, 16, 20.0),
    # D 256 (the output from registers as in every varlen program), no mask but the lengths'
    ([513, 2048], [513, 2048], 4, 4, 256, 256, torch.bfloat16, -1, -1, None),
]


def varlen_spec(case) -> A.AttentionVarlenFwdSpec:
    lens_q, lens_k, h, h_kv, d, d_v, dtype, left, right, softcap = case
    return A.AttentionVarlenFwdSpec(
        device=_device(), total_q=sum(lens_q), total_kv=sum(lens_k), batch=len(lens_q),
        heads=h, heads_kv=h_kv, dim=d, dim_v=d_v, dtype=NAMES[dtype], scale=1.0 / math.sqrt(d),
        window_left=left, window_right=right, softcap=softcap)


def _offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@cuda
@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"b{len(c[0])}-h{c[2]}x{c[3]}-d{c[4]}")
def test_varlen_matches_float64_a_sequence_at_a_time(case):
    spec = varlen_spec(case)
    dtype = case[6]
    cq, ck = _offsets(case[0]), _offsets(case[1])
    q = torch.randn(spec.total_q, spec.heads, spec.dim, device="cuda", dtype=dtype)
    k = torch.randn(spec.total_kv, spec.heads_kv, spec.dim, device="cuda", dtype=dtype)
    v = torch.randn(spec.total_kv, spec.heads_kv, spec.dim_v, device="cuda", dtype=dtype)
    o = torch.full((spec.total_q, spec.heads, spec.dim_v), float("nan"), device="cuda",
                   dtype=dtype)
    lse = torch.full((spec.heads, spec.total_q), float("nan"), device="cuda")
    impl = select(A.AttentionVarlenFwdInterface, (A.AttentionVarlenFwdKernel,), spec)
    impl.entry_for(spec, None)(q, k, v, torch.tensor(cq, dtype=torch.int32, device="cuda"),
                               torch.tensor(ck, dtype=torch.int32, device="cuda"), o, lse)
    assert not bool(torch.isnan(o).any()), "an output element was not written"
    for b in range(spec.batch):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        dense = A.AttentionFwdSpec(
            device=spec.device, batch=1, seq_q=q1 - q0, seq_kv=k1 - k0, heads=spec.heads,
            heads_kv=spec.heads_kv, dim=spec.dim, dim_v=spec.dim_v, dtype=spec.dtype,
            layout=A.AttentionLayout.BSHD, scale=spec.scale, window_left=spec.window_left,
            window_right=spec.window_right, softcap=spec.softcap)
        if k1 == k0:
            assert bool((o[q0:q1] == 0).all()) and bool(torch.isneginf(lse[:, q0:q1]).all())
            continue
        want_o, want_lse = _reference(dense, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        _check(lse[:, q0:q1], want_lse[0], LSE_ATOL, 1e-4, f"lse of sequence {b}")
        _check(o[q0:q1], want_o[0], TOL[dtype], TOL[dtype], f"o of sequence {b}")


# --- the prebuild ----------------------------------------------------------------------------


def program_keys():
    """The distinct programs this file compiles: the program keys of CASES and VARLEN."""
    keys = [("fwd", k[:-2] + schedule) for k in (A.program_key(case_spec(c)) for c in CASES)
            for schedule in SCHEDULES]
    keys += [("fwd", k[:-3] + schedule) for k in (A.program_key(case_spec(c)) for c in CASES)
             for schedule in PERSISTENT_SCHEDULES]
    keys += [("varlen", A.varlen_program_key(varlen_spec(c))) for c in VARLEN]
    keys += [("bwd", AB.bwd_program_key(case_spec(c))) for c in BWD_CASES]
    keys += [("bwd_fragment", AB.bwd_program_key(case_spec(c))) for c in BWD_CASES]
    keys += [("bwd_tma", AB.bwd_program_key(case_spec(c)) + schedule) for c in BWD_CASES
             for schedule in BWD_SCHEDULES]
    return list(dict.fromkeys(keys))


def _build(key):
    kind, program = key
    if kind == "bwd_fragment":  # as AttentionBwdFragmentKernel builds its two programs
        layout, h, _, d, d_v, dtype = program[:6]
        plan = AB.attention_bwd_plan(d, d_v)._replace(dq_fragment_order=True)
        AB.build_attention_bwd(program, plan=plan)
        AB.build_attention_bwd_dq(layout, h, d, dtype)
        return
    if kind == "bwd_tma":  # as AttentionBwdTmaKernel builds its programs
        # the program key, then its schedule (STATS_TMA, OVERLAP): the module's when absent
        program, schedule = program[:10], program[10:] or (AB.STATS_TMA, AB.OVERLAP)
        layout, h, _, d, d_v, dtype = program[:6]
        plan = AB.attention_bwd_plan(d, d_v)._replace(**AB.AttentionBwdTmaKernel.plan_fields,
                                                      stats_tma=schedule[0],
                                                      overlap=schedule[1])
        AB.build_attention_bwd(program, plan=plan)
        for with_dlse in (False, True):
            AB.build_attention_bwd_delta(layout, h, d_v, dtype, with_dlse,
                                         tile=plan.block_m if plan.stats_tma else 0)
        return
    if kind == "fwd_plan":  # a sweep's plan (benchmarks/prebuild_attention.py)
        A.build_attention_fwd(*program[:1], plan=program[1])
        return
    {"fwd": A.build_attention_fwd, "varlen": A.build_attention_varlen_fwd,
     "bwd": AB.build_attention_bwd}[kind](program)


def _describe(key) -> str:
    kind, program = key
    plan = None
    if kind == "fwd_plan":  # a sweep's plan (benchmarks/prebuild_attention.py)
        kind, (program, plan) = "fwd", program
    if kind == "fwd":
        layout, h, h_kv, d, d_v, dtype, _, left, right, softcap, masked, persistent, overlap, \
            turns = program
        if plan is not None:
            persistent, overlap, turns = plan.persistent, plan.overlap, plan.turns
        schedule = " turns" if turns else " overlap" if overlap else ""
        schedule += f" persistent {persistent}" if persistent else ""
        if plan is not None:
            schedule += f" stages {plan.stages}{'' if plan.fast_math else ' exact math'}"
        kind = f"fwd {layout}{' masked' if masked else ''}{schedule}"
    elif kind in ("bwd", "bwd_fragment", "bwd_tma"):
        layout, h, h_kv, d, d_v, dtype, _, left, right, softcap = program[:10]
        stats_tma, overlap = program[10:] or (False, False)
        schedule = " overlap" if overlap else " stats-tma" if stats_tma else ""
        kind = f"{kind.replace('_', ' ')} {layout}{schedule}"
    else:
        h, h_kv, d, d_v, dtype, _, left, right, softcap = program
    return f"{kind} h{h}x{h_kv} d{d}x{d_v} {dtype} window ({left}, {right}) softcap {softcap}"


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
