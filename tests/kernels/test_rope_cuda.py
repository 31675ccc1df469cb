"""The RoPE kernel on a GPU, through the public ops, against their float64 references, with
fresh random inputs: every variant in both styles and layouts, with and without position_ids
(positions up to 2 * 10^5, past any cached table), partial rotation (rotary_dim = head_dim / 2),
odd head counts, head_dim 96, in place, strided inputs, the gradients through autograd and
LongRoPE's choice of table on the device.

``python3 tests/kernels/test_rope_cuda.py --prebuild --workers 15`` compiles exactly the
programs these tests use, in spawned processes, so the tests load them from the disk cache.

Tolerance: the kernel rounds once, from float32 products of float32 cos/sin of a float64-
reduced angle, so it is held to two units in the last place of the output dtype relative to
the reference's magnitude (``rtol``) plus the same absolute floor (values near zero).
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda
if __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import tileops.ops as O  # noqa: E402

TOL = {torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11, torch.float32: 1e-5}
FACTORS = {"short_factor": [1.0 + 0.05 * i for i in range(64)],
           "long_factor": [1.0 + 0.9 * i for i in range(64)]}

#: (id, op class, params, (B, S, H, HK, D), dtype, positions: None | "arange" | "random" | max)
CASES = [
    ("neox-bar", O.RopeNeoxFwdOp, {}, (2, 512, 32, 8, 128), torch.bfloat16, None),
    ("neox-bhsd-pos", O.RopeNeoxFwdOp, {"layout": "bhsd"}, (2, 300, 32, 8, 128),
     torch.bfloat16, "random"),
    ("neox-half-odd", O.RopeNeoxFwdOp, {"rotary_dim": 48}, (3, 77, 7, 3, 96), torch.float16,
     "random"),
    ("neox-cache-past", O.RopeNeoxFwdOp, {"cache_length": 64}, (2, 200, 5, 1, 64),
     torch.bfloat16, "random"),
    ("neox-inplace", O.RopeNeoxFwdOp, {"inplace": True}, (2, 129, 32, 8, 128), torch.bfloat16,
     None),
    ("neox-decode", O.RopeNeoxFwdOp, {}, (64, 1, 32, 8, 128), torch.bfloat16, "random"),
    ("neox-fp32-base", O.RopeNeoxFwdOp, {"base": 500000.0}, (1, 33, 4, 2, 128),
     torch.float32, "random"),
    ("gptj", O.RopeNonNeoxFwdOp, {}, (2, 257, 32, 8, 128), torch.bfloat16, None),
    ("gptj-bhsd-half", O.RopeNonNeoxFwdOp, {"layout": "bhsd", "rotary_dim": 64},
     (2, 100, 9, 3, 128), torch.bfloat16, "random"),
    ("gptj-cache-inplace", O.RopeNonNeoxFwdOp, {"cache_length": 32, "inplace": True},
     (1, 100, 3, 3, 64), torch.float16, "random"),
    ("llama31", O.RopeLlama31FwdOp, {}, (2, 300, 32, 8, 128), torch.bfloat16, "random"),
    ("llama31-gptj-cache", O.RopeLlama31FwdOp, {"interleaved": True, "cache_length": 128},
     (2, 100, 7, 1, 128), torch.bfloat16, "random"),
    ("yarn", O.RopeYarnFwdOp, {}, (2, 300, 32, 8, 128), torch.bfloat16, "random"),
    ("yarn-bhsd-half", O.RopeYarnFwdOp, {"layout": "bhsd", "rotary_dim": 64},
     (1, 65, 5, 5, 128), torch.float32, None),
    ("longrope-short", O.RopeLongRopeFwdOp, FACTORS, (2, 100, 8, 8, 128), torch.bfloat16, 1000),
    ("longrope-long", O.RopeLongRopeFwdOp, FACTORS, (2, 100, 8, 8, 128), torch.bfloat16,
     20000),
    # B * S past SCAN_POSITIONS: the largest position comes from an amax launch, not the CTAs
    ("longrope-long-amax", O.RopeLongRopeFwdOp, FACTORS, (4, 300, 8, 2, 128), torch.bfloat16,
     20000),
    ("longrope-decode", O.RopeLongRopeFwdOp, FACTORS, (64, 1, 32, 8, 128), torch.bfloat16,
     20000),
    ("longrope-no-pos-long", O.RopeLongRopeFwdOp, {**FACTORS, "original_max_position": 64},
     (1, 100, 4, 2, 128), torch.bfloat16, None),
    ("neox-bwd", O.RopeNeoxBwdOp, {}, (2, 100, 32, 8, 128), torch.bfloat16, "random"),
    ("gptj-bwd-bhsd", O.RopeNonNeoxBwdOp, {"layout": "bhsd"}, (2, 100, 7, 3, 64),
     torch.bfloat16, None),
]


def shapes(params, b, s, h, hk, d):
    if params.get("layout") == "bhsd":
        return (b, h, s, d), (b, hk, s, d)
    return (b, s, h, d), (b, s, hk, d)


def positions(kind, b, s, device):
    if kind is None:
        return None
    if kind == "arange":
        return torch.arange(s, device=device).expand(b, s).contiguous()
    if kind == "random":  # every other position past any cached table, the rest inside
        p = torch.randint(0, 200000, (b, s), device=device)
        p[..., ::2] = torch.randint(0, 32, (b, (s + 1) // 2), device=device)
        return p
    return torch.randint(0, kind, (b, s), device=device)


def check(got, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("name", "cls", "params", "dims", "dtype", "pos"), CASES,
                         ids=[c[0] for c in CASES])
def test_against_float64(name, cls, params, dims, dtype, pos):
    op = cls(**params)
    sq, sk = shapes(params, *dims)
    q = torch.randn(sq, device="cuda", dtype=dtype)
    k = torch.randn(sk, device="cuda", dtype=dtype)
    p = positions(pos, dims[0], dims[1], "cuda")
    ref = op.fp64_reference(q, k, p) if p is not None else op.fp64_reference(q, k)
    q0, k0 = q.clone(), k.clone()
    outs = op(q, k, p) if p is not None else op(q, k)
    assert op.serving_target == "tileops"
    for got, r in zip(outs, ref, strict=True):
        check(got, r, dtype)
    if params.get("inplace"):
        assert outs[0] is q and outs[1] is k
    else:
        assert torch.equal(q, q0) and torch.equal(k, k0)


def test_strided_inputs_are_copied_and_written_back():
    """q and k as views of one fused qkv projection (not contiguous): the op copies, and an
    in-place call writes the rotated copies back into the views."""
    b, s, h, hk, d = 2, 50, 8, 2, 128
    qkv = torch.randn(b, s, h + 2 * hk, d, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :, :h], qkv[:, :, h:h + hk]
    ref = O.RopeNeoxFwdOp().fp64_reference(q, k)
    out = O.RopeNeoxFwdOp()(q, k)
    check(out[0], ref[0], torch.bfloat16)
    check(out[1], ref[1], torch.bfloat16)
    v0 = qkv[:, :, h + hk:].clone()
    O.RopeNeoxFwdOp(inplace=True)(q, k)
    check(qkv[:, :, :h], ref[0], torch.bfloat16)
    check(qkv[:, :, h:h + hk], ref[1], torch.bfloat16)
    assert torch.equal(qkv[:, :, h + hk:], v0)  # v untouched


@pytest.mark.parametrize("cls", [O.RopeNeoxFwdOp, O.RopeNonNeoxFwdOp, O.RopeLlama31FwdOp,
                                 O.RopeYarnFwdOp, O.RopeLongRopeFwdOp])
def test_gradients_through_autograd(cls):
    params = FACTORS if cls is O.RopeLongRopeFwdOp else {}
    op = cls(**params)
    q = torch.randn(2, 40, 6, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 40, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.randint(0, 50000, (2, 40), device="cuda")
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    qo, ko = op(q, k, p)
    torch.autograd.backward((qo, ko), (dq_out, dk_out))
    bwd = op._backward_op(())
    ref = bwd.fp64_reference(dq_out, dk_out, p)
    check(q.grad, ref[0], torch.bfloat16)
    check(k.grad, ref[1], torch.bfloat16)
    # the transposed rotation undoes the rotation; a schedule that scales cos and sin by an
    # attention factor (YaRN, LongRoPE) scales twice, once each way
    back = bwd.fp64_reference(*op.fp64_reference(q.detach(), k.detach(), p), p)
    scale = op.attention_scale() ** 2
    torch.testing.assert_close(back[0], scale * q.detach().double(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("b", "s"), [(1, 16), (4, 128), (2, 600)],
                         ids=["scanned", "scanned-at-the-limit", "amax"])
def test_longrope_switches_on_the_device_within_one_graph(b, s):
    """The table is chosen from the positions' largest value on the device, by the CTAs' own
    scan (few positions) or an amax launch (more than SCAN_POSITIONS): one captured CUDA graph
    replays with short and with long positions, each matching its reference, also when the
    largest position is the last one."""
    from tileops.kernels.rope import SCAN_POSITIONS

    assert (b * s > SCAN_POSITIONS) == (s == 600)
    op = O.RopeLongRopeFwdOp(**FACTORS)
    q = torch.randn(b, s, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, 4, 128, device="cuda", dtype=torch.bfloat16)
    p = torch.randint(0, 1000, (b, s), device="cuda")
    op(q, k, p)  # build outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = op(q, k, p)
    for case in ("short", "long", "one long position, the last"):
        p.copy_(torch.randint(0, 990, (b, s), device="cuda"))
        if case == "long":
            p.add_(99000)
        elif case != "short":  # the scan must reach the last position
            p[-1, -1] = 50000
        g.replay()
        ref = op.fp64_reference(q, k, p)
        check(outs[0], ref[0], torch.bfloat16)


# --- the prebuild ----------------------------------------------------------------------------


def program_specs():
    """The call specs of every program the tests above build (meta tensors: no GPU)."""
    specs = {}

    for _, cls, params, dims, dtype, pos in CASES:
        op = cls(**params)
        _, _, h, hk, d = dims
        rd = d if op.rotary_dim is None else op.rotary_dim
        has_pos = pos is not None
        sp = op._spec(None, dtype, h, hk, d, rd, has_pos, op.freq_source(has_pos))
        specs[sp] = None
    bf = torch.bfloat16
    for op, dims, has_pos in [(O.RopeNeoxFwdOp(), (2, 50, 8, 2, 128), False),
                              (O.RopeNeoxFwdOp(inplace=True), (2, 50, 8, 2, 128), False),
                              (O.RopeLongRopeFwdOp(**FACTORS), (1, 16, 4, 4, 128), True)]:
        _, _, h, hk, d = dims
        specs[op._spec(None, bf, h, hk, d, d, has_pos, op.freq_source(has_pos))] = None
    for cls in (O.RopeNeoxFwdOp, O.RopeNonNeoxFwdOp, O.RopeLlama31FwdOp, O.RopeYarnFwdOp,
                O.RopeLongRopeFwdOp):
        op = cls(**(FACTORS if cls is O.RopeLongRopeFwdOp else {}))
        for o in (op, op._backward_op(())):
            specs[o._spec(None, bf, 6, 2, 128, 128, True, o.freq_source(True))] = None
    return list(specs)


def _build(spec):
    import time

    from tileops.kernels.rope import build_rope_kernel

    t = time.perf_counter()
    try:
        build_rope_kernel(spec)
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, the others go on
        status = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    what = f"{spec.style.value} {spec.layout.value} {spec.freq.value} {spec.dtype}"
    return what, time.perf_counter() - t, status


def main(argv=None) -> int:
    import argparse
    import time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    ap = argparse.ArgumentParser(description="compile this file's programs in parallel")
    ap.add_argument("--prebuild", action="store_true", required=True)
    ap.add_argument("--workers", type=int, default=15)
    args = ap.parse_args(argv)
    specs = program_specs()
    t, failed = time.perf_counter(), 0
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        for what, secs, status in pool.map(_build, specs):
            failed += status != "ok"
            print(f"{what} {secs:.1f}s {status}", flush=True)
    print(f"prebuilt {len(specs)} programs in {time.perf_counter() - t:.0f}s, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
