"""tileops.integrations.transformers on the CPU (the reference target): tiny Llama, Qwen2,
Qwen3 and Mistral models patched against the same weights unpatched: logits, losses,
gradients, a 30-step AdamW loss curve, each flag on its own, instance and class-level
patching, the attention implementation's mask decisions, the refusals by their text."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import tileops.integrations.transformers as tit
from tileops.integrations import _hf_attention
from tileops.ops import GroupedQueryAttentionFwdOp

sys.path.insert(0, str(Path(__file__).parent))
from _cast import cast  # noqa: E402

KINDS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              tit.apply_tileops_to_llama, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              tit.apply_tileops_to_qwen2, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              tit.apply_tileops_to_qwen3, {"head_dim": 16}),
    # a window shorter than the sequences: the op's window, not a mask
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                tit.apply_tileops_to_mistral, {"sliding_window": 5, "head_dim": 16}),
}


def tiny_config(kind: str, **overrides):
    config_cls, _, _, extra = KINDS[kind]
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(extra)
    kw.update(overrides)
    return config_cls(**kw)


def build(kind: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A tiny causal LM of ``kind`` with the default attention (sdpa), seeded weights."""
    _, model_cls, _, _ = KINDS[kind]
    torch.manual_seed(seed)
    model = model_cls(tiny_config(kind, **overrides))
    return cast(model, dtype)


def pair(kind: str, dtype=torch.float32, **flags):
    """``(reference, patched)``: two models of the same weights, the second patched at
    instance level with ``flags``."""
    ref = build(kind, dtype)
    model = build(kind, dtype)
    model.load_state_dict(ref.state_dict())
    KINDS[kind][2](model, **flags)
    return ref, model


def graph_nodes(t: torch.Tensor) -> set[str]:
    """The names of the autograd nodes ``t`` was computed through: an op's node is
    ``<Op>Backward``, so the set says which ops ran."""
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
#: the op nodes each flag puts in a training step's graph
NODES = {"rms_norm": "RMSNormFwdOpBackward", "rope": "RopeNeoxFwdOpBackward",
         "swiglu": "SwiGLUFwdOpBackward", "attention": "GroupedQueryAttentionFwdOpBackward",
         "cross_entropy": "CrossEntropyFwdOpBackward",
         "fused_linear_cross_entropy": "FusedLinearCrossEntropyFwdOpBackward"}
FLAGS = tuple(NODES)
#: whether the attention op has a backward: a step that needs gradients runs it, else sdpa
ATTN_TRAINS = GroupedQueryAttentionFwdOp._gradient is not None
#: the op nodes a training step of a model patched with the defaults holds
TRAINED = {NODES[f] for f in FLAGS if f != "fused_linear_cross_entropy"
           and (f != "attention" or ATTN_TRAINS)}
OFF = dict.fromkeys(FLAGS, False)
# float32: the ops reduce in another order than torch; float64: Hugging Face forms cos/sin
# in float32 whatever the model's dtype, so a float64 model agrees to float32's rounding
TOL = {torch.float32: 2e-5, torch.float64: 1e-6}


def tokens(batch=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g)


def assert_close(a, b, tol, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} over {tol:g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_llama_logits_loss_and_gradients(dtype):
    ref, model = pair("llama", dtype)
    ids = tokens()
    a, b = ref(ids, labels=ids), model(ids, labels=ids)
    assert_close(b.logits, a.logits, TOL[dtype], "logits")
    assert_close(b.loss, a.loss, TOL[dtype], "loss")
    # Hugging Face's loss is float32 whatever the logits (it casts them with .float()); the
    # op's is float32 or wider
    assert b.loss.dtype == torch.promote_types(dtype, torch.float32)
    assert graph_nodes(b.loss) >= TRAINED
    a.loss.backward()
    b.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert_close(p.grad, ref_params[name].grad, 10 * TOL[dtype], f"grad of {name}")


@pytest.mark.parametrize("flag", FLAGS)
def test_each_flag_on_its_own(flag):
    ref, model = pair("llama", **{**OFF, flag: True})
    model.train()
    ids = tokens()
    # no cache, as training loops call it (Hugging Face then hands the mask its packed-sequence
    # mask: the op must still serve the call)
    a, b = ref(ids, labels=ids, use_cache=False), model(ids, labels=ids, use_cache=False)
    nodes = graph_nodes(b.loss)
    ran = {NODES[flag]} if flag != "attention" or ATTN_TRAINS else set()
    assert {NODES[f] for f in FLAGS if NODES[f] in nodes} == ran
    assert_close(b.loss, a.loss, 2e-5, "loss")
    if flag == "fused_linear_cross_entropy":
        assert b.logits is None  # a training step with labels forms no logits
    else:
        assert_close(b.logits, a.logits, 2e-5, "logits")


def test_instance_patch_shares_parameters_and_state_dict():
    ref = build("llama")
    params = dict(ref.named_parameters())
    keys = list(ref.state_dict())
    tit.apply_tileops_to_llama(ref)
    assert dict(ref.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in ref.named_parameters())  # the same objects
    assert list(ref.state_dict()) == keys
    layer = ref.model.layers[0]
    assert isinstance(layer.input_layernorm, transformers.models.llama.modeling_llama.nn.Module)
    assert type(layer.input_layernorm) is tit.TileOpsRMSNorm
    assert type(layer.mlp) is tit.TileOpsSwiGLUMLP
    assert type(ref.model.rotary_emb) is tit.TileOpsRotaryEmbedding
    assert ref.config._attn_implementation == "tileops"
    assert layer.input_layernorm.variance_epsilon == 1e-6


def test_gradient_checkpointing():
    """Recomputed decoder layers (Hugging Face's gradient checkpointing) carry the rotary
    module through the (cos, sin) slot as any argument, and give the same gradients."""
    ref, model = pair("llama", fused_linear_cross_entropy=True)
    for m in (ref, model):
        m.gradient_checkpointing_enable()
        m.train()
    ids = tokens()
    a, b = ref(ids, labels=ids, use_cache=False), model(ids, labels=ids, use_cache=False)
    a.loss.backward()
    b.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_params[name].grad, 2e-4, f"grad of {name}")


def test_training_curve_30_steps():
    """AdamW on synthetic tokens, fixed seed: the patched loss curve is the unpatched one
    (every flag, the fused loss included)."""
    curves = []
    for patched in (False, True):
        model = build("llama")
        if patched:
            tit.apply_tileops_to_llama(model, fused_linear_cross_entropy=True)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(7)
        curve = []
        for _ in range(30):
            # sequences counting by 3 from a random start: learnable from the last token
            ids = (torch.randint(0, 128, (2, 1), generator=g) + 3 * torch.arange(12)) % 128
            loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    ref, got = curves
    assert ref[-1] < ref[0] - 0.5  # it learns
    assert_close(got, ref, 1e-3, "loss curve")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_training_under_bf16_autocast(kind):
    """The usual mixed precision: float32 weights, bf16 autocast. The projections run in
    bf16 and the norms meet bf16 activations beside their float32 weights (Qwen3's q_norm and
    k_norm first): the patched model takes the same steps as the unpatched one, within bf16's
    rounding, and every gradient comes back in float32."""
    ref, model = pair(kind)
    ids = tokens(seq=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = ref(ids, labels=ids, use_cache=False)
        b = model(ids, labels=ids, use_cache=False)
    assert b.loss.dtype == torch.float32
    assert abs(b.loss.item() - a.loss.item()) < 2e-2 * abs(a.loss.item())
    a.loss.backward()
    b.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, name
        want = ref_params[name].grad
        assert (p.grad - want).norm() <= 0.1 * want.norm() + 1e-6, name


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_other_models(kind):
    ref, model = pair(kind)
    ids = tokens(seq=12)
    # no cache, as training loops call it (Hugging Face then hands the mask its packed-sequence
    # mask: the op must still serve the call)
    a, b = ref(ids, labels=ids, use_cache=False), model(ids, labels=ids, use_cache=False)
    assert_close(b.logits, a.logits, 2e-5, "logits")
    assert graph_nodes(b.loss) >= TRAINED
    a.loss.backward()
    b.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_params[name].grad, 2e-4, f"grad of {name}")
    if kind == "qwen3":  # the per-head q_norm / k_norm are swapped too
        assert type(model.model.layers[0].self_attn.q_norm) is tit.TileOpsRMSNorm


def test_class_level_patch(restored):
    ref = build("llama")
    tit.apply_tileops_to_llama(fused_linear_cross_entropy=True)
    model = build("llama")  # built by the patched modeling module
    layer = model.model.layers[0]
    assert type(layer.input_layernorm) is tit.TileOpsRMSNorm
    assert type(layer.mlp) is tit.TileOpsSwiGLUMLP
    assert type(model.model.rotary_emb) is tit.TileOpsRotaryEmbedding
    assert model.config._attn_implementation == "tileops"
    # the same seed draws the same weights: the swapped layers initialise as Hugging Face's
    for (n, p), (n2, p2) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert n == n2 and torch.equal(p, p2), n
    ids = tokens()
    model.train()
    ref.train()
    a, b = ref(ids, labels=ids), model(ids, labels=ids)
    assert b.logits is None
    assert_close(b.loss, a.loss, 2e-5, "loss")
    assert TRAINED - {NODES["cross_entropy"]} | {NODES["fused_linear_cross_entropy"]} \
        <= graph_nodes(b.loss)
    model.eval()
    c = model(ids, labels=ids)  # logits formed: the cross-entropy flag's loss
    assert NODES["cross_entropy"] in graph_nodes(c.loss)
    assert_close(c.logits, ref(ids).logits, 2e-5, "logits")
    # an explicit attention implementation still wins over the patched default
    eager = transformers.LlamaForCausalLM._from_config(tiny_config("llama"),
                                                       attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"


def test_class_level_patch_through_a_class(restored):
    assert tit.apply_tileops_to_qwen2(transformers.Qwen2ForCausalLM, rope=False) \
        is transformers.Qwen2ForCausalLM
    model = build("qwen2")
    assert type(model.model.layers[0].mlp) is tit.TileOpsSwiGLUMLP
    assert type(model.model.rotary_emb) is not tit.TileOpsRotaryEmbedding


def test_registered_attention_by_name(monkeypatch):
    """register_attention alone: a model asks for "tileops" as for any implementation."""
    calls, op_for = [], _hf_attention.op_for
    monkeypatch.setattr(_hf_attention, "op_for",
                        lambda cls, **params: calls.append(params) or op_for(cls, **params))
    tit.register_attention()
    ref = build("llama")
    model = transformers.LlamaForCausalLM._from_config(tiny_config("llama"),
                                                       attn_implementation="tileops")
    model.load_state_dict(ref.state_dict())
    assert model.config._attn_implementation == "tileops"
    ids = tokens()
    with torch.no_grad():
        assert_close(model(ids).logits, ref(ids).logits, 2e-5, "logits")
    # the op in each layer, reading q, k, v in place: Hugging Face's rotation of the
    # projections' [B, S, H, D] output keeps that memory layout under its [B, H, S, D] view
    assert len(calls) == 2
    assert {c["layout"] for c in calls} == {"bshd"}


def test_padded_batch_takes_sdpa_with_its_mask():
    ref, model = pair("llama")
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    a, b = ref(ids, attention_mask=mask), model(ids, attention_mask=mask)
    assert_close(b.logits[:, 4:], a.logits[:, 4:], 2e-5, "logits")
    assert_close(b.logits[1], a.logits[1], 2e-5, "logits")


def test_decode_with_cache_matches():
    ref, model = pair("llama")
    ids = tokens(batch=1, seq=8)
    with torch.no_grad():
        a = ref.generate(ids, max_new_tokens=4, do_sample=False)
        b = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_attention_op_serves_inference(monkeypatch):
    """Without gradients the op serves every mask-less call (a spy on the op's cache)."""
    calls, op_for = [], _hf_attention.op_for

    def spy(cls, **params):
        calls.append(params)
        return op_for(cls, **params)

    monkeypatch.setattr(_hf_attention, "op_for", spy)
    ref, model = pair("mistral")
    # the patch built both layouts, with and without the window, for CUDA and the others
    assert len(calls) == 8
    calls.clear()
    ids = tokens()
    with torch.no_grad():
        assert_close(model(ids).logits, ref(ids).logits, 2e-5, "logits")
    scale = 16 ** -0.5
    assert calls == [dict(is_causal=True, scale=scale, window=(4, 0), softcap=None,
                          layout="bshd", target="reference")] * 2  # two layers, read in place


def test_attention_mask_decisions():
    from transformers.masking_utils import causal_mask_function

    pos = torch.arange(6)
    assert _hf_attention.attention_mask(2, pos, 6) is None
    assert _hf_attention.attention_mask(2, pos, 6, local_size=3) is None
    assert _hf_attention.attention_mask(2, pos, 6, attention_mask=torch.ones(2, 6, dtype=bool)) \
        is None
    padded = torch.ones(2, 6, dtype=torch.bool)
    padded[0, 0] = False
    got = _hf_attention.attention_mask(2, pos, 6, attention_mask=padded)
    assert got.shape == (2, 1, 6, 6) and not got[0, 0, 3, 0] and got[1, 0, 3, 0]
    # a decode step over a cache, a compiled cache's forbidden skip: Hugging Face's mask
    step = _hf_attention.attention_mask(2, torch.arange(5, 6), 6,
                                        mask_function=causal_mask_function)
    assert step is None  # sdpa's own skip: one query row sees every key
    kept = _hf_attention.attention_mask(1, pos, 6, allow_is_causal_skip=False)
    assert torch.equal(kept[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())


@settings(max_examples=120, deadline=None)
@given(batch=st.integers(1, 2), q_len=st.integers(1, 6), past=st.integers(0, 3),
       offset=st.integers(0, 1), local=st.one_of(st.none(), st.integers(1, 6)),
       pad=st.one_of(st.none(), st.integers(0, 3)), skip=st.booleans(),
       resets=st.one_of(st.none(), st.lists(st.integers(1, 5), max_size=2)))
def test_mask_none_only_where_it_is_the_ops_mask(batch, q_len, past, offset, local, pad, skip,
                                                 resets):
    """Over a space of mask calls (decode steps over a cache, offsets, windows, padding, and
    the packed-sequence mask of a call without a cache, its position ids restarting at
    ``resets`` in the last row or not at all): where the mask function returns None, the
    op's bottom-right causal mask (with the window) is exactly the mask Hugging Face would
    build; elsewhere it is sdpa's own."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
        sdpa_mask,
        sliding_window_causal_mask_function,
    )

    if resets is not None:  # a call without a cache: its keys are its queries
        past = offset = 0
    kv_len = q_len + past
    cache_position = torch.arange(past, kv_len) + offset
    fn = causal_mask_function if local is None else sliding_window_causal_mask_function(local)
    if resets is not None:  # Hugging Face's packed-sequence mask, skipping refused
        positions = torch.arange(kv_len).repeat(batch, 1)
        for r in resets:
            if r < kv_len:
                positions[-1, r:] -= positions[-1, r].clone()
        packed = find_packed_sequence_indices(positions)
        fn, skip = and_masks(fn, packed_sequence_mask_function(packed)), False
    padding = None
    if pad is not None:
        padding = torch.ones(batch, kv_len, dtype=torch.bool)
        padding[0, :min(pad, kv_len - 1)] = False
    kw = dict(batch_size=batch, cache_position=cache_position, kv_length=kv_len,
              kv_offset=offset, mask_function=fn, attention_mask=padding, local_size=local)
    got = _hf_attention.attention_mask(**kw, allow_is_causal_skip=skip)
    if got is not None:
        assert torch.equal(got, sdpa_mask(**kw, allow_is_causal_skip=skip))
        return
    full = sdpa_mask(**kw, allow_is_causal_skip=False)
    left = -1 if local is None else local - 1
    ours = _hf_attention.window_mask(q_len, kv_len, left, True, "cpu")
    assert torch.equal(full, ours.expand_as(full))


def test_training_call_without_a_cache_runs_the_op(monkeypatch):
    """A call without a cache (``use_cache=False``, as training loops make it) comes with
    Hugging Face's packed-sequence mask: one sequence a row is the op's mask and runs the op;
    position ids that restart (packed sequences) take sdpa with Hugging Face's mask, the
    logits the unpatched model's either way."""
    sdpa = []
    real = _hf_attention._sdpa
    monkeypatch.setattr(_hf_attention, "_sdpa", lambda *a: sdpa.append(1) or real(*a))
    ref, model = pair("llama", **{**OFF, "attention": True})
    ids = tokens()
    restart = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)
    for position_ids, op_runs in ((None, True), (restart, False)):
        sdpa.clear()
        kw = dict(use_cache=False, position_ids=position_ids)
        out = model(ids, labels=ids, **kw)
        assert ("GroupedQueryAttentionFwdOpBackward" in graph_nodes(out.loss)) == op_runs
        assert bool(sdpa) != op_runs
        assert_close(out.logits, ref(ids, labels=ids, **kw).logits, TOL[torch.float32],
                     "logits")


@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_mask_is_hugging_faces_sliding_window(window):
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    hf = sdpa_mask(batch_size=1, cache_position=torch.arange(7), kv_length=7,
                   mask_function=sliding_window_causal_mask_function(window),
                   allow_is_causal_skip=False)
    ours = _hf_attention.window_mask(7, 7, window - 1, True, "cpu")
    assert torch.equal(ours, hf)


def test_bad_arguments():
    model = build("llama")
    with pytest.raises(TypeError) as e:
        tit.apply_tileops_to_llama(model, rope=1)
    assert str(e.value) == "apply_tileops_to_llama: argument rope must be a bool, seen int 1"
    with pytest.raises(TypeError) as e:
        tit.apply_tileops_to_qwen2(model)
    assert str(e.value) == (
        "apply_tileops_to_qwen2: argument model_or_class must be a Qwen2 model (a "
        "Qwen2PreTrainedModel), one of its classes, or None for the modeling module "
        "transformers.models.qwen2.modeling_qwen2; seen LlamaForCausalLM")
    gelu = build("llama", hidden_act="gelu")
    with pytest.raises(ValueError) as e:
        tit.apply_tileops_to_llama(gelu)
    assert str(e.value) == ("TileOpsSwiGLUMLP: config.hidden_act must be 'silu' (the fused op "
                            "computes silu(gate) * up), seen 'gelu'; patch with swiglu=False")
    assert type(gelu.model.norm) is not tit.TileOpsRMSNorm  # a refusal changes nothing
    biased = build("llama")
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(128))
    with pytest.raises(ValueError) as e:
        tit.apply_tileops_to_llama(biased, fused_linear_cross_entropy=True)
    assert str(e.value) == ("apply_tileops_to_llama: fused_linear_cross_entropy reads lm_head's "
                            "weight only; this lm_head has a bias (pass "
                            "fused_linear_cross_entropy=False)")
    dynamic = build("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError) as e:
        tit.apply_tileops_to_llama(dynamic)
    assert str(e.value) == ("TileOpsRotaryEmbedding: config.rope_scaling's rope_type must be "
                            "one of default, llama3, yarn, longrope, seen 'dynamic'; patch "
                            "with rope=False")


def test_llama3_rope_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    ref, model = (build("llama", rope_scaling=scaling) for _ in range(2))
    tit.apply_tileops_to_llama(model, **{**OFF, "rope": True})
    ids = tokens(seq=40)
    with torch.no_grad():
        assert_close(model(ids).logits, ref(ids).logits, 2e-5, "logits")


_SHORT = [1.0 + 0.1 * i for i in range(8)]
_LONG = [2.0 + 0.3 * i for i in range(8)]


@pytest.mark.parametrize(("config", "scaling"), [
    # YaRN without the pre-YaRN length: transformers takes max_position_embeddings
    ({"max_position_embeddings": 64}, {"rope_type": "yarn", "factor": 4.0}),
    ({"max_position_embeddings": 256},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ({"max_position_embeddings": 256},  # DeepSeek's attention factor
     {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 64}),
    ({"max_position_embeddings": 256},  # None: transformers' default
     {"rope_type": "yarn", "factor": 4.0, "beta_fast": None,
      "original_max_position_embeddings": 64}),
    # LongRoPE: Phi-3's original length is a config attribute, and the factor max / original
    ({"max_position_embeddings": 8192, "original_max_position_embeddings": 2048},
     {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}),
    ({"max_position_embeddings": 1024, "original_max_position_embeddings": 2048},
     {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}),
    # without it the original length is max_position_embeddings, the factor the scaling's
    ({"max_position_embeddings": 4096},
     {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG, "factor": 4.0}),
    ({"max_position_embeddings": 4096},
     {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG, "factor": 2.0,
      "attention_factor": 1.3}),
], ids=["yarn-no-original", "yarn", "yarn-mscale", "yarn-beta-none", "longrope-phi3",
        "longrope-phi3-short-max", "longrope-factor", "longrope-attention-factor"])
@pytest.mark.parametrize("start", [0, 3000, 9000])
def test_scaled_rope_rotates_as_hugging_face_s(config, scaling, start):
    """The patch's rotary module against Hugging Face's on one config, float64, positions on
    both sides of LongRoPE's switch (Hugging Face forms its frequencies in float32: a few
    1e-4 apart at position 9000)."""
    from transformers.models.llama import modeling_llama

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, vocab_size=100, num_hidden_layers=1,
                                   intermediate_size=32, rope_scaling=scaling, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' note on the assumed pre-YaRN length
        theirs = modeling_llama.LlamaRotaryEmbedding(cfg).double()
    mine = tit.TileOpsRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(start)
    q = torch.randn(1, 6, 2, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 6, 1, 16, generator=g, dtype=torch.float64)
    pos = torch.arange(start, start + 6)[None]
    cos, sin = theirs(q, pos)
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2),
                                                         cos, sin)
    got_q, got_k = mine.rotary(q, k, pos)
    torch.testing.assert_close(got_q, want_q.transpose(1, 2), rtol=0, atol=2e-3)
    torch.testing.assert_close(got_k, want_k.transpose(1, 2), rtol=0, atol=2e-3)


@pytest.mark.parametrize(("scaling", "message"), [
    ({"rope_type": "yarn", "factor": 4.0, "truncate": False},
     "rope_type 'yarn' with truncate=False is not served (the op truncates the correction "
     "range to whole dimensions, as truncate=True)"),
    ({"rope_type": "yarn", "factor": 4.0, "rescale": 2.0},
     "scaling key 'rescale' is not a key of rope_type 'yarn' (factor, beta_fast, beta_slow, "
     "attention_factor, original_max_position_embeddings, mscale, mscale_all_dim, truncate)"),
])
def test_a_rope_scaling_the_patch_cannot_serve_is_refused_naming_the_way_out(scaling, message):
    model = build("llama", rope_scaling=scaling)
    with pytest.raises(ValueError) as e:
        tit.apply_tileops_to_llama(model)
    assert str(e.value) == (f"TileOpsRotaryEmbedding: config.rope_scaling: {message}; patch "
                            f"with rope=False")


def test_bf16_rope_at_long_positions():
    """bfloat16 at positions up to 1023 (Llama 3's schedule, base 5e5): the RoPE patch's logits
    within twice the unpatched bfloat16 model's error against the float32 model. The models
    keep their rotary frequencies in float32 (``_cast``), as ``from_pretrained(dtype=...)``
    does: rounded to bfloat16 they would turn the unpatched model's angles by up to 2 radians
    here."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    # weights drawn wide enough that the attention is sharp and so sees the angles
    kw = dict(rope_scaling=scaling, rope_theta=500000.0, max_position_embeddings=2048,
              head_dim=32, initializer_range=0.2)
    wide = build("llama", torch.float32, **kw).eval()
    ref, model = (build("llama", torch.bfloat16, **kw).eval() for _ in range(2))
    tit.apply_tileops_to_llama(model, **{**OFF, "rope": True})
    ids = tokens(seq=1024)
    with torch.no_grad():
        want = wide(ids).logits
        err = [((m(ids).logits.float() - want).abs().max() / want.abs().max()).item()
               for m in (ref, model)]
    assert err[1] <= 2 * err[0] + 1e-3, f"patched {err[1]:.3g} against unpatched {err[0]:.3g}"


def test_missing_transformers_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError) as e:
        tit.apply_tileops_to_llama()
    assert str(e.value) == ("apply_tileops_to_llama: transformers is not installed; install "
                            "the extra: pip install 'tileops-ops[transformers]'")


def test_too_old_transformers_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    with pytest.raises(ImportError) as e:
        tit.apply_tileops_to_qwen3()
    assert str(e.value) == (
        f"apply_tileops_to_qwen3: transformers {transformers.__version__} has no "
        f"AttentionInterface / AttentionMaskInterface; the integration needs a newer one "
        f"(written against 4.57): pip install -U 'tileops-ops[transformers]'")


def test_importing_the_ops_does_not_import_transformers():
    code = ("import sys, tileops.ops, tileops.nn, tileops.integrations.transformers; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_compiled_training_step_has_no_graph_break():
    """A patched model compiled before any eager call (the op caches emptied first): the
    patch built every op the step calls, so tracing builds none and the graph is whole."""
    from tileops.integrations import _hf_loss
    from tileops.nn import functional

    functional._cache.clear()
    _hf_loss._layers.clear()
    ref, model = pair("llama", fused_linear_cross_entropy=True)
    ref.train()
    model.train()
    ids = tokens()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    a = ref(ids, labels=ids, use_cache=False).loss
    b = compiled(ids, labels=ids, use_cache=False).loss
    assert_close(b, a, 2e-5, "loss")
    a.backward()
    b.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_params[name].grad, 2e-4, f"grad of {name}")


# --- benchmarks/llama.py -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("llama")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_benchmark_tiny_mode(bench, tmp_path, capsys):
    # torch.compile's contender is left out: its compile of the step would take most of the
    # test's time (test_compiled_forward_has_no_graph_break compiles the patched model)
    rc = bench.main(["--dry-run", "--steps", "3", "--warmup", "1", "--against",
                     "eager,liger,tileops-sdpa", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "llama-cpu.json").read_text())
    assert out.endswith(f"wrote {tmp_path / 'llama-cpu.json'}, {tmp_path / 'llama-cpu.md'}\n")
    assert rc == 0
    assert (doc["device"], doc["layers"], doc["tokens"], doc["steps"]) == ("cpu", 2, 32, 3)
    cells = doc["contenders"]
    assert list(cells) == ["eager", "tileops", "liger", "tileops-sdpa"]
    for name in ("eager", "tileops", "tileops-sdpa"):
        c = cells[name]
        assert c["error"] is None and len(c["losses"]) == 3 and c["step_s"] > 0
        assert c["loss_ok"] and c["logits_ok"] and c["logits_err"] < 1e-5
    if importlib.util.find_spec("liger_kernel") is None:
        assert cells["liger"]["note"].startswith("not run: ModuleNotFoundError")
    assert doc["bars"] == {"1.15x eager": doc["bars"]["1.15x eager"], "1x torch.compile": None,
                           "loss within 1%": True, "logits": True}
    assert "| tileops |" in out and "bars (tileops): 1.15x eager" in out


def test_benchmark_contenders_do_not_share_a_config(bench):
    """The tileops patch sets its model's attention implementation in its config: a model the
    benchmark builds after it (eager, torch.compile, Liger-Kernel) keeps transformers' own."""
    import argparse

    args = argparse.Namespace(dry_run=True, layers=1, seq=16)
    config = bench.llama_config(args)
    cpu = torch.device("cpu")
    patched = bench.prepare("tileops", bench.build(config, cpu, torch.float32, 0), args)
    later = bench.build(config, cpu, torch.float32, 0)
    assert patched.config._attn_implementation == "tileops"
    assert later.config._attn_implementation == "sdpa"


def test_benchmark_profile(bench, tmp_path, capsys):
    """--profile: a table a contender of the step's time by kernel (on the CPU, the torch ops
    in their place), the total first; an unknown contender or too few steps refused."""
    rc = bench.main(["--dry-run", "--profile", "tileops,eager", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "llama_profile-cpu.json").read_text())
    assert rc == 0 and list(doc["profiles"]) == ["tileops", "eager"]
    for rows in doc["profiles"].values():
        assert rows[0]["kernel"] == "(all kernels)" and rows[0]["ms"] > 0
        assert len(rows) > 5 and all(r["calls"] > 0 for r in rows)
    assert "## tileops" in capsys.readouterr().out
    for argv, err in ((["--profile", "flash"], "--profile: unknown contender 'flash'"),
                      (["--profile", "eager", "--steps", "4", "--warmup", "1"],
                       "--profile needs --steps of 5 or more, got 4")):
        with pytest.raises(SystemExit):
            bench.main(["--dry-run", *argv, "--out", str(tmp_path)])
        assert err in capsys.readouterr().err


@pytest.mark.parametrize("flag", FLAGS)
def test_benchmark_prebuild_job(bench, flag):
    """Each prebuild job runs its flag's layers at the run's shapes (here the tiny ones)."""
    options = {"dry_run": True, "device": "cpu", "batch": 2, "seq": 16, "eval_seq": 8,
               "layers": 2}
    label, _, status = bench._prebuild_one((flag, options))
    assert (label, status) == (flag, "ok")


def test_benchmark_refuses_bad_arguments(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--against", "eager,flash"])
    assert capsys.readouterr().err.endswith(
        "error: --against: unknown contender 'flash'; valid: eager, torch.compile, liger, "
        "tileops+compile, tileops-sdpa\n")


def test_example_trains_on_the_cpu(capsys):
    spec = importlib.util.spec_from_file_location(
        "llama_train", BENCHMARKS.parent / "examples" / "llama_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--tiny", "--steps", "5"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["step", "1"], ["step", "5"]]
    first, last = (float(line.split()[3]) for line in lines)
    assert last < first  # it learns


# --- on the GPU ----------------------------------------------------------------------------------


def cuda_pair(kind: str, **overrides):
    """``(float32 reference, bf16 unpatched, bf16 patched)`` of one set of weights on the GPU,
    head_dim 64 (a head dim the attention kernels serve)."""
    kw = dict(hidden_size=256, intermediate_size=704, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=1000)
    kw.update(overrides)
    wide = build(kind, torch.float32, **kw).cuda()
    ref, model = (cast(build(kind, torch.float32, **kw), "cuda", torch.bfloat16)
                  for _ in range(2))
    KINDS[kind][2](model)
    return wide, ref, model


def logit_error(logits, wide):
    return ((logits.float() - wide).abs().max() / wide.abs().max()).item()


@pytest.mark.parametrize(("kind", "overrides"), [
    ("llama", {}), ("llama", {"attention_bias": True}), ("qwen2", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}}),
])
def test_the_attention_block_is_hugging_faces(kind, overrides):
    """tileops.nn.Attention built from a model's attention layer (its projections, the
    config's heads and RoPE) gives that layer's output and input gradient, float64 on the
    reference target (Qwen2: biases on q, k, v; attention_bias: on o too)."""
    from tileops.nn import Attention

    model = build(kind, torch.float64, **overrides)
    config, hf = model.config, model.model.layers[0].self_attn
    block = Attention.from_linears(hf.q_proj, hf.k_proj, hf.v_proj, hf.o_proj,
                                   config.num_attention_heads, config.num_key_value_heads,
                                   rope_theta=config.rope_theta,
                                   rope_scaling=config.rope_scaling,
                                   max_position_embeddings=config.max_position_embeddings)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 11, config.hidden_size, generator=g, dtype=torch.float64)
    positions = torch.randint(0, 40, (2, 11), generator=g)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = block(mine, positions)
    want, _ = hf(theirs, model.model.rotary_emb(theirs, positions), None)
    torch.testing.assert_close(y, want, rtol=1e-9, atol=1e-9)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * dy).sum().backward()
    (want * dy).sum().backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3"])
def test_cuda_bf16_logits_within_bf16_tolerance(kind):
    wide, ref, model = cuda_pair(kind)
    ids = tokens(batch=3, seq=333).cuda()  # lengths off every tile
    with torch.no_grad():
        exact = wide(ids).logits
        err_ref, err = logit_error(ref(ids).logits, exact), logit_error(model(ids).logits, exact)
    assert err <= 2 * err_ref + 1e-3, (err, err_ref)


@pytest.mark.cuda
def test_cuda_training_step_runs_the_ops_and_matches():
    wide, ref, model = cuda_pair("llama")
    model.train()
    ref.train()
    ids = tokens(batch=2, seq=257).cuda()
    # no cache, as training loops call it (Hugging Face then hands the mask its packed-sequence
    # mask: the op must still serve the call)
    a, b = ref(ids, labels=ids, use_cache=False), model(ids, labels=ids, use_cache=False)
    assert graph_nodes(b.loss) >= TRAINED
    assert abs(b.loss.item() - a.loss.item()) <= 1e-2 * a.loss.item()
    a.loss.backward()
    b.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, r = p.grad.float(), ref_params[name].grad.float()
        rel = ((g - r).norm() / r.norm().clamp_min(1e-12)).item()
        assert rel <= 5e-2, f"grad of {name}: relative L2 error {rel:.3g}"


@pytest.mark.cuda
def test_cuda_loss_curve_30_steps():
    curves = []
    for patched in (False, True):
        model = cast(build("llama", torch.float32, hidden_size=256, intermediate_size=704,
                           head_dim=64, vocab_size=1000), "cuda", torch.bfloat16).train()
        if patched:
            tit.apply_tileops_to_llama(model, fused_linear_cross_entropy=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(7)
        curve = []
        for _ in range(30):
            ids = ((torch.randint(0, 1000, (4, 1), generator=g) + 3 * torch.arange(256))
                   % 1000).cuda()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    ref, got = curves
    assert ref[-1] < ref[0] - 1.0
    assert abs(got[-1] - ref[-1]) <= 1e-2 * ref[-1], (got, ref)
