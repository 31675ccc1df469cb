"""A Llama MLP split over two ranks with tileops.nn's tensor-parallel layers, checked against the
same block on one device.

    torchrun --nproc-per-node 2 examples/tensor_parallel_mlp.py

(or ``python -m torch.distributed.run --nproc-per-node 2 examples/tensor_parallel_mlp.py``).
With CUDA and a GPU for each rank it runs on NCCL in bfloat16 through the in-tree kernels;
otherwise on gloo on the CPU in float32, through the ``reference`` target. Every rank builds the
full block from one seed, takes its shard with ``TensorParallelMLP.from_mlp``, runs one forward
and backward, and compares the output and the input gradient with the unsharded block's.
Exits non-zero where they differ.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import tileops.nn as tnn

HIDDEN, INTERMEDIATE, TOKENS = 256, 688, 64


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if on_gpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    dtype, tol = (torch.bfloat16, 2e-2) if on_gpu else (torch.float32, 1e-5)
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)  # the same full block and input on every rank
        gate, up = nn.Linear(HIDDEN, INTERMEDIATE, bias=False), nn.Linear(HIDDEN, INTERMEDIATE,
                                                                          bias=False)
        down = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        for layer in (gate, up, down):
            layer.to(device, dtype)
        x = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype)

        mlp = tnn.TensorParallelMLP.from_mlp(gate, up, down)
        xs = x.clone().requires_grad_()
        y = mlp(xs)
        y.float().square().sum().backward()

        x1 = x.clone().requires_grad_()  # the same block on this rank alone, in torch
        y1 = down(nn.functional.silu(gate(x1)) * up(x1))
        y1.float().square().sum().backward()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a.float() - b.float()).norm() / b.float().norm()).item()

        errors = {"output": rel(y, y1), "input gradient": rel(xs.grad, x1.grad)}
        print(f"rank {rank} of {dist.get_world_size()} ({device}, {dtype}): "
              + ", ".join(f"{k} rel. error {v:.1e}" for k, v in errors.items()), flush=True)
        return 0 if all(v <= tol for v in errors.values()) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # leave without the interpreter's teardown, where a C++ thread torch.distributed left
    # joinable (gloo's) can abort a rank after the run ("terminate called without an active
    # exception"); the output is flushed first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
