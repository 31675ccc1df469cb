"""The top-k kernel on a GPU, called through TopkFwdOp (the layout, the slot, its entry), on
fresh random rows, against the answer the entry promises: a stable sort's first k (the lowest
indices among equal values, NaN above every number, -0.0 equal to 0.0), computed in float64
on the CPU. Values and indices must be equal, exactly: a selection does no arithmetic.

Each case exercises a path of the program (why it exists is on its line): the one pass into
the candidate buffer with 16-byte and scalar loads, thread and piece maxima for the bound, 16-
and 32-bit keys, the smallest k; rows whose candidates overflow the buffer (rounds over the
row, then the index-ordered gather), rows of many equal values (ties past the sort array),
special values, k equal to the row, k = 0, and a strided input. Every case runs on the
earlier plan too (``lean=False``), kept for comparison.

``python3 tests/kernels/test_topk_cuda.py --prebuild --workers 15`` compiles exactly the
programs these tests use in spawned processes first, so the tests load them from TileLang's
disk cache.
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import topk as K  # noqa: E402

pytestmark = pytest.mark.cuda
if __name__ not in ("__main__", "__mp_main__") and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

#: (rows, n, k, dtype, largest, values)
CASES = [
    (256, 128256, 50, torch.bfloat16, True, "normal"),  # the vocabulary: thread maxima, one pass
    (1, 128256, 50, torch.bfloat16, True, "normal"),  # one row: 16 segments and the merge
    (4, 131072, 1024, torch.bfloat16, True, "normal"),  # piece maxima, the large buffer, split
    (1, 262144, 50, torch.bfloat16, True, "normal"),  # 64 segments
    (3, 7, 2, torch.float32, True, "normal"),  # one warp, 32-bit keys
    (3, 7, 2, torch.bfloat16, True, "normal"),
    (32, 32000, 50, torch.float32, True, "normal"),
    (32, 32000, 10, torch.bfloat16, False, "normal"),  # the smallest k
    (5, 4097, 8, torch.float16, True, "normal"),  # scalar loads, a predicated tail
    (64, 32768, 100, torch.bfloat16, True, "normal"),  # lean: ranks over 256, bitonic merge
    (4, 128256, 50, torch.bfloat16, True, "few-values"),  # overflow, ties past the sort array
    (512, 32768, 50, torch.bfloat16, True, "few-values"),  # the same, unsplit
    (4, 32000, 50, torch.float32, True, "ascending"),  # the held chunks are the smallest
    (4, 32000, 50, torch.float32, False, "ascending"),
    (8, 4096, 16, torch.float32, True, "special"),  # NaN, infinities, signed zeros, subnormals
    (8, 4096, 16, torch.bfloat16, False, "special"),
    (6, 300, 300, torch.float32, True, "normal"),  # k = n, no bound (fewer maxima than k)
    (6, 300, 0, torch.float32, True, "normal"),  # nothing to select
]
_SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 1e-40, -1e-40,
            3.0, -3.0]


def _rows(rows, n, dtype, values, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if values == "normal":
        x = torch.randn(rows, n, device="cuda", generator=g)
    elif values == "few-values":
        x = torch.randint(0, 3, (rows, n), device="cuda", generator=g).float()
    elif values == "ascending":
        x = torch.arange(n, device="cuda", dtype=torch.float32).expand(rows, n) * 0.01
    else:
        pick = torch.randint(0, len(_SPECIAL), (rows, n), device="cuda", generator=g)
        x = torch.tensor(_SPECIAL, device="cuda")[pick]
    return x.to(dtype).contiguous()


def _check(x, k, largest, vals, idx):
    want_v, want_i = torch.sort(x.double().cpu(), dim=-1, descending=largest, stable=True)
    want_v, want_i = want_v[..., :k], want_i[..., :k]
    assert idx.dtype == torch.int64 and vals.dtype == x.dtype
    bad = (idx.cpu() != want_i).any(dim=-1)
    assert not bad.any(), (f"{int(bad.sum())} rows differ; row {int(bad.nonzero()[0])}: "
                           f"{idx.cpu()[bad][0][:8].tolist()} against "
                           f"{want_i[bad][0][:8].tolist()}")
    got = vals.double().cpu()
    assert torch.equal(got.isnan(), want_v.isnan())
    same = (got == want_v) | (got.isnan() & want_v.isnan())
    assert same.all()
    assert torch.equal(torch.signbit(got), torch.signbit(want_v))  # the value at the index


@pytest.mark.parametrize(("rows", "n", "k", "dtype", "largest", "values"), CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_topk_matches_the_stable_sort(rows, n, k, dtype, largest, values):
    from tileops.ops import TopkFwdOp
    from tileops.runtime import targets

    op = TopkFwdOp(k=k, largest=largest)
    for seed in (0, 1):  # a second call reuses the entry on new values
        x = _rows(rows, n, dtype, values, seed)
        vals, idx = op(x)
        torch.cuda.synchronize()
        assert op.serving_target == targets.IN_TREE
        _check(x, k, largest, vals, idx)


@pytest.mark.parametrize(("rows", "n", "k", "dtype", "largest", "values"),
                         [c for c in CASES if c[2]], ids=lambda v: str(v).removeprefix("torch."))
def test_the_earlier_plan_matches_the_stable_sort(rows, n, k, dtype, largest, values):
    """The earlier plan (512 threads, the key of every element), kept for comparison, gives
    the same answers: the kernel built with ``lean=False`` and called as the entry calls it."""
    name = str(dtype).removeprefix("torch.")
    kernel = K.TopkRadixKernel(K.TopkSpec(device="cuda", rows=rows, n=n, k=k, dtype=name,
                                          largest=largest), lean=False)
    x = _rows(rows, n, dtype, values, 2)
    vals = torch.empty(rows, k, dtype=dtype, device="cuda")
    idx = torch.empty(rows, k, dtype=torch.int64, device="cuda")
    kernel(x, vals, idx)
    torch.cuda.synchronize()
    _check(x, k, largest, vals, idx)


def test_a_transposed_input_is_selected_as_torch_does():
    from tileops.ops import TopkFwdOp

    x = torch.randn(4096, 300, device="cuda").t()  # (300, 4096), strided
    vals, idx = TopkFwdOp(k=20)(x)
    _check(x, 20, True, vals, idx)


# --- the prebuild ----------------------------------------------------------------------------


def _programs(rows, n, k, dtype, largest, lean=True):
    """build_topk's arguments of the programs a call runs on a plan: one, or a split's two."""
    if not k:
        return []
    segs = K.split_plan(rows, n, k)
    out = [(n // segs, k, dtype, largest, None, K.topk_plan(n // segs, k, dtype, lean))]
    if segs > 1:
        out.append((segs * k, k, dtype, largest, None, K.topk_plan(segs * k, k, dtype, lean)))
    return out


def program_keys():
    """The distinct programs the file (on both plans) and the spec workloads (at full size,
    so that the harness's and the benchmarks' calls are covered) compile: build_topk's
    arguments, deduplicated."""
    import math

    from tileops.ops import TopkFwdOp
    from tileops.ops.workloads import cases_of

    calls = [(rows, n, k, str(dtype).removeprefix("torch."), largest)
             for rows, n, k, dtype, largest, _ in CASES]
    calls.append((300, 4096, 20, "float32", True))
    for c in cases_of(TopkFwdOp):
        shape, dtype = c.inputs[0].shape, c.inputs[0].dtype
        if dtype in K._TOPK_DTYPES:
            calls.append((math.prod(shape[:-1]), shape[-1], c.params["k"], dtype,
                          c.params.get("largest", True)))
    earlier = [(rows, n, k, str(dtype).removeprefix("torch."), largest, False)
               for rows, n, k, dtype, largest, _ in CASES]
    return list(dict.fromkeys(p for call in calls + earlier for p in _programs(*call)))


def _build(key):
    K.build_topk(*key)


def _describe(key) -> str:
    return f"topk {key}"


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
