"""Class definition and construction: what __init_subclass__ installs, the construction check,
the instance state of tables 2 and 3 right after construction, and that construction reads no
device property."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tileops.runtime import (
    CallSpec,
    Kernel,
    KernelInterface,
    Op,
    SpecSet,
    TargetError,
    instance_for_key,
)
from tileops.runtime.op import _EMPTY, _UNRESOLVED
from tileops.signature import ConstructionError, SignaturePlan

SPECS_DIR = Path(__file__).parent / "specs"
SPECS = SpecSet.load(SPECS_DIR / "ops.yaml")


class ScaleSpec(CallSpec, frozen=True):
    n: int


class ScaleIface(KernelInterface):
    slot = "scale"
    call_spec = ScaleSpec


class SmallScale(Kernel, ScaleIface):
    devices = ("cpu",)

    @classmethod
    def region_refusal(cls, spec):
        return None if spec.n <= 16 else f"n = {spec.n} > 16"

    def __call__(self, x, y, alpha):
        torch.mul(x, alpha, out=y)


class AnyScale(Kernel, ScaleIface):
    devices = ("cpu", "meta")
    general = True
    preferred_over = ()

    def __call__(self, x, y, alpha):
        torch.mul(x, alpha, out=y)


class OtherIface(KernelInterface):
    slot = "other"
    call_spec = CallSpec


class OtherKernel(Kernel, OtherIface):
    devices = ("cpu",)
    general = True


class ScaleOp(Op, specs=SPECS):
    kernel_types = {ScaleIface: (SmallScale, AnyScale)}

    def __init__(self, *, alpha: float = 2.0, **kw):
        super().__init__(alpha=alpha, **kw)

    def forward(self, call, x, bias, y):
        self.kernel(ScaleIface, ScaleSpec(call.device, x.shape[-1]))(x, y, self.alpha)


class RowStatsOp(Op, specs=SPECS):
    pass


class NotInSpecs(Op, specs=SPECS):
    pass


class Renamed(Op, specs=SPECS, entry="ScaleOp"):
    pass


class ScaleAddOp(Op, specs=SPECS):
    delegate_types = {"scale": ScaleOp}


# --- __init_subclass__ ---------------------------------------------------------------------------


def test_class_with_an_entry_installs_its_plan_and_param_names() -> None:
    assert isinstance(ScaleOp._signature, SignaturePlan)
    assert ScaleOp._signature.name == "ScaleOp"
    assert ScaleOp._param_names == ("alpha",)
    assert RowStatsOp._param_names == ("width",)
    # one plan per class, shared by every instance
    assert ScaleOp()._signature is ScaleOp(alpha=3.0)._signature


def test_entry_can_be_named_explicitly() -> None:
    assert Renamed._signature.name == "ScaleOp"
    assert Renamed._param_names == ("alpha",)


def test_class_without_an_entry_installs_nothing() -> None:
    assert NotInSpecs._signature is None
    assert NotInSpecs._param_names == ()
    assert Op._signature is None and Op._param_names == ()
    with pytest.raises(TypeError, match="has no spec entry"):
        NotInSpecs()


def test_subclass_without_its_own_entry_installs_nothing() -> None:
    class MyScale(ScaleOp):  # not an entry: the reference document installs no methods
        pass

    assert MyScale._signature is None
    assert MyScale._param_names == ()


def test_unknown_explicit_entry_is_an_error() -> None:
    with pytest.raises(LookupError, match="no spec entry named 'Nope'"):
        class Bad(Op, specs=SPECS, entry="Nope"):
            pass


# --- the construction check ----------------------------------------------------------------------


def test_construction_check_rejects_bad_params() -> None:
    with pytest.raises(ConstructionError, match="alpha must be a number"):
        ScaleOp(alpha="big")
    with pytest.raises(ConstructionError, match="no construction param 'beta'"):
        ScaleOp(beta=1.0)
    with pytest.raises(ConstructionError, match="width is required"):
        RowStatsOp()
    with pytest.raises(ConstructionError, match="width > 0"):
        RowStatsOp(width=0)


def test_construction_params_become_attributes() -> None:
    op = ScaleOp(alpha=3)
    assert op.alpha == 3
    assert op._construction_indices == {"alpha": 3.0}
    assert RowStatsOp(width=8).width == 8


def test_unknown_target_is_refused_at_construction() -> None:
    with pytest.raises(TargetError, match="unknown target 'nowhere'"):
        ScaleOp(target="nowhere")


def test_kernel_map_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="not a slot of this op"):
        ScaleOp(kernel_map={"other": OtherKernel})
    with pytest.raises(TypeError, match="must be a Kernel class implementing ScaleIface"):
        ScaleOp(kernel_map={"scale": OtherKernel})
    with pytest.raises(TypeError, match="must be a Kernel class"):
        ScaleOp(kernel_map={ScaleIface: object})
    with pytest.raises(ValueError, match="runs no kernels of its own"):
        RowStatsOp(width=4, kernel_map={"scale": AnyScale})
    with pytest.raises(TypeError) as exc:
        ScaleOp(kernel_map=5)
    assert str(exc.value) == ("ScaleOp: kernel_map must be a mapping of slots (or kernel "
                              "interfaces) to Kernel classes, or None; got int")


@pytest.mark.parametrize("tune", ["yes", 1, None])
def test_tune_is_a_bool(tune) -> None:
    with pytest.raises(TypeError) as exc:
        ScaleOp(tune=tune)
    assert str(exc.value) == (f"ScaleOp: tune must be True or False, got {tune!r} "
                              f"({type(tune).__name__})")


def test_kernel_map_replaces_a_slot_by_name_or_interface() -> None:
    assert ScaleOp(kernel_map={"scale": AnyScale})._installed_kernel_types == {
        ScaleIface: (AnyScale,)}
    assert ScaleOp(kernel_map={ScaleIface: [SmallScale]})._installed_kernel_types == {
        ScaleIface: (SmallScale,)}


# --- tables 2 and 3: the state right after construction ---------------------------------------


def test_every_field_of_table_2_exists_after_construction(state) -> None:
    for op in (ScaleOp(), RowStatsOp(width=2), ScaleAddOp(alpha=1.0)):
        state.assert_fields_present(op)


def test_construction_group_after_construction() -> None:
    op = ScaleOp(alpha=1.5, target="reference")
    assert op.alpha == 1.5
    assert op.target == "reference"
    assert op._installed_kernel_types == {ScaleIface: (SmallScale, AnyScale)}
    assert op._preferred_over == {SmallScale: (), AnyScale: ()}
    assert op._keys_by_interface == {ScaleIface: "scale"}
    assert op._construction_indices == {"alpha": 1.5}
    assert isinstance(op._instance_key, str)
    assert op._instance_key.startswith("ScaleOp@")
    assert op._instance_key != ScaleOp()._instance_key


def test_composite_without_kernels_reads_the_class_level_empty_maps() -> None:
    op = ScaleAddOp()
    for name in ("_installed_kernel_types", "_preferred_over", "_keys_by_interface"):
        assert name not in vars(op)
        assert getattr(op, name) is _EMPTY


def test_binding_group_starts_at_its_initial_values(state) -> None:
    op = ScaleOp()
    state.assert_binding_initial(op)
    # table 3: _target_builder and _serving_target are class-attribute defaults
    assert "_target_builder" not in vars(op) and "_serving_target" not in vars(op)
    assert Op._target_builder is _UNRESOLVED and Op._serving_target is None
    # the three caches are tables of their own, built by Op.__init__
    other = ScaleOp()
    for name in ("_entries_by_call", "_built_entries", "_target_kernels"):
        assert name in vars(op)
        assert getattr(op, name) is not getattr(other, name)


def test_run_group_starts_empty() -> None:
    op = ScaleOp()
    assert op._tune_requested is False
    assert op._delegates == {}
    assert op._effect_branches == {}
    assert op._last_call is None and op.last_call is None
    assert op._tune_warned is False
    assert ScaleOp(tune=True)._tune_requested is True


def test_groups_are_disjoint_and_cover_table_2(state) -> None:
    groups = (state.CONSTRUCTION, state.BINDING, state.RUN)
    assert not set(groups[0]) & set(groups[1]) and not set(groups[1]) & set(groups[2])
    # table 2 names 19 fields; params and construction-time tensors are per op class; the
    # construction record pickling rebuilds from and the backward ops of the gradient add two
    assert sum(map(len, groups)) == 19


def test_instance_key_resolves_the_live_instance_only() -> None:
    op = ScaleOp()
    key = op._instance_key
    assert instance_for_key(key) is op
    del op
    import gc

    gc.collect()
    with pytest.raises(LookupError, match="no live TileOPs op instance"):
        instance_for_key(key)


# --- construction reads no device property --------------------------------------------------------


def test_construction_reads_no_device_property(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_device(*a, **k):
        raise AssertionError("construction read a device property")

    for name in ("is_available", "device_count", "current_device", "get_device_capability",
                 "get_device_properties", "get_device_name", "init", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, no_device)

    class FreshScale(Op, specs=SPECS, entry="ScaleOp"):
        kernel_types = {ScaleIface: (SmallScale, AnyScale)}

    FreshScale(alpha=1.0)
    FreshScale(kernel_map={"scale": AnyScale}, tune=True)
    ScaleAddOp().delegate_for("scale", alpha=2.0)
    assert not torch.cuda.is_initialized()


def test_a_param_that_would_hide_an_op_attribute_is_refused(tmp_path) -> None:
    from tileops.runtime import Op, SpecSet

    for bad in ("forward", "target", "_point"):
        path = tmp_path / f"{bad.strip('_')}.yaml"
        path.write_text(
            "ClashOp:\n  family: test\n  status: spec-only\n  signature:\n"
            f"    params:\n      {bad}: {{type: int, default: 1}}\n"
            "    inputs:\n      x: {dtype: float32, shape: \"[N]\"}\n"
            "    forall: {N: Dim}\n"
            "    outputs:\n      y: {dtype: float32, shape: \"[N]\"}\n")
        specs = SpecSet.load(path)
        with pytest.raises(TypeError, match=f"construction param '{bad}' of its spec entry "
                                            f"would hide an attribute of Op"):
            class ClashOp(Op, specs=specs):  # noqa: F841
                pass
