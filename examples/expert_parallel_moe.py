"""A mixture-of-experts layer's experts split over two ranks with
tileops.nn.ExpertParallelMoE, checked against the same layer on one device.

    torchrun --nproc-per-node 2 examples/expert_parallel_moe.py

(or ``python -m torch.distributed.run --nproc-per-node 2 examples/expert_parallel_moe.py``).
With CUDA and a GPU for each rank it runs on NCCL in bfloat16 through the in-tree kernels;
otherwise on gloo on the CPU in float32, through the ``reference`` target. Every rank builds
the full layer (Mixtral's routing, 8 experts, top-2) and the whole batch from one seed, takes
its four experts with ``ExpertParallelMoE.from_moe`` and its own half of the tokens, runs one
forward and backward, and compares its output, its input gradient and its experts' gradients
with the full layer's on the whole batch. Exits non-zero where they differ.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import tileops.nn as tnn
from tileops.nn.expert_parallel import ExpertParallelMoE

HIDDEN, INTERMEDIATE, EXPERTS, TOKENS = 256, 512, 8, 64  # TOKENS a rank's


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if on_gpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    dtype, tol = (torch.bfloat16, 3e-2) if on_gpu else (torch.float32, 1e-5)
    target = None if on_gpu else "reference"
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)  # the same full layer and batch on every rank
        full = tnn.MoE.mixtral(HIDDEN, INTERMEDIATE, EXPERTS, device=device, dtype=dtype,
                               target=target)
        x_all = torch.randn(world * TOKENS, HIDDEN, device=device, dtype=dtype)
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)

        layer = ExpertParallelMoE.from_moe(full)
        x = x_all[mine].clone().requires_grad_()
        y = layer(x)
        y.float().square().sum().backward()

        x1 = x_all.clone().requires_grad_()  # the whole batch through the full layer
        y1 = full(x1)
        y1.float().square().sum().backward()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()

        part = slice(layer.expert_offset, layer.expert_offset + layer.num_local_experts)
        errors = {"output": rel(y, y1[mine]), "input gradient": rel(x.grad, x1.grad[mine]),
                  "w13 gradient": rel(layer.w13.grad, full.w13.grad[part]),
                  "w2 gradient": rel(layer.w2.grad, full.w2.grad[part])}
        print(f"rank {rank} of {dist.get_world_size()} ({device}, {dtype}, experts "
              f"{part.start}-{part.stop - 1}): "
              + ", ".join(f"{k} rel. error {v:.1e}" for k, v in errors.items()), flush=True)
        dist.barrier()
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
