"""tileops.nn.parallel: the tensor-parallel layers on two ranks against one device, and the
errors a bad construction gets.

The two-rank run is a real one: torchrun starts _tp_worker.py twice on gloo (CPU, float32,
the ``reference`` target), which compares each layer's forward and backward with the same
torch.nn block on one device in float64 and exits non-zero on any mismatch; the example in
examples/ runs the same way. The error tests run in this process: without torch.distributed
initialised, and on a one-rank gloo group (an in-memory store, no network) where an argument
is wrong whatever the world size.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tileops.nn as tnn

ROOT = Path(__file__).resolve().parents[2]

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with the gloo backend", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: Path, *, gpus: bool = False) -> subprocess.CompletedProcess[str]:
    """Two ranks of ``script``: on the CPU (gloo; no GPU visible), or with ``gpus`` on this
    host's GPUs (NCCL, a GPU a rank)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600 if gpus else 120)


@pytest.mark.parametrize(("script", "cases"), [("tests/nn/_tp_worker.py", 11),
                                             ("tests/nn/_tp_attention_worker.py", 5),
                                             ("examples/tensor_parallel_mlp.py", None)])
def test_two_ranks_match_one_device(script: str, cases: int | None) -> None:
    result = _torchrun(ROOT / script)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} under torchrun exited {result.returncode}:\n{output}"
    if cases is not None:
        for rank in (0, 1):
            assert f"rank {rank} of 2: {cases} of {cases} cases match" in output, output


@pytest.mark.cuda2
@pytest.mark.parametrize("script", ["examples/tensor_parallel_mlp.py",
                                    "examples/expert_parallel_moe.py"])
def test_two_gpus_match_one_device(script: str) -> None:
    """The examples on two GPUs: NCCL, bfloat16, the in-tree kernels."""
    result = _torchrun(ROOT / script, gpus=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} on two GPUs exited {result.returncode}:\n{output}"
    for rank in (0, 1):
        assert f"rank {rank} of 2 (cuda:{rank}, torch.bfloat16)" in output, output


NOT_INITIALISED = ("{}: torch.distributed is not initialised; expected "
                   "torch.distributed.init_process_group() to have been called (torchrun sets up "
                   "its environment) before the layer is built")


@pytest.mark.parametrize(("name", "build"), [
    ("ColumnParallelLinear", lambda: tnn.ColumnParallelLinear(4, 6)),
    ("RowParallelLinear", lambda: tnn.RowParallelLinear(4, 6)),
    ("TensorParallelMLP", lambda: tnn.TensorParallelMLP(4, 6)),
    ("ColumnParallelLinear", lambda: tnn.ColumnParallelLinear.from_linear(nn.Linear(4, 6))),
    ("RowParallelLinear", lambda: tnn.RowParallelLinear.from_linear(nn.Linear(4, 6))),
    ("TensorParallelMLP", lambda: tnn.TensorParallelMLP.from_mlp(
        nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4))),
    ("TensorParallelAttention", lambda: tnn.TensorParallelAttention(8, 2)),
])
def test_refused_without_torch_distributed(name, build) -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as info:
        build()
    assert str(info.value) == NOT_INITIALISED.format(name)


@pytest.fixture
def one_rank():
    """A one-rank gloo group on an in-memory store, destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("cls", [tnn.ColumnParallelLinear, tnn.RowParallelLinear])
def test_from_linear_refuses_what_is_not_a_linear(cls) -> None:
    with pytest.raises(TypeError) as info:
        cls.from_linear(nn.Conv1d(4, 6, 1))
    assert str(info.value) == (f"{cls.__name__}.from_linear: argument linear must be a "
                               f"torch.nn.Linear (the full, unsharded layer), seen Conv1d")


@pytest.mark.usefixtures("one_rank")
def test_load_full_refuses_another_shape() -> None:
    layer = tnn.RowParallelLinear(4, 6)
    with pytest.raises(ValueError) as info:
        layer.load_full(nn.Linear(4, 6, bias=False))
    assert str(info.value) == (
        "RowParallelLinear: argument linear does not match the layer; expected in_features=4, "
        "out_features=6, bias=True, seen in_features=4, out_features=6, bias=False")


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(("layers", "message"), [
    ((nn.Linear(4, 6), nn.Linear(4, 5), nn.Linear(6, 4)),
     "TensorParallelMLP.from_mlp: argument up does not match gate (4 -> 6); expected 4 -> 6, "
     "seen 4 -> 5"),
    ((nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)),
     "TensorParallelMLP.from_mlp: argument down does not match gate (4 -> 6); expected 6 -> 4, "
     "seen 6 -> 3"),
    ((nn.Linear(4, 6), nn.Linear(4, 6, bias=False), nn.Linear(6, 4)),
     "TensorParallelMLP.from_mlp: gate, up and down must all have a bias or all have none; "
     "seen gate True, up False, down True"),
])
def test_from_mlp_refuses_blocks_that_do_not_fit(layers, message) -> None:
    with pytest.raises(ValueError) as info:
        tnn.TensorParallelMLP.from_mlp(*layers)
    assert str(info.value) == message


@pytest.mark.usefixtures("one_rank")
def test_from_mlp_refuses_what_is_not_a_linear() -> None:
    with pytest.raises(TypeError) as info:
        tnn.TensorParallelMLP.from_mlp(nn.Linear(4, 6), nn.Identity(), nn.Linear(6, 4))
    assert str(info.value) == ("TensorParallelMLP.from_mlp: argument up must be a "
                               "torch.nn.Linear (the full, unsharded layer), seen Identity")


@pytest.mark.usefixtures("one_rank")
def test_shard_state_dict_and_init() -> None:
    """A shard's state_dict holds its own weight and bias; a fresh shard is drawn from the
    full torch.nn.Linear's init bound, 1/sqrt(in_features)."""
    torch.manual_seed(0)
    layer = tnn.ColumnParallelLinear(16, 6, gather_output=True)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == {
        "weight": (6, 16), "bias": (6,)}
    bound = 1 / 16 ** 0.5
    for p in (layer.weight, layer.bias):
        assert p.abs().max() <= bound and p.abs().max() > bound / 2
    full = nn.Linear(16, 6)
    layer.load_state_dict(full.state_dict())  # one rank: the shard is the whole layer
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), full(x))


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: tnn.TensorParallelAttention(32, 4, 3), ValueError,
     "TensorParallelAttention: argument num_heads is 4, not a multiple of num_kv_heads 3; "
     "expected each key/value head to serve the same number of query heads"),
    (lambda: tnn.TensorParallelAttention(30, 4), ValueError,
     "TensorParallelAttention: argument hidden is 30, not divisible by num_heads 4; give "
     "head_dim"),
    (lambda: tnn.TensorParallelAttention.from_linears(
        nn.Linear(8, 8), nn.Linear(8, 4), nn.Identity(), nn.Linear(8, 8, bias=False), 2, 1),
     TypeError, "TensorParallelAttention.from_linears: argument v must be a torch.nn.Linear "
                "(the full, unsharded layer), seen Identity"),
    (lambda: tnn.TensorParallelAttention.from_linears(
        nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 8), nn.Linear(8, 8, bias=False), 2, 1),
     ValueError, "TensorParallelAttention.from_linears: argument v does not match q (8 -> 2 "
                 "heads of 4); expected 8 -> 4, seen 8 -> 8"),
    (lambda: tnn.TensorParallelAttention.from_linears(
        nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 8), 2, 1),
     ValueError, "TensorParallelAttention.from_linears: argument o has a bias; Llama's o_proj "
                 "has none, and this block adds none"),
    (lambda: tnn.TensorParallelAttention.from_linears(
        nn.Linear(8, 8), nn.Linear(8, 4, bias=False), nn.Linear(8, 4),
        nn.Linear(8, 8, bias=False), 2, 1),
     ValueError, "TensorParallelAttention.from_linears: q, k and v must all have a bias or all "
                 "have none; seen q True, k False, v True"),
])
def test_attention_refuses_blocks_that_do_not_fit(build, error, message) -> None:
    with pytest.raises(error) as info:
        build()
    assert str(info.value) == message


@pytest.mark.usefixtures("one_rank")
def test_attention_on_one_rank_is_the_whole_block_and_its_names_are_llamas() -> None:
    torch.manual_seed(0)
    q, k, v = nn.Linear(16, 16, bias=False), nn.Linear(16, 8, bias=False), \
        nn.Linear(16, 8, bias=False)
    o = nn.Linear(16, 16, bias=False)
    block = tnn.TensorParallelAttention.from_linears(q, k, v, o, 4, 2, target="reference")
    assert set(block.state_dict()) == {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                       "o_proj.weight"}
    assert (block.local_heads, block.local_kv_heads, block.head_dim) == (4, 2, 4)
    x = torch.randn(1, 3, 16)
    assert block(x).shape == (1, 3, 16)
