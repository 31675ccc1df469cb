"""The decode-attention kernels on a GPU, through the public ops (the layout, the slot, the
entry), on fresh random inputs, against float64: the definition evaluated from the float64
copies of the same inputs (rel L2 within the storage dtype's bound), 0 exactly for an empty
sequence.

Each case exercises a path of the program (why it exists is on its line): the bars' shapes
(three and six parts), odd cache lengths and lengths off the tile (the zero-filled tail),
lengths 0 and 1, MHA (one head a CTA), MQA and 64 heads a key head, head widths 64 and 256,
a softcap and a scale, every page size (a tile of 4 or 2 pages of 16 or 32, or inside a page),
pages shuffled over a pool, block-table entries past a sequence's pages holding -1 or a huge
page, and NaN in the cache past each sequence's length (freed pages): none may reach an
output. The same call under other split counts checks the combine against one part. Data that
breaks the kernels' contract (a length past the cache, a page read outside the pool) makes
that sequence's output NaN and no other's.

``python3 tests/kernels/test_attention_decode_cuda.py --prebuild --workers 15`` compiles the
programs these tests and the spec workloads use in spawned processes first, so the tests load
them from TileLang's disk cache; ``--sweep`` times the bars under other split counts and
tile plans (see :func:`sweep`).
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import math

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import attention_decode as K  # noqa: E402

pytestmark = pytest.mark.cuda
if __name__ not in ("__main__", "__mp_main__") and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

#: (batch, capacity S, heads, kv_heads, head_dim, page_size (0: contiguous), lengths, softcap,
#: scale, dtype); lengths: "full", "mixed" (S, 0, 1 and spread values off the tile), "short"
CASES = [
    (64, 8192, 32, 8, 128, 0, "full", None, None, torch.bfloat16),  # the bar: three parts
    (8, 32768, 32, 8, 128, 0, "full", None, None, torch.bfloat16),  # six parts
    (64, 8192, 32, 8, 128, 64, "full", None, None, torch.bfloat16),  # the paged bar
    (7, 1000, 8, 2, 128, 0, "mixed", None, None, torch.float16),  # odd S, the tail tile
    (5, 513, 8, 8, 64, 0, "mixed", None, None, torch.bfloat16),  # MHA: one head a CTA
    (3, 777, 16, 4, 256, 0, "mixed", None, None, torch.bfloat16),  # D 256: 32-key tiles
    (4, 1000, 32, 8, 128, 0, "mixed", 30.0, None, torch.bfloat16),  # softcap
    (2, 300, 32, 1, 128, 0, "mixed", None, 0.05, torch.bfloat16),  # MQA: 32 heads a CTA
    (2, 200, 128, 2, 128, 0, "mixed", None, None, torch.bfloat16),  # 64 heads a CTA, two CTAs
    (6, 320, 8, 2, 64, 16, "mixed", None, None, torch.bfloat16),  # four 16-token pages a tile
    (6, 320, 8, 2, 128, 32, "mixed", None, None, torch.float16),  # two 32-token pages a tile
    (5, 1000, 16, 2, 128, 128, "mixed", 20.0, None, torch.bfloat16),  # tiles inside a page
    (3, 1024, 16, 4, 256, 256, "mixed", None, None, torch.bfloat16),  # D 256 in 256-token pages
    (4, 1, 8, 2, 128, 0, "short", None, None, torch.bfloat16),  # one key, every sequence
    (4, 64, 8, 2, 64, 16, "short", None, None, torch.bfloat16),  # paged, one key
    (5, 320, 4, 4, 128, 32, "mixed", None, None, torch.bfloat16),  # paged MHA
]


def _lengths(b, s, kind, g):
    if kind == "full":
        return torch.full((b,), s, dtype=torch.int32)
    if kind == "short":
        return torch.ones(b, dtype=torch.int32)
    lens = torch.randint(0, s + 1, (b,), generator=g, dtype=torch.int32)
    lens[0], lens[-1] = s, 0
    if b > 2:
        lens[1] = 1
    return lens


def _inputs(b, s, h, hk, d, ps, kind, dtype, seed):
    """q, the cache (contiguous or paged, NaN wherever no sequence reads), the lengths and the
    block table (None for a contiguous cache), on the GPU, and the dense keys and values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    k = torch.randn(b, s, hk, d, generator=g).to(dtype)
    v = torch.randn(b, s, hk, d, generator=g).to(dtype)
    lens = _lengths(b, s, kind, g)
    seen = torch.arange(s)[None, :] < lens[:, None]  # (B, S)
    k[~seen], v[~seen] = float("nan"), float("nan")  # past a length: never read
    if not ps:
        return [x.cuda() for x in (q, k, v, lens)] + [None], k, v
    mp = -(-s // ps)
    pad = mp * ps - s
    kd = torch.cat([k, torch.full((b, pad, hk, d), float("nan"), dtype=dtype)], 1)
    vd = torch.cat([v, torch.full((b, pad, hk, d), float("nan"), dtype=dtype)], 1)
    pool = b * mp + 3  # three pages no one reads
    order = torch.randperm(pool, generator=g)
    table = order[:b * mp].view(b, mp).to(torch.int32)
    kp = torch.full((pool, ps, hk, d), float("nan"), dtype=dtype)
    vp = torch.full_like(kp, float("nan"))
    kp[table.long()] = kd.view(b, mp, ps, hk, d)
    vp[table.long()] = vd.view(b, mp, ps, hk, d)
    used = -(-lens.long() // ps)
    past = torch.arange(mp)[None, :] >= used[:, None]
    table[past] = torch.where(torch.arange(past.sum()) % 2 == 0, -1, 1 << 30).to(torch.int32)
    return [x.cuda() for x in (q, kp, vp, lens, table)], k, v


def _expected(q, k, v, lens, scale, softcap):
    """The definition in float64 (on the GPU), from the same (rounded) inputs, on the CPU."""
    b, h, d = q.shape
    hk = k.shape[2]
    q, k, v, lens = (x.cuda() for x in (q, k, v, lens))
    qg = q.double().view(b, hk, h // hk, d)
    seen = torch.arange(k.shape[1], device="cuda")[None, :] < lens[:, None]
    kk = torch.where(seen[:, :, None, None], k.double(), 0.0)
    vv = torch.where(seen[:, :, None, None], v.double(), 0.0)
    s = torch.einsum("bkgd,bskd->bkgs", qg, kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen[:, None, None, :], -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bkgs,bskd->bkgd", p, vv).reshape(b, h, d).cpu()


def _op(ps, h, hk, scale, softcap):
    from tileops.ops import (
        GroupedQueryAttentionDecodePagedWithKVCacheFwdOp,
        GroupedQueryAttentionDecodeWithKVCacheFwdOp,
        MultiHeadAttentionDecodePagedWithKVCacheFwdOp,
        MultiHeadAttentionDecodeWithKVCacheFwdOp,
    )

    if ps:
        cls = (MultiHeadAttentionDecodePagedWithKVCacheFwdOp if h == hk else
               GroupedQueryAttentionDecodePagedWithKVCacheFwdOp)
    else:
        cls = (MultiHeadAttentionDecodeWithKVCacheFwdOp if h == hk else
               GroupedQueryAttentionDecodeWithKVCacheFwdOp)
    return cls(scale=scale, softcap=softcap)


def _check(out, ref, lens, dtype):
    assert out.dtype == dtype and torch.isfinite(out).all(), "a NaN reached the output"
    got = out.double().cpu()
    err = (got - ref).norm().item() / max(ref.norm().item(), 1e-30)
    assert err < _TOL[dtype], f"rel L2 {err:.2e} against float64"
    empty = lens == 0
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))


@pytest.mark.parametrize(("b", "s", "h", "hk", "d", "ps", "kind", "softcap", "scale", "dtype"),
                         CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_decode_matches_float64(b, s, h, hk, d, ps, kind, softcap, scale, dtype):
    from tileops.runtime import targets

    op = _op(ps, h, hk, scale, softcap)
    for seed in (0, 1):  # a second call reuses the entry on new values
        args, k, v = _inputs(b, s, h, hk, d, ps, kind, dtype, seed)
        out = op(*[a for a in args if a is not None])
        torch.cuda.synchronize()
        assert op.serving_target == targets.IN_TREE
        ref = _expected(args[0].cpu(), k, v, args[3].cpu(), scale or d ** -0.5, softcap)
        _check(out, ref, args[3].cpu(), dtype)


def _spec(b, s, h, hk, d, ps, softcap, scale, dtype):
    paged = K.CacheLayout.PAGED if ps else K.CacheLayout.CONTIGUOUS
    mp = -(-s // ps) if ps else 0
    return K.AttentionDecodeSpec(
        device=torch.device("cuda", 0), layout=paged, batch=b, heads=h, kv_heads=hk, head_dim=d,
        capacity=(b * mp + 3) if ps else s, page_size=ps, max_pages=mp,
        dtype=str(dtype).removeprefix("torch."), scale=scale or d ** -0.5, softcap=softcap)


#: (case, the split counts it also runs under)
SPLITS = [(CASES[3], (1, 2, 7)), (CASES[9], (1, 3)), (CASES[1], (1, 32))]


@pytest.mark.parametrize(("case", "splits"), SPLITS, ids=lambda v: str(v[:7]))
def test_every_split_count_gives_the_same_answer(case, splits):
    """The kernel built under forced plans (one part: the CTA writes o; several: the parts
    and their log2-sum-exps, then the combine) matches float64 every time."""
    b, s, h, hk, d, ps, kind, softcap, scale, dtype = case
    spec = _spec(b, s, h, hk, d, ps, softcap, scale, dtype)
    base = K.decode_plan(batch=b, heads=h, kv_heads=hk, head_dim=d, max_keys=spec.max_keys,
                         page_size=ps, sms=K._sms(spec.device))
    args, k, v = _inputs(b, s, h, hk, d, ps, kind, dtype, 3)
    ref = _expected(args[0].cpu(), k, v, args[3].cpu(), spec.scale, softcap)
    for n in splits:
        plan = K.DecodePlan(base.vh, base.block_h, base.block_n, base.stages, n, base.resident)
        kernel = K.AttentionDecodeSplitKernel(spec, plan)
        out = torch.empty(b, h, d, dtype=dtype, device="cuda")
        kernel(*args, out)
        torch.cuda.synchronize()
        _check(out, ref, args[3].cpu(), dtype)


@pytest.mark.parametrize(("case", "splits"), [(CASES[9], (1, 3)), (CASES[3], (1, 2))],
                         ids=("paged", "contiguous"))
def test_bad_data_makes_its_sequence_nan_and_no_other(case, splits):
    """A length past the cache, or a page outside the pool among those a sequence reads: that
    sequence's output is NaN, every head (found by the CTA reading it: no host check, no
    synchronisation); the other sequences' outputs are as with good data, under one part or
    several (the combine carries a part's NaN through its weights)."""
    b, s, h, hk, d, ps, kind, softcap, scale, dtype = case
    spec = _spec(b, s, h, hk, d, ps, softcap, scale, dtype)
    base = K.decode_plan(batch=b, heads=h, kv_heads=hk, head_dim=d, max_keys=spec.max_keys,
                         page_size=ps, sms=K._sms(spec.device))
    args, k, v = _inputs(b, s, h, hk, d, ps, kind, dtype, 5)
    lens = args[3].cpu()
    ref = _expected(args[0].cpu(), k, v, lens, spec.scale, softcap)
    bad = torch.zeros(b, dtype=torch.bool)
    args[3] = args[3].clone()
    args[3][0] = spec.max_keys + 1  # a length past the cache, and one below 0
    args[3][2] = -1
    bad[[0, 2]] = True
    if ps:
        # sequence 3 reads four pages, its last one outside the pool; an entry past sequence
        # 4's pages names no page (never read: no effect)
        args[3][3] = 3 * ps + 1
        args[4] = args[4].clone()
        args[4][3, :4] = torch.tensor([0, 1, 2, spec.capacity], dtype=torch.int32)
        bad[3] = True
        assert lens[4] <= spec.max_keys - ps
        args[4][4, -1] = -5
    for n in splits:
        plan = K.DecodePlan(base.vh, base.block_h, base.block_n, base.stages, n, base.resident)
        out = torch.empty(b, h, d, dtype=dtype, device="cuda")
        K.AttentionDecodeSplitKernel(spec, plan)(*args, out)
        torch.cuda.synchronize()
        got = out.double().cpu()
        assert got[bad].isnan().all(), f"{n} parts: a bad sequence's output is not all NaN"
        good = got[~bad]
        assert torch.isfinite(good).all(), f"{n} parts: a NaN reached a good sequence"
        err = (good - ref[~bad]).norm().item() / max(ref[~bad].norm().item(), 1e-30)
        assert err < _TOL[dtype], f"{n} parts: rel L2 {err:.2e} against float64"


# --- the prebuild ----------------------------------------------------------------------------


def program_keys():
    """The distinct (spec, plan) programs this file and the spec workloads (at full size: the
    harness's and the benchmarks' calls) compile, under the plans the kernel makes here."""
    from tileops.ops import (
        GroupedQueryAttentionDecodePagedWithKVCacheFwdOp,
        GroupedQueryAttentionDecodeWithKVCacheFwdOp,
        MultiHeadAttentionDecodePagedWithKVCacheFwdOp,
        MultiHeadAttentionDecodeWithKVCacheFwdOp,
    )
    from tileops.ops.workloads import cases_of

    sms = K._sms(torch.device("cuda", 0))

    def planned(spec, splits=None):
        base = K.decode_plan(batch=spec.batch, heads=spec.heads, kv_heads=spec.kv_heads,
                             head_dim=spec.head_dim, max_keys=spec.max_keys,
                             page_size=spec.page_size, sms=sms)
        if splits is None:
            return [(spec, base)]
        return [(spec, K.DecodePlan(base.vh, base.block_h, base.block_n, base.stages, n,
                                    base.resident)) for n in splits]

    keys = []
    for b, s, h, hk, d, ps, _, softcap, scale, dtype in CASES:
        keys += planned(_spec(b, s, h, hk, d, ps, softcap, scale, dtype))
    for case, splits in SPLITS:
        b, s, h, hk, d, ps, _, softcap, scale, dtype = case
        keys += planned(_spec(b, s, h, hk, d, ps, softcap, scale, dtype), splits)
    for cls in (MultiHeadAttentionDecodeWithKVCacheFwdOp,
                GroupedQueryAttentionDecodeWithKVCacheFwdOp,
                MultiHeadAttentionDecodePagedWithKVCacheFwdOp,
                GroupedQueryAttentionDecodePagedWithKVCacheFwdOp):
        paged = cls.layout is K.CacheLayout.PAGED
        for c in cases_of(cls):
            shapes = {i.name: i.shape for i in c.inputs}
            dtype = c.inputs[0].dtype
            if dtype not in ("float16", "bfloat16"):
                continue
            b, h, d = shapes["q"]
            rows, width, hk = shapes["k_cache"][:3]
            mp = shapes["block_table"][1] if paged else 0
            keys += planned(K.AttentionDecodeSpec(
                device=torch.device("cuda", 0),
                layout=K.CacheLayout.PAGED if paged else K.CacheLayout.CONTIGUOUS, batch=b,
                heads=h, kv_heads=hk, head_dim=d, capacity=rows if paged else width,
                page_size=width if paged else 0, max_pages=mp, dtype=dtype,
                scale=c.params.get("scale") or d ** -0.5, softcap=c.params.get("softcap")))
    return list(dict.fromkeys(keys))


def _build(key):
    K.build_decode(*key)


def _describe(key) -> str:
    spec, plan = key
    return (f"attention_decode {spec.layout.value} B{spec.batch} H{spec.heads}:{spec.kv_heads} "
            f"D{spec.head_dim} cap{spec.capacity} ps{spec.page_size} {spec.dtype} "
            f"softcap={spec.softcap} {plan}")


# --- the sweep of the split count and the pipeline depth at the bars' shapes -----------------

#: (batch, S, page_size): the bars (32:8 heads, D 128, bf16, every length S)
SWEEP_SHAPES = [(64, 8192, 0), (64, 8192, 64), (8, 32768, 0), (8, 32768, 64)]
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12)
#: (keys a tile, tiles in flight, CTAs an SM): the default, a deeper pipeline, larger tiles
#: (one CTA an SM by shared memory), smaller tiles deeper
SWEEP_TILES = ((64, 2, 3), (64, 3, 2), (128, 2, 1), (32, 4, 3))


def _sweep_keys(sms):
    out = []
    for b, s, ps in SWEEP_SHAPES:
        spec = _spec(b, s, 32, 8, 128, ps, None, None, torch.bfloat16)
        base = K.decode_plan(batch=b, heads=32, kv_heads=8, head_dim=128, max_keys=s,
                             page_size=ps, sms=sms)
        for bn, stages, resident in SWEEP_TILES:
            for n in SWEEP_SPLITS:
                plan = K.DecodePlan(base.vh, base.block_h, bn, stages, n, resident)
                out.append((spec, plan, plan == base))
    return out


def _sweep_build(key):
    K.build_decode(key[0], key[1])


def sweep(workers) -> int:
    """Time each bar under every split count and tile plan (compiled in parallel first), each
    checked against float64 first; prints ms and TB/s of the KV read (the roofline's
    bytes), the plan decode_plan picks marked with *."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from tileops.ops.cli.timing import device_time

    sms = K._sms(torch.device("cuda", 0))
    keys = _sweep_keys(sms)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_sweep_build, keys))
    dev = torch.device("cuda", 0)
    last = None
    for spec, plan, chosen in keys:
        if spec != last:
            b, h, d = spec.batch, spec.heads, spec.head_dim
            s = spec.max_keys
            args, k, v = _inputs(b, s, h, spec.kv_heads, d, spec.page_size, "full",
                                 torch.bfloat16, 0)
            ref = _expected(args[0].cpu(), k, v, args[3].cpu(), spec.scale, None)
            moved = 2 * (2 * b * s * spec.kv_heads * d + 2 * b * h * d)
            out = torch.empty(b, h, d, dtype=torch.bfloat16, device="cuda")
            last = spec
        kernel = K.AttentionDecodeSplitKernel(spec, plan)
        kernel(*args, out)
        _check(out, ref, args[3].cpu(), torch.bfloat16)
        t = device_time(lambda kernel=kernel, args=args, out=out: kernel(*args, out), dev).seconds
        print(f"{spec.layout.value:<10} B{spec.batch} S{spec.max_keys} ps{spec.page_size} "
              f"split {plan.num_split:>2} keys {plan.block_n:>3} stages {plan.stages} "
              f"resident {plan.resident}"
              f"{' *' if chosen else '  '} {t * 1e3:8.3f} ms {moved / t / 1e12:5.2f} TB/s",
              flush=True)
    return 0


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="compile this file's programs in parallel, or "
                                             "time the bars under other launch plans")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prebuild", action="store_true")
    mode.add_argument("--sweep", action="store_true")
    ap.add_argument("--workers", type=int, default=15)
    args = ap.parse_args(argv)
    if args.sweep:
        return sweep(args.workers)
    from _prebuild import build_all  # beside this file, which runs as a script here

    return build_all(program_keys(), _build, _describe, args.workers)


if __name__ == "__main__":
    sys.exit(main())
