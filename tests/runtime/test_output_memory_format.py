"""An op's ``output_memory_format`` and ``output_layout``: the outputs it allocates follow
them, eagerly (the general call and the fused one) and as the compile boundary's fake
outputs; without them they are contiguous."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tileops.runtime import Op, SpecSet, register_builder, register_target  # noqa: E402

SPEC = """
FormatPoolOp:
  family: test
  status: implemented
  signature:
    forall: {N: Dim, C: Dim, H: Dim, W: Dim, T: "DType[float32 | bfloat16]"}
    inputs:
      x: {dtype: T, shape: "[N, C, H, W]"}
    outputs:
      y: {dtype: float32, shape: "[N, C, H, W]"}
LayoutScaleOp:
  family: test
  status: implemented
  signature:
    forall: {S: Shape, T: "DType[float32]"}
    inputs:
      x: {dtype: T, shape: "[*S]"}
    outputs:
      y: {dtype: T, shape: "[*S]"}
"""


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("spec")) / "format.yaml"
    path.write_text(SPEC)
    specs = SpecSet.load(path)

    class FormatPoolOp(Op, specs=specs):
        """Its outputs in its input's memory format, channels last or contiguous."""

        def output_memory_format(self, inputs):
            x = inputs[0]
            return (torch.channels_last if not x.is_contiguous()
                    and x.is_contiguous(memory_format=torch.channels_last)
                    else torch.contiguous_format)

    class PlainPoolOp(Op, specs=specs, entry="FormatPoolOp"):
        pass

    class LayoutScaleOp(Op, specs=specs):
        """Its output in its input's memory order (``torch.empty_like``'s strides)."""

        def output_layout(self, inputs, shape):
            return torch.empty_like(inputs[0]).stride()

    class PlainScaleOp(Op, specs=specs, entry="LayoutScaleOp"):
        pass

    register_target("format-test", None)

    def builder(op, call):
        def kernel(x, y):
            y.copy_(x.float() * 2)

        return kernel

    ops = (FormatPoolOp, PlainPoolOp, LayoutScaleOp, PlainScaleOp)
    for cls in ops:
        register_builder("format-test", cls, builder)
    return ops


def test_fresh_outputs_follow_the_ops_format(classes):
    fmt_cls, plain_cls, *_ = classes
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    op = fmt_cls(target="format-test")
    for _ in range(3):  # the general call, then the fused one
        y = op(x)
        assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
        torch.testing.assert_close(y, x.float() * 2)
    assert op(x.contiguous()).is_contiguous()
    assert plain_cls(target="format-test")(x).is_contiguous()  # no hook: contiguous


def test_fake_outputs_follow_the_ops_format(classes):
    fmt_cls, *_ = classes
    op = fmt_cls(target="format-test")
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)

    def strides(t):
        y = op(t)
        # read while tracing: the fake output's strides
        return y, torch.tensor(y.is_contiguous(memory_format=torch.channels_last))

    y, cl = torch.compile(strides, fullgraph=True, backend="eager")(x)
    assert bool(cl) and y.is_contiguous(memory_format=torch.channels_last)



def test_outputs_like_an_input_follow_the_ops_layout(classes):
    """An op's ``output_layout``: the output like a non-contiguous input takes its strides,
    in the general call, the fused one and as the compile boundary's fake; a contiguous input
    gives a contiguous output without consulting it; without the hook, contiguous."""
    _, _, layout_cls, plain_cls = classes
    x = torch.randn(3, 4, 5).permute(2, 0, 1)
    op = layout_cls(target="format-test")
    for _ in range(3):  # the general call, then the fused one
        y = op(x)
        assert y.stride() == x.stride() and not y.is_contiguous()
        torch.testing.assert_close(y, x * 2)
    assert op(x.contiguous()).is_contiguous()
    assert plain_cls(target="format-test")(x).is_contiguous()

    def fn(t):
        y = op(t)
        return y, torch.tensor(y.stride())  # read while tracing: the fake's strides

    y, fake = torch.compile(fn, fullgraph=True, backend="eager")(x)
    assert tuple(fake.tolist()) == x.stride() == y.stride()


ANY_SPEC = """
AnyFirstLikeOp:
  family: test
  status: implemented
  signature:
    forall: {S: Shape, T: "DType[float32]"}
    inputs:
      s: {dtype: T, shape: "[*S]", device: any}
      x: {dtype: T, shape: "[*S]"}
    outputs:
      y: {dtype: T, shape: "[*S]"}
AnyFirstNewOp:
  family: test
  status: implemented
  signature:
    forall: {S: Shape, T: "DType[float32]"}
    inputs:
      s: {dtype: T, shape: "[*S]", device: any}
      x: {dtype: T, shape: "[*S]"}
    outputs:
      y: {dtype: float32, shape: "[*S]"}
      z: {dtype: T, shape: "[2, *S]"}
"""


def test_outputs_are_never_allocated_like_an_input_that_may_be_elsewhere(tmp_path):
    """An input declared ``device: any`` (a CPU tensor beside the call's others) is never the
    one an output is allocated like: the outputs are on the call's device (meta here), in the
    general call and the fused one, whether the output has that input's declared dtype or
    another one of the same type."""
    path = tmp_path / "any.yaml"
    path.write_text(ANY_SPEC)
    specs = SpecSet.load(path)

    class AnyFirstLikeOp(Op, specs=specs):
        pass

    class AnyFirstNewOp(Op, specs=specs):
        pass

    register_target("any-device-test", None)
    register_builder("any-device-test", AnyFirstLikeOp, lambda op, call: lambda s, x, y: None)
    register_builder("any-device-test", AnyFirstNewOp,
                     lambda op, call: lambda s, x, y, z: None)
    s, x = torch.randn(3), torch.empty(3, device="meta")
    for cls in (AnyFirstLikeOp, AnyFirstNewOp):
        op = cls(target="any-device-test")
        for _ in range(3):  # the general call, then the fused one
            out = op(s, x)
            outs = out if isinstance(out, tuple) else (out,)
            assert [o.device.type for o in outs] == ["meta"] * len(outs)
