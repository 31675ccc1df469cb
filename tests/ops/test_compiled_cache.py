"""A compiled training step whose compiled code comes from torch's on-disk caches: the second
process to compile the same step loads the forward and backward from the cache (the FX graph
and AOT autograd caches), so no traced backward built its ops there. Its backward must find
the backward ops' custom ops registered and its op instance by a key that holds across
processes (the forward's, which the traced graph bakes; registry.py), and give eager's
gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from tileops.ops import MulFwdOp  # noqa: E402
from tileops.runtime.registry import backward_key, instance_for_key  # noqa: E402

STEP = textwrap.dedent("""
    import json, sys
    import torch
    from tileops.ops import AddFwdOp, MulFwdOp, WhereFwdOp, SiluFwdOp

    add, mul, where, silu = AddFwdOp(), MulFwdOp(), WhereFwdOp(), SiluFwdOp()

    def step(x, w):
        return where(x > 0, mul(add(x, w), 2.0), silu(x)).sum()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    compiled(x, w).backward()
    got = [x.grad.tolist(), w.grad.tolist()]
    x.grad = w.grad = None
    step(x, w).backward()
    want = [x.grad.tolist(), w.grad.tolist()]
    print(json.dumps({"got": got, "want": want}))
""")


def _run(cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    out = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_compiled_training_step_runs_from_a_warm_cache_in_a_new_process(tmp_path):
    cache = str(tmp_path / "inductor")
    for _ in range(2):  # the first fills the cache, the second loads from it
        result = _run(cache)
        torch.testing.assert_close(torch.tensor(result["got"][0]),
                                   torch.tensor(result["want"][0]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.tensor(result["got"][1]),
                                   torch.tensor(result["want"][1]), rtol=1e-12, atol=1e-12)
    assert any(f for _, _, fs in os.walk(cache) for f in fs), "nothing was cached"


def test_a_backward_op_is_found_by_its_forwards_key_though_not_built():
    """A compiled backward names its op by the forward instance's key and the needs
    (registry.backward_key): found as the op the forward holds, built on the lookup where the
    forward never built it (a backward loaded from another process's cache), and refused by
    name where no forward of that key lives."""
    fwd = MulFwdOp()
    built = fwd._backward_op((True, True))
    assert built._instance_key == backward_key(fwd._instance_key, (True, True))
    assert instance_for_key(built._instance_key) is built
    key = backward_key(fwd._instance_key, (False, True))
    assert (False, True) not in fwd._backward_ops
    other = instance_for_key(key)
    assert other is fwd._backward_ops[(False, True)]
    assert (other.grad_a, other.grad_b) == (False, True)
    with pytest.raises(LookupError, match=r"no live TileOPs op instance for key 'MulFwdOp@-1>10'"):
        instance_for_key("MulFwdOp@-1>10")


def test_the_backward_ops_a_forward_built_take_its_tune_request():
    """A forward may hold backward ops before any backward runs (a traced call registers its
    backward class by building one), so a later request_tune reaches those already built, and
    a forward made with tune=True builds them tuning."""
    fwd = MulFwdOp()
    built = fwd._backward_op((True, True))
    assert not built._tune_requested
    fwd.request_tune()
    assert built._tune_requested and fwd._backward_op((True, False))._tune_requested
    assert MulFwdOp(tune=True)._backward_op((True, True))._tune_requested
