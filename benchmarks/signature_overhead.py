"""Host cost of the generated call check, against a hand-written check doing the same work.

    python benchmarks/signature_overhead.py [--number N] [--repeat R] [--seconds S] [--out DIR]

Every op call runs its signature's call check: unify the declared shapes and dtypes with the
actual tensors, check the refinements and build the ``SignatureCall`` record. This measures
that check at a cached construction point on CPU torch tensors, for an RMSNorm-like signature
(a Shape index, a list-valued param, an optional input; called with and without it) and a
GEMM signature (a type family folded at construction, a dtype index, three Dims).

Each generated check is paired with a hand-written function that does the same work: the same
reads, the same comparisons in the same order (each later input's device compared with the
first's, ``if w.device != dev``, and each input's exact type looked up among the library's tensor
types, whose shapes hold sizes by construction), and the same record (the point's ``record_type``, holding
what the check read) built with the same fields. The ratio generated / hand-written is what the
code generation costs.

"reads only" is the floor under both: reading ``.shape``, ``.dtype`` and ``.device`` of each
tensor, which any check must do (torch builds a new ``torch.Size`` per read).

Timing: ``timeit`` with ``number`` calls per repeat; the best of the repeats is kept (the least
disturbed by other processes). Every case's generated check, hand-written check and reads-only
floor take turns repeat by repeat, for at least ``repeat`` repeats spread over at least
``seconds`` (a shared machine's speed drifts over seconds; a sample per function in each
stretch lets each function's best come from an undisturbed one). Goal: at most 1.5 us per call
on a 2-core CI machine, and within 1.3x of hand-written.

Results: a table on stdout, and JSON + Markdown under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import tileops.signature  # noqa: F401
except ImportError:  # run from a checkout: use the packages' sources
    for _p in sorted((ROOT / "packages").glob("*/src")):
        if str(_p) not in sys.path:
            sys.path.insert(0, str(_p))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from _common import cpu_model, interleaved_us  # noqa: E402
from tileops.signature import SignatureCall, SignatureCallError, SignaturePlan  # noqa: E402
from tileops.spec import load_spec_text  # noqa: E402

GOAL_US = 1.5
GOAL_RATIO = 1.3

SPEC = """\
RMSNormFwdOp:
  family: norm
  status: spec-only
  signature:
    forall: {B: Shape, T: "DType[float16 | bfloat16 | float32]"}
    params:
      normalized_shape: {type: "list[int] | tuple[int, ...]"}
      eps: {type: "float | None", default: null}
    inputs:
      x: {dtype: T, shape: "[*B, *normalized_shape]"}
      weight: {dtype: T, shape: "[*normalized_shape]", optional: true}
    outputs:
      y: {dtype: T, shape: "[*B, *normalized_shape]"}
    shape_rules:
    - "len(normalized_shape) > 0"
  roofline:
    flops: "(4 if present(weight) else 3) * prod(B) * prod(normalized_shape)"

GemmFwdOp:
  family: gemm
  status: spec-only
  signature:
    types:
      Mat:
        params: {t: Bool, R: Dim, C: Dim}
        match: t
        cases:
        - {when: false, is: "[R, C]"}
        - {when: true, is: "[C, R]"}
    forall: {M: Dim, N: Dim, K: Dim, T: "DType[float16 | bfloat16]"}
    params:
      trans_a: {type: bool, default: false}
      trans_b: {type: bool, default: false}
    inputs:
      a: {dtype: T, shape: "Mat[trans_a, M, K]"}
      b: {dtype: T, shape: "Mat[trans_b, K, N]"}
    outputs:
      c: {dtype: T, shape: "[M, N]"}
  roofline:
    flops: "2 * M * N * K"
"""


class _Mismatch(ValueError):
    pass


class _StandIn:
    """Not a tensor: a tensor's dtype and device, and a shape of its own."""

    def __init__(self, shape: tuple, like: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = shape, like.dtype, like.device


def hand_rmsnorm(point, n: int):
    """RMSNorm at normalized_shape=[n]: what the generated check does, written by hand."""
    allowed = frozenset(getattr(torch, d) for d in ("float16", "bfloat16", "float32"))
    arrays = {Tensor}
    with_w, without_w = ((), False, ("y",)), ((), False, ("y",))
    R = point.record_type  # noqa: N806 - the generated code binds it the same way

    def check(x, weight=None):
        s_x = x.shape
        d_x = x.dtype
        if type(x) not in arrays:  # another object's shape is checked entry by entry
            raise _Mismatch
        if d_x not in allowed:
            raise _Mismatch
        if not s_x or s_x[-1] != n:
            raise _Mismatch
        if weight is None:
            # the record holds what was read; B and y's shape are derived on access
            return R(x.device, without_w, s_x, d_x, None, None)
        dev = x.device
        s_w = weight.shape
        d_w = weight.dtype
        if type(weight) not in arrays:
            raise _Mismatch
        if weight.device != dev:
            raise _Mismatch
        if d_w != d_x or s_w != (n,):
            raise _Mismatch
        return R(dev, with_w, s_x, d_x, s_w, d_w)

    return check


def hand_gemm(point):
    """GEMM at trans_a = trans_b = False, written by hand."""
    allowed = frozenset((torch.float16, torch.bfloat16))
    arrays = {Tensor}
    branch = ((), False, ("c",))
    R = point.record_type  # noqa: N806

    def check(a, b):
        s_a = a.shape
        d_a = a.dtype
        if type(a) not in arrays:
            raise _Mismatch
        dev = a.device
        if d_a not in allowed or len(s_a) != 2:
            raise _Mismatch
        k = s_a[1]
        s_b = b.shape
        d_b = b.dtype
        if type(b) not in arrays:
            raise _Mismatch
        if b.device != dev:
            raise _Mismatch
        if d_b != d_a or len(s_b) != 2:
            raise _Mismatch
        if s_b[0] != k:
            raise _Mismatch
        # M, N and c's shape are derived on access
        return R(dev, branch, s_a, d_a, s_b, d_b)

    return check


def cases():
    spec = load_spec_text(SPEC, "signature_overhead.py")
    rms = SignaturePlan("RMSNormFwdOp", spec.entries["RMSNormFwdOp"],
                        spec=spec).construct(normalized_shape=[4096], eps=1e-6)
    gemm = SignaturePlan("GemmFwdOp", spec.entries["GemmFwdOp"], spec=spec).construct()
    bf16 = torch.bfloat16
    x, w = torch.empty(2, 3, 4096, dtype=bf16), torch.empty(4096, dtype=bf16)
    a, b = torch.empty(128, 4096, dtype=bf16), torch.empty(4096, 512, dtype=bf16)
    hand_r, hand_g = hand_rmsnorm(rms, 4096), hand_gemm(gemm)
    return [
        ("RMSNorm (x, weight)", rms.check, hand_r, (x, w)),
        ("RMSNorm (x)", rms.check, hand_r, (x,)),
        ("GEMM (a, b)", gemm.check, hand_g, (a, b)),
    ]


def same_record(generated: SignatureCall, hand: SignatureCall) -> None:
    """The hand-written check builds the record the generated one builds."""
    assert type(generated) is type(hand)
    for f in ("point", "values", "input_shapes", "input_dtypes", "output_shapes",
              "output_dtypes", "device", "branch"):
        assert getattr(generated, f) == getattr(hand, f), f
    assert generated.indices == hand.indices and generated.traffic == hand.traffic


def reads_only_1(x):
    """The floor: the attribute reads any check of these tensors makes, and nothing else."""
    x.shape  # noqa: B018
    x.dtype  # noqa: B018
    x.device  # noqa: B018


def reads_only_2(a, b):
    a.shape  # noqa: B018
    a.dtype  # noqa: B018
    a.device  # noqa: B018
    b.shape  # noqa: B018
    b.dtype  # noqa: B018
    b.device  # noqa: B018


def _timer(fn, args) -> timeit.Timer:
    return timeit.Timer("check(*args)", globals={"check": fn, "args": args})


def measure(number: int, repeat: int, seconds: float) -> list[dict]:
    timers = {}
    checks = cases()
    for name, gen, hand, args in checks:
        record = gen(*args)
        same_record(record, hand(*args))
        # mismatching calls are rejected by both (the hand-written one is no shortcut): a
        # shape, the last input on another device, the first a stand-in holding a non-size
        bads = [tuple(torch.empty(3, 7, dtype=t.dtype) for t in args),
                (_StandIn((True, *args[0].shape[1:]), args[0]), *args[1:])]
        if len(args) > 1:
            bads.append((*args[:-1], args[-1].to("meta")))
        for bad in bads:
            for fn, exc in ((gen, SignatureCallError), (hand, _Mismatch)):
                try:
                    fn(*bad)
                except exc:
                    pass
                else:
                    raise AssertionError(f"{name}: a mismatching call passed")
        reads = reads_only_1 if len(args) == 1 else reads_only_2
        for kind, fn in (("generated", gen), ("hand", hand), ("reads", reads)):
            timers[(name, kind)] = _timer(fn, args)
            timers[(name, kind)].timeit(number // 10)  # warm up
    # every case and function takes turns round by round, the rounds spread over time
    samples = interleaved_us(timers, number, repeat, seconds)
    rows = []
    for name, gen, _, args in checks:
        g, h, f = (min(samples[(name, kind)]) for kind in ("generated", "hand", "reads"))
        rows.append({"case": name, "call": gen(*args).compact(), "generated_us": g,
                     "hand_written_us": h, "ratio": g / h, "attribute_reads_us": f,
                     "goal_us_met": g <= GOAL_US, "goal_ratio_met": g / h <= GOAL_RATIO,
                     "rounds": len(samples[(name, "generated")])})
    return rows


def logical_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def render(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        out.append([r["case"], f"{r['generated_us']:.2f}", f"{r['hand_written_us']:.2f}",
                    f"{r['ratio']:.2f}x", f"{r['attribute_reads_us']:.2f}",
                    "yes" if r["generated_us"] <= GOAL_US else "no",
                    "yes" if r["ratio"] <= GOAL_RATIO else "no"])
    return out


HEADER = ["call check", "generated (us)", "hand-written (us)", "ratio", "reads only (us)",
          f"<= {GOAL_US} us", f"<= {GOAL_RATIO}x"]


def print_table(rows: list[dict], meta: dict) -> None:
    title = (f"signature call check, best of {meta['repeat']} x {meta['number']} calls\n"
             f"{meta['cpu']}, {meta['cpus']} CPUs; goal <= {GOAL_US} us and <= {GOAL_RATIO}x")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(h), *(len(r[i]) for r in render(rows))) for i, h in enumerate(HEADER)]
        for line in [HEADER, *render(rows)]:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
        return
    table = Table(title=title)
    for i, h in enumerate(HEADER):
        table.add_column(h, justify="left" if i == 0 else "right")
    for line in render(rows):
        table.add_row(*line)
    console = Console()
    if not console.is_terminal:  # a pipe or a log: do not wrap the table at 80 columns
        console = Console(width=110)
    console.print(table)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Signature call-check overhead",
        "",
        f"Generated by `benchmarks/signature_overhead.py` on {meta['date']}.",
        "",
        f"- CPU: {meta['cpu']} ({meta['cpus']} logical CPUs)",
        f"- Python {meta['python']}, torch {meta['torch']}",
        f"- Timing: {meta['method']}",
        f"- Goal: at most {GOAL_US} us per call and at most {GOAL_RATIO}x the hand-written "
        "check",
        "",
        "| " + " | ".join([HEADER[0], "call", *HEADER[1:]]) + " |",
        "|" + "|".join(["---", "---"] + ["---:"] * (len(HEADER) - 1)) + "|",
    ]
    lines += ["| " + " | ".join([line[0], f"`{r['call']}`", *line[1:]]) + " |"
              for r, line in zip(rows, render(rows), strict=True)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=20_000, help="calls per repeat")
    ap.add_argument("--repeat", type=int, default=15, help="repeats at least; the best is kept")
    ap.add_argument("--seconds", type=float, default=30.0,
                    help="spread the repeats over at least this long (the machine's speed "
                         "drifts over seconds when shared)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpus": logical_cpus(),
        "number": args.number,
        "repeat": args.repeat,
        "goal": {"us_per_call": GOAL_US, "ratio_to_hand_written": GOAL_RATIO},
    }
    rows = measure(args.number, args.repeat, args.seconds)
    meta["repeat"] = rows[0]["rounds"]
    meta["method"] = (f"timeit, best of {meta['repeat']} repeats of {args.number} calls each "
                      f"spread over at least {args.seconds:g} s (every case's generated, "
                      "hand-written and reads-only functions taking turns repeat by repeat), "
                      "microseconds per call")
    print_table(rows, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "signature_overhead.json").write_text(
        json.dumps({**meta, "results": rows}, indent=2) + "\n")
    (args.out / "signature_overhead.md").write_text(markdown(rows, meta))
    print(f"wrote {args.out / 'signature_overhead.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
