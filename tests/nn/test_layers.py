"""tileops.nn's layers against torch.nn's: constructor, parameters and init, state_dict both
ways, forward numerics, repr, copies (deepcopy, pickle, torch.save), rebuilding the op, and the
errors a bad input gets.

Everything runs on the CPU, where the ops are served by the ``reference`` target. Forward
numerics run under ``torch.no_grad()``: the parameters require grad, and that the layers train
is test_grad.py's subject. Shapes are tiny: the reference target builds a kernel per shape.
"""

from __future__ import annotations

import copy
import io
import operator
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tileops.nn as tnn
from tileops.runtime import TargetError
from tileops.signature import SignatureCallError

# (tileops.nn layer, torch.nn layer): the constructor args both take
NORMS = {
    "rmsnorm": (tnn.RMSNorm, nn.RMSNorm, (8,), {}),
    "rmsnorm-eps-2d": (tnn.RMSNorm, nn.RMSNorm, ((2, 4),), {"eps": 1e-3}),
    "rmsnorm-no-affine": (tnn.RMSNorm, nn.RMSNorm, (8,), {"elementwise_affine": False}),
    "layernorm": (tnn.LayerNorm, nn.LayerNorm, (8,), {}),
    "layernorm-2d": (tnn.LayerNorm, nn.LayerNorm, ((2, 4),), {"eps": 1e-3}),
    "layernorm-no-bias": (tnn.LayerNorm, nn.LayerNorm, (8,), {"bias": False}),
    "layernorm-no-affine": (tnn.LayerNorm, nn.LayerNorm, (8,), {"elementwise_affine": False}),
}
LINEARS = {
    "linear": ((5, 4), {}),
    "linear-no-bias": ((5, 4), {"bias": False}),
}
ALL = {**NORMS, **{k: (tnn.Linear, nn.Linear, args, kw) for k, (args, kw) in LINEARS.items()}}


def _pair(name: str, **extra) -> tuple[nn.Module, nn.Module]:
    ours, theirs, args, kw = ALL[name]
    return ours(*args, **kw, **extra), theirs(*args, **kw, **extra)


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.dtype))
    return module


def _input(module: nn.Module, dtype: torch.dtype = torch.float32, lead=(3, 2)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    tail = (module.in_features,) if isinstance(module, nn.Linear) else module.normalized_shape
    return torch.randn(*lead, *tail, generator=gen).to(dtype)


# --- constructor, parameters, init -------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_same_parameters_and_init_as_torch(name):
    ours_cls, theirs_cls, args, kw = ALL[name]
    torch.manual_seed(0)
    ours = ours_cls(*args, **kw)
    torch.manual_seed(0)
    theirs = theirs_cls(*args, **kw)
    assert isinstance(ours, type(theirs))
    got, want = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert list(got) == list(want)
    for k in want:
        assert type(got[k]) is nn.Parameter
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype
        assert torch.equal(got[k], want[k]), k  # same init, same RNG draws
    # an absent weight or bias is registered as None, as torch does
    assert {k: v is None for k, v in ours._parameters.items()} == \
        {k: v is None for k, v in theirs._parameters.items()}


@pytest.mark.parametrize("name", ALL)
def test_reset_parameters_is_torchs(name):
    ours, theirs = _pair(name)
    _randomize(ours)
    torch.manual_seed(3)
    ours.reset_parameters()
    torch.manual_seed(3)
    theirs.reset_parameters()
    for (k, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.equal(a, b), k


def test_device_and_dtype_reach_the_parameters():
    for layer in (tnn.RMSNorm(4, dtype=torch.float16, device="cpu"),
                  tnn.LayerNorm(4, dtype=torch.float16, device="cpu"),
                  tnn.Linear(4, 3, dtype=torch.float16, device="cpu"),
                  tnn.FusedAddRMSNorm(4, dtype=torch.float16, device="cpu")):
        assert {p.dtype for p in layer.parameters()} == {torch.float16}
        assert {p.device.type for p in layer.parameters()} == {"cpu"}


# --- state_dict both ways ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_state_dict_loads_both_ways(name):
    ours, theirs = _pair(name)
    _randomize(theirs, seed=1)
    assert ours.load_state_dict(theirs.state_dict(), strict=True).missing_keys == []
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    ours2, theirs2 = _pair(name)
    _randomize(ours2, seed=2)
    theirs2.load_state_dict(ours2.state_dict(), strict=True)
    for k, v in ours2.state_dict().items():
        assert torch.equal(theirs2.state_dict()[k], v), k


@pytest.mark.parametrize("affine", [True, False])
def test_fused_add_rms_norm_state_dict_is_rms_norms(affine):
    ours = _randomize(tnn.FusedAddRMSNorm(8, elementwise_affine=affine))
    theirs = nn.RMSNorm(8, elementwise_affine=affine)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    back = tnn.FusedAddRMSNorm(8, elementwise_affine=affine)
    back.load_state_dict(_randomize(theirs, seed=4).state_dict(), strict=True)
    assert list(back.state_dict()) == (["weight"] if affine else [])
    for k, v in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


# --- forward numerics --------------------------------------------------------------------------


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("lead", [(3, 2), (1,), ()], ids=["lead-3x2", "lead-1", "no-lead"])
def test_norm_matches_torch(name, lead):
    ours, theirs = _pair(name)
    _randomize(theirs)
    ours.load_state_dict(theirs.state_dict())
    x = _input(ours, lead=lead)
    with torch.no_grad():
        y = ours(x)
        torch.testing.assert_close(y, theirs(x))  # float32, the same state
        # and against float64: the op computes in float32, so float32's tolerance
        torch.testing.assert_close(y.double(), copy.deepcopy(theirs).double()(x.double()),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in NORMS if "no-affine" not in n])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_a_float32_weight_beside_16_bit_inputs_answers_in_the_inputs_dtype(name, x_dtype):
    """Mixed precision keeps float32 parameters beside 16-bit activations: torch's norms take
    them and answer in the input's dtype, and so do these (the weight taken as it is, its
    gradient computed and returned in float32)."""
    ours, theirs = _pair(name)
    _randomize(theirs)
    ours.load_state_dict(theirs.state_dict())
    x = _input(ours).to(x_dtype)
    y = ours(x)
    want = theirs(x)
    assert y.dtype == want.dtype == x_dtype
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    want.float().sum().backward()
    for mine, ref in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert mine.grad.dtype == torch.float32
        torch.testing.assert_close(mine.grad, ref.grad, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "fused-add"])
def test_a_float32_weight_s_gradient_is_float32_accurate_beside_bfloat16_inputs(name):
    """The gradient of a float32 weight (and bias) beside bfloat16 inputs is summed in float32
    and rounded once to float32, as torch's: within float32's accuracy of the float64
    gradient (rounded through bfloat16 it was about 0.25 off on a sum of up to 189)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g).bfloat16()
    dy = torch.randn(4096, 64, generator=g).bfloat16()
    if name == "fused-add":
        r = torch.randn(4096, 64, generator=g).bfloat16()
        ours = tnn.FusedAddRMSNorm(64)
        ours(x, r)[0].backward(dy)
        x = (x.float() + r.float()).bfloat16()  # the rounded sum the norm normalizes
        ref = nn.RMSNorm(64, eps=1e-6).double()
    else:
        ours = tnn.RMSNorm(64) if name == "rmsnorm" else tnn.LayerNorm(64)
        ours(x).backward(dy)
        ref = (nn.RMSNorm(64) if name == "rmsnorm" else nn.LayerNorm(64)).double()
    ref(x.double()).backward(dy.double())
    for mine, want in zip(ours.parameters(), ref.parameters(), strict=True):
        assert mine.grad.dtype == torch.float32
        err = float((mine.grad.double() - want.grad).abs().max())
        assert err <= 1e-4 * float(want.grad.abs().max()), err


def test_linear_under_autocast_runs_in_autocasts_dtype():
    ours, theirs = _pair("linear")
    ours.load_state_dict(theirs.state_dict())
    x = _input(ours)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = ours(x), theirs(x)
    assert y.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32
    assert ours(x).dtype == torch.float32  # autocast off again


@settings(max_examples=20, deadline=None)
@given(layer=st.sampled_from(["rmsnorm", "layernorm"]),
       lead=st.lists(st.integers(1, 4), max_size=2),
       shape=st.lists(st.integers(1, 9), min_size=1, max_size=2),
       eps=st.sampled_from([1e-6, 1e-2]))
def test_norm_matches_torch_over_shapes(layer, lead, shape, eps):
    ours_cls, theirs_cls = (tnn.RMSNorm, nn.RMSNorm) if layer == "rmsnorm" else \
        (tnn.LayerNorm, nn.LayerNorm)
    theirs = _randomize(theirs_cls(shape, eps=eps))
    ours = ours_cls(shape, eps=eps)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(*lead, *shape, generator=torch.Generator().manual_seed(len(lead)))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).double(), theirs.double()(x.double()),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_add_rms_norm_is_add_then_rms_norm(affine, inplace):
    layer = _randomize(tnn.FusedAddRMSNorm(8, eps=1e-5, elementwise_affine=affine,
                                           inplace=inplace))
    rms = nn.RMSNorm(8, eps=1e-5, elementwise_affine=affine)
    rms.load_state_dict(layer.state_dict())
    gen = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    want_s = x + r
    with torch.no_grad():
        want_y = rms(want_s)
        y, s = layer(x.clone() if not inplace else x, r.clone() if not inplace else r)
    torch.testing.assert_close(s, want_s)
    torch.testing.assert_close(y, want_y)
    if inplace:  # the results are written into the inputs
        assert y.data_ptr() == x.data_ptr() and s.data_ptr() == r.data_ptr()


# the tolerance is the output's rounding; GemmFwdOp's dtypes have no float32 yet (the training
# contract's union has it), so a float32 Linear is refused by the signature check
LINEAR_DTYPES = [
    pytest.param(torch.bfloat16, 1.6e-2, id="bfloat16"),
    pytest.param(torch.float16, 2e-3, id="float16"),
    pytest.param(torch.float64, 1e-12, id="float64"),
    pytest.param(torch.float32, 1e-5, id="float32"),
]


@pytest.mark.parametrize("name", LINEARS)
@pytest.mark.parametrize(("dtype", "tol"), LINEAR_DTYPES)
@pytest.mark.parametrize("lead", [(3, 2), (6,), ()], ids=["lead-3x2", "lead-6", "one-row"])
def test_linear_matches_torch(name, dtype, tol, lead):
    (args, kw) = LINEARS[name]
    theirs = _randomize(nn.Linear(*args, **kw, dtype=dtype))
    ours = tnn.Linear(*args, **kw, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    x = _input(ours, dtype, lead)
    with torch.no_grad():
        y = ours(x)
        assert y.shape == (*lead, args[1]) and y.dtype == dtype
        want = copy.deepcopy(theirs).double()(x.double())  # the same values, in float64
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)


# --- repr ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_repr_is_torchs(name):
    ours, theirs = _pair(name)
    assert repr(ours) == repr(theirs)


def test_repr_shows_the_target_when_set():
    assert repr(tnn.RMSNorm(8, target="reference")) == \
        "RMSNorm((8,), eps=None, elementwise_affine=True, target='reference')"
    assert repr(tnn.LayerNorm(8, bias=False, target="reference")) == \
        "LayerNorm((8,), eps=1e-05, elementwise_affine=True, bias=False, target='reference')"
    assert repr(tnn.Linear(4, 3, target="reference")) == \
        "Linear(in_features=4, out_features=3, bias=True, target='reference')"


def test_fused_add_rms_norm_repr():
    assert repr(tnn.FusedAddRMSNorm(8)) == \
        "FusedAddRMSNorm((8,), eps=1e-06, elementwise_affine=True)"
    assert repr(tnn.FusedAddRMSNorm((8,), eps=1e-5, elementwise_affine=False, inplace=True,
                                    target="reference")) == \
        ("FusedAddRMSNorm((8,), eps=1e-05, elementwise_affine=False, inplace=True, "
         "target='reference')")


# --- the op: passed params, copies, rebuilds -----------------------------------------------------


def _ops_of(layer):
    """Every op a layer runs, its parts' included (held ops and the parts' ``op``)."""
    from tileops.runtime import Op

    found = []
    for module in layer.modules():
        found += [v for v in vars(module).values() if isinstance(v, Op)]
    return found


@pytest.mark.parametrize("make", [
    lambda: tnn.SwiGLUMLP(8, 16),
    lambda: tnn.Attention(32, 4, 2),
    lambda: tnn.Attention(32, 4, 2, window=4, softcap=30.0),
], ids=["swiglu_mlp", "attention", "attention-window"])
def test_assigning_a_composite_layer_s_target_reaches_every_part(make):
    layer = make()
    assert {op.target for op in _ops_of(layer)} == {None}
    layer.target = "reference"
    ops_ = _ops_of(layer)
    assert len(ops_) >= 2 and {op.target for op in ops_} == {"reference"}
    assert {m.target for m in layer.modules() if hasattr(m, "target")} == {"reference"}
    layer.target = None  # and back
    assert {op.target for op in _ops_of(layer)} == {None}
    moved = copy.deepcopy(make()).double()  # a move rebuilds the held ops with the target
    moved.target = "reference"
    assert {op.target for op in _ops_of(moved.double())} == {"reference"}


def test_the_op_gets_the_layers_params():
    op = tnn.RMSNorm((2, 4), eps=1e-3, target="reference").op
    assert (type(op).__name__, op.normalized_shape, op.eps, op.target) == \
        ("RMSNormFwdOp", (2, 4), 1e-3, "reference")
    op = tnn.LayerNorm(8).op
    assert (type(op).__name__, op.normalized_shape, op.eps, op.target) == \
        ("LayerNormFwdOp", (8,), 1e-5, None)
    op = tnn.Linear(4, 3).op
    assert (type(op).__name__, op.trans_a, op.trans_b) == ("GemmFwdOp", False, True)
    op = tnn.FusedAddRMSNorm(8, eps=1e-5, inplace=True).op
    assert (type(op).__name__, op.eps, op.inplace) == ("FusedAddRMSNormFwdOp", 1e-5, True)


def _saved_and_loaded(module: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


ROUND_TRIPS = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _saved_and_loaded,
}
LAYERS = {
    "rmsnorm": lambda: tnn.RMSNorm((2, 4), eps=1e-3, target="reference"),
    "layernorm": lambda: tnn.LayerNorm(8, bias=False),
    "linear": lambda: tnn.Linear(8, 3, dtype=torch.bfloat16),
    "fused-add": lambda: tnn.FusedAddRMSNorm(8, inplace=False),
}


def _run(module: nn.Module) -> tuple:
    dtype = next(module.parameters()).dtype
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5)).to(dtype)
    if isinstance(module, tnn.RMSNorm):
        x = x.view(3, 2, 4)
    with torch.no_grad():
        out = module(x, x.clone()) if isinstance(module, tnn.FusedAddRMSNorm) else module(x)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.parametrize("layer", LAYERS)
def test_round_trip_gives_a_working_layer(trip, layer):
    module = _randomize(LAYERS[layer]())
    before = _run(module)  # bound to a target and holding kernels: still copied whole
    assert "_op" not in module.__getstate__()
    back = ROUND_TRIPS[trip](module)
    assert type(back) is type(module) and repr(back) == repr(module)
    assert back.op is not module.op and type(back.op) is type(module.op)
    assert back.op.target == module.op.target
    for k, v in module.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    for a, b in zip(_run(back), before, strict=True):
        assert torch.equal(a, b)


def test_assigning_a_config_attribute_rebuilds_the_op():
    layer, rms = tnn.RMSNorm(8), nn.RMSNorm(8)
    x = torch.randn(2, 8)
    first = layer.op
    layer.eps = 0.5
    rms.eps = 0.5
    with torch.no_grad():
        torch.testing.assert_close(layer(x), rms(x))
    assert layer.op is not first and layer.op.eps == 0.5
    layer.target = "reference"
    assert layer.op.target == "reference"
    layer.weight.data.mul_(2)  # not config: the op stays
    assert layer.op is layer.op


def test_a_config_assigned_between_compiled_calls_is_taken():
    """The op is rebuilt at the assignment, not at the next call: a compiled call, which
    cannot construct one, sees the new eps."""
    torch._dynamo.reset()
    layer = tnn.RMSNorm(8)
    x = torch.randn(3, 8)
    f = torch.compile(lambda a: layer(a), fullgraph=True)
    f(x)
    layer.eps = 0.25
    torch.testing.assert_close(f(x), F.rms_norm(x, (8,), layer.weight, 0.25))
    # a half-written config the construction refuses waits for the next call, whose error
    # is the op's own
    layer.normalized_shape = (3,)
    with pytest.raises(SignatureCallError, match="RMSNormFwdOp"):
        layer(x)


def test_moving_a_layer_rebuilds_its_op():
    layer = tnn.RMSNorm(8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        layer(x)
        first = layer.op
        layer.to(torch.float16)
        assert layer.op is not first and first.serving_target == "reference"
        assert layer.op.serving_target is None  # the target is chosen again at the next call
        y = layer(x.half())
    torch.testing.assert_close(y, nn.RMSNorm(8, dtype=torch.float16)(x.half()),
                               rtol=2e-3, atol=2e-3)


# --- errors --------------------------------------------------------------------------------------


def test_a_wrong_input_shape_gets_the_ops_error():
    with torch.no_grad():
        with pytest.raises(SignatureCallError) as e:
            tnn.RMSNorm(8)(torch.randn(2, 7))
        assert "RMSNormFwdOp: argument x does not match the signature" in str(e.value)
        assert "x.shape[-1] must be 8, but is 7" in str(e.value)
        with pytest.raises(SignatureCallError) as e:
            tnn.LayerNorm((2, 4))(torch.randn(3, 8))
        assert "LayerNormFwdOp: argument x does not match the signature" in str(e.value)
        with pytest.raises(SignatureCallError) as e:
            tnn.Linear(4, 3, dtype=torch.bfloat16)(torch.randn(2, 5, dtype=torch.bfloat16))
        # the weight is b of a @ b.T: its in_features disagree with the input's
        assert "GemmFwdOp: argument b does not match the signature" in str(e.value)
        assert "K bound to 5 by a.shape[1], but b.shape[1] is 4" in str(e.value)
        with pytest.raises(SignatureCallError) as e:
            tnn.FusedAddRMSNorm(8)(torch.randn(2, 7), torch.randn(2, 7))
        assert "FusedAddRMSNormFwdOp: argument weight does not match the signature" in \
            str(e.value)


def test_fused_add_rms_norm_without_weight_checks_the_row_length():
    layer = tnn.FusedAddRMSNorm(8, elementwise_affine=False)
    with pytest.raises(ValueError) as e:
        layer(torch.randn(2, 7), torch.randn(2, 7))
    assert str(e.value) == ("FusedAddRMSNorm: argument x expected [..., 8] (its last axis is "
                            "normalized_shape (8,)), seen float32[2, 7]")
    with pytest.raises(ValueError, match=r"seen float32\[\]$"):
        layer(torch.tensor(1.0), torch.tensor(1.0))


def test_fused_add_rms_norm_normalizes_one_axis():
    with pytest.raises(ValueError) as e:
        tnn.FusedAddRMSNorm((2, 4))
    assert str(e.value) == ("FusedAddRMSNorm: normalized_shape names the one axis "
                            "FusedAddRMSNormFwdOp normalizes (the last); expected one size, "
                            "seen (2, 4)")


def test_bad_params_are_refused_at_construction_by_the_op():
    with pytest.raises(SignatureCallError) as e:
        tnn.LayerNorm(8, eps=-1.0)
    assert str(e.value).startswith("LayerNormFwdOp: ") and "eps" in str(e.value)
    with pytest.raises(TargetError) as e:
        tnn.Linear(4, 3, target="nowhere")
    assert str(e.value).startswith("GemmFwdOp: unknown target 'nowhere'")


def test_a_zero_dim_input_to_linear():
    with pytest.raises(ValueError) as e:
        tnn.Linear(1, 3, dtype=torch.bfloat16)(torch.tensor(1.0, dtype=torch.bfloat16))
    assert str(e.value) == ("linear: argument input is a 0-dim tensor; expected at least one "
                            "axis (its last is in_features), seen bfloat16[]")


# --- torch.compile ------------------------------------------------------------------------------


def _own_op(cls: type) -> object:
    (name,) = cls.compile_op_names
    return getattr(torch.ops.tileops, name.split("::", 1)[1]).default


def test_a_moved_model_compiles_to_the_ops_nodes():
    """One compile (slow on a small CI machine), of a model moved after construction: the
    layers rebuilt their ops in _apply, so tracing constructs none and the graph holds the ops'
    own nodes and the bias add, in one piece (fullgraph)."""
    torch._dynamo.reset()
    model = nn.Sequential(tnn.RMSNorm(8, dtype=torch.bfloat16),
                          tnn.Linear(8, 3, dtype=torch.bfloat16)).to("cpu")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        y = torch.compile(model, backend=capture, fullgraph=True)(x)
        want = model(x)
    (graph,) = graphs
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert calls == [_own_op(type(model[0].op)), _own_op(type(model[1].op)), operator.add]
    assert torch.equal(y, want)
