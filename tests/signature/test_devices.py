"""Devices: the tensors of one call share a device.

The generated checks compare each given input's device with the call's (the first given
input's, read through the adapter) and refuse a mismatch with the structured call error,
naming both inputs and both devices; an input declared ``device: any`` is left out; an
adapter without devices (numpy) reads and compares none. The spec is written here so its
lines are fixed.
"""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")

from tileops.signature import (  # noqa: E402
    DTypeAdapter,
    SignatureCallError,
    SignaturePlan,
    explain,
    numpy_adapter,
)
from tileops.spec import load_spec_text  # noqa: E402

SPEC = """\
TwoOp:
  family: misc
  status: spec-only
  signature:
    forall: {N: Dim, T: "DType[float32]"}
    inputs:
      x: {dtype: T, shape: "[N]"}
      weight: {dtype: T, shape: "[N]"}
    outputs:
      y: {dtype: T, shape: "[N]"}

ThreeOp:
  family: misc
  status: spec-only
  signature:
    forall: {N: Dim, T: "DType[float32]"}
    inputs:
      a: {dtype: T, shape: "[N]"}
      b: {dtype: T, shape: "[N]"}
      c: {dtype: T, shape: "[N]", optional: true}
    outputs:
      y: {dtype: T, shape: "[N]"}

ScaledOp:
  family: misc
  status: spec-only
  signature:
    forall: {N: Dim, T: "DType[float32]"}
    inputs:
      index: {dtype: int64, shape: "[N]", device: any}
      x: {dtype: T, shape: "[N]"}
      scale: {dtype: float32, shape: "[]", device: any}
      bias: {dtype: T, shape: "[N]"}
    outputs:
      y: {dtype: T, shape: "[N]"}

HostOp:
  family: misc
  status: spec-only
  signature:
    forall: {N: Dim}
    inputs:
      a: {dtype: int64, shape: "[N]", device: any}
      b: {dtype: int64, shape: "[N]", device: any}
    outputs:
      y: {dtype: int64, shape: "[N]"}
"""


@pytest.fixture(scope="module")
def spec():
    return load_spec_text(SPEC, "devices.yaml")


def point(spec, name: str, adapter: DTypeAdapter | None = None):
    return SignaturePlan(name, spec.entries[name], spec=spec, adapter=adapter).construct()


def t(n: int, device: str = "cpu", dtype=torch.float32):
    return torch.ones(n, dtype=dtype, device=device)


def checks(p):
    """Every variant of the call check: each must refuse with the same error."""
    return (p.check, p.check_exact, p.check_symbolic)


def refused(check, *args) -> str:
    with pytest.raises(SignatureCallError) as info:
        check(*args)
    assert type(info.value) is SignatureCallError
    return str(info.value)


def test_two_inputs_on_different_devices(spec) -> None:
    p = point(spec, "TwoOp")
    for check in checks(p):
        assert refused(check, t(3), t(3, "meta")) == textwrap.dedent("""\
            TwoOp: argument weight does not match the signature
              expected: weight: Tensor[T, [N]] on x's device
              seen:     weight: f32[3]
              because:  weight is on meta, x on cpu: the tensors of one call must share a device
              call:     x: f32[3], weight: f32[3]
              bound:    T = float32, N = 3
              spec:     devices.yaml:8 (TwoOp.signature.inputs.weight)""")
    # the first input sets the call's device: the other way round names the other pair
    assert "because:  weight is on cpu, x on meta:" in refused(p.check, t(3, "meta"), t(3))
    call = p.check(t(3, "meta"), t(3, "meta"))
    assert call.device == torch.device("meta")


@pytest.mark.parametrize(("elsewhere", "args"), [
    ("b", lambda: (t(3), t(3, "meta"), t(3))),
    ("c", lambda: (t(3), t(3), t(3, "meta"))),
])
def test_three_inputs_the_second_or_third_elsewhere(spec, elsewhere, args) -> None:
    p = point(spec, "ThreeOp")
    line = {"b": 19, "c": 20}[elsewhere]
    for check in checks(p):
        assert refused(check, *args()) == textwrap.dedent(f"""\
            ThreeOp: argument {elsewhere} does not match the signature
              expected: {elsewhere}: Tensor[T, [N]] on a's device
              seen:     {elsewhere}: f32[3]
              because:  {elsewhere} is on meta, a on cpu: the tensors of one call must share a device
              call:     a: f32[3], b: f32[3], c: f32[3]
              bound:    T = float32, N = 3
              spec:     devices.yaml:{line} (ThreeOp.signature.inputs.{elsewhere})""")
    assert p.check(t(3), t(3)).device == torch.device("cpu")  # c absent: nothing to compare


def test_a_device_mismatch_is_found_before_the_inputs_own_checks(spec) -> None:
    # b is compared with a as soon as it is read, before its dtype and shape
    bad = (t(3), t(4, "meta", torch.float16))
    assert "because:  b is on meta, a on cpu:" in refused(point(spec, "ThreeOp").check, *bad)
    # an earlier input's own failure comes first, as for every other check
    assert "because:  N bound to 3 by a.shape[0], but b.shape[0] is 4" in refused(
        point(spec, "ThreeOp").check, t(3), t(4), t(3, "meta"))


def test_an_input_declared_device_any_is_exempt(spec) -> None:
    p = point(spec, "ScaledOp")
    index, scale = t(3, "meta", torch.int64), torch.tensor(2.0)
    for check in checks(p):
        call = check(index, t(3), scale, t(3))
        # the call's device is the first input that is compared, x (not index, on meta)
        assert call.device == torch.device("cpu")
        assert check(t(3, dtype=torch.int64), t(3, "meta"), scale, t(3, "meta")).device \
            == torch.device("meta")
        assert refused(check, index, t(3), scale, t(3, "meta")) == textwrap.dedent("""\
            ScaledOp: argument bias does not match the signature
              expected: bias: Tensor[T, [N]] on x's device
              seen:     bias: f32[3]
              because:  bias is on meta, x on cpu: the tensors of one call must share a device
              call:     index: i64[3], x: f32[3], scale: f32[], bias: f32[3]
              bound:    N = 3, T = float32
              spec:     devices.yaml:33 (ScaledOp.signature.inputs.bias)""")
    source = p.source()
    assert "t_index.device" not in source and "t_scale.device" not in source
    assert "  effects: index on any device; scale on any device" in explain(p.plan).splitlines()


def test_when_every_input_may_be_anywhere_the_first_gives_the_device(spec) -> None:
    p = point(spec, "HostOp")
    call = p.check(t(3, "meta", torch.int64), t(3, dtype=torch.int64))
    assert call.device == torch.device("meta")
    assert ".device ==" not in p.source() and "return _R(t_a.device, " in p.source()


def test_the_hot_path_reads_each_device_once(spec) -> None:
    # one read and one comparison per input after the first; the record reuses the first's
    fast = point(spec, "ThreeOp").source().split("def check(")[1].split("def check_symbolic(")[0]
    present = fast.split("else:")[1]
    assert present.count(".device") == 3
    assert "if not (t_b.device == dev_a): raise _Miss" in present
    assert "if not (t_c.device == dev_a): raise _Miss" in present
    assert "return _R(dev_a, " in present
    # a single input: its device read once, for the record, as without the comparison
    single = point(spec, "TwoOp").source()
    assert "return _R(dev_x, " in single
    absent = fast.split("else:")[0]
    assert absent.count(".device") == 2 and "dev_a" in absent


# --- adapters ----------------------------------------------------------------------------------


def test_numpy_arrays_have_no_device_to_compare(spec) -> None:
    np = pytest.importorskip("numpy")
    p = point(spec, "TwoOp", numpy_adapter())
    call = p.check(np.ones(3, dtype=np.float32), np.ones(3, dtype=np.float32))
    assert call.device is None
    assert "device" not in p.source().replace("_R(None", "")


class Arr:
    """A tensor-like object of a library whose device attribute is ``where``."""

    def __init__(self, n: int, where: str) -> None:
        self.shape, self.dtype, self.where = (n,), "f32", where


def test_the_device_is_read_through_the_adapter(spec) -> None:
    adapter = DTypeAdapter("mylib", {"float32": "f32"}, device="where")
    p = point(spec, "TwoOp", adapter)
    assert p.check(Arr(3, "host"), Arr(3, "host")).device == "host"
    assert refused(p.check, Arr(3, "host"), Arr(3, "npu")).splitlines()[3] == (
        "  because:  weight is on npu, x on host: the tensors of one call must share a device")
    # without a device attribute nothing is read: objects that have none pass
    bare = DTypeAdapter("bare", {"float32": "f32"})
    obj = type("Obj", (), {"shape": (3,), "dtype": "f32"})
    assert point(spec, "TwoOp", bare).check(obj(), obj()).device is None


def test_an_adapter_device_attribute_must_be_an_identifier() -> None:
    with pytest.raises(ValueError) as info:
        DTypeAdapter("mylib", {}, device="x.device")
    assert str(info.value) == "adapter 'mylib': device attribute 'x.device' is not an identifier"
