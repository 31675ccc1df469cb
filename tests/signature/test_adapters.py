"""Dtype adapters: the plan works on any object with ``.shape`` and ``.dtype``.

torch and numpy adapters ship; any other tensor-like plugs in with a :class:`DTypeAdapter`
of its own. Importing :mod:`tileops.signature` imports neither library.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tileops.signature import DTypeAdapter, SignatureCallError, SignaturePlan, numpy_adapter
from tileops.spec import DTYPES, load_spec_text

SPEC = """\
NormOp:
  family: norm
  status: spec-only
  signature:
    forall: {B: Shape, T: "DType[float16 | bfloat16 | float32]"}
    params:
      n: {type: int}
    inputs:
      x: {dtype: T, shape: "[*B, n]"}
      weight: {dtype: T, shape: "[n]", optional: true}
    outputs:
      y: {dtype: T, shape: "[*B, n]"}
      rstd: {dtype: float32, shape: "[*B]"}
  roofline:
    flops: "(4 if present(weight) else 3) * prod(B) * n"

Bf16Op:
  family: misc
  status: spec-only
  signature:
    forall: {N: Dim}
    inputs:
      x: {dtype: bfloat16, shape: "[N]"}
    outputs:
      y: {dtype: bfloat16, shape: "[N]"}
"""


@pytest.fixture(scope="module")
def spec():
    return load_spec_text(SPEC, "adapters.yaml")


# --- numpy -----------------------------------------------------------------------------------


def test_numpy_arrays(spec) -> None:
    np = pytest.importorskip("numpy")
    point = SignaturePlan("NormOp", spec.entries["NormOp"], spec=spec,
                          adapter=numpy_adapter()).construct(n=8)
    for dtype, itemsize in (("float16", 2), ("float32", 4)):
        x, w = np.zeros((2, 3, 8), dtype=dtype), np.zeros((8,), dtype=dtype)
        call = point.check(x, w)
        assert call.indices == {"n": 8, "B": (2, 3), "T": dtype}
        assert call.tensors == {"x": ((2, 3, 8), dtype), "weight": ((8,), dtype),
                                "y": ((2, 3, 8), dtype), "rstd": ((2, 3), "float32")}
        assert call.output_dtypes == (np.dtype(dtype), np.dtype("float32"))
        assert call.device is None  # numpy has no device
        assert call.roofline() == (4 * 6 * 8, itemsize * (2 * 48 + 8) + 4 * 6)
        assert point.check(x).roofline()[0] == 3 * 6 * 8


def test_numpy_errors_use_the_same_structure(spec) -> None:
    np = pytest.importorskip("numpy")
    point = SignaturePlan("NormOp", spec.entries["NormOp"], spec=spec,
                          adapter=numpy_adapter()).construct(n=8)
    with pytest.raises(SignatureCallError) as info:
        point.check(np.zeros((2, 8), dtype="float32"), np.zeros((8,), dtype="float16"))
    assert str(info.value) == textwrap.dedent("""\
        NormOp: argument weight does not match the signature
          expected: weight: Tensor[T, [8]]  (declared [n])
          seen:     weight: f16[8]
          because:  T bound to float32 by x.dtype, but weight.dtype is float16
          call:     x: f32[2, 8], weight: f16[8]
          bound:    T = float32, B = [2]
          spec:     adapters.yaml:10 (NormOp.signature.inputs.weight)""")
    with pytest.raises(SignatureCallError, match="x.dtype is float64, but T must be one of "
                                                 "float16, bfloat16, float32"):
        point.check(np.zeros((8,), dtype="float64"))


def test_numpy_adapter_maps_only_the_dtypes_numpy_has(spec) -> None:
    np = pytest.importorskip("numpy")
    ad = numpy_adapter()
    # numpy alone has no bfloat16; ml_dtypes (which some libraries import) registers one
    for name, native in ad.natives.items():
        assert native == np.dtype(name)
    assert ad.native("float16") == np.dtype("float16")
    if "bfloat16" not in ad.natives:
        with pytest.raises(KeyError, match="numpy has no dtype 'bfloat16'"):
            ad.native("bfloat16")
    # a signature that insists on bfloat16 compiles, and a float16 array does not satisfy it
    point = SignaturePlan("Bf16Op", spec.entries["Bf16Op"], spec=spec,
                          adapter=ad).construct()
    with pytest.raises(SignatureCallError, match="x.dtype must be bfloat16, but is float16"):
        point.check(np.zeros((4,), dtype="float16"))


# --- torch -------------------------------------------------------------------------------------


def test_torch_adapter() -> None:
    torch = pytest.importorskip("torch")
    from tileops.signature import torch_adapter

    ad = torch_adapter()
    assert ad is torch_adapter()  # one per library
    assert ad.native("bfloat16") is torch.bfloat16
    assert ad.name_of(torch.float8_e4m3fn) == "float8_e4m3fn"
    assert ad.short(torch.bfloat16) == "bf16" and ad.short(torch.int32) == "i32"
    assert ad.itemsizes[torch.float32] == 4 and ad.itemsizes[torch.complex128] == 16
    assert set(ad.natives) == set(DTYPES)


def test_a_strict_torch_adapter_takes_torch_tensors_only(spec) -> None:
    """What an op's kernels run on is a torch.Tensor: the strict adapter (the runtime's)
    refuses any other object by its type, where the plain one checks its shape."""
    torch = pytest.importorskip("torch")
    from tileops.signature import torch_adapter

    strict = torch_adapter(strict=True)
    assert strict is torch_adapter(strict=True) and strict is not torch_adapter()
    assert strict.natives == torch_adapter().natives

    class Tensorish:
        shape, dtype, device = torch.Size([8, 4096]), torch.bfloat16, torch.device("cpu")

    plans = {ad: SignaturePlan("NormOp", spec.entries["NormOp"], spec=spec, adapter=ad)
             for ad in (strict, torch_adapter())}
    assert plans[torch_adapter()].construct(n=4096).check(Tensorish()) is not None
    point = plans[strict].construct(n=4096)
    for check in (point.check, point.check_exact, point.check_symbolic):
        with pytest.raises(SignatureCallError) as info:
            check(Tensorish())
        assert info.value.because == (f"x must be a torch.Tensor, got {__name__}."
                                      "test_a_strict_torch_adapter_takes_torch_tensors_only."
                                      "<locals>.Tensorish")
    x = torch.empty(8, 4096, dtype=torch.bfloat16, device="meta")
    assert point.check(x).tensors["y"] == ((8, 4096), "bfloat16")
    with pytest.raises(ValueError, match="a strict adapter names its array types"):
        DTypeAdapter("x", {}, strict=True)


def test_torch_meta_tensors(spec) -> None:
    # the check reads only .shape, .dtype and .device: meta tensors (no storage) pass
    torch = pytest.importorskip("torch")
    point = SignaturePlan("NormOp", spec.entries["NormOp"], spec=spec).construct(n=4096)
    x = torch.empty(8, 4096, dtype=torch.bfloat16, device="meta")
    call = point.check(x)
    assert call.device == torch.device("meta")
    assert call.tensors["y"] == ((8, 4096), "bfloat16")


# --- any tensor-like -------------------------------------------------------------------------


class Array:
    """A tensor-like from some other library: dtypes are its own objects."""

    def __init__(self, shape: tuple[int, ...], dtype: Dtype) -> None:
        self.shape, self.dtype = shape, dtype


class Dtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Dtype({self.name})"


def test_a_custom_adapter(spec) -> None:
    dtypes = {n: Dtype(n) for n in ("float16", "bfloat16", "float32")}
    ad = DTypeAdapter("mylib", dtypes)
    point = SignaturePlan("NormOp", spec.entries["NormOp"], spec=spec,
                          adapter=ad).construct(n=4)
    call = point.check(Array((5, 4), dtypes["bfloat16"]), Array((4,), dtypes["bfloat16"]))
    assert call.indices["T"] == "bfloat16"
    assert call.output_dtypes == (dtypes["bfloat16"], dtypes["float32"])
    assert call.roofline() == (4 * 5 * 4, 2 * (20 + 4 + 20) + 4 * 5)
    with pytest.raises(SignatureCallError, match=r"seen:     x: bf16\[5, 3\]"):
        point.check(Array((5, 3), dtypes["bfloat16"]))


def test_unknown_dtype_is_reported_not_crashed(spec) -> None:
    ad = DTypeAdapter("mylib", {"float32": "f32"})
    point = SignaturePlan("NormOp", spec.entries["NormOp"], spec=spec,
                          adapter=ad).construct(n=4)
    with pytest.raises(SignatureCallError) as info:
        point.check(Array((4,), "weird"))  # type: ignore[arg-type]
    assert info.value.because == ("x.dtype is 'weird' (builtins.str), not a dtype the mylib "
                                  "adapter maps; T must be one of float16, bfloat16, float32")


# --- no torch at import --------------------------------------------------------------------------


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=False)


def test_import_does_not_import_torch() -> None:
    r = _run("import sys, tileops.signature; assert 'torch' not in sys.modules, 'torch'; "
             "assert 'numpy' not in sys.modules, 'numpy'")
    assert r.returncode == 0, r.stderr


def test_numpy_use_does_not_import_torch() -> None:
    pytest.importorskip("numpy")
    code = textwrap.dedent(f"""\
        import sys
        import numpy as np
        from tileops.spec import load_spec_text
        from tileops.signature import SignaturePlan, numpy_adapter, explain
        spec = load_spec_text({SPEC!r}, "adapters.yaml")
        plan = SignaturePlan("NormOp", spec.entries["NormOp"], spec=spec,
                             adapter=numpy_adapter())
        call = plan.construct(n=8).check(np.zeros((2, 8), dtype="float32"))
        call.roofline(); call.traffic; call.indices; explain(plan, code=True, params={{"n": 8}})
        assert "torch" not in sys.modules
        """)
    r = _run(code)
    assert r.returncode == 0, r.stderr


def test_a_subclass_that_redefines_shape_has_its_entries_checked(spec) -> None:
    """An array subclass that keeps the library's ``shape`` is trusted as the library's arrays
    are; one whose ``shape`` is its own (here: -3 and 2.5) is read entry by entry and refused
    by name, as any other object with ``.shape``."""
    np = pytest.importorskip("numpy")

    class Lying(np.ndarray):
        shape = property(lambda self: self.fake)

    class Plain(np.ndarray):
        pass

    point = SignaturePlan("NormOp", spec.entries["NormOp"], spec=spec,
                          adapter=numpy_adapter()).construct(n=8)
    lying = np.zeros((2, 8), "float32").view(Lying)
    lying.fake = (-3, 2.5)
    for check in (point.check, point.check_exact):
        with pytest.raises(SignatureCallError, match=r"x\.shape\[0\] is -3, not a size"):
            check(lying)
        assert check(np.zeros((2, 8), "float32").view(Plain)).tensors["x"] == ((2, 8), "float32")
