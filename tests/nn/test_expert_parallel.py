"""tileops.nn.expert_parallel: ExpertParallelMoE on two ranks against the one-device
tileops.nn.MoE, and the errors a bad construction gets.

The two-rank run is a real one: torchrun starts _ep_worker.py twice on gloo (CPU, float64, the
``reference`` target), which compares the sharded layer's forward and backward with the full
layer's and exits non-zero on any mismatch; the example in examples/ runs the same way. The
other tests run in this process: without torch.distributed initialised, and on a one-rank gloo
group (an in-memory store, no network), where the layer holds every expert and is the one-device
layer exactly.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tileops.nn import MoE
from tileops.nn.expert_parallel import ExpertParallelMoE
from tileops.ops.moe import MaskedLayoutSpec
from tileops.signature import ConstructionError

ROOT = Path(__file__).resolve().parents[2]

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with the gloo backend", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("script", "cases"), [("tests/nn/_ep_worker.py", 6),
                                             ("examples/expert_parallel_moe.py", None)])
def test_two_ranks_match_one_device(script: str, cases: int | None) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(ROOT / script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} under torchrun exited {result.returncode}:\n{output}"
    if cases is not None:
        for rank in (0, 1):
            assert f"rank {rank} of 2: {cases} of {cases} cases match" in output, output


def test_refused_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    for build in (lambda: ExpertParallelMoE(8, 4, 4, 2),
                  lambda: ExpertParallelMoE.from_moe(MoE(8, 4, 4, 2))):
        with pytest.raises(RuntimeError) as info:
            build()
        assert str(info.value) == (
            "ExpertParallelMoE: torch.distributed is not initialised; expected "
            "torch.distributed.init_process_group() to have been called (torchrun sets up its "
            "environment) before the layer is built")


def test_from_moe_refuses_what_is_not_a_moe() -> None:
    with pytest.raises(TypeError) as info:
        ExpertParallelMoE.from_moe(nn.Linear(4, 4))
    assert str(info.value) == ("ExpertParallelMoE.from_moe: argument moe must be a "
                               "tileops.nn.MoE (the full, unsharded layer), seen Linear")


@pytest.fixture
def one_rank():
    """A one-rank gloo group on an in-memory store, destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("layout", [None, MaskedLayoutSpec(3)])
def test_one_rank_is_the_one_device_layer(layout) -> None:
    torch.manual_seed(5)
    full = MoE.deepseek_v3(hidden_size=8, intermediate_size=4, num_experts=8, top_k=2,
                           num_groups=4, topk_groups=2, layout=layout, dtype=torch.float64)
    with torch.no_grad():
        full.e_score_correction_bias.copy_(torch.randn(8) / 10)
    layer = ExpertParallelMoE.from_moe(full)
    assert (layer.num_local_experts, layer.expert_offset, layer.layout) == (8, 0, full.layout)
    assert sorted(layer.state_dict()) == ["e_score_correction_bias", "gate.weight", "w13", "w2"]
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), full(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-14)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    for a, b in [(xa.grad, xb.grad), (layer.w13.grad, full.w13.grad),
                 (layer.w2.grad, full.w2.grad), (layer.gate.weight.grad, full.gate.weight.grad)]:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    with torch.no_grad():  # inference runs the same stages
        torch.testing.assert_close(layer(x), full(x), rtol=1e-12, atol=1e-14)


@pytest.mark.usefixtures("one_rank")
def test_a_bad_routing_is_refused_where_the_layer_is_made() -> None:
    """By the construction check of the composite a one-device MoE of the config holds."""
    with pytest.raises(ConstructionError) as info:
        ExpertParallelMoE(8, 4, 4, 5)
    assert str(info.value).splitlines()[:4] == [
        "FusedMoeFwdOp: construction param top_k, num_experts does not match the signature",
        "  expected: 1 <= top_k <= num_experts",
        "  seen:     top_k = 5, num_experts = 4",
        "  because:  refinement '1 <= top_k <= num_experts' does not hold"]


@pytest.mark.usefixtures("one_rank")
def test_the_shard_pickles_without_its_stage_ops() -> None:
    layer = ExpertParallelMoE(8, 4, 4, 2, dtype=torch.float64)
    layer(torch.randn(3, 8, dtype=torch.float64))
    restored = copy.deepcopy(layer)
    assert "_stages" not in restored.__dict__ and "_dispatch" not in restored.__dict__
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(restored(x), layer(x), rtol=0, atol=0)
    assert repr(layer).startswith("ExpertParallelMoE(\n  hidden_size=8, intermediate_size=4, "
                                  "num_experts=4, top_k=2, experts [0, 4) of 1 ranks")
