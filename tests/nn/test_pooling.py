"""tileops.nn's pooling layers are torch.nn's: the same constructor and attributes, the same
outputs (indices included) and gradients, on the reference target here."""

import copy
import pickle

import pytest
import torch

import tileops.nn.pooling as tp
from tileops.signature import ConstructionError

#: (layer, its constructor arguments, input shape)
CASES = [
    (tp.MaxPool1d, dict(kernel_size=3, stride=2, padding=1, dilation=2), (2, 3, 17)),
    (tp.MaxPool2d, dict(kernel_size=3, stride=2, ceil_mode=True), (2, 3, 11, 12)),
    (tp.MaxPool2d, dict(kernel_size=(3, 2), return_indices=True), (3, 11, 12)),
    (tp.MaxPool3d, dict(kernel_size=2, padding=1, return_indices=True), (2, 3, 5, 6, 7)),
    (tp.AvgPool1d, dict(kernel_size=4, stride=3, padding=2, count_include_pad=False),
     (2, 3, 17)),
    (tp.AvgPool2d, dict(kernel_size=3, stride=2, padding=1, divisor_override=4),
     (2, 3, 11, 12)),
    (tp.AvgPool3d, dict(kernel_size=(1, 2, 3), ceil_mode=True), (2, 3, 5, 6, 7)),
    (tp.AdaptiveAvgPool2d, dict(output_size=(4, 5)), (2, 3, 11, 12)),
    (tp.AdaptiveMaxPool2d, dict(output_size=3, return_indices=True), (2, 3, 11, 12)),
]


def torch_layer(cls):
    return next(b for b in cls.__mro__ if b.__module__.startswith("torch.nn"))


@pytest.mark.parametrize("cls,kw,shape", CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_layer_is_torchs(cls, kw, shape):
    layer, ref = cls(**kw), torch_layer(cls)(**kw)
    assert isinstance(layer, torch_layer(cls)) and repr(layer) == repr(ref)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    got, want = layer(x), ref(x)
    if kw.get("return_indices"):
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want)
    dy = torch.randn_like(want)
    (g,) = torch.autograd.grad(got, x, dy)
    (w,) = torch.autograd.grad(want, x, dy)
    torch.testing.assert_close(g, w)


def test_a_changed_attribute_rebuilds_the_op():
    layer = tp.MaxPool2d(kernel_size=2, target="reference")
    op = layer.op
    layer.kernel_size = 3
    assert layer.op is not op and layer.op.kernel_size == 3
    assert repr(layer).endswith("target='reference')")
    assert copy.deepcopy(layer).op.kernel_size == 3


def test_a_window_given_as_a_list_is_read_only_and_assigning_rebuilds_the_op():
    """``kernel_size=[2, 2]`` is held as given (a list, torch's repr) but read only: a change
    in place would not reach the op built from it (the next call pooled 2 x 2 windows with
    ``kernel_size`` saying 3), so it is refused by name; assigning rebuilds the op."""
    layer = tp.MaxPool2d(kernel_size=[2, 2])
    assert layer.kernel_size == [2, 2] and repr(layer) == repr(torch.nn.MaxPool2d([2, 2]))
    with pytest.raises(TypeError) as exc:
        layer.kernel_size[0] = 3
    assert str(exc.value) == (
        "MaxPool2d.kernel_size is read only: the layer's op is built from kernel_size, and a "
        "change in place would not reach it; assign a new value (layer.kernel_size = ...), "
        "which rebuilds the op")
    x = torch.randn(1, 2, 6, 6)
    torch.testing.assert_close(layer(x), torch.nn.functional.max_pool2d(x, 2))
    layer.kernel_size, layer.stride = [3, 3], [3, 3]
    torch.testing.assert_close(layer(x), torch.nn.functional.max_pool2d(x, 3))
    other = copy.deepcopy(layer)
    assert other.kernel_size == [3, 3]
    with pytest.raises(TypeError, match="read only"):
        other.stride.append(1)


def test_a_bad_window_is_refused_where_the_layer_is_made():
    with pytest.raises(Exception, match="0 <= pH <= kH // 2"):
        tp.MaxPool2d(kernel_size=3, padding=2)


@pytest.mark.parametrize("size", [(None, 3), (4, None), (None, None), [None, 2]])
@pytest.mark.parametrize("cls", [tp.AdaptiveAvgPool2d, tp.AdaptiveMaxPool2d])
def test_an_adaptive_output_size_with_none_keeps_the_input_s_size_as_torch(cls, size):
    """A None component of output_size is the input's size along that axis, resolved at each
    call (two input sizes, one layer), through a copy and a pickle, and after output_size is
    assigned; a bad given component is still refused at construction."""
    torch_cls = getattr(torch.nn, cls.__name__)
    layer, ref = cls(size), torch_cls(size)
    for shape in ((2, 3, 9, 7), (3, 5, 6)):
        x = torch.randn(shape)
        torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)
    x = torch.randn(2, 3, 9, 7)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        torch.testing.assert_close(copied(x), ref(x), rtol=0, atol=0)
    layer.output_size = ref.output_size = (2, None)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)
    with pytest.raises(ConstructionError, match="H_out > 0"):
        cls((0, None))
