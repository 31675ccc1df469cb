"""The reduction kernels lower and compile for sm_90 on a machine without a GPU: one program
for each code path the CPU can check (why it exists is on its line), and what its source must
hold; twelve programs, each compile seconds. The GPU tests' prebuild compiles the rest (odd rows,
integer and bool columns, every kind).

Then the entries' calls against their programs' declarations, with stand-ins for the compiled
programs (the prim_funcs are built, not compiled): every tensor an entry hands a program has
the rank, the static sizes and the dtype its parameter declares, and one value for each
launch-time size; and calls that differ only in the row count share one entry and one
program."""

import re
import shutil

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import reduction as K  # noqa: E402
from tileops.kernels.reduction import ReduceKind as RK  # noqa: E402

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


#: a 16-byte vector access, as CUDA spells it for each element type
WIDE = re.compile(r"\*\((uint4|float4|int4|longlong2)\*\)\(X")


def _src(kernel) -> str:
    return kernel.get_kernel_source()


@needs_nvcc
@pytest.mark.parametrize(("kind", "m", "n", "dtype", "wants"), [
    # the bar: a CTA a row, 16-byte loads, cross-warp partials in shared memory
    pytest.param(RK.SUM, 32768, 8192, "bfloat16", ("*(uint4*)(X", "__shfl_xor_sync",
                                                   "__syncthreads"),
                 id="sum-16B-rows"),
    # eight short rows a CTA (a warp each), bool read as bytes
    pytest.param(RK.ALL, 3, 7, "bool", ("const uchar* __restrict__ X", "(uchar)acc"), id="all-bool-tiny"),
    # int64 read as itself, compared with zero
    pytest.param(RK.ANY, 64, 4096, "int64", ("const int64_t* __restrict__ X",), id="any-int64"),
    # int8 read as itself, 16 a 16-byte access, summed in int64
    pytest.param(RK.SUM, 64, 4096, "int8", ("const signed char* __restrict__ X", "*(int4*)(X",
                                            "int64_t* __restrict__ Y0"), id="sum-int8"),
    # NaN tests through isnan, the index carried
    pytest.param(RK.ARGMAX, 64, 4096, "float16", ("isnan", "int64_t"), id="argmax"),
    # moments with the shift broadcast from lane 0 (n mod 2^16 >= 2^15)
    pytest.param(RK.VAR_MEAN, 64, 100000, "float32", ("__shfl_sync",), id="var-mean-spread"),
    # one element, correction 1: the divisor is 0, M2 * inf instead of a constant division
    pytest.param(RK.VAR_MEAN, 4, 1, "float32", ("CUDART_INF_F",), id="var-no-freedom"),
])
def test_row_programs_compile_for_sm90(kind, m, n, dtype, wants) -> None:
    src = _src(K.build_row_kernel(kind, n, dtype, 1.0 if kind is RK.VAR_MEAN else 0.0,
                                  K.row_plan(m, n, dtype)[-1], "sm_90"))
    assert "int M)" in src  # the row count is the launch's
    for w in wants:
        assert w in src, w


@needs_nvcc
@pytest.mark.parametrize(("kind", "outer", "r", "inner", "dtype"), [
    pytest.param(RK.SUM, 1, 32768, 8192, "bfloat16", id="sum-dim0-split"),  # the bar
    pytest.param(RK.ARGMIN, 4, 33, 7, "float16", id="argmin-narrow"),  # tcols < 32
    pytest.param(RK.VAR, 16, 1024, 512, "float32", id="var-middle-dim"),
])
def test_column_programs_compile_for_sm90(kind, outer, r, inner, dtype) -> None:
    src = _src(K.build_column_kernel(kind, r, inner, dtype, 1.0 if kind is RK.VAR else 0.0,
                                     K.column_plan(outer, r, inner, dtype)[-1], "sm_90"))
    assert "__syncthreads" in src  # the groups' partials meet in shared memory
    assert "int outer)" in src  # outer is the launch's
    wide = K.column_plan(outer, r, inner, dtype)[2] * K._ITEMSIZE[K._storage(dtype)] == 16
    assert bool(WIDE.search(src)) == wide


@needs_nvcc
@pytest.mark.parametrize(("kind", "splits", "dtype"), [
    pytest.param(RK.ARGMAX, 528, "bfloat16", id="argmax-one-row"),
    pytest.param(RK.VAR_MEAN, 2, "float32", id="var-mean-two-outputs"),
])
def test_finish_programs_compile_for_sm90(kind, splits, dtype) -> None:
    src = _src(K.build_finish_kernel(kind, splits, dtype, 4097,
                                     1.0 if kind is RK.VAR_MEAN else 0.0, "sm_90"))
    assert "__shfl_xor_sync" in src
    assert "int P)" in src  # the outputs' count is the launch's


# --- the entries' calls against the programs' declarations ----------------------------------------


class _Program:
    """A compiled program's stand-in: it checks each call's tensors against the prim_func's
    parameters (rank, static sizes, dtype, contiguity; a launch-time size takes one value
    across them) and records the launch-time sizes it saw."""

    def __init__(self, prim) -> None:
        self.params = [prim.buffer_map[p] for p in prim.params]
        self.calls: list[dict[str, int]] = []

    def __call__(self, *tensors) -> None:
        assert len(tensors) == len(self.params), [b.name for b in self.params]
        sizes: dict[str, int] = {}
        for buf, t in zip(self.params, tensors, strict=True):
            declared = list(buf.shape)
            assert t.dim() == len(declared), (f"{buf.name}: a rank-{t.dim()} tensor for a "
                                              f"rank-{len(declared)} parameter {declared}")
            for want, got in zip(declared, t.shape, strict=True):
                if hasattr(want, "name"):  # a launch-time size
                    assert sizes.setdefault(want.name, got) == got, (buf.name, want.name)
                else:
                    assert int(want) == got, f"{buf.name}: {tuple(t.shape)} for {declared}"
            assert str(t.dtype).removeprefix("torch.") == str(buf.dtype), buf.name
            assert t.is_contiguous(), buf.name
        self.calls.append(sizes)


@pytest.fixture
def programs(monkeypatch):
    """The builders compile to :class:`_Program` stand-ins (their caches emptied around the
    test); the list of every program built."""
    built: list[_Program] = []

    def compile_program(prim, target=None):
        built.append(_Program(prim))
        return built[-1]

    builders = (K.build_row_kernel, K.build_column_kernel, K.build_finish_kernel)
    for b in builders:
        b.cache_clear()
    monkeypatch.setattr(K, "compile_program", compile_program)
    yield built
    for b in builders:
        b.cache_clear()


def _call(kernel, spec):
    """The entry of ``kernel`` for ``spec`` called as the op calls it: the ``(outer, r,
    inner)`` view and flat outputs (meta tensors: the stand-ins read only their shapes)."""
    dt = {"bool": torch.bool}.get(spec.dtype) or getattr(torch, spec.dtype)
    x = torch.empty((spec.outer, spec.r, spec.inner), dtype=dt, device="meta")
    p = spec.outer * spec.inner
    out = torch.empty(p, dtype=getattr(torch, spec.out_dtype), device="meta")
    out2 = torch.empty_like(out) if spec.kind is RK.VAR_MEAN else None
    entry = kernel(spec)
    entry(x, out, out2)
    return entry


def _spec(kind, outer, r, inner, dtype):
    return K.ReductionSpec(device=torch.device("cpu"), kind=kind, outer=outer, r=r,
                           inner=inner, dtype=dtype,
                           correction=1.0 if kind is RK.VAR_MEAN else 0.0)


@pytest.mark.parametrize(("kernel", "kind", "view", "dtype", "programs_run"), [
    pytest.param(K.ReductionRowKernel, RK.SUM, (6, 64, 1), "float32", 1, id="rows"),
    pytest.param(K.ReductionRowKernel, RK.ALL, (3, 7, 1), "bool", 1, id="bool-rows"),
    pytest.param(K.ReductionRowKernel, RK.VAR_MEAN, (1, 1 << 20, 1), "bfloat16", 2,
                 id="split-row-two-outputs"),
    pytest.param(K.ReductionRowKernel, RK.ARGMAX, (2, 1 << 16, 1), "float32", 2,
                 id="split-rows-indices"),
    pytest.param(K.ReductionColumnKernel, RK.VAR_MEAN, (5, 33, 7), "float16", 1,
                 id="columns-two-outputs"),
    pytest.param(K.ReductionColumnKernel, RK.ARGMIN, (1, 4096, 64), "float32", 2,
                 id="split-columns-indices"),
    pytest.param(K.ReductionColumnKernel, RK.SUM, (2, 4096, 64), "bool", 2,
                 id="split-bool-columns"),
])
def test_each_entry_hands_its_programs_what_they_declare(programs, kernel, kind, view, dtype,
                                                         programs_run) -> None:
    spec = _spec(kind, *view, dtype)
    entry = _call(kernel, spec)
    assert (entry.splits > 1) == (programs_run == 2)  # a split runs the finish after
    assert [len(p.calls) for p in programs] == [1] * programs_run


@pytest.mark.parametrize(("kernel", "r", "inner", "outers"), [
    pytest.param(K.ReductionRowKernel, 8192, 1, (1, 5, 70000), id="rows"),
    # 423 and 302 splits asked for: both 256
    pytest.param(K.ReductionRowKernel, 1 << 22, 1, (5, 7), id="split-rows"),
    pytest.param(K.ReductionColumnKernel, 8192, 48, (2112, 4097, 70000), id="columns"),
    # 235 and 176 splits asked for: both 128
    pytest.param(K.ReductionColumnKernel, 1 << 16, 48, (9, 12), id="split-columns"),
])
def test_calls_differing_in_outer_share_one_program(programs, kernel, r, inner,
                                                    outers) -> None:
    specs = [_spec(RK.SUM, outer, r, inner, "bfloat16") for outer in outers]
    assert len({kernel.identity(s) for s in specs}) == 1
    entry = kernel(specs[0])
    for s in specs:
        entry(torch.empty((s.outer, s.r, s.inner), dtype=torch.bfloat16, device="meta"),
              torch.empty(s.outer * s.inner, dtype=torch.bfloat16, device="meta"), None)
    assert len(programs) == (1 if entry.splits == 1 else 2)
    size = "M" if kernel is K.ReductionRowKernel else "outer"
    assert [c[size] for c in programs[0].calls] == list(outers)
