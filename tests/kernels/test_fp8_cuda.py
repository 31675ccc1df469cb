"""The fp8 kernels on a GPU against float64, called through the slots as the ops call them (a
spec from the sizes, the implementation the slot selects, its entry), on fresh random inputs.

Quantising: every granularity from bfloat16 to e4m3 (from float16 and float32 too, and to
e5m2, at the ragged shape) at shapes chosen for what they exercise: one row (1 x 4096), a row shorter than a
tile (3 x 7), rows and columns that overhang every tile and block (333 x 4095), a block row
exactly (128 x 256), many rows (1000 x 8192); and for the row and tensor programs each of
their plans and paths (``ROW_TENSOR_SHAPES``: rows held in registers or walked in steps, the
tensor in one CTA or in two programs). The scales must be the float64 ``max(amax, 1e-12) / fp8_max`` of each block to
float32 rounding; each ``q * scale`` must be within half an fp8 ulp of ``x`` (one rounding of
``x / scale``, saturated) and ``q`` equal to torch's rounding of the float64 quotient but for
quotients within fp32's error of a tie. Outputs are poisoned with NaN first, so an element never
written fails.

The GEMM: every scaling at decode (1, 16 rows: the 64-row tiles), a row count past the decode
range by one (65), prefill (2048), sizes that overhang the tiles and break TMA's alignment
(333 x 4097 x 4095: the plain copies) and 1000^3, with and without a bias, each output dtype
and e5m2 somewhere; the sweep's persistent and promoting programs per tensor and per row; the
swapped decode tiles (one CTA or several an SM, K split in two to four with the reduction's
epilogue) under every scaling, at K that leaves a split or a step part empty, with a bias,
through plain copies where rows break TMA's alignment, and through the slot with the heuristic
taking them.
The bound is elementwise: one rounding to the output dtype, plus a share of the product of the
magnitudes ``|a| @ |b|^T`` for the accumulation. wgmma's fp8 accumulator keeps about 14 bits:
over the whole of K (tensor and row scales, no promotion) its error grows to about 2^-13 of
the magnitudes at a few sigma, held to 2^-10; promoted every 128 products (block scales) it
stays within one step's partial, held to 2^-12.

``python3 tests/kernels/test_fp8_cuda.py --prebuild --workers 15`` compiles every program these
tests use in spawned processes first, so the tests load them from TileLang's disk cache.
"""

import math
import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import fp8_gemm as G  # noqa: E402
from tileops.kernels import fp8_quant as Q  # noqa: E402
from tileops.runtime import select  # noqa: E402

pytestmark = pytest.mark.cuda

NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
         torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: mantissa bits of each fp8 dtype and the exponent of its smallest subnormal
MANT = {E4M3: (3, -9), E5M2: (2, -16)}
EPS_OUT = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}

QUANT_SHAPES = [(1, 4096), (3, 7), (333, 4095), (128, 256), (1000, 8192)]
#: the row and tensor programs' other plans and paths: few rows of the bars' length (the
#: row-wise decode shape; the tensor's one-CTA program at its 64 KiB limit and one row past
#: it, two programs), the longest rows held (bf16 and fp32) and rows past them (steps read
#: twice, the last partly past the row), rows shorter than a warp's share packed 256 threads
#: a CTA (100 x 1000: 16 rows a CTA; 20000 x 64: 256), and more row groups than partial
#: maxima off the vector (4099 x 4095: each partial over several groups)
ROW_TENSOR_SHAPES = [(16, 4096, torch.bfloat16), (8, 4096, torch.bfloat16),
                     (9, 4096, torch.bfloat16), (5, 32768, torch.bfloat16),
                     (3, 16384, torch.float32), (5, 32776, torch.bfloat16),
                     (2, 65536, torch.float16), (100, 1000, torch.bfloat16),
                     (20000, 64, torch.bfloat16), (4099, 4095, torch.bfloat16)]
#: every shape from bfloat16; float16 and float32 (another load) at the ragged and short ones
QUANT_CASES = ([(g, m, k, torch.bfloat16, E4M3) for g in Q.Granularity for m, k in QUANT_SHAPES]
               + [(g, m, k, dt, E4M3) for g in Q.Granularity for m, k in [(333, 4095), (3, 7)]
                  for dt in (torch.float16, torch.float32)]
               + [(g, 333, 4095, torch.bfloat16, E5M2) for g in Q.Granularity]
               + [(g, m, k, dt, E4M3) for g in (Q.Granularity.ROW, Q.Granularity.TENSOR)
                  for m, k, dt in ROW_TENSOR_SHAPES])

GEMM_SHAPES = [(1, 4096, 4096), (16, 8192, 1024), (65, 384, 512), (2048, 4096, 4096),
               (333, 4097, 4095), (1000, 1000, 1000)]
GEMM_CASES = ([(s, m, n, k, torch.bfloat16, E4M3, False) for s in G.Scaling
               for m, n, k in GEMM_SHAPES]
              + [(s, 333, 4097, 4095, torch.bfloat16, E4M3, True) for s in G.Scaling]
              + [(G.Scaling.ROW, 65, 384, 512, torch.float16, E5M2, True),
                 (G.Scaling.TENSOR, 2048, 4096, 4096, torch.float32, E4M3, True),
                 (G.Scaling.BLOCK, 16, 8192, 1024, torch.float16, E4M3, False),
                 (G.Scaling.BLOCK, 1000, 1000, 1000, torch.float32, E5M2, True)])


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cuda", 0)


def quant_spec(g, m, k, dtype, fp8):
    return Q.Fp8QuantSpec(device=_device(), m=m, k=k, dtype=NAMES[dtype],
                          fp8_dtype=NAMES[fp8], granularity=g)


def gemm_spec(scaling, m, n, k, out, fp8, bias):
    return G.GemmFp8Spec(device=_device(), m=m, n=n, k=k, a_dtype=NAMES[fp8],
                         b_dtype=NAMES[fp8], out_dtype=NAMES[out], scaling=scaling,
                         has_bias=bias)


def _entry(interface, kernels, spec):
    return select(interface, kernels, spec).entry_for(spec, None)


def _scale_shape(g, r, c):
    return {Q.Granularity.TENSOR: (), Q.Granularity.ROW: (r, 1),
            Q.Granularity.GROUP: (r, math.ceil(c / 128)),
            Q.Granularity.BLOCK: (math.ceil(r / 128), math.ceil(c / 128))}[g]


def _block_dims(g, r, c):
    return {Q.Granularity.TENSOR: (max(r, 1), max(c, 1)), Q.Granularity.ROW: (1, max(c, 1)),
            Q.Granularity.GROUP: (1, 128), Q.Granularity.BLOCK: (128, 128)}[g]


def _spread(scale, g, r, c):
    """Each block's scale over its elements ``[r, c]``."""
    if g is Q.Granularity.TENSOR:
        return scale.reshape(1, 1).expand(r, c)
    br, bc = _block_dims(g, r, c)
    return scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:r, :c]


def _amax_blocks(x, g):
    r, c = x.shape
    br, bc = _block_dims(g, r, c)
    rb = 1 if g is Q.Granularity.TENSOR else math.ceil(r / br)
    cb = 1 if g in (Q.Granularity.TENSOR, Q.Granularity.ROW) else math.ceil(c / bc)
    padded = x.new_zeros((rb * br, cb * bc))
    padded[:r, :c] = x
    amax = padded.abs().view(rb, br, cb, bc).amax(dim=(1, 3))
    return amax.reshape(()) if g is Q.Granularity.TENSOR else amax


@pytest.mark.parametrize(("g", "m", "k", "dtype", "fp8"), QUANT_CASES,
                         ids=[f"{c[0].value}-{c[1]}x{c[2]}-{NAMES[c[3]]}-{NAMES[c[4]]}"
                              for c in QUANT_CASES])
def test_quantise_against_float64(g, m, k, dtype, fp8):
    torch.manual_seed(m * 7919 + k)
    x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 8).to(dtype)
    if m > 2:
        x[2] = 0  # an all-zero row: the floored scale
    q = torch.full((m, k), float("nan"), device="cuda").to(fp8)
    scale = torch.full(_scale_shape(g, m, k), float("nan"), device="cuda")
    _entry(Q.Fp8QuantInterface, (Q.Fp8QuantKernel,), quant_spec(g, m, k, dtype, fp8))(
        x, q, scale)
    torch.cuda.synchronize()
    fmax = torch.finfo(fp8).max
    want_scale = _amax_blocks(x.double(), g).clamp_min(Q.AMAX_FLOOR) / fmax
    torch.testing.assert_close(scale.double(), want_scale, rtol=2 ** -23, atol=0)
    qd = q.double()
    assert not bool(qd.isnan().any()), "an element of q was never written"
    s = _spread(scale.double(), g, m, k)
    quot = (x.double() / s).clamp(-fmax, fmax)
    mant, sub = MANT[fp8]
    # one rounding of the quotient: half an ulp of the fp8 value, or of the smallest subnormal
    half_ulp = torch.maximum(quot.abs() * 2.0 ** -(mant + 1), torch.full_like(quot, 2.0 ** (sub - 1)))
    assert bool(((qd - quot).abs() <= half_ulp * (1 + 2 ** -20)).all())
    same = qd == quot.to(fp8).double()
    assert same.double().mean().item() >= 0.999


@pytest.mark.parametrize(("scaling", "m", "n", "k", "out", "fp8", "bias"), GEMM_CASES,
                         ids=[f"{c[0].value}-{c[1]}x{c[2]}x{c[3]}-{NAMES[c[4]]}-{NAMES[c[5]]}"
                              f"{'-bias' if c[6] else ''}" for c in GEMM_CASES])
def test_gemm_against_float64(scaling, m, n, k, out, fp8, bias):
    torch.manual_seed(m * 31 + n * 7 + k)
    ops = _operands(scaling, m, n, k, out, fp8, bias)
    kernels = (G.GemmFp8ScaledKernel, G.GemmFp8BlockKernel)
    _entry(G.GemmFp8Interface, kernels, gemm_spec(scaling, m, n, k, out, fp8, bias))(*ops)
    _check(scaling, *ops, acc=2 ** -12 if scaling is G.Scaling.BLOCK else 2 ** -10)


#: granularities of ``a``'s and ``b``'s scales per scaling
_GRAN = {G.Scaling.TENSOR: (Q.Granularity.TENSOR,) * 2,
         G.Scaling.ROW: (Q.Granularity.ROW,) * 2,
         G.Scaling.BLOCK: (Q.Granularity.GROUP, Q.Granularity.BLOCK)}


def _operands(scaling, m, n, k, out, fp8, bias):
    """``(a, b, sa, sb, bias, c)`` of one call on the GPU (the caller seeds): fp8 operands of
    spread magnitudes, scales of distinct sizes for ``a`` and ``b``, ``c`` all NaN so that an
    element no program writes is seen."""
    ga, gb = _GRAN[scaling]
    a = (torch.randn(m, k, device="cuda") * 2).to(fp8)
    b = (torch.randn(n, k, device="cuda") * 2).to(fp8)
    sa = torch.rand(_scale_shape(ga, m, k), device="cuda") + 0.5
    sb = torch.rand(_scale_shape(gb, n, k), device="cuda") * 0.01 + 0.005
    bv = torch.randn(n, device="cuda").to(out) if bias else None
    c = torch.full((m, n), float("nan"), device="cuda", dtype=out)
    return a, b, sa, sb, bv, c


def _check(scaling, a, b, sa, sb, bv, c, *, acc):
    """``c`` against the float64 product of the scaled operands (plus the bias): every element
    written, each within one rounding to ``c``'s dtype plus ``acc`` times the product of the
    magnitudes (the accumulator's error)."""
    torch.cuda.synchronize()
    (m, k), n = a.shape, b.shape[0]
    ga, gb = _GRAN[scaling]
    da = a.double() * _spread(sa.double(), ga, m, k)
    db = b.double() * _spread(sb.double(), gb, n, k)
    want = da @ db.T
    if bv is not None:
        want += bv.double()
    got = c.double()
    assert not bool(got.isnan().any()), "an element of c was never written"
    bound = EPS_OUT[c.dtype] * want.abs() + acc * (da.abs() @ db.abs().T) + 1e-30
    bad = (got - want).abs() > bound
    if bool(bad.any()):
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} elements off, e.g. at {idx}: "
                             f"got {got[idx].item()!r}, want {want[idx].item()!r}")


def _flat(scaling, ops):
    """``ops`` as a program takes them: a per-tensor scale as one element, not a 0-dim
    tensor, and no bias as any tensor of ``c``'s dtype (never read)."""
    a, b, sa, sb, bv, c = ops
    if scaling is G.Scaling.TENSOR:
        sa, sb = sa.view(1), sb.view(1)
    return a, b, sa, sb, c[0] if bv is None else bv, c


#: the sweep's other programs (not the heuristic's): the persistent grid per tensor and per
#: row (a tile count that is not a multiple of the grid, rows past M) and the promoting
#: 128 x 128 tile, held to the promoted bound, at a long K
PERSISTENT = G.FP8_CONFIGS["128x256"]._replace(persistent=True)
PROMOTED = G.Fp8Config(128, 128, 128, 4, 256, policy="row", promote=True)
VARIANT_CASES = [(PERSISTENT, G.Scaling.TENSOR, 2048, 4096, 4096, torch.bfloat16, False),
                 (PERSISTENT, G.Scaling.ROW, 333, 4096, 1024, torch.bfloat16, True),
                 (PERSISTENT, G.Scaling.ROW, 1000, 2048, 512, torch.float16, False),
                 (PROMOTED, G.Scaling.ROW, 333, 4096, 14336, torch.bfloat16, True),
                 (PROMOTED, G.Scaling.TENSOR, 1000, 1000, 1000, torch.float32, False)]


@pytest.mark.parametrize(("cfg", "scaling", "m", "n", "k", "out", "bias"), VARIANT_CASES,
                         ids=[f"{c[0].label()}-{c[1].value}-{c[2]}x{c[3]}x{c[4]}"
                              for c in VARIANT_CASES])
def test_sweep_programs_against_float64(cfg, scaling, m, n, k, out, bias):
    torch.manual_seed(m + n + k)
    ops = _operands(scaling, m, n, k, out, E4M3, bias)
    spec = gemm_spec(scaling, m, n, k, out, E4M3, bias)
    cfg = cfg._replace(tma=G.choose_fp8_config(spec).tma)
    prog = G.build_fp8_gemm_kernel(n, k, NAMES[E4M3], NAMES[E4M3], NAMES[out], scaling, bias,
                                   cfg, None, _sms())
    prog(*_flat(scaling, ops))
    _check(scaling, *ops, acc=2 ** -12 if cfg.promote else 2 ** -10)


#: the swapped decode tiles (``Fp8Config.swap``): (config, scaling, m, n, k, out, fp8, bias);
#: K = 4000 and 1040 leave the last CTA of a split steps past K (TMA's zero fill), N = 1000 a
#: part tile, K = 1000 breaks TMA's alignment (the plain copies)
_T = G.Fp8Config(16, 64, 256, 4, 128, 0, swap=True, resident=2)
_TB = G.Fp8Config(16, 64, 128, 8, 128, 0, swap=True, resident=2)
SWAPPED_CASES = [
    (_T._replace(split=2), G.Scaling.ROW, 16, 4096, 4096, torch.bfloat16, E4M3, True),
    (_T._replace(split=3, stages=3, resident=3), G.Scaling.TENSOR, 5, 4096, 4000,
     torch.float32, E4M3, True),
    (_T, G.Scaling.ROW, 16, 2048, 4096, torch.float16, E5M2, False),
    (_T._replace(stages=8, resident=1), G.Scaling.TENSOR, 1, 4096, 4096, torch.bfloat16, E4M3,
     True),
    (G.Fp8Config(16, 128, 256, 3, 128, 0, swap=True, split=4, resident=2), G.Scaling.TENSOR,
     16, 4096, 4096, torch.bfloat16, E4M3, False),
    (_TB._replace(split=2), G.Scaling.BLOCK, 16, 4096, 4000, torch.float16, E4M3, True),
    (_TB._replace(split=3), G.Scaling.BLOCK, 1, 1000, 1040, torch.bfloat16, E4M3, False),
    (_TB, G.Scaling.BLOCK, 9, 2048, 4096, torch.float32, E4M3, True),
    (_T._replace(block_k=128, split=2, tma=False), G.Scaling.ROW, 16, 1000, 1000,
     torch.bfloat16, E4M3, True),
    (_TB._replace(tma=False), G.Scaling.BLOCK, 3, 1000, 1000, torch.bfloat16, E4M3, True),
]
@pytest.mark.parametrize(("cfg", "scaling", "m", "n", "k", "out", "fp8", "bias"),
                         SWAPPED_CASES,
                         ids=[f"{c[0].label()}-{c[1].value}-{c[2]}x{c[3]}x{c[4]}-{NAMES[c[5]]}"
                              f"-{NAMES[c[6]]}{'-bias' if c[7] else ''}" for c in SWAPPED_CASES])
def test_swapped_programs_against_float64(cfg, scaling, m, n, k, out, fp8, bias):
    torch.manual_seed(m + n + k + cfg.split)
    ops = _operands(scaling, m, n, k, out, fp8, bias)
    run = G.fp8_gemm_launch(n, k, NAMES[fp8], NAMES[fp8], NAMES[out], scaling, bias, cfg)
    run(*_flat(scaling, ops))
    _check(scaling, *ops, acc=2 ** -12 if scaling is G.Scaling.BLOCK else 2 ** -10)


#: calls the heuristic gives the swapped tile (per row, per tensor with a bias into float32,
#: float16 out; block-scaled)
SLOT_SWAPPED = [(G.Scaling.ROW, 16, 8192, 2048, torch.bfloat16, E4M3, False),
                (G.Scaling.TENSOR, 1, 4096, 4096, torch.float32, E4M3, True),
                (G.Scaling.ROW, 7, 14336, 512, torch.float16, E4M3, True),
                (G.Scaling.BLOCK, 16, 4096, 1024, torch.bfloat16, E4M3, False)]


@pytest.mark.parametrize(("scaling", "m", "n", "k", "out", "fp8", "bias"), SLOT_SWAPPED,
                         ids=[f"{c[0].value}-{c[1]}x{c[2]}x{c[3]}-{NAMES[c[4]]}"
                              f"{'-bias' if c[6] else ''}" for c in SLOT_SWAPPED])
def test_gemm_with_swapped_decode_against_float64(monkeypatch, scaling, m, n, k, out, fp8,
                                                  bias):
    monkeypatch.setattr(G, "SWAPPED_DECODE", True)
    assert G.choose_fp8_config(gemm_spec(scaling, m, n, k, out, fp8, bias)).swap
    test_gemm_against_float64(scaling, m, n, k, out, fp8, bias)


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count \
        if torch.cuda.is_available() else 132


# --- the prebuild ----------------------------------------------------------------------------


def program_keys():
    """The distinct programs this file compiles: the quantiser's entries' programs
    (:func:`fp8_quant.program_keys`: "quant", "amax", "tensor_one") and ("gemm", ...), each with
    its builder's arguments."""
    keys = {}
    for g, m, k, dtype, fp8 in QUANT_CASES:
        for key in Q.program_keys(quant_spec(g, m, k, dtype, fp8)):
            keys[key] = None
    for scaling, m, n, k, out, fp8, bias in GEMM_CASES:
        spec = gemm_spec(scaling, m, n, k, out, fp8, bias)
        keys[("gemm", n, k, spec.a_dtype, spec.b_dtype, spec.out_dtype, scaling, bias,
              G.choose_fp8_config(spec))] = None
    for cfg, scaling, m, n, k, out, bias in VARIANT_CASES:
        spec = gemm_spec(scaling, m, n, k, out, E4M3, bias)
        cfg = cfg._replace(tma=G.choose_fp8_config(spec).tma)
        keys[("gemm", n, k, NAMES[E4M3], NAMES[E4M3], NAMES[out], scaling, bias, cfg, None,
              _sms())] = None
    for cfg, scaling, _m, n, k, out, fp8, bias in SWAPPED_CASES:
        keys[("launch", n, k, NAMES[fp8], NAMES[fp8], NAMES[out], scaling, bias, cfg)] = None
    for scaling, m, n, k, out, fp8, bias in SLOT_SWAPPED:
        spec = gemm_spec(scaling, m, n, k, out, fp8, bias)
        keys[("launch", n, k, spec.a_dtype, spec.b_dtype, spec.out_dtype, scaling, bias,
              G.swapped_decode_config(spec), None, _sms())] = None
    return list(keys)


def _build(key):
    what, *args = key
    {**Q.BUILDERS, "gemm": G.build_fp8_gemm_kernel, "launch": G.fp8_gemm_launch}[what](*args)


def _describe(key) -> str:
    what, *args = key
    if what in ("gemm", "launch"):
        n, k, dt, _, out, scaling, bias, cfg = args[:8]
        return f"gemm {scaling.value} n{n} k{k} {dt} -> {out}{' bias' if bias else ''} {cfg.label()}"
    if what == "amax":
        return f"amax k{args[0]} {args[1]} {args[2]}"
    if what == "tensor_one":
        k, dt, fp8, plan = args
        return f"quant tensor (one CTA) k{k} {dt} -> {fp8} {plan}"
    k, dt, fp8, g, plan = args
    return f"quant {g.value} k{k} {dt} -> {fp8} {plan}"


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
