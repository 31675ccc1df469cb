"""The top-k program runs on the host, every thread of a block a host thread meeting the others
at ``__syncthreads`` and its warp at each shuffle (tests/kernels/_host_run.py): its values and
indices against a stable sort's first k (among equal values the lowest indices) over rows that
take each of its paths: the lean pass's test of a whole access against the bound's magnitude
(normal logits, a row of negatives whose bound is below zero, the smallest k), NaNs, -0.0
beside 0.0, a row of equal values (the buffer's overflow and the gather in index order)."""

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from tileops.kernels import topk as K  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _host_run as H  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling a kernel's source for the host needs nvcc")

#: host versions of the device calls the program makes (TileLang's atomics on shared memory,
#: the 16-bit pairs' maximum), placed before the kernel
_PRELUDE = r"""
static int host_atomic_add_ret(int* p, int v, int = 0) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static void host_atomic_add(int* p, int v, int = 0) { __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static unsigned host_vmaxu2(unsigned a, unsigned b) {
  unsigned lo = (a & 0xFFFFu) > (b & 0xFFFFu) ? (a & 0xFFFFu) : (b & 0xFFFFu);
  unsigned hi = (a >> 16) > (b >> 16) ? (a >> 16) : (b >> 16);
  return lo | (hi << 16);
}
#define AtomicAddRet host_atomic_add_ret
#define atomicAdd host_atomic_add_ret
#define AtomicAdd host_atomic_add
#define __vmaxu2 host_vmaxu2
"""


def _host_source(source: str) -> str:
    at = source.index('extern "C" __global__')
    return source[:at] + _PRELUDE + source[at:]


def _rows(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    normal = torch.randn(n, generator=g) * 3
    negative = -torch.rand(n, generator=g) * 8 - 1  # every value below zero: so is the bound
    nans = torch.randn(n, generator=g)
    nans[torch.randint(0, n, (9,), generator=g)] = float("nan")
    nans[5] = -float("nan")
    zeros = torch.zeros(n)
    zeros[1::3] = -0.0
    zeros[n // 2] = 1.0
    equal = torch.full((n,), 0.5)
    return torch.stack([normal, negative, nans, zeros, equal]).bfloat16()


def _reference(x: torch.Tensor, k: int, largest: bool):
    order = torch.sort(x.float(), dim=1, descending=largest, stable=True).indices[:, :k]
    return torch.gather(x, 1, order), order


@pytest.mark.parametrize(("dtype", "largest", "lean"), [
    pytest.param("bfloat16", True, True, id="bf16-largest"),
    pytest.param("bfloat16", False, True, id="bf16-smallest"),
    pytest.param("float16", True, True, id="f16-largest"),
    pytest.param("float32", False, True, id="f32-smallest-32-bit-keys"),
    pytest.param("bfloat16", True, False, id="bf16-earlier-plan"),
])
def test_the_program_is_a_stable_sorts_first_k_on_the_host(dtype, largest, lean):
    n, k = 20000, 50  # more chunks than the bound holds (a second step of the pass), a tail
    x = _rows(n).to(getattr(torch, dtype))
    plan = K.topk_plan(n, k, dtype, lean)
    src = K.build_topk(n, k, dtype, largest, "sm_90a", plan).get_kernel_source()
    m = x.shape[0]
    out = H.run_outputs(_host_source(src), {"X": H.host_array(x), "M": m}, (m, 1),
                        {"V": m * k, "Idx": m * k})
    bits = torch.int32 if dtype == "float32" else torch.int16
    values = torch.from_numpy(out["V"][0].copy()).view(bits)
    indices = torch.from_numpy(out["Idx"][0].copy())
    want_v, want_i = _reference(x, k, largest)
    assert torch.equal(indices.view(m, k), want_i)
    assert torch.equal(values.view(m, k), want_v.view(bits))
