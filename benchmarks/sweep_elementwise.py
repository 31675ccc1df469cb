"""Time the elementwise kernels' fast paths and sweep their launch plan, against torch eager
and torch.compile, to set :func:`tileops.kernels.elementwise.plan`'s defaults from measurement.

    python3 benchmarks/sweep_elementwise.py [--quick] [--shapes silu-32768x8192,...] [--out DIR]
    python3 benchmarks/sweep_elementwise.py --dry-run      # list shapes and plans (CPU)

Shapes (:data:`SHAPES`, bf16): the unary functions and activations over 32768 x 8192 (the
math functions' 16-bit forms and the cheapest functions among them) and silu over 32768 x
4097 (a flat run with a masked tail), a few over 16384 x 4097 (whole vectors, rows off them)
and over 2048 x 4096 (traffic that fits in L2, with add of two such inputs and clamp with
three), silu_and_mul and gelu_and_mul over a 16384 x 28672 input (its halves as strided rows),
small calls (one row, three elements, odd gated rows, SwiGLU's rows), silu over permuted views
(the strided kind, and the same with the output in the view's layout), add with a
row-broadcast bias (``[8192]``, and an odd ``[4097]``) and with a 0-dim scalar, and a device
copy of 32768 x 8192 (``y.copy_(x)``: the bandwidth the others are compared with; timed last,
after a second of warm-up copies, by CUDA events around plain calls).

Candidates per shape: the launch plan with ``threads`` in :data:`THREADS` and ``per``
(accesses of 16 bytes a thread) in :data:`PERS`, for the flat kind 64 threads with ``per``
1, 2 or 4 and one warp with 1 (:data:`FLAT_EXTRA`), for the small flat calls accesses
narrower than 16 bytes (:data:`TINY`), for flat calls of three or more inputs 8-byte
accesses (:data:`NARROW`), and where the function has a 16-bit
form, the other form (:data:`FORMS_TILED`: the rows kind with it, some under a register cap;
the flat kind's default without it), the default marked; ``--quick`` times the
default plan only. Every program is compiled first in ``--workers`` processes (TileLang's
disk cache then serves this one). Each candidate is checked once against float64 torch (max
error within 2 ulp of bf16 at the reference, else WRONG), then timed by CUDA-graph replay
(:func:`_common.graph_events`: the device time, median of 5 replays of 20 calls, or of
enough calls to fill 200 us). Every tensor of the
large shapes is at least 128 MB, so L2 (50 MB on the H200) holds none of it between calls; the
small shapes (one row, three elements, five odd rows) time a call's latency, which the plan's
chain of accesses a thread and its count of CTAs decide.

Contenders: torch eager (the functional call, allocating its output as torch does) and
``torch.compile`` built fresh for each shape (``torch._dynamo.reset()``, ``dynamic=False``).
TB/s counts the floor traffic: every input read once (a broadcast input once at its own size),
every output written once.

Output: a table a shape (plans by time, then the contenders), the best plan of each shape,
and ``sweep_elementwise-<device>.txt`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
for _p in reversed(PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common  # noqa: E402
from tileops.kernels import elementwise as E  # noqa: E402

THREADS = (128, 256, 512)
PERS = (1, 2, 4, 8)
#: the flat kind's extra candidates: a smaller CTA with fewer accesses in flight (one warp
#: for the small calls)
FLAT_EXTRA = (*((64, p) for p in (1, 2, 4)), (32, 1))
#: where the function has a 16-bit form, the tiled kinds' candidates with it or under a register
#: cap (``(threads, per, half, resident)``: ``resident`` CTAs an SM, 0 for no cap); the flat
#: kind's default plan is also timed with the float32 form
FORMS_TILED = ((128, 1, False, 0), (256, 1, True, 0), (64, 1, True, 0), (256, 2, True, 0),
               (256, 2, True, 4), (256, 4, True, 4), (128, 2, True, 8), (256, 4, False, 4))
#: the small flat calls' candidates of narrower accesses, one a thread: ``(threads, vec)``
TINY = ((32, 1), (64, 1), (128, 1), (32, 2), (32, 4), (128, 8))
#: the flat calls of three or more inputs also get 8-byte accesses: ``(threads, per, vec)``
NARROW = ((128, 1, 4), (256, 1, 4), (512, 1, 4), (128, 2, 4), (256, 2, 4), (64, 2, 4))
#: the small flat calls (less than a MiB moved) get the narrower-access candidates
SMALL_BYTES = 1 << 20

#: label -> (fn, params, input shapes, input strides or None (contiguous), output shape,
#: torch function of the inputs)
SHAPES = {
    "silu-32768x8192": ("silu", (), [(32768, 8192)], None, (32768, 8192), "silu"),
    "gelu-32768x8192": ("gelu", (), [(32768, 8192)], None, (32768, 8192), "gelu"),
    "relu-32768x8192": ("relu", (), [(32768, 8192)], None, (32768, 8192), "relu"),
    "gelu_tanh-32768x8192": ("gelu_tanh", (), [(32768, 8192)], None, (32768, 8192),
                             "gelu_tanh"),
    "mish-32768x8192": ("mish", (), [(32768, 8192)], None, (32768, 8192), "mish"),
    "softplus-32768x8192": ("softplus", (1.0, 20.0), [(32768, 8192)], None, (32768, 8192),
                            "softplus"),
    "selu-32768x8192": ("selu", (), [(32768, 8192)], None, (32768, 8192), "selu"),
    "silu-32768x4097": ("silu", (), [(32768, 4097)], None, (32768, 4097), "silu"),
    # the math functions' 16-bit forms, and the cheapest functions (one access a thread or two)
    **{f"{fn}-32768x8192": (fn, (), [(32768, 8192)], None, (32768, 8192), fn)
       for fn in ("tanh", "erf", "log", "sin", "cos", "exp", "abs", "hardswish", "sigmoid",
                  "hardsigmoid", "sqrt", "rsqrt", "reciprocal", "neg", "floor", "sign",
                  "log1p", "expm1", "ceil", "round", "trunc")},
    **{f"{fn}-32768x8192": (fn, params, [(32768, 8192)], None, (32768, 8192), fn)
       for fn, params in (("elu", (1.0,)), ("leaky_relu", (0.01,)), ("hardtanh", (-1.0, 1.0)),
                          ("clamp", (-0.5, 0.5, True, True)))},
    # a flat run of an odd row (16384 x 4097: whole vectors, rows off them)
    **{f"{fn}-16384x4097": (fn, (), [(16384, 4097)], None, (16384, 4097), fn)
       for fn in ("neg", "reciprocal", "exp", "sigmoid")},
    "silu_and_mul-16384x28672": ("silu_and_mul", (), [(16384, 14336)] * 2,
                                 [(28672, 1)] * 2, (16384, 14336), "silu_and_mul"),
    "gelu_and_mul-16384x28672": ("gelu_and_mul", (), [(16384, 14336)] * 2,
                                 [(28672, 1)] * 2, (16384, 14336), "gelu_and_mul"),
    "add-bias-32768x8192": ("add", (1,), [(32768, 8192), (8192,)], None, (32768, 8192), "add"),
    "add-scalar-32768x8192": ("add", (1,), [(32768, 8192), ()], None, (32768, 8192), "add"),
    # a row off the vector: the modular flat run, the bias read at the index modulo its row
    "add-bias-16384x4097": ("add", (1,), [(16384, 4097), (4097,)], None, (16384, 4097), "add"),
    # calls whose traffic fits in L2 (32 MB and 48 MB moved; 64 MB for the three-input clamp)
    **{f"{fn}-2048x4096": (fn, (), [(2048, 4096)], None, (2048, 4096), fn)
       for fn in ("exp", "hardswish", "neg", "tanh")},
    "add-2048x4096": ("add", (1,), [(2048, 4096)] * 2, None, (2048, 4096), "add"),
    "clamp_tensor-2048x4096": ("clamp_tensor", (True, True), [(2048, 4096)] * 3, None,
                               (2048, 4096), "clamp_tensor"),
    # small calls, timed for their latency: one row, three elements, a gated op's odd rows
    # (halves at odd offsets: single-element accesses) and one row of two inputs (SwiGLU's)
    "mish-1x4096": ("mish", (), [(1, 4096)], None, (1, 4096), "mish"),
    "gelu-1x4096": ("gelu", (), [(1, 4096)], None, (1, 4096), "gelu"),
    "gelu-3": ("gelu", (), [(3,)], None, (3,), "gelu"),
    "silu-3": ("silu", (), [(3,)], None, (3,), "silu"),
    "relu-3": ("relu", (), [(3,)], None, (3,), "relu"),
    "neg-3": ("neg", (), [(3,)], None, (3,), "neg"),
    "reciprocal-3": ("reciprocal", (), [(3,)], None, (3,), "reciprocal"),
    "neg-1x4096": ("neg", (), [(1, 4096)], None, (1, 4096), "neg"),
    "abs-1x4096": ("abs", (), [(1, 4096)], None, (1, 4096), "abs"),
    "silu_and_mul-5x8194": ("silu_and_mul", (), [(5, 4097)] * 2, [(8194, 1)] * 2, (5, 4097),
                            "silu_and_mul"),
    "silu_and_mul-1x28672": ("silu_and_mul", (), [(1, 14336)] * 2, [(28672, 1)] * 2,
                             (1, 14336), "silu_and_mul"),
    # permuted views (:data:`PERMUTED`): the shapes are the contiguous tensors permuted
    "silu-bshd-to-bhsd": ("silu", (), [(16, 2048, 32, 128)], None, (16, 32, 2048, 128),
                          "silu"),
    "silu-transposed-64x1024x1024": ("silu", (), [(64, 1024, 1024)], None, (64, 1024, 1024),
                                     "silu"),
    # the same views with the output in their own layout, as the ops allocate it (torch's)
    "silu-bshd-to-bhsd-own": ("silu", (), [(16, 2048, 32, 128)], None, (16, 32, 2048, 128),
                              "silu"),
    "silu-transposed-64x1024x1024-own": ("silu", (), [(64, 1024, 1024)], None,
                                         (64, 1024, 1024), "silu"),
    "swiglu-5x4097": ("silu_and_mul", (), [(5, 4097)] * 2, None, (5, 4097), "silu_and_mul"),
    "swiglu-1x14336": ("silu_and_mul", (), [(1, 14336)] * 2, None, (1, 14336),
                       "silu_and_mul"),
}


#: label -> the permutation a shape's inputs are read through (the strided kind: a [B, S, H, D]
#: activation read as [B, H, S, D], 16-byte accesses along D; a transpose of the last two
#: dims, single elements)
PERMUTED = {"silu-bshd-to-bhsd": (0, 2, 1, 3), "silu-transposed-64x1024x1024": (0, 2, 1),
            "silu-bshd-to-bhsd-own": (0, 2, 1, 3), "silu-transposed-64x1024x1024-own": (0, 2, 1)}
#: the permuted shapes whose output is in the input's layout (``torch.empty_like``; the others
#: write a contiguous one)
OWN_LAYOUT = {"silu-bshd-to-bhsd-own", "silu-transposed-64x1024x1024-own"}


def _contiguous(shape):
    """The strides of a contiguous tensor of ``shape`` (torch's, from a meta tensor)."""
    return tuple(torch.empty(shape, device="meta").stride())


def make_spec(label: str, device=None) -> E.ElementwiseSpec:
    fn, params, shapes, strides, out_shape, _ = SHAPES[label]
    if label in PERMUTED:
        views = [torch.empty(s, device="meta").permute(PERMUTED[label]) for s in shapes]
        shapes, strides = [v.shape for v in views], [v.stride() for v in views]
    strides = strides or [_contiguous(s) for s in shapes]
    out_strides = tuple(strides[0]) if label in OWN_LAYOUT else _contiguous(out_shape)
    return E.ElementwiseSpec(
        device=device, fn=fn, params=params, in_dtypes=("bfloat16",) * len(shapes),
        out_dtypes=("bfloat16",), compute="float32", out_shape=out_shape,
        in_shapes=tuple(map(tuple, shapes)), in_strides=tuple(map(tuple, strides)),
        in_align=(16,) * len(shapes), out_strides=(out_strides,), out_align=(16,))


def candidates(label: str, quick: bool) -> list[tuple[E.Plan, bool]]:
    """``(plan, is_default)`` for a shape, the default first."""
    s = make_spec(label)
    default = E.plan(s)
    if quick:
        return [(default, True)]
    out = [(default, True)]
    pairs = [(t, p) for t in THREADS for p in PERS]
    if default.kind == "flat":
        pairs += FLAT_EXTRA
    for t, p in pairs:
        cand = E.plan(s, threads=t, per=p)
        if cand != default:
            out.append((cand, False))
    if default.kind == "flat" and _bytes_of(label) < SMALL_BYTES:
        for t, v in TINY:
            cand = E.plan(s, threads=t, per=1, vec=v)
            if cand != default and (cand, False) not in out:
                out.append((cand, False))
    if default.kind == "flat" and len(s.in_shapes) >= 3:
        for t, p, v in NARROW:
            cand = E.plan(s, threads=t, per=p, vec=v)
            if cand != default and (cand, False) not in out:
                out.append((cand, False))
    if E.SCALAR_FNS[s.fn].half_build is not None:
        if default.kind == "flat":
            forms = [E.plan(s, threads=default.threads, per=default.per, half=False)]
        else:
            forms = [E.plan(s, threads=t, per=p, half=h, resident=r)
                     for t, p, h, r in FORMS_TILED]
        out += [(cand, False) for cand in dict.fromkeys(forms)
                if cand != default and (cand, False) not in out]
    return out


def _bytes_of(label: str) -> int:
    """The bytes a shape's call moves (bf16: every input read once, the output written)."""
    _, _, shapes, _, out_shape, _ = SHAPES[label]
    return 2 * sum(math.prod(s) for s in (*shapes, out_shape))


def describe(p: E.Plan) -> str:
    """A plan as the tables name it: threads, accesses, width, the 16-bit form where the
    function's own is used, and a register cap."""
    return (f"threads={p.threads} per={p.per} vec={p.vec}" + (" half-form" if p.half else "")
            + (f" resident={p.resident}" if p.resident else ""))


def _build(job) -> tuple[str, float, str]:
    """Worker: compile one program (fills TileLang's disk cache)."""
    label, p = job
    t = time.perf_counter()
    s = make_spec(label)
    try:
        E.build_kernel(s.fn, s.params, s.in_dtypes, s.out_dtypes, s.compute,
                       len(s.out_shape), p)
        status = "ok"
    except Exception as exc:  # reported, the sweep goes on without it
        status = _common.first_line(exc)
    return f"{label} {describe(p)}", time.perf_counter() - t, status


def _tensors(label: str, torch):
    fn, params, shapes, strides, out_shape, _ = SHAPES[label]
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    if strides:  # the gated op's halves of one [B, 2N] input
        x = torch.randn(shapes[0][0], 2 * shapes[0][1], device=dev, dtype=torch.bfloat16,
                        generator=g)
        n = shapes[0][1]
        ins = [x[:, :n], x[:, n:]]
    else:
        ins = [torch.randn(s, device=dev, dtype=torch.bfloat16, generator=g) for s in shapes]
        if label in PERMUTED:
            ins = [t.permute(PERMUTED[label]) for t in ins]
        if SHAPES[label][0] in ("log", "sqrt", "rsqrt", "log1p"):  # a positive argument
            ins = [t.abs() for t in ins]
    out = (torch.empty_like(ins[0]) if label in OWN_LAYOUT else
           torch.empty(out_shape, device=dev, dtype=torch.bfloat16))
    return ins, out


def _torch_fn(name: str, torch):
    F = torch.nn.functional
    return {"silu": F.silu, "gelu": F.gelu, "relu": torch.relu, "add": torch.add,
            "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "mish": F.mish,
            "silu_and_mul": lambda a, b: F.silu(a) * b,
            "gelu_and_mul": lambda a, b: F.gelu(a) * b, "softplus": F.softplus,
            "selu": F.selu, "tanh": torch.tanh, "erf": torch.erf, "log": torch.log,
            "sin": torch.sin, "cos": torch.cos, "exp": torch.exp, "abs": torch.abs,
            "hardswish": F.hardswish, "sigmoid": torch.sigmoid,
            "hardsigmoid": F.hardsigmoid, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
            "reciprocal": torch.reciprocal, "neg": torch.neg, "floor": torch.floor,
            "sign": torch.sign, "log1p": torch.log1p, "expm1": torch.expm1,
            "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc,
            "elu": F.elu, "leaky_relu": F.leaky_relu, "hardtanh": F.hardtanh,
            "clamp": lambda x: torch.clamp(x, -0.5, 0.5), "clamp_tensor": torch.clamp}[name]


def _bytes(ins, out) -> int:
    return sum(t.numel() * t.element_size() for t in (*ins, out))


def _reference(label: str, ins, torch):
    return _torch_fn(SHAPES[label][5], torch)(*(t.double() for t in ins))


def _ok(got, ref, torch) -> bool:
    err = (got.double() - ref).abs()
    tol = 2 * ref.abs().clamp_min(torch.finfo(torch.bfloat16).tiny) * torch.finfo(
        torch.bfloat16).eps
    return bool(((err <= tol) | (got.double() == ref)).all())  # an equal inf too


def run_shape(label: str, cands, torch) -> list[str]:
    ins, out = _tensors(label, torch)
    nbytes = _bytes(ins, out)
    s = make_spec(label, torch.device("cuda"))
    ref = _reference(label, ins, torch)
    rows = []
    for p, default in cands:
        try:
            prog = E.build_kernel(s.fn, s.params, s.in_dtypes, s.out_dtypes, s.compute,
                                  len(s.out_shape), p)
            prog(*ins, out)
            torch.cuda.synchronize()
            good = _ok(out, ref, torch)
            ms = _common.graph_events(lambda prog=prog: prog(*ins, out), 20)
            rows.append((ms, f"tileops {describe(p)}"
                         + (" (default)" if default else "") + ("" if good else " WRONG")))
        except Exception as exc:
            rows.append((float("inf"), f"tileops {describe(p)}: {_common.first_line(exc)}"))
    f = _torch_fn(SHAPES[label][5], torch)
    rows.append((_common.graph_events(lambda: f(*ins), 20), "torch eager"))
    torch._dynamo.reset()
    compiled = torch.compile(f, dynamic=False)
    compiled(*ins)
    rows.append((_common.graph_events(lambda: compiled(*ins), 20), "torch.compile"))
    lines = [f"## {label} ({nbytes / 1e6:.0f} MB moved)", "",
             f"{'time (us)':>10}  {'TB/s':>6}  candidate"]
    for ms, what in sorted(rows):
        tbs = nbytes / (ms * 1e-3) / 1e12 if ms != float("inf") else 0.0
        lines.append(f"{ms * 1e3:10.2f}  {tbs:6.3f}  {what}")
    return lines + [""]


def copy_line(torch) -> list[str]:
    """The device copy, after a second of copies, timed by events around plain calls: a copy
    captured in a CUDA graph becomes a memcpy node, which read 2.75 TB/s (391 us, 2026-12-04)
    for a copy that runs at about 4.3 as a kernel."""
    x = torch.randn(32768, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        for _ in range(20):
            y.copy_(x)
        torch.cuda.synchronize()
    ms = _common.events(lambda: y.copy_(x), 20)
    return [f"device copy 32768x8192 bf16: {ms * 1e3:.1f} us, "
            f"{2 * x.numel() * 2 / (ms * 1e-3) / 1e12:.3f} TB/s", ""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated labels")
    ap.add_argument("--quick", action="store_true", help="the default plan only")
    ap.add_argument("--dry-run", action="store_true", help="list shapes and plans (no GPU)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    labels = [x for x in args.shapes.split(",") if x]
    unknown = [x for x in labels if x not in SHAPES]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}; one of {', '.join(SHAPES)}")
    plans = {label: candidates(label, args.quick) for label in labels}
    if args.dry_run:
        for label, cands in plans.items():
            print(f"{label}: " + ", ".join(
                f"{p.kind} {describe(p)}" + ("*" if d else "")
                for p, d in cands))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (--dry-run lists the plans without one)", file=sys.stderr)
        return 2
    # shapes of one function and layout class share programs: each is compiled once
    unique = {(SHAPES[label][:2], len(SHAPES[label][2]), p): (label, p)
              for label, cands in plans.items() for p, _ in cands}
    jobs = list(unique.values())
    _common.prebuild(jobs, _build, args.workers)
    dev = _common.parse_device("cuda")
    head = _common.header("sweep_elementwise", dev, quick=args.quick)
    lines = []
    for label in labels:
        lines += run_shape(label, plans[label], torch)
        print("\n".join(lines[-(len(plans[label]) + 6):]), flush=True)
    copy = copy_line(torch)  # after the shapes too: the clocks are up
    print(copy[0], flush=True)
    lines = _common.title(head, "Elementwise launch plans") + copy + lines
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sweep_elementwise-{str(dev).replace(':', '')}.txt"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
