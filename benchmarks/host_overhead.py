"""Host overhead of the op layer: a cached op call whose kernel does nothing, against calling
that kernel directly.

Measured per call, best of N interleaved rounds spread over at least ``--seconds`` (``timeit``;
the machine may be shared, and a shared machine's speed drifts over seconds):

  (a) ``op(x)``: the whole op layer (signature check, effect branch and output allocation,
      target, entry lookup, forward, record) around a kernel that does nothing;
  (b) ``entry(x, y)``: the same pre-computed entry called directly, output preallocated;
  (c) (b) plus the output allocation the op makes (``torch.empty`` of the output's shape,
      dtype and device, all precomputed).

The layer's cost is (a) - (c); (a) - (b) also charges it the allocation. Both paths are measured:
in-tree kernels (the op's ``forward`` gets its entry with ``self.kernel``) and a target kernel
(``kernel(*inputs, *outputs)`` called by the base class). The goal is at most 3 us for
(a) - (c) on the 2-core CI machine.

    python benchmarks/host_overhead.py                 # writes benchmarks/results/host_overhead.*
    python benchmarks/host_overhead.py --rounds 10 --seconds 0 --no-write
    python benchmarks/host_overhead.py --profile       # cProfile of the cached op call
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import tileops.runtime  # noqa: F401
except ImportError:  # run from a checkout: the packages' sources
    for name in ("spec", "signature", "runtime"):
        sys.path.insert(0, str(ROOT / "packages" / name / "src"))

import torch  # noqa: E402

from _common import cpu_model, interleaved_us  # noqa: E402
from tileops.runtime import (  # noqa: E402
    CallSpec,
    Kernel,
    KernelInterface,
    Op,
    SpecSet,
    register_builder,
    register_target,
)

GOAL_US = 3.0
RESULTS = ROOT / "benchmarks" / "results"

SPEC = """
NopOp:
  family: bench
  status: implemented
  signature:
    forall: {B: Shape, N: Dim, T: "DType[float32 | float16 | bfloat16]"}
    inputs:
      x: {dtype: T, shape: "[*B, N]"}
    outputs:
      y: {dtype: T, shape: "[*B, N]"}
  roofline:
    flops: "prod(B) * N"
"""


class NopSpec(CallSpec, frozen=True):
    dtype: torch.dtype


class NopIface(KernelInterface):
    slot = "nop"
    call_spec = NopSpec


class NopKernel(Kernel, NopIface):
    devices = ("cpu",)
    general = True

    def __call__(self, x, y):
        pass


def nop_kernel(x, y):
    pass


def make_ops():
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.yaml"
        path.write_text(SPEC)
        specs = SpecSet.load(path)

    class NopOp(Op, specs=specs):
        kernel_types = {NopIface: (NopKernel,)}

        def forward(self, call, x, y):
            self.kernel(NopIface, NopSpec(call.device, x.dtype))(x, y)

    class NopTargetOp(Op, specs=specs, entry="NopOp"):
        pass

    register_target("bench-nop", None)
    register_builder("bench-nop", NopTargetOp, lambda op, call: nop_kernel)
    return NopOp(), NopTargetOp(target="bench-nop")


def measure(rounds: int, number: int, seconds: float) -> dict:
    op, top = make_ops()
    x = torch.ones(4, 8)
    op(x)
    top(x)  # warm: bind the target, build the entries
    assert op.serving_target == "tileops" and top.serving_target == "bench-nop"
    entry = op.kernel(NopIface, NopSpec(x.device, x.dtype))
    kernel = next(iter(top._target_kernels.values()))
    # (c) allocates the way the op does: empty_like of the input the output always matches in
    # shape and dtype (the signature knows; the input is contiguous), else empty of the shape
    # object the record holds
    call = op._point.check(x)
    shape, dtype, device = call.output_shapes[0], call.output_dtypes[0], call.device
    like = bool(getattr(op._point, "output_like", None)) and hasattr(Op, "_branch_allocator")
    alloc = "empty_like(x)" if like else "empty(shape, dtype=dtype, device=device)"
    g = {"op": op, "top": top, "x": x, "y": torch.empty_like(x), "entry": entry,
         "kernel": kernel, "empty": torch.empty, "empty_like": torch.empty_like,
         "shape": shape, "dtype": dtype, "device": device, "check": op._point.check,
         "call": call, "forward": op.forward, "NopSpec": NopSpec, "NopIface": NopIface,
          "kernels": top._target_kernels}
    stmts = {
        "in-tree (a) op(x)": "op(x)",
        "in-tree (b) entry(x, y)": "entry(x, y)",
        f"in-tree (c) entry(x, {alloc})": f"entry(x, {alloc})",
        "target (a) op(x)": "top(x)",
        "target (b) kernel(x, y)": "kernel(x, y)",
        f"target (c) kernel(x, {alloc})": f"kernel(x, {alloc})",
        "part: signature check": "check(x)",
        "part: in-tree forward (spec, lookup, entry call)": "forward(call, x, y)",
        # the key the op builds from what its check read (the record's s_x, d_x fields); the
        # fused call tries a one-entry memo of the last key first
        "part: target kernel lookup": "kernels.get((call.device, (call.d_x,), (call.s_x,)))",
    }
    timers = {k: timeit.Timer(s, globals=g) for k, s in stmts.items()}
    samples = interleaved_us(timers, number, rounds, seconds)
    best = {k: min(v) for k, v in samples.items()}
    median = {k: statistics.median(v) for k, v in samples.items()}
    out = {"best_us": best, "median_us": median, "rounds": len(next(iter(samples.values())))}
    for path in ("in-tree", "target"):
        a, b, c = (best[k] for k in best if k.startswith(path))
        out[f"{path} layer (a)-(c) us"] = a - c
        out[f"{path} layer+alloc (a)-(b) us"] = a - b
    return out


def profile(number: int) -> None:
    import cProfile
    import pstats

    op, _ = make_ops()
    x = torch.ones(4, 8)
    op(x)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(number):
        op(x)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def _loadavg() -> list[float] | None:
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


def report(res: dict, meta: dict) -> str:
    lines = ["| measurement | best us/call | median us/call |", "|---|---:|---:|"]
    for k, v in res["best_us"].items():
        lines.append(f"| {k} | {v:.3f} | {res['median_us'][k]:.3f} |")
    lines.append("")
    lines.append("| op layer cost | us/call | goal |")
    lines.append("|---|---:|---|")
    for path in ("in-tree", "target"):
        layer = res[f"{path} layer (a)-(c) us"]
        verdict = "met" if layer <= GOAL_US else "NOT met"
        lines.append(f"| {path}: (a) - (c) | {layer:.3f} | <= {GOAL_US} us: {verdict} |")
        lines.append(f"| {path}: (a) - (b), allocation included | "
                     f"{res[f'{path} layer+alloc (a)-(b) us']:.3f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds (best of N)")
    ap.add_argument("--number", type=int, default=2000, help="calls per round")
    ap.add_argument("--seconds", type=float, default=30.0,
                    help="spread the rounds over at least this long (the machine's speed "
                         "drifts over seconds when shared)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--profile", action="store_true", help="cProfile the cached op call")
    args = ap.parse_args(argv)
    if args.profile:
        profile(args.number * 10)
        return 0
    load_before = _loadavg()
    res = measure(args.rounds, args.number, args.seconds)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "rounds": res["rounds"],
        "seconds": args.seconds,
        "calls_per_round": args.number,
        "input": "float32[4, 8] on cpu",
        "goal_us": GOAL_US,
    }
    table = report(res, meta)
    print(f"{meta['date']}  python {meta['python']}  torch {meta['torch']}")
    print(f"{meta['cpu']} ({meta['cpu_count']} cores), load {meta['loadavg_before']}")
    print(table)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "host_overhead.json").write_text(
            json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
        md = [
            "# Host overhead of the op layer",
            "",
            f"Measured {meta['date']} with `python benchmarks/host_overhead.py`: Python "
            f"{meta['python']}, torch {meta['torch']}, {meta['cpu']} ({meta['cpu_count']} "
            f"cores; load average {meta['loadavg_before']} before, "
            f"{meta['loadavg_after']} after).",
            "",
            f"A cached call on {meta['input']}; the kernel does nothing. Per call, best of "
            f"{meta['rounds']} interleaved rounds of {meta['calls_per_round']} calls spread over "
            f"at least {meta['seconds']:g} s (the "
            "machine may be shared; the median shows how much). (a) the op call, (b) the same "
            "entry called directly with a preallocated output, (c) (b) plus the output "
            "allocation the op makes (here `torch.empty_like` of the input, since the "
            "signature proves the output has its shape and dtype). The layer's cost is "
            "(a) - (c); (a) - (b) also charges it the allocation. `in-tree`: the op's `forward` "
            "gets its entry with `self.kernel`; `target`: a target kernel called by the base "
            "class. The `part:` rows time pieces of (a) alone: the generated signature check, "
            "the in-tree `forward` (call spec, entry lookup, entry call) and the target "
            "kernel lookup.",
            "",
            table,
            "",
        ]
        (RESULTS / "host_overhead.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
