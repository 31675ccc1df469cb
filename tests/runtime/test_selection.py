"""Choosing among a slot's implementations (op-interface-design.md, Kernel selection) and
get-or-build of entries (Kernel caching)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tileops.runtime import (
    AmbiguousKernelError,
    CallSpec,
    Kernel,
    KernelInterface,
    NoKernelError,
    Op,
    SpecSet,
    device_arch,
    kernel,
    select,
)

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")
CPU = torch.device("cpu")


class RowSpec(CallSpec, frozen=True):
    n: int
    dtype: torch.dtype


class RowIface(KernelInterface):
    slot = "rows"
    call_spec = RowSpec


class Base(Kernel, RowIface):
    devices = ("cpu", "meta")
    built: list = []

    @classmethod
    def entry_for(cls, spec, op):
        Base.built.append((cls, spec))
        return cls(spec)

    def __call__(self, x, y):
        y.copy_(x)


class Short(Base):
    """Serves rows of at most 16 elements."""

    @classmethod
    def region_refusal(cls, spec):
        return None if spec.n <= 16 else f"n = {spec.n} > 16"


class Half(Base):
    """Serves float16 rows."""

    @classmethod
    def region_refusal(cls, spec):
        return None if spec.dtype == torch.float16 else f"dtype {spec.dtype} is not float16"


class HalfShort(Half):
    """Float16 rows of at most 16: more specific than Half and Short together."""

    preferred_over = (Half, Short)

    @classmethod
    def region_refusal(cls, spec):
        return Half.region_refusal(spec) or Short.region_refusal(spec)


class Any_(Base):
    general = True


class OtherGeneral(Base):
    general = True


class CudaOnly(Base):
    devices = ("cuda",)
    supported_archs = frozenset({(9, 0)})


class Nothing(Base):
    @classmethod
    def region_refusal(cls, spec):
        return "serves nothing"


def spec(n: int = 8, dtype: torch.dtype = torch.float32, device=CPU) -> RowSpec:
    return RowSpec(device, n, dtype)


# --- select --------------------------------------------------------------------------------------


def test_the_one_specialised_claimant_runs() -> None:
    assert select(RowIface, (Short, Any_), spec(8)) is Short


def test_the_general_one_runs_where_no_specialised_one_applies() -> None:
    assert select(RowIface, (Short, Any_), spec(64)) is Any_


def test_two_specialised_claimants_are_an_ambiguity_naming_both() -> None:
    with pytest.raises(AmbiguousKernelError) as info:
        select(RowIface, (Short, Half, Any_), spec(8, torch.float16))
    msg = str(info.value)
    assert "Short" in msg and "Half" in msg and "rows:" in msg
    assert "preferred_over" in msg


def test_preferred_over_resolves_an_overlap() -> None:
    impls = (Short, Half, HalfShort, Any_)
    assert select(RowIface, impls, spec(8, torch.float16)) is HalfShort
    assert select(RowIface, impls, spec(64, torch.float16)) is Half
    assert select(RowIface, impls, spec(8)) is Short
    assert select(RowIface, impls, spec(64)) is Any_


def test_order_decides_nothing() -> None:
    impls = (Short, Half, HalfShort, Any_)
    for perm in itertools.permutations(impls):
        assert select(RowIface, perm, spec(8, torch.float16)) is HalfShort
        assert select(RowIface, perm, spec(64)) is Any_
    for perm in itertools.permutations((Short, Half, Any_)):
        with pytest.raises(AmbiguousKernelError):
            select(RowIface, perm, spec(8, torch.float16))


def test_two_general_implementations_are_ambiguous() -> None:
    with pytest.raises(AmbiguousKernelError, match="more than one general"):
        select(RowIface, (Any_, OtherGeneral), spec())


def test_nothing_applicable_lists_each_refusal() -> None:
    with pytest.raises(NoKernelError) as info:
        select(RowIface, (Short, Half, CudaOnly, Nothing), spec(64))
    msg = str(info.value)
    assert "rows: no implementation serves" in msg
    assert "Short: n = 64 > 16" in msg
    assert "Half: dtype torch.float32 is not float16" in msg
    assert "CudaOnly: runs on cuda, not cpu" in msg
    assert "Nothing: serves nothing" in msg


def test_no_implementation_installed() -> None:
    with pytest.raises(NoKernelError, match="no implementation is installed"):
        select(RowIface, (), spec())


def test_architecture_refusal_is_the_implementations(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda", 0)
    monkeypatch.setitem(kernel._ARCH_CACHE, dev, (8, 0))
    assert device_arch(dev) == (8, 0)
    assert CudaOnly.refusal(spec(device=dev)) == "written for sm_90, not sm_80"
    monkeypatch.setitem(kernel._ARCH_CACHE, dev, (9, 0))
    assert CudaOnly.refusal(spec(device=dev)) is None
    assert device_arch(CPU) is None


# --- in an op: get-or-build --------------------------------------------------------------------


class CopyOp(Op, specs=SPECS, entry="ScaleOp"):
    kernel_types = {RowIface: (Short, Half, HalfShort, Any_)}

    def forward(self, call, x, bias, y):
        self.kernel(RowIface, RowSpec(call.device, x.shape[-1], x.dtype))(x, y)


class ByDtype(Base):
    """One entry per dtype: sizes share it."""

    general = True

    @classmethod
    def identity(cls, spec):
        return (spec.device, spec.dtype)


@pytest.fixture(autouse=True)
def _clear_built():
    Base.built.clear()


def test_entries_are_built_once_per_implementation_and_identity() -> None:
    op = CopyOp(kernel_map={"rows": ByDtype})
    for n in (4, 8, 100, 4):
        op(torch.ones(2, n))
    assert Base.built == [(ByDtype, spec(4))]
    assert len(op._entries_by_call) == 3  # one per call spec, all the same entry
    assert len({id(e) for e in op._entries_by_call.values()}) == 1
    op(torch.ones(2, 4, dtype=torch.float16))
    assert [c for c, _ in Base.built] == [ByDtype, ByDtype]
    assert set(op.built_entries[RowIface]) == {
        (ByDtype, (CPU, torch.float32)), (ByDtype, (CPU, torch.float16))}


def test_each_call_selects_by_its_own_spec() -> None:
    op = CopyOp()
    op(torch.ones(2, 8, dtype=torch.float16))
    op(torch.ones(2, 64, dtype=torch.float16))
    op(torch.ones(2, 8))
    op(torch.ones(2, 64))
    assert [c for c, _ in Base.built] == [HalfShort, Half, Short, Any_]


def test_a_cached_call_is_one_dictionary_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    op = CopyOp()
    x = torch.ones(2, 8)
    op(x)

    class Counting(dict):
        gets = 0

        def get(self, key, default=None):
            Counting.gets += 1
            return super().get(key, default)

    op._entries_by_call = Counting(op._entries_by_call)

    def fail(*a, **k):
        raise AssertionError("a cached call selected or built")

    monkeypatch.setattr("tileops.runtime.op.select", fail)
    monkeypatch.setattr(Short, "entry_for", classmethod(fail))
    for _ in range(3):
        op(x)
    assert Counting.gets == 3


def test_a_replacement_answers_the_same_question(state) -> None:
    op = CopyOp(kernel_map={RowIface: (Short,)})
    op(torch.ones(2, 8))
    assert [c for c, _ in Base.built] == [Short]
    before = state.snapshot(op)
    with pytest.raises(NoKernelError, match="Short: n = 64 > 16"):
        op(torch.ones(2, 64))
    state.assert_failed_and_kept(op, before)
    with pytest.raises(AmbiguousKernelError, match="Short and Half"):
        CopyOp(kernel_map={"rows": [Short, Half]})(torch.ones(1, 8, dtype=torch.float16))


def test_kernel_of_an_undeclared_slot() -> None:
    class Stray(KernelInterface):
        pass

    op = CopyOp()
    with pytest.raises(LookupError, match="declares no slot Stray"):
        op.kernel(Stray, spec())


def test_a_preference_cycle_is_an_ambiguity() -> None:
    class A(Base):
        pass

    class B(Base):
        preferred_over = (A,)

    A.preferred_over = (B,)
    with pytest.raises(AmbiguousKernelError, match="A and B claim .* break the cycle"):
        select(RowIface, (A, B, Any_), spec())
