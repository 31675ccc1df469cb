"""tileops.nn.functional: the functions against torch.nn.functional's, and the op cache."""

from __future__ import annotations

import inspect
import threading

import pytest
import torch
import torch.nn.functional as F

import tileops.nn.functional as tf
from tileops.ops import GemmFwdOp, RMSNormFwdOp
from tileops.signature import ConstructionError, SignatureCallError


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


_EMPTY = inspect.Parameter.empty
# F.linear is a builtin without an inspectable signature; this is its documented one
_LINEAR = [("input", _EMPTY), ("weight", _EMPTY), ("bias", None)]


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "linear"])
def test_signatures_are_torchs_plus_target(name):
    ours = inspect.signature(getattr(tf, name)).parameters
    theirs = _LINEAR if name == "linear" else \
        [(p.name, p.default) for p in inspect.signature(getattr(F, name)).parameters.values()]
    assert theirs == [(p.name, p.default) for p in ours.values() if p.name != "target"]
    assert ours["target"].kind is inspect.Parameter.KEYWORD_ONLY and ours["target"].default is None


@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize(("shape", "eps"), [(8, None), ((2, 4), 1e-3)])
def test_rms_norm(weight, shape, eps):
    tail = (shape,) if isinstance(shape, int) else shape
    x, w = _randn(3, *tail), _randn(*tail, seed=1) if weight else None
    torch.testing.assert_close(tf.rms_norm(x, shape, w, eps), F.rms_norm(x, tail, w, eps))


@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm(affine):
    x = _randn(3, 8)
    w = _randn(8, seed=1) if affine != "none" else None
    b = _randn(8, seed=2) if affine == "both" else None
    torch.testing.assert_close(tf.layer_norm(x, (8,), w, b, 1e-3),
                               F.layer_norm(x, (8,), w, b, 1e-3))


def test_fused_add_rms_norm():
    x, r, w = _randn(3, 8), _randn(3, 8, seed=1), _randn(8, seed=2)
    y, s = tf.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, F.rms_norm(x + r, (8,), w, 1e-5))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(2, 3), (4,), ()], ids=["lead-2x3", "lead-4", "one-row"])
def test_linear(bias, lead):
    x = _randn(*lead, 5, dtype=torch.bfloat16)
    w = _randn(4, 5, dtype=torch.bfloat16, seed=1)
    b = _randn(4, dtype=torch.bfloat16, seed=2) if bias else None
    y = tf.linear(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (*lead, 4) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("lead", [(2, 3), (4,)], ids=["lead-2x3", "lead-4"])
def test_linear_of_no_in_features_is_torchs(lead):
    """in_features = 0 with leading axes: the bias (or zeros) of torch's shape (the leading
    axes were flattened with a -1, ambiguous among 0 elements)."""
    x, w, b = torch.randn(*lead, 0), torch.randn(4, 0), torch.randn(4)
    for bias in (None, b):
        torch.testing.assert_close(tf.linear(x, w, bias), F.linear(x, w, bias), rtol=0, atol=0)


@pytest.mark.parametrize(("bias", "seen"), [
    (torch.zeros(4, dtype=torch.float32), "float32[4]"),  # torch's add would promote it
    (torch.zeros(1, dtype=torch.bfloat16), "bfloat16[1]"),  # and broadcast this one
    (0.5, "float"),
])
def test_linear_refuses_a_bias_unlike_the_output(bias, seen):
    x, w = _randn(2, 5, dtype=torch.bfloat16), _randn(4, 5, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        tf.linear(x, w, bias)
    assert str(e.value) == ("linear: argument bias does not match the output; expected "
                            f"bfloat16[4] (the output's dtype, out_features), seen {seen}")


def test_linear_leaves_a_non_tensor_input_to_the_op():
    with pytest.raises(SignatureCallError, match="^GemmFwdOp: argument a"):
        tf.linear([[1.0]], _randn(4, 1, dtype=torch.bfloat16))


# --- the op cache ------------------------------------------------------------------------------


def test_one_op_per_configuration():
    tf.rms_norm(_randn(2, 8), 8, eps=1e-4)
    op = tf.op_for(RMSNormFwdOp, normalized_shape=8, eps=1e-4, target=None)
    assert op is tf.op_for(RMSNormFwdOp, normalized_shape=8, eps=1e-4, target=None)
    assert op.last_call is not None  # the one rms_norm ran
    assert tf.op_for(RMSNormFwdOp, normalized_shape=8, eps=1e-3, target=None) is not op
    # a list and a tuple of the same sizes are one configuration
    assert tf.op_for(RMSNormFwdOp, normalized_shape=[2, 4]) is \
        tf.op_for(RMSNormFwdOp, normalized_shape=(2, 4))
    # 1 == True and hash(1) == hash(True), but the op refuses trans_a=1: the cached
    # trans_a=True instance must not answer for it
    assert tf.op_for(GemmFwdOp, trans_a=True).trans_a is True
    with pytest.raises(ConstructionError, match="^GemmFwdOp: construction param trans_a"):
        tf.op_for(GemmFwdOp, trans_a=1)


def test_the_cache_is_bounded_oldest_first():
    cache = tf.OpCache(2)
    a = cache.get(GemmFwdOp, trans_a=False)
    b = cache.get(GemmFwdOp, trans_a=True)
    assert cache.get(GemmFwdOp, trans_a=False) is a  # a hit does not reorder
    c = cache.get(GemmFwdOp, trans_b=True)  # evicts a, the oldest
    assert len(cache) == 2
    assert cache.get(GemmFwdOp, trans_a=True) is b
    assert cache.get(GemmFwdOp, trans_b=True) is c
    assert cache.get(GemmFwdOp, trans_a=False) is not a  # rebuilt, evicting b
    assert cache.get(GemmFwdOp, trans_b=True) is c
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="^OpCache: maxsize must be at least 1, got 0$"):
        tf.OpCache(0)
    assert tf._cache.maxsize == tf.MAX_CACHED_OPS


def test_threads_get_one_instance():
    cache = tf.OpCache(8)
    start = threading.Barrier(8)
    got = []

    def work():
        start.wait()
        got.append(cache.get(RMSNormFwdOp, normalized_shape=(16,), eps=1e-5))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(op is got[0] for op in got) and len(cache) == 1


def test_params_that_cannot_be_a_key_reach_the_ops_check():
    cache = tf.OpCache(4)
    with pytest.raises(SignatureCallError, match="^RMSNormFwdOp: "):
        cache.get(RMSNormFwdOp, normalized_shape={8: 1})
    assert len(cache) == 0


def test_a_configuration_first_seen_inside_torch_compile_is_refused_by_name():
    """The functional cache builds an op at a configuration's first call, which a compiled
    function cannot do: refused naming the op and its arguments; after one eager call the
    same function compiles."""
    torch._dynamo.reset()
    x = torch.randn(3, 8)

    def f(a):
        return tf.rms_norm(a, (8,), None, 1e-4)

    tf._cache.clear()
    with pytest.raises(Exception, match=r"tileops.nn.functional: the RMSNormFwdOp\("
                                        r"normalized_shape=\(8,\), eps=0.0001, target=None\)"):
        torch.compile(f, fullgraph=True)(x)
    f(x)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), F.rms_norm(x, (8,), None,
                                                                               1e-4))
