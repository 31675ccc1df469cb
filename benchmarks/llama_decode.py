"""Greedy decoding of a Llama patched onto TileOPs over a paged KV cache, side by side with the
same model unpatched in eager mode (``generate``, Hugging Face's default cache) and unpatched
under torch.compile (``generate`` with its static cache, which compiles the decode step).

    python benchmarks/llama.py --decode [--out DIR] [--layers N] [--batch B] [--prompt P]
                                        [--new N] [--against ...]
    python benchmarks/llama.py --decode --prebuild [--workers N]   # build our kernels first
    python benchmarks/llama.py --decode --dry-run [...]            # CPU, reference target, tiny

- Model: ``llama.py``'s Llama-3-8B-shaped stack of ``--layers`` decoder layers (default 4),
  bfloat16, random weights from one seed, every contender the same; ``--dry-run``: its tiny
  float32 model on the CPU (the ops' reference target). No eos (``generation_config``'s
  ``eos_token_id`` set to None): every contender runs ``--new`` steps.
- Contenders: ``tileops`` (``apply_tileops_to_llama``, then
  :func:`~tileops.integrations.transformers.generate_paged`: pages of 64 tokens, each decode
  step the paged decode op, the steps after the first replayed as a CUDA graph on CUDA),
  ``tileops-eager-steps`` (the same without the graph: what the host costs), ``eager``
  (unpatched, ``generate(do_sample=False)``) and ``torch.compile`` (unpatched, ``generate``
  with ``cache_implementation="static"``: transformers compiles the step, mode
  reduce-overhead). Prompts: ``--batch`` (default 32) random prompts of ``--prompt`` tokens
  (default 2048); ``--new`` tokens (default 128).
- Timing: each contender runs the whole generation once (kernel builds, compiles, CUDA graph
  capture) and is timed on the second run: the wall clock at each step's chosen tokens, the
  device synchronised (``generate``'s through a logits processor, ours through its
  ``on_step``). ``prefill s`` is the time to the first token; decode tokens/s is the steady
  rate, ``batch * (steps - 3)`` over the time from the third token to the last (the first two
  decode steps left out for every contender: ours runs the first eagerly and captures its
  graph in the second, torch.compile's may still settle in them). Peak memory:
  ``torch.cuda.max_memory_allocated`` over the timed run (the weights included, the same for
  every contender).
- Checks: each contender's tokens against eager's, the share of sequences equal throughout
  (``--dry-run``, float32: every one must be; in bfloat16 two implementations' roundings may
  tip a near tie of random weights' logits, so on the GPU it is reported, not required).
- Bar (tileops): decode tokens/s at least 1.3x eager's.

Results: ``llama_decode-<device>.json`` and ``.md`` under ``--out``; the table is printed last.
The exit status is 1 when the tileops contender failed (or, with ``--dry-run``, its tokens
differ from eager's).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import llama as train_bench
from _common import first_line, header, md_table, parse_device, prebuild, title, write_results

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("tileops", "tileops-eager-steps", "eager", "torch.compile")
SPEEDUP_BAR = 1.3
#: the tokens before the steady decode rate: the prefill's and the first decode step's
SETTLE = 2
#: the flags of the patch: the loss flags do nothing for a generation
FLAGS = ("rms_norm", "rope", "swiglu", "attention")


def prompts(config: Any, args: argparse.Namespace, dev: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed + 3)
    return torch.randint(0, config.vocab_size, (args.batch, args.prompt), generator=g).to(dev)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Clock:
    """The synchronised wall clock at each step's tokens; as a logits processor, ``generate``
    calls it at each step after the forward."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.stamps = dev, []

    def tick(self) -> None:
        sync(self.dev)
        self.stamps.append(time.perf_counter())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.tick()
        return scores


def generation(name: str, model: Any, ids: torch.Tensor, args: argparse.Namespace,
               clock: _Clock) -> tuple[torch.Tensor, str | None]:
    """One whole generation of contender ``name``: the new tokens and a note, if any."""
    if name.startswith("tileops"):
        from tileops.integrations.transformers import generate_paged

        held: list = []
        out = generate_paged(model, ids, args.new, graphs=name == "tileops",
                             on_step=clock.tick, cache_out=held)
        return out[:, ids.shape[1]:], held[0].graph_note
    from transformers import LogitsProcessorList

    extra = {"cache_implementation": "static"} if name == "torch.compile" else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                         do_sample=False,
                         logits_processor=LogitsProcessorList([clock]), **extra)
    return out[:, ids.shape[1]:], None


def run(name: str, config: Any, ids: torch.Tensor, args: argparse.Namespace,
        dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One contender: a warm-up generation, then the timed one."""
    cell: dict[str, Any] = {"error": None, "note": None}
    model = None
    try:
        model = train_bench.build(config, dev, dtype, args.seed).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        if name.startswith("tileops"):
            from tileops.integrations.transformers import apply_tileops_to_llama

            apply_tileops_to_llama(model, **{f: True for f in FLAGS},
                                   cross_entropy=False, fused_linear_cross_entropy=False)
        with torch.no_grad():
            generation(name, model, ids, args, _Clock(dev))
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            clock = _Clock(dev)
            sync(dev)
            start = time.perf_counter()
            tokens, note = generation(name, model, ids, args, clock)
        stamps = clock.stamps
        steps = len(stamps)
        steady = stamps[SETTLE:]
        cell.update(note=note, tokens=tokens.tolist(), steps=steps, prefill_s=stamps[0] - start,
                    decode_tokens_per_s=(args.batch * (len(steady) - 1)
                                         / (steady[-1] - steady[0])),
                    total_s=stamps[-1] - start,
                    peak_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                    else None)
    except ImportError as exc:
        cell["note"] = f"not run: {first_line(exc)}"
    except Exception as exc:  # noqa: BLE001 - one contender's failure is a cell of the table
        cell["error"] = first_line(exc)
    finally:
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return cell


def checks(cells: dict[str, dict[str, Any]]) -> None:
    """Each run cell's share of sequences whose tokens are eager's (in place)."""
    eager = cells.get("eager", {}).get("tokens")
    for cell in cells.values():
        if eager is not None and cell.get("tokens") is not None:
            same = sum(a == b for a, b in zip(cell["tokens"], eager, strict=True))
            cell["same_as_eager"] = same / len(eager)


def bars(cells: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    ours, eager = cells["tileops"], cells.get("eager", {})
    ok = bool(ours.get("decode_tokens_per_s")) and bool(eager.get("decode_tokens_per_s"))
    ratio = ours["decode_tokens_per_s"] / eager["decode_tokens_per_s"] if ok else None
    return {f"{SPEEDUP_BAR:g}x eager tokens/s": None if ratio is None else ratio >= SPEEDUP_BAR}


def markdown(head: dict[str, Any], cells: dict[str, dict[str, Any]],
             met: dict[str, bool | None]) -> str:
    eager = cells.get("eager", {}).get("decode_tokens_per_s")
    rows = []
    for name, c in cells.items():
        if c.get("decode_tokens_per_s") is None:
            rows.append([name, c["error"] or c["note"] or "-", *["-"] * 5])
            continue
        peak = "-" if c["peak_bytes"] is None else f"{c['peak_bytes'] / 2**30:.1f}"
        speed = "-" if eager is None else f"{c['decode_tokens_per_s'] / eager:.2f}x"
        same = "-" if "same_as_eager" not in c else f"{c['same_as_eager']:.0%}"
        rows.append([name, f"{c['prefill_s']:.3f}", f"{c['decode_tokens_per_s']:,.0f}", speed,
                     peak, same, c["note"] or ""])
    lines = title(head, "Llama greedy decode")
    lines += [f"{head['layers']} layers, hidden {head['hidden']}, batch {head['batch']} x "
              f"{head['prompt']}-token prompts, {head['new']} new tokens, {head['dtype']}; "
              f"{head['timing']}.", ""]
    lines += md_table(["contender", "prefill s", "decode tokens/s", "vs eager", "peak GiB",
                       "sequences = eager's", "note"], rows)
    lines += ["", "bars (tileops): " + ", ".join(
        f"{k} {'-' if v is None else ('✓' if v else '✗')}" for k, v in met.items()), ""]
    return "\n".join(lines)


def _prebuild_one(job: tuple[str, dict[str, Any]]) -> tuple[str, float, str]:
    """The kernels of one patch flag (and the paged decode op) at the run's shapes, in a
    process of its own: a one-layer model patched with that flag alone generates 3 tokens."""
    flag, options = job
    t = time.perf_counter()
    try:
        from tileops.integrations.transformers import apply_tileops_to_llama, generate_paged

        args = argparse.Namespace(**options)
        dev = torch.device(args.device)
        config = train_bench.llama_config(argparse.Namespace(**{**options, "layers": 1}))
        model = train_bench.build(config, dev, torch.bfloat16, 0).eval()
        with_rope = {flag, "rope"} if flag == "attention" else {flag}
        apply_tileops_to_llama(model, **{f: f in with_rope for f in FLAGS},
                               cross_entropy=False, fused_linear_cross_entropy=False)
        generate_paged(model, prompts(config, args, dev), 3, eos_token_id=None)
        sync(dev)
        return flag, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        return flag, time.perf_counter() - t, first_line(exc)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llama.py --decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--against", default=",".join(CONTENDERS[1:]),
                    help="contenders beside tileops, comma-separated "
                         "(default: tileops-eager-steps,eager,torch.compile)")
    ap.add_argument("--layers", type=int, default=None, help="default 4 (2 with --dry-run)")
    ap.add_argument("--batch", type=int, default=None, help="default 32 (2 with --dry-run)")
    ap.add_argument("--prompt", type=int, default=None,
                    help="tokens a prompt (default 2048; 37 with --dry-run)")
    ap.add_argument("--new", type=int, default=None,
                    help="new tokens (default 128; 6 with --dry-run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, the reference target, a tiny float32 model")
    ap.add_argument("--prebuild", action="store_true",
                    help="only build our kernels at the run's shapes, in --workers processes")
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args(argv)
    peers = [n.strip() for n in args.against.split(",") if n.strip()]
    bad = [n for n in peers if n not in CONTENDERS[1:]]
    if bad:
        ap.error(f"--against: unknown contender {bad[0]!r}; valid: {', '.join(CONTENDERS[1:])}")
    tiny = args.dry_run
    for name, full, small in (("layers", 4, 2), ("batch", 32, 2), ("prompt", 2048, 37),
                              ("new", 128, 6)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    if args.new < SETTLE + 2:
        ap.error(f"--new must be at least {SETTLE + 2} (two steady decode steps after the "
                 f"first {SETTLE} tokens), got {args.new}")
    dev = parse_device(args.device or ("cpu" if tiny else "cuda"))
    dtype = torch.float32 if tiny else torch.bfloat16
    # llama.py's config reads the sequence length its positions must cover
    shape = argparse.Namespace(dry_run=tiny, layers=args.layers, seq=args.prompt + args.new)
    if args.prebuild:
        options = {**vars(args), **vars(shape), "device": str(dev), "out": None}
        return prebuild([(f, options) for f in FLAGS], _prebuild_one, args.workers)
    config = train_bench.llama_config(shape)
    head = header("llama_decode", dev, layers=args.layers, hidden=config.hidden_size,
                  batch=args.batch, prompt=args.prompt, new=args.new,
                  dtype=str(dtype).removeprefix("torch."),
                  timing="wall clock at each step's tokens (synchronised), the second of two "
                         "runs; decode tokens/s = batch x (steps - 3) / (last - third token)")
    ids = prompts(config, args, dev)
    cells: dict[str, dict[str, Any]] = {}
    for name in ["eager", "tileops", *[p for p in peers if p != "eager"]]:
        if name == "eager" and "eager" not in peers:
            continue
        print(f"[{name}]", file=sys.stderr, flush=True)
        cells[name] = run(name, config, ids, args, dev, dtype)
    checks(cells)
    met = bars(cells)
    doc = {**head, "bars": met, "contenders": cells}
    write_results(args.out, "llama_decode", dev, doc, markdown(head, cells, met))
    ours = cells["tileops"]
    if ours.get("decode_tokens_per_s") is None:
        return 1
    return 1 if tiny and ours.get("same_as_eager", 1.0) < 1.0 else 0


if __name__ == "__main__":
    sys.exit(main())
