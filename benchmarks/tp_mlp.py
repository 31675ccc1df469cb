"""The tensor-parallel SwiGLU MLP's training step on two GPUs against one, side by side with the
same block built from torch ops.

    torchrun --nproc-per-node 2 benchmarks/tp_mlp.py [--tokens 8192] [--out benchmarks/results]

One step is the forward and backward of ``(mlp(x) * g).sum()`` (no optimizer) for a Llama-3-8B
MLP (hidden 4096, intermediate 14336, bf16) at ``--tokens`` tokens, timed with CUDA events
(the median of 5 trials of ``--iters`` back-to-back steps, after a warm-up). Contenders:

- ``tileops``: ``tileops.nn.SwiGLUMLP`` on one GPU, then ``tileops.nn.TensorParallelMLP``
  (its shards on our GEMM and SwiGLU, torch.distributed's all-reduce) on both;
- ``torch``: the block as torch ops (``nn.Linear``, ``F.silu``) on one GPU, then the same
  module sharded by ``torch.distributed.tensor.parallel.parallelize_module`` (gate and up
  column-wise, down row-wise: DTensor's Megatron split) on both.

The one-GPU steps run on rank 0 while rank 1 waits at a barrier; the two-GPU step's time is the
slower rank's. Scaling efficiency is ``t(1 GPU) / (2 * t(2 GPUs))`` (1.0: the step halves).
Each contender's input gradient is compared with the one-GPU torch block's (the table's last
column; a mismatch past bf16's tolerance exits 1).
``--dry-run``: gloo on the CPU, float32, a tiny MLP through the ``reference`` target and
wall-clock timing (what CI runs, to prove the wiring). Rank 0 writes ``tp_mlp-<device>.json``
and ``.md`` under ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--dry-run", action="store_true",
                   help="gloo on the CPU, float32, a tiny MLP, the reference target")
    args = p.parse_args(argv)
    if args.dry_run:
        args.hidden, args.intermediate, args.tokens, args.iters = 64, 176, 48, 2
    for name in ("hidden", "intermediate", "tokens", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive, seen {getattr(args, name)}")
    return args


def _torch_mlp(hidden: int, intermediate: int) -> Any:
    import torch
    from torch import nn

    class TorchMLP(nn.Module):
        """Llama's MLP as torch ops: ``down(silu(gate(x)) * up(x))``."""

        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
            self.up_proj = nn.Linear(hidden, intermediate, bias=False)
            self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    return TorchMLP()


def _step(module: Any, x: Any, g: Any) -> Callable[[], Any]:
    def step() -> Any:
        xs = x.detach().requires_grad_()
        (module(xs) * g).sum().backward()
        return xs.grad

    return step


def _time_ms(fn: Callable[[], Any], iters: int, cuda: bool) -> float:
    for _ in range(2):
        fn()
    if cuda:
        return _common.events(fn, iters)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(times)


def _rel(a: Any, b: Any) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import tileops.nn as tnn

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = not args.dry_run
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < world:
            print(f"tp_mlp: needs a CUDA GPU per rank ({world}), seen "
                  f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; "
                  f"--dry-run runs on the CPU", file=sys.stderr)
            return 2
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype, tol = (torch.bfloat16, 2e-2) if cuda else (torch.float32, 1e-5)
    target = None if cuda else "reference"
    try:
        if args.intermediate % world:
            raise SystemExit(f"tp_mlp: --intermediate {args.intermediate} is not divisible by "
                             f"the world size {world}")
        torch.manual_seed(0)  # the same full block and input on every rank
        full = _torch_mlp(args.hidden, args.intermediate).to(dev, dtype)
        x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)
        g = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)
        want = _step(full, x, g)()
        contenders: dict[str, tuple[int, Any]] = {
            "tileops": (1, tnn.SwiGLUMLP.from_mlp(full, target=target)),
            "torch": (1, copy.deepcopy(full)),
            "tileops TP": (world, tnn.TensorParallelMLP.from_mlp(
                full.gate_proj, full.up_proj, full.down_proj, target=target)),
        }
        mesh = init_device_mesh(dev.type, (world,))
        contenders["torch TP (DTensor)"] = (world, parallelize_module(
            copy.deepcopy(full), mesh, {"gate_proj": ColwiseParallel(),
                                        "up_proj": ColwiseParallel(),
                                        "down_proj": RowwiseParallel()}))
        rows = []
        for name, (ranks, module) in contenders.items():
            dist.barrier()
            ms, err = 0.0, 0.0
            if ranks == world or rank == 0:
                step = _step(module, x, g)
                err = _rel(step(), want)
                ms = _time_ms(step, args.iters, cuda)
            # the slower rank's time and the larger error (no rank leaves the loop early: a
            # collective would wait for it)
            worst = torch.tensor([ms, err], device=dev, dtype=torch.float64)
            if ranks == world:
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            rows.append((name, ranks, worst[0].item(), worst[1].item()))
        dist.barrier()
        bad = [f"{name}: input gradient {err:.2e} from the one-device torch block's (allowed "
               f"{tol:g})" for name, _, _, err in rows if not err <= tol]
        if rank == 0:
            _report(args, dev, world, rows)
            for line in bad:
                print(f"tp_mlp: MISMATCH {line}", flush=True)
        return 1 if bad else 0
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _report(args: argparse.Namespace, dev: Any, world: int,
            rows: list[tuple[str, int, float, float]]) -> None:
    # three GEMMs of 2 * tokens * hidden * intermediate flops forward, twice that backward
    flops = 3 * 3 * 2 * args.tokens * args.hidden * args.intermediate
    one = {name: ms for name, ranks, ms, _ in rows if ranks == 1}
    cells = []
    for name, ranks, ms, err in rows:
        base = one.get(name.split(" ")[0])
        eff = base / (ranks * ms) if ranks > 1 and base else None
        cells.append({"contender": name, "gpus": ranks, "step_ms": ms,
                      "tflops_per_gpu": flops / ranks / (ms * 1e-3) / 1e12,
                      "scaling_efficiency": eff, "input_grad_rel_err": err})
    head = _common.header("tp_mlp", dev, world=world, hidden=args.hidden,
                          intermediate=args.intermediate, tokens=args.tokens,
                          dtype="float32" if args.dry_run else "bfloat16")
    table = _common.md_table(
        ["contender", "GPUs" if dev.type == "cuda" else "ranks", "step ms", "TFLOP/s a rank",
         "scaling efficiency", "input grad rel. error"],
        [[c["contender"], str(c["gpus"]), f"{c['step_ms']:.3f}", f"{c['tflops_per_gpu']:.1f}",
          "" if c["scaling_efficiency"] is None else f"{c['scaling_efficiency']:.2f}",
          f"{c['input_grad_rel_err']:.1e}"] for c in cells])
    markdown = "\n".join([*_common.title(head, "Tensor-parallel SwiGLU MLP, training step"),
                          "", f"hidden {args.hidden}, intermediate {args.intermediate}, "
                          f"{args.tokens} tokens; the step is forward + backward", "",
                          *table, ""])
    _common.write_results(args.out, "tp_mlp", dev, {**head, "contenders": cells}, markdown)


if __name__ == "__main__":
    code = main()
    # the interpreter's teardown after the process group is destroyed can abort a rank
    # ("terminate called without an active exception": a gloo thread of torch.distributed's,
    # about one run in ten on a loaded 2-core machine); the results are written by then, so
    # the process leaves without the teardown, its output flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
