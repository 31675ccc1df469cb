"""tileops.nn.RotaryEmbedding: the op a config's rope_scaling selects and its params, the
rotation against transformers' form, an empty state_dict, rebuilds on copy and ``.to()``, the
gradient, and the errors for a config it cannot serve."""

import copy
import math
import pickle

import pytest
import torch

import tileops.ops as O
from tileops.nn.rotary import RotaryEmbedding

F64 = torch.float64


def hf_apply(q, k, pos, inv):
    """transformers' rotary module + apply_rotary_pos_emb (rotate_half), [B, S, H, D]."""
    freqs = pos[..., None].to(F64) * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[:, :, None], emb.sin()[:, :, None]

    def rot(x):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    return rot(q), rot(k)


def test_default_matches_transformers_and_trains():
    layer = RotaryEmbedding(64, base=10000.0)
    assert isinstance(layer.op, O.RopeNeoxFwdOp) and dict(layer.state_dict()) == {}
    q = torch.randn(2, 5, 4, 64, dtype=F64, requires_grad=True)
    k = torch.randn(2, 5, 2, 64, dtype=F64, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 4000]])
    inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=F64) / 64)
    got, want = layer(q, k, pos), hf_apply(q, k, pos, inv)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    small = (q[:1, :3, :2].detach().clone().requires_grad_(), k[:1, :3, :1].detach().clone()
             .requires_grad_())
    assert torch.autograd.gradcheck(lambda a, b: layer(a, b, pos[:1, :3]), small)


@pytest.mark.parametrize(("kw", "cls", "attrs"), [
    ({"interleaved": True}, O.RopeNonNeoxFwdOp, {}),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     O.RopeLlama31FwdOp, {"factor": 8.0, "original_max_position": 8192}),
    ({"scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}},
     O.RopeYarnFwdOp, {"factor": 4.0, "original_max_position": 2048}),
    ({"scaling": {"rope_type": "longrope", "short_factor": [1.0] * 32,
                  "long_factor": [2.0] * 32, "original_max_position_embeddings": 4096},
      "max_position_embeddings": 131072},
     O.RopeLongRopeFwdOp, {"original_max_position": 4096, "max_position": 131072}),
])
def test_scaling_selects_the_op(kw, cls, attrs):
    layer = RotaryEmbedding(64, **kw)
    assert type(layer.op) is cls
    for a, v in attrs.items():
        assert getattr(layer.op, a) == v
    q, k = torch.randn(1, 3, 2, 64, dtype=F64), torch.randn(1, 3, 1, 64, dtype=F64)
    pos = torch.tensor([[0, 5000, 9]])
    ref = layer.op.fp64_reference(q, k, pos)
    got = layer(q, k, pos)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)


def test_longrope_attention_factor_comes_from_the_model():
    layer = RotaryEmbedding(64, scaling={"rope_type": "longrope", "short_factor": [1.0] * 32,
                                         "long_factor": [1.0] * 32,
                                         "original_max_position_embeddings": 4096},
                            max_position_embeddings=131072)
    assert layer.op.attention_scale() == pytest.approx(
        math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-15)


def test_the_lengths_before_scaling_come_from_the_model_where_the_scaling_has_none():
    # transformers: YaRN's pre-scaling length is max_position_embeddings where the scaling
    # names none; LongRoPE's switch is there too, its attention factor of the scaling's factor
    yarn = RotaryEmbedding(64, scaling={"rope_type": "yarn", "factor": 4.0},
                           max_position_embeddings=64)
    assert yarn.op.original_max_position == 64
    long = RotaryEmbedding(64, scaling={"rope_type": "longrope", "short_factor": [1.0] * 32,
                                        "long_factor": [2.0] * 32, "factor": 4.0},
                           max_position_embeddings=4096)
    assert long.op.original_max_position == 4096
    assert long.op.attention_scale() == pytest.approx(
        math.sqrt(1 + math.log(4.0) / math.log(4096)), rel=1e-15)
    deepseek = RotaryEmbedding(64, scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                            "mscale_all_dim": 0.707,
                                            "original_max_position_embeddings": 4096})
    assert deepseek.op.attention_scale() == pytest.approx(1.0, rel=1e-15)
    with pytest.raises(ValueError) as e:
        RotaryEmbedding(64, scaling={"rope_type": "yarn", "factor": 4.0})
    assert str(e.value) == ("RotaryEmbedding: rope_type 'yarn' needs the context length "
                            "before scaling: original_max_position_embeddings in scaling, or "
                            "max_position_embeddings")


def test_copies_and_moves_rebuild_the_op():
    layer = RotaryEmbedding(32, rotary_dim=16, layout="bhsd")
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.op is not layer.op and other.op.rotary_dim == 16
        assert other.op.layout == "bhsd"
    op = layer.op
    layer.to(torch.float64)
    assert layer.op is not op
    layer.base = 500.0
    assert layer.op.base == 500.0
    assert "rotary_dim=16" in repr(layer) and "layout='bhsd'" in repr(layer)


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
             "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("change", [
    lambda s: s.__setitem__("factor", 4.0), lambda s: s.update(factor=4.0),
    lambda s: s.pop("factor"), lambda s: s.__delitem__("factor"), lambda s: s.clear(),
    lambda s: s.setdefault("beta_fast", 2.0), lambda s: s.popitem()])
def test_scaling_changed_in_place_is_refused_and_assigning_rebuilds_the_op(change):
    """The op is built from ``scaling``: a change in place would not reach it (the next call
    ran the old factor), so the layer holds it read only and refuses one by name; assigning
    a new scaling rebuilds the op, and the layer keeps serving."""
    given = dict(_LLAMA3)
    layer = RotaryEmbedding(64, scaling=given)
    assert layer.scaling == given and isinstance(layer.scaling, dict)
    op = layer.op
    with pytest.raises(TypeError) as exc:
        change(layer.scaling)
    assert str(exc.value) == (
        "RotaryEmbedding.scaling is read only: the layer's op is built from scaling, and a "
        "change in place would not reach it; assign a new value (layer.scaling = ...), which "
        "rebuilds the op")
    assert layer.scaling == given and layer.op is op and op.factor == 8.0
    given["factor"] = 2.0  # the caller's dict is not the layer's
    assert layer.scaling["factor"] == 8.0 and layer.op.factor == 8.0
    layer.scaling = {**layer.scaling, "factor": 4.0}
    assert layer.op is not op and layer.op.factor == 4.0
    q, k = torch.randn(1, 3, 2, 64, dtype=F64), torch.randn(1, 3, 1, 64, dtype=F64)
    pos = torch.tensor([[0, 9000, 9]])
    want = RotaryEmbedding(64, scaling={**_LLAMA3, "factor": 4.0})(q, k, pos)
    torch.testing.assert_close(layer(q, k, pos), want, rtol=0, atol=0)
    assert not torch.equal(layer(q, k, pos)[0], op(q, k, pos)[0])  # factor 8 differs


def test_scaling_s_lists_are_read_only_too_and_copies_keep_it():
    layer = RotaryEmbedding(64, scaling=_LONGROPE, max_position_embeddings=131072)
    short = layer.scaling["short_factor"]
    assert short == [1.0] * 32 and isinstance(short, list)
    for change in (lambda: short.__setitem__(0, 3.0), lambda: short.append(1.0),
                   lambda: short.sort(), lambda: short.__iadd__([1.0])):
        with pytest.raises(TypeError, match=r"^RotaryEmbedding\.scaling\['short_factor'\] is "
                                            r"read only: the layer's op is built from scaling"):
            change()
    assert torch.as_tensor(layer.op.short_factor).tolist() == [1.0] * 32
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.scaling == layer.scaling
        with pytest.raises(TypeError, match="read only"):
            other.scaling["long_factor"][0] = 0.5
    writable = {**layer.scaling, "short_factor": [*short[:-1], 1.5]}
    writable["long_factor"] = [2.5] * 32
    layer.scaling = writable
    assert torch.as_tensor(layer.op.short_factor).tolist() == [1.0] * 31 + [1.5]
    assert torch.as_tensor(layer.op.long_factor).tolist() == [2.5] * 32


@pytest.mark.parametrize(("kw", "message"), [
    ({"scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "RotaryEmbedding: rope_type must be one of default, llama3, yarn, longrope, got 'dynamic'"),
    ({"scaling": {"rope_type": "llama3", "factr": 2.0}},
     "RotaryEmbedding: scaling key 'factr' is not a key of rope_type 'llama3' \\(factor, "),
    ({"scaling": {"rope_type": "longrope", "short_factor": [1.0]}, "cache_length": 16},
     "RotaryEmbedding: rope_type 'longrope' computes every angle"),
])
def test_configs_it_cannot_serve_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(64, **kw)


def test_head_dim_is_checked():
    layer = RotaryEmbedding(64)
    with pytest.raises(ValueError, match="RotaryEmbedding: q has head_dim 32, the layer was "
                                         "made for 64"):
        layer(torch.randn(1, 2, 2, 32), torch.randn(1, 2, 1, 32))


@pytest.mark.parametrize("form", ["[S]", "[1, S]", "int32", "[B, S]"])
def test_position_ids_in_the_forms_models_pass(form):
    """[S] and [1, S] give every sequence of the batch the same positions, and int32 ones are
    read as int64, as Hugging Face's rotary modules take them."""
    layer = RotaryEmbedding(8)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 5, h, 8, generator=g, dtype=F64) for h in (4, 2))
    pos = torch.tensor([2, 3, 5, 7, 11])
    want = layer(q, k, pos[None].expand(3, 5).contiguous())
    given = {"[S]": pos, "[1, S]": pos[None], "int32": pos.int()[None],
             "[B, S]": pos[None].expand(3, 5)}[form]
    for got, ref in zip(layer(q, k, given), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
