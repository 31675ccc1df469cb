"""A Llama training step patched onto TileOPs, side by side with the same model unpatched in
eager mode, unpatched under torch.compile and patched by Liger-Kernel.

    python benchmarks/llama.py [--out DIR] [--layers N] [--batch B] [--seq S] [--against ...]
    python benchmarks/llama.py --prebuild [--workers N]     # build our kernels first
    python benchmarks/llama.py --dry-run [...]              # CPU, reference target, tiny
    python benchmarks/llama.py --decode [...]               # greedy decode (llama_decode.py)
    python benchmarks/llama.py --profile tileops,eager      # a step's device time by kernel

- Model: a Llama-3-8B-shaped stack (hidden 4096, 32 query heads over 8 key/value heads of 128,
  MLP 14336, vocab 128256, rope_theta 500000 with Llama 3.1's rope scaling, untied head) of
  ``--layers`` decoder layers (default 4), bfloat16, random weights from one seed: every
  contender starts from the same weights. ``--dry-run``: hidden 64, 2 layers, 4:2 heads,
  vocab 128, float32 on the CPU (the ops' reference target).
- Contenders: ``tileops`` (``apply_tileops_to_llama`` with every flag and
  ``fused_linear_cross_entropy``), ``eager`` (unpatched, transformers' default sdpa
  attention), ``torch.compile`` (unpatched, ``torch.compile(model)``; its first steps
  compile), ``liger`` (``apply_liger_kernel_to_llama``: rope, rms_norm, swiglu and
  fused_linear_cross_entropy; left out with a note where Liger-Kernel is not installed) and
  ``tileops+compile`` (the tileops patch, then ``torch.compile``: our ops as whole nodes of
  the graph, the rest fused by inductor); on request (``--against``) ``tileops-sdpa`` (the
  tileops patch with ``attention=False``: transformers' sdpa attention, cuDNN's on an H200).
- A step: ``model(input_ids, labels=input_ids, use_cache=False).loss``, backward,
  ``AdamW.step()`` (fused on CUDA), ``zero_grad``; ``--steps`` of them (default 30) on the
  same synthetic tokens for every contender (each row counts by 3 from a random start, which
  a model can learn). Timing:
  wall clock of each step, the device synchronised after it; the median of the steps after
  ``--warmup`` (default 5). Peak memory: ``torch.cuda.max_memory_allocated`` over those steps
  (weights, gradients and AdamW's state included: the same for every contender).
- Checks: the loss after the last step within 1% of eager's; the logits of one evaluation
  batch (``--eval-seq`` tokens, before the first step) against a float32 copy of the
  unpatched model holding the same weights: a contender's largest error, relative to the
  largest logit, at most twice eager's bfloat16 error (plus 1e-3).
- Bars (tileops): a step at least 1.15x faster than eager's and faster than torch.compile's,
  a lower peak than both, and both checks met.

Results: ``llama-<device>.json`` and ``.md`` under ``--out``; the table is printed last. The
exit status is 1 when the tileops contender failed or missed a check.

``--profile NAMES`` runs no contest: for each named contender, three steps and then two under
``torch.profiler``, the device time of a step by kernel (grouped by name, grid and block: the
in-tree programs share TileLang's kernel names, their launch shapes tell them apart), to
``llama_profile-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
for _p in reversed(PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from _common import (  # noqa: E402
    first_line,
    header,
    md_table,
    parse_device,
    prebuild,
    title,
    write_results,
)

CONTENDERS = ("tileops", "eager", "torch.compile", "liger", "tileops+compile", "tileops-sdpa")
#: the contenders beside tileops a run takes unless --against names others
DEFAULT_AGAINST = ("eager", "torch.compile", "liger", "tileops+compile")
SPEEDUP_BAR = 1.15
LOSS_BAR = 0.01
FLAGS = ("rms_norm", "rope", "swiglu", "attention", "cross_entropy",
         "fused_linear_cross_entropy")


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    if args.dry_run:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                           max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=max(8192, args.seq), rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False)


def build(config: Any, dev: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """The model of ``config`` on ``dev`` in ``dtype``, its weights drawn from ``seed``.

    Made in ``dtype`` as ``from_pretrained(dtype=...)`` makes a model, not cast afterwards:
    ``model.to(torch.bfloat16)`` would round the rotary module's ``inv_freq`` buffer to
    bfloat16 too, and the unpatched model (and the float32 copy the logits are checked against)
    would rotate by angles off by up to ``position * 2^-9`` radians (4 at position 2047).
    Each model holds its own copy of ``config``: a patch sets its model's attention
    implementation in the config, which would reach every model built after it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    return model.train()


def prepare(name: str, model: Any, args: argparse.Namespace) -> Any:
    """The callable a contender trains (the model, patched or compiled), or raises."""
    if name in ("tileops", "tileops+compile", "tileops-sdpa"):
        from tileops.integrations.transformers import apply_tileops_to_llama

        apply_tileops_to_llama(model, fused_linear_cross_entropy=True,
                               attention=name != "tileops-sdpa")
        if name != "tileops+compile":
            return model
        return torch.compile(model, backend=args.compile_backend)
    if name == "eager":
        return model
    if name == "torch.compile":
        return torch.compile(model, backend=args.compile_backend)
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(model=model, rope=True, rms_norm=True, swiglu=True,
                                cross_entropy=False, fused_linear_cross_entropy=True)
    return model


def batches(config: Any, args: argparse.Namespace, dev: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed + 1)
    start = torch.randint(0, config.vocab_size, (args.steps, args.batch, 1), generator=g)
    ids = (start + 3 * torch.arange(args.seq)) % config.vocab_size
    return [b.to(dev) for b in ids]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def train(name: str, config: Any, data: list[torch.Tensor], args: argparse.Namespace,
          dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One contender's run: its loss curve, step times and peak memory."""
    cell: dict[str, Any] = {"error": None, "note": None}
    model = fn = opt = None
    try:
        model = build(config, dev, dtype, args.seed)
        fn = prepare(name, model, args)
        cell["logits_err"] = eval_error(model, fn, config, args, dev, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                fused=dev.type == "cuda" or None)
        losses, times = [], []
        for i, ids in enumerate(data):
            if i == args.warmup and dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            sync(dev)
            t = time.perf_counter()
            loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(dev)
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
        cell.update(losses=losses, step_times_s=times,
                    step_s=statistics.median(times[args.warmup:]),
                    peak_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                    else None)
    except ImportError as exc:
        cell["note"] = f"not run: {first_line(exc)}"
    except Exception as exc:  # noqa: BLE001 - one contender's failure is a cell of the table
        cell["error"] = first_line(exc)
    finally:
        del model, fn, opt
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return cell


def profile(name: str, config: Any, data: list[torch.Tensor], args: argparse.Namespace,
            dev: torch.device, dtype: torch.dtype, top: int = 30) -> list[dict[str, Any]]:
    """Where one contender's step spends the device's time: three steps, then two under
    ``torch.profiler``, its kernels grouped by name, grid and block (the in-tree programs all
    carry TileLang's kernel name; their grids and blocks tell them apart), the ``top``
    largest as ``{kernel, grid, block, ms (a step), calls (a step)}``."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model = build(config, dev, dtype, args.seed)
    fn = prepare(name, model, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=dev.type == "cuda" or None)
    cuda = dev.type == "cuda"  # on the CPU (--dry-run) the torch ops stand in for kernels

    def step(ids: torch.Tensor, fn: Any, opt: Any) -> None:
        fn(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for ids in data[:3]:
        step(ids, fn, opt)
    sync(dev)
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) \
            as prof:
        for ids in data[3:5]:
            step(ids, fn, opt)
        sync(dev)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    groups: dict[tuple, list[float]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != ("kernel" if cuda else "cpu_op"):
            continue
        a = ev.get("args", {})
        key = (ev["name"], str(a.get("grid")), str(a.get("block")))
        groups.setdefault(key, []).append(float(ev.get("dur", 0.0)))
    rows = [{"kernel": k[0], "grid": k[1], "block": k[2], "ms": sum(d) / 2e3,
             "calls": len(d) / 2} for k, d in groups.items()]
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return [{"kernel": "(all kernels)", "grid": "", "block": "", "ms": total,
             "calls": sum(r["calls"] for r in rows)}, *rows[:top]]


def profile_markdown(head: dict[str, Any], tables: dict[str, list[dict[str, Any]]]) -> str:
    lines = title(head, "Llama training step: device time by kernel")
    for name, rows in tables.items():
        lines += ["", f"## {name}", ""]
        lines += md_table(["kernel", "grid", "block", "ms a step", "calls a step"],
                          [[r["kernel"][:90], r["grid"], r["block"], f"{r['ms']:.2f}",
                            f"{r['calls']:g}"] for r in rows])
    return "\n".join(lines) + "\n"


def eval_batch(config: Any, args: argparse.Namespace, dev: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed + 2)
    return torch.randint(0, config.vocab_size, (1, args.eval_seq), generator=g).to(dev)


_reference: dict[str, torch.Tensor] = {}


def reference_logits(config: Any, args: argparse.Namespace, dev: torch.device,
                     dtype: torch.dtype) -> torch.Tensor:
    """The evaluation batch's logits from a float32 copy of the initial unpatched model."""
    if "logits" not in _reference:
        model = build(config, dev, dtype, args.seed)
        wide = copy.deepcopy(model).float().eval()
        del model
        with torch.no_grad():
            _reference["logits"] = wide(eval_batch(config, args, dev)).logits.float()
        del wide
        gc.collect()
    return _reference["logits"]


def eval_error(model: Any, fn: Any, config: Any, args: argparse.Namespace,
               dev: torch.device, dtype: torch.dtype) -> float:
    """The largest logit error of the contender (``fn``, over ``model`` at its initial
    weights) on the evaluation batch against :func:`reference_logits`, relative to the
    largest logit."""
    ref = reference_logits(config, args, dev, dtype)
    model.eval()
    with torch.no_grad():
        logits = fn(input_ids=eval_batch(config, args, dev)).logits.float()
    model.train()
    return ((logits - ref).abs().max() / ref.abs().max()).item()


def _prebuild_one(job: tuple[str, dict[str, Any]]) -> tuple[str, float, str]:
    """The kernels of one patch flag at the run's shapes, in a process of its own: a one-layer
    model patched with that flag alone runs a step of the decoder (or the loss alone), with
    and without gradients, so TileLang's disk cache holds what the run calls."""
    flag, options = job
    t = time.perf_counter()
    try:
        from tileops.integrations import _hf_loss
        from tileops.integrations.transformers import apply_tileops_to_llama

        args = argparse.Namespace(**options)
        dev = torch.device(args.device)
        config = llama_config(argparse.Namespace(**{**options, "layers": 1}))
        b, s, v, h = args.batch, args.seq, config.vocab_size, config.hidden_size
        labels = torch.randint(0, v, (b, s), device=dev)
        if flag == "cross_entropy":
            logits = torch.randn(b, s, v, device=dev, dtype=torch.bfloat16, requires_grad=True)
            _hf_loss.causal_lm_loss(logits, labels, v).backward()
        elif flag == "fused_linear_cross_entropy":
            hidden = torch.randn(b, s, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
            weight = torch.randn(v, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
            _hf_loss.fused_causal_lm_loss(hidden, weight / 64, labels).backward()
        else:
            model = build(config, dev, torch.bfloat16, 0)
            # the attention's layout is the rotary op's output's, as in the run
            with_rope = {flag, "rope"} if flag == "attention" else {flag}
            apply_tileops_to_llama(model, **{f: f in with_rope for f in FLAGS})
            hidden = model.model(labels, use_cache=False).last_hidden_state
            hidden.float().square().mean().backward()
            with torch.no_grad():
                model.model(labels[:1, :args.eval_seq])
        sync(dev)
        return flag, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        return flag, time.perf_counter() - t, first_line(exc)


def checks(cells: dict[str, dict[str, Any]]) -> None:
    """Each run cell's loss and logits checks against eager's (in place)."""
    eager = cells.get("eager", {})
    for cell in cells.values():
        if not cell.get("losses") or not eager.get("losses"):
            continue
        ref, got = eager["losses"][-1], cell["losses"][-1]
        cell["loss_rel"] = abs(got - ref) / abs(ref)
        cell["loss_ok"] = cell["loss_rel"] <= LOSS_BAR
        cell["logits_ok"] = cell["logits_err"] <= 2 * eager["logits_err"] + 1e-3


def bars(cells: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The tileops bars (None where the contender it is measured against did not run)."""
    ours = cells["tileops"]
    out: dict[str, bool | None] = {}
    for name, need in (("eager", SPEEDUP_BAR), ("torch.compile", 1.0)):
        other = cells.get(name, {})
        ok = "step_s" in ours and "step_s" in other
        out[f"{need:g}x {name}"] = other["step_s"] / ours["step_s"] >= need if ok else None
        if ours.get("peak_bytes") is not None and other.get("peak_bytes") is not None:
            out[f"peak < {name}"] = ours["peak_bytes"] < other["peak_bytes"]
    out["loss within 1%"] = ours.get("loss_ok")
    out["logits"] = ours.get("logits_ok")
    return out


def markdown(head: dict[str, Any], cells: dict[str, dict[str, Any]],
             met: dict[str, bool | None]) -> str:
    eager = cells.get("eager", {}).get("step_s")
    rows = []
    for name, c in cells.items():
        if "step_s" not in c:
            rows.append([name, c["error"] or c["note"] or "-", *["-"] * 6])
            continue
        peak = "-" if c["peak_bytes"] is None else f"{c['peak_bytes'] / 2**30:.1f}"
        speed = "-" if eager is None else f"{eager / c['step_s']:.2f}x"
        loss = f"{c['losses'][-1]:.4f}" + (f" ({c['loss_rel']:.2%})" if "loss_rel" in c else "")
        rows.append([name, f"{c['step_s'] * 1e3:.1f}", speed, peak, f"{c['losses'][0]:.4f}",
                     loss, f"{c['logits_err']:.2e}",
                     "ok" if c.get("loss_ok") and c.get("logits_ok") else
                     ("-" if "loss_ok" not in c else "✗")])
    lines = title(head, "Llama training step")
    lines += [f"{head['layers']} layers, hidden {head['hidden']}, {head['tokens']} tokens a "
              f"step ({head['batch']} x {head['seq']}), {head['dtype']}; {head['timing']}.", ""]
    lines += md_table(["contender", "step ms", "vs eager", "peak GiB", "first loss",
                       f"loss after {head['steps']} (vs eager)", "logits err", "checks"], rows)
    lines += ["", "bars (tileops): " + ", ".join(
        f"{k} {'-' if v is None else ('✓' if v else '✗')}" for k, v in met.items()), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--decode" in argv:  # the decode benchmark, its own options
        import llama_decode

        return llama_decode.main([a for a in argv if a != "--decode"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", action="store_true",
                    help="greedy decode over the paged KV cache instead (benchmarks/"
                         "llama_decode.py; its options: --decode -h)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--against", default=",".join(DEFAULT_AGAINST),
                    help="contenders beside tileops, comma-separated (default: "
                         f"{','.join(DEFAULT_AGAINST)}; also tileops-sdpa)")
    ap.add_argument("--layers", type=int, default=None, help="default 4 (2 with --dry-run)")
    ap.add_argument("--batch", type=int, default=None, help="default 8 (2 with --dry-run)")
    ap.add_argument("--seq", type=int, default=None, help="default 4096 (16 with --dry-run)")
    ap.add_argument("--eval-seq", type=int, default=None,
                    help="tokens of the logits check (default 2048; 16 with --dry-run)")
    ap.add_argument("--steps", type=int, default=None, help="default 30 (6 with --dry-run)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps left out of the timing (default 5; 2 with --dry-run)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, the reference target, a tiny float32 model, 6 steps")
    ap.add_argument("--prebuild", action="store_true",
                    help="only build our kernels at the run's shapes, in --workers processes")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--profile", default=None, metavar="NAMES",
                    help="instead of the run: the device time of a step by kernel for these "
                         "contenders (comma-separated), to llama_profile-<device>.md")
    args = ap.parse_args(argv)
    peers = [n.strip() for n in args.against.split(",") if n.strip()]
    bad = [n for n in peers if n not in CONTENDERS[1:]]
    if bad:
        ap.error(f"--against: unknown contender {bad[0]!r}; valid: {', '.join(CONTENDERS[1:])}")
    tiny = args.dry_run
    for name, full, small in (("layers", 4, 2), ("batch", 8, 2), ("seq", 4096, 16),
                              ("eval_seq", 2048, 16), ("steps", 30, 6), ("warmup", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    if args.warmup >= args.steps:
        ap.error(f"--warmup must be below --steps ({args.steps}), got {args.warmup}")
    dev = parse_device(args.device or ("cpu" if tiny else "cuda"))
    dtype = torch.float32 if tiny else torch.bfloat16
    if args.prebuild:
        options = {**vars(args), "device": str(dev), "out": None}
        return prebuild([(f, options) for f in FLAGS], _prebuild_one, args.workers)
    config = llama_config(args)
    head = header("llama", dev, layers=args.layers, hidden=config.hidden_size,
                  batch=args.batch, seq=args.seq, tokens=args.batch * args.seq,
                  steps=args.steps, dtype=str(dtype).removeprefix("torch."), lr=args.lr,
                  timing=f"wall clock of a step (synchronised), the median of steps "
                         f"{args.warmup + 1}-{args.steps}",
                  compile_backend=args.compile_backend)
    data = batches(config, args, dev)
    if args.profile:
        names = [n.strip() for n in args.profile.split(",") if n.strip()]
        unknown = [n for n in names if n not in CONTENDERS]
        if unknown:
            ap.error(f"--profile: unknown contender {unknown[0]!r}; valid: "
                     f"{', '.join(CONTENDERS)}")
        if len(data) < 5:
            ap.error(f"--profile needs --steps of 5 or more, got {args.steps}")
        tables = {}
        for n in names:
            tables[n] = profile(n, config, data, args, dev, dtype)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        write_results(args.out, "llama_profile", dev, {**head, "profiles": tables},
                      profile_markdown(head, tables))
        return 0
    cells: dict[str, dict[str, Any]] = {}
    for name in ["eager", "tileops", *[p for p in peers if p != "eager"]]:
        if name == "eager" and "eager" not in peers:
            continue
        print(f"[{name}]", file=sys.stderr, flush=True)
        cells[name] = train(name, config, data, args, dev, dtype)
    checks(cells)
    met = bars(cells)
    doc = {**head, "bars": met, "contenders": cells}
    write_results(args.out, "llama", dev, doc, markdown(head, cells, met))
    ours = cells["tileops"]
    return 0 if "step_s" in ours and ours.get("loss_ok", True) and \
        ours.get("logits_ok", True) and all(math.isfinite(x) for x in ours["losses"]) else 1


if __name__ == "__main__":
    sys.exit(main())
