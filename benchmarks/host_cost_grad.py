"""Host cost of autograd on a cached eager call: RMSNormFwdOp on 1 x 4096 bfloat16 with grad
off and with x and weight requiring grad, against ``F.rms_norm`` in the same loop with the
same grad settings.

    python benchmarks/host_cost_grad.py [--out DIR] [--before TREE] [--pairs N]
    python benchmarks/host_cost_grad.py --dry-run [...]     # CPU, reference target, short loops

Three settings (the rows), each for the op and for ``F.rms_norm(x, [4096], weight, 1e-6)``:

- grad off: nothing requires grad (grad mode on): the call as it was before autograd;
- grad on, forward: x and weight require grad, so the call records its autograd node (the
  output is dropped, and the graph with it);
- grad on, forward + backward: then ``torch.autograd.grad(y, (x, weight), dy)``.

Method (``benchmarks/host_cost_ops.py``'s): 200 calls between two synchronisations, best of 5
rounds, every function taking its turn in each round, after two warm-up calls each. Each tree
is measured in fresh processes (``--child``, which prints its figures as JSON), alternating:
this tree, then with ``--before`` the tree at ``TREE`` (a checkout whose ``packages/*/src``
hold the code to compare with, say the commit before autograd), ``--pairs`` times; a figure is
the best over its tree's processes. A host's speed moves 10-40% between processes
(``results/family_host_cost.txt``), hence the alternation and ``F.rms_norm`` beside every
figure.

Bars: grad off no slower than the ``--before`` tree's grad off (not judged without one); grad
on, forward, at most 5 us more than grad off. The forward + backward row has no bar.

Results: ``host_cost_grad-<device>.json`` and ``.md`` under ``--out``; the table is printed
last. The exit status is 1 when a bar judged is missed or the op failed a setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("grad off", "grad on, forward", "grad on, forward + backward")
FUNCTIONS = ("tileops", "F.rms_norm")
#: how much more than grad off the forward with grad on may cost, microseconds
GRAD_ON_BUDGET_US = 5.0


def tree_paths(tree: Path) -> list[str]:
    paths = [str(p) for p in sorted((tree / "packages").glob("*/src"))]
    if not paths:
        raise SystemExit(f"--before {tree}: no packages/*/src in it (a checkout of the "
                         f"repository is expected)")
    return paths


# --- one process: the figures of the tree on sys.path -----------------------------------------


def child(device: str, target: str | None, calls: int, rounds: int) -> dict[str, Any]:
    """Best microseconds per call of each (function, setting) with the TileOPs on sys.path; a
    setting the op refuses is its error instead (an op without autograd refuses grad)."""
    import torch
    import torch.nn.functional as F

    from tileops.ops import RMSNormFwdOp

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    x, w, dy = (torch.randn(shape, dtype=torch.bfloat16, device=dev, generator=gen)
                for shape in ((1, 4096), (4096,), (1, 4096)))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-6, **({"target": target} if target else {}))

    def rms(x, w):
        return F.rms_norm(x, [4096], w, 1e-6)

    fns = {}
    for name, fn in (("tileops", op), ("F.rms_norm", rms)):
        fns[name, SETTINGS[0]] = lambda fn=fn: fn(x, w)
        fns[name, SETTINGS[1]] = lambda fn=fn: fn(xg, wg)
        fns[name, SETTINGS[2]] = lambda fn=fn: torch.autograd.grad(fn(xg, wg), (xg, wg), dy)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    errors = {}
    for key, fn in fns.items():
        try:
            fn()
            fn()
        except Exception as exc:  # noqa: BLE001 - reported as the figure
            errors[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    best = {k: float("inf") for k in fns if k not in errors}
    for _ in range(rounds):
        for key in best:
            fn = fns[key]
            sync()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            best[key] = min(best[key], (time.perf_counter() - t) / calls * 1e6)
    out: dict[str, Any] = {n: {} for n in FUNCTIONS}
    for (name, setting), us in best.items():
        out[name][setting] = us
    for (name, setting), err in errors.items():
        out[name][setting] = err
    return out


# --- the run: processes of each tree, alternating ------------------------------------------------


def run_child(paths: list[str], own: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The figures of one fresh process with ``paths`` first on its PYTHONPATH (this tree's own
    ``own`` paths taken out of the inherited one)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and p not in own]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, *inherited]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--device", args.device,
           "--calls", str(args.calls), "--rounds", str(args.rounds)]
    if args.target:
        cmd += ["--target", args.target]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"host_cost_grad --child failed ({res.returncode}) with "
                         f"PYTHONPATH={env['PYTHONPATH']}:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def best_of(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per function and setting, the lowest figure over ``runs`` (an error where every run
    gave one)."""
    out: dict[str, dict[str, Any]] = {n: {} for n in FUNCTIONS}
    for name in FUNCTIONS:
        for setting in SETTINGS:
            vals = [r[name].get(setting) for r in runs]
            nums = [v for v in vals if isinstance(v, float)]
            out[name][setting] = min(nums) if nums else next(
                (v for v in vals if v is not None), "not measured")
    return out


def judge(now: dict[str, dict[str, Any]],
          before: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Per setting: the bar's text and whether it is met (None: not judged)."""
    ours = now["tileops"]
    off = ours[SETTINGS[0]]
    on = ours[SETTINGS[1]]
    bars: dict[str, dict[str, Any]] = {}
    prev = before["tileops"][SETTINGS[0]] if before else None
    bars[SETTINGS[0]] = {"bar": "≤ before", "meets": (
        None if not isinstance(prev, float) else isinstance(off, float) and off <= prev)}
    bars[SETTINGS[1]] = {"bar": f"≤ grad off + {GRAD_ON_BUDGET_US:g} µs", "meets": (
        isinstance(on, float) and isinstance(off, float) and on - off <= GRAD_ON_BUDGET_US)}
    bars[SETTINGS[2]] = {"bar": "-", "meets": None}
    return bars


def _us(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else "error"


def markdown(head: dict[str, Any], doc: dict[str, Any]) -> str:
    from _common import md_table, title

    now, before, bars = doc["now"], doc["before"], doc["bars"]
    lines = title(head, "RMSNormFwdOp host cost with autograd, 1 x 4096 bfloat16")
    lines += [f"Microseconds per cached eager call: {head['calls']} calls between "
              f"synchronisations, best of {head['rounds']} rounds (functions in turn), best "
              f"over {head['pairs']} fresh process{'es' if head['pairs'] > 1 else ''} per tree, "
              f"the trees alternating; target {head['target'] or 'by device'}"
              + (f"; before: {head['before']}" if head["before"] else "; no --before tree")
              + ".", ""]
    cols = ["setting", "tileops µs", "F.rms_norm µs", "tileops − F.rms_norm"]
    if before:
        cols += ["before: tileops µs", "before: F.rms_norm µs"]
    cols += ["bar", "meets"]
    body = []
    notes = []
    for s in SETTINGS:
        ours, theirs = now["tileops"][s], now["F.rms_norm"][s]
        diff = ours - theirs if isinstance(ours, float) and isinstance(theirs, float) else None
        line = [s, _us(ours), _us(theirs), f"{diff:+.2f}" if diff is not None else "-"]
        if before:
            line += [_us(before["tileops"][s]), _us(before["F.rms_norm"][s])]
        line += [bars[s]["bar"], {True: "yes", False: "NO", None: "-"}[bars[s]["meets"]]]
        body.append(line)
        for tree, figs in (("this tree", now), ("before", before or {})):
            for name, by in figs.items():
                if not isinstance(by[s], float):
                    notes.append(f"- {s}, {name} ({tree}): {by[s]}")
    lines += md_table(cols, body)
    per = [f"{_us(r['tileops'][SETTINGS[0]])}" for r in doc["processes"]["now"]]
    lines += ["", f"Grad off, tileops, per process of this tree: {', '.join(per)} µs."]
    if before:
        per = [f"{_us(r['tileops'][SETTINGS[0]])}" for r in doc["processes"]["before"]]
        lines.append(f"Grad off, tileops, per process of the before tree: {', '.join(per)} µs.")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--before", type=Path, default=None, metavar="TREE",
                    help="a checkout to compare the grad-off call with")
    ap.add_argument("--pairs", type=int, default=None,
                    help="processes per tree (default 3; 1 with --dry-run)")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    ap.add_argument("--target", default=None, help="the op's target (default: by device)")
    ap.add_argument("--calls", type=int, default=None, help="calls per round (default 200)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, the reference target, 20 calls, 2 rounds, one process a tree")
    ap.add_argument("--child", action="store_true",
                    help="measure the tree on sys.path once; print JSON (used by the run)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = args.device or "cpu"
        args.target = args.target or "reference"
        args.calls = args.calls or 20
        args.rounds = args.rounds or 2
        args.pairs = args.pairs or 1
    args.device = args.device or "cuda"
    args.calls = args.calls or 200
    args.rounds = args.rounds or 5
    args.pairs = args.pairs or 3
    if args.child:
        print(json.dumps(child(args.device, args.target, args.calls, args.rounds)))
        return 0
    import _common
    import train_norm  # this tree's sources on sys.path

    own = train_norm.PATHS
    before_paths = tree_paths(args.before.resolve()) if args.before else None
    runs: dict[str, list[dict[str, Any]]] = {"now": [], "before": []}
    for i in range(args.pairs):
        print(f"[{i + 1}/{args.pairs}] this tree" + (", then before" if before_paths else ""),
              file=sys.stderr, flush=True)
        runs["now"].append(run_child(own, own, args))
        if before_paths:
            runs["before"].append(run_child(before_paths, own, args))
    now = best_of(runs["now"])
    before = best_of(runs["before"]) if before_paths else None
    bars = judge(now, before)
    dev = _common.parse_device(args.device)
    head = _common.header("host_cost_grad", dev, target=args.target,
                             before=str(args.before) if args.before else None,
                             calls=args.calls, rounds=args.rounds, pairs=args.pairs)
    doc = {**head, "now": now, "before": before, "bars": bars, "processes": runs}
    _common.write_results(args.out, "host_cost_grad", dev, doc, markdown(head, doc))
    ours = now["tileops"]
    missed = any(b["meets"] is False for b in bars.values())
    return 1 if missed or any(not isinstance(ours[s], float) for s in SETTINGS) else 0


if __name__ == "__main__":
    sys.exit(main())
