"""apply_tileops_to_mixtral on the CPU (the reference target): a tiny Mixtral patched against
the same weights unpatched (logits, router logits and the load-balancing loss in float32 and
float64, a training step's loss and gradients), each flag on its own, instance and class-level
patching, the stacked experts' state_dict, the refusals by their text."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.mixtral import modeling_mixtral

import tileops.integrations.transformers as tit
from tileops.integrations import _hf_moe

sys.path.insert(0, str(Path(__file__).parent))
from _cast import cast  # noqa: E402

FLAGS = ("rms_norm", "rope", "swiglu", "attention", "cross_entropy",
         "fused_linear_cross_entropy", "moe")
OFF = dict.fromkeys(FLAGS, False)
# float64: Hugging Face forms cos/sin and the routing softmax in float32 whatever the dtype
TOL = {torch.float32: 2e-5, torch.float64: 1e-6}


def config(**overrides):
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
              num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    kw.update(overrides)
    return transformers.MixtralConfig(**kw)


def build(dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    return cast(transformers.MixtralForCausalLM(config(**overrides)), dtype)


def pair(dtype=torch.float32, overrides=None, **flags):
    """``(reference, patched)`` of one set of weights (a config of ``overrides``), the second
    patched on the instance with ``flags``."""
    ref = build(dtype, **(overrides or {}))
    model = build(dtype, **(overrides or {}))
    model.load_state_dict(ref.state_dict())
    tit.apply_tileops_to_mixtral(model, **flags)
    return ref, model


def tokens(batch=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g)


def assert_close(a, b, tol, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} over {tol:g}"


def stacked_grads(ref_block):
    """The gradients of Hugging Face's experts as the stacked layer holds them."""
    experts = ref_block.experts
    w13 = torch.stack([torch.cat([e.w1.weight.grad, e.w3.weight.grad]) for e in experts])
    return w13, torch.stack([e.w2.weight.grad for e in experts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_logits_router_logits_and_aux_loss(dtype):
    ref, model = pair(dtype)
    ids = tokens()
    with torch.no_grad():
        a = ref(ids, output_router_logits=True)
        b = model(ids, output_router_logits=True)
    assert_close(b.logits, a.logits, TOL[dtype], "logits")
    assert len(b.router_logits) == 2  # recorded from each layer's block
    for x, y in zip(b.router_logits, a.router_logits, strict=True):
        assert x.dtype == dtype and x.shape == (24, 4)
        assert_close(x, y, TOL[dtype], "router logits")
    assert_close(b.aux_loss, a.aux_loss, TOL[dtype], "aux loss")
    block = model.model.layers[0].block_sparse_moe
    assert isinstance(block, modeling_mixtral.MixtralSparseMoeBlock)
    assert block.op.last_call is not None  # inference ran the fused op


def test_a_block_refuses_another_hidden_size_by_name():
    _, model = pair()
    block = model.model.layers[0].block_sparse_moe
    for grad in (False, True):
        with pytest.raises(ValueError) as exc:
            block(torch.randn(1, 4, 32, requires_grad=grad))
        assert str(exc.value) == (f"{type(block).__name__}: argument hidden_states expected a "
                                  "tensor [..., 64] (its last axis is hidden_size), seen "
                                  "float32[1, 4, 32]")
    out, logits = block(torch.randn(1, 4, 64))
    assert out.shape == (1, 4, 64) and logits.shape == (4, 4)


def test_training_step_loss_and_gradients():
    """A call needing gradients runs tileops.nn.MoE's training path (its stage ops with
    gradients): the loss (with the aux loss) and every gradient are the unpatched model's."""
    ref, model = pair(fused_linear_cross_entropy=True)
    ref.train()
    model.train()
    ids = tokens()
    a = ref(ids, labels=ids, output_router_logits=True)
    b = model(ids, labels=ids, output_router_logits=True)
    assert b.logits is None and b.aux_loss is not None
    assert_close(b.loss, a.loss, 2e-5, "loss")
    a.loss.backward()
    b.loss.backward()
    params = dict(ref.named_parameters())
    for i, layer in enumerate(model.model.layers):
        block = layer.block_sparse_moe
        w13, w2 = stacked_grads(ref.model.layers[i].block_sparse_moe)
        assert_close(block.w13.grad, w13, 2e-4, f"layer {i} w13 grad")
        assert_close(block.w2.grad, w2, 2e-4, f"layer {i} w2 grad")
    for name, p in model.named_parameters():
        if name in params:
            assert_close(p.grad, params[name].grad, 2e-4, f"grad of {name}")


def test_training_curve_10_steps():
    """AdamW on synthetic tokens (the optimizer built after patching, which copied the
    experts), the load-balancing loss in the loss: the patched curve is the unpatched one.

    float64, and gradients zeroed rather than set to None: an expert no token chose in a step
    gets a zero slice of the stacked gradient where Hugging Face's Linear gets none, and AdamW
    skips a parameter without one (its decay and moments then part ways for that expert); in
    float32 AdamW's normalisation amplifies the roundings (Hugging Face's softmax is float32,
    the routing's order of sums differs) past 1e-3 in 20 steps."""
    curves = []
    for patched in (False, True):
        model = build(torch.float64, output_router_logits=True)
        if patched:
            tit.apply_tileops_to_mixtral(model, fused_linear_cross_entropy=True)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        g = torch.Generator().manual_seed(7)
        curve = []
        for _ in range(10):
            ids = (torch.randint(0, 128, (2, 1), generator=g) + 3 * torch.arange(12)) % 128
            out = model(ids, labels=ids)
            opt.zero_grad(set_to_none=False)
            out.loss.backward()
            opt.step()
            curve.append(out.loss.item())
        if patched:
            assert "MoeUnpermuteFwdOpBackward" in graph_nodes(out.loss)  # the MoE ops trained
        curves.append(torch.tensor(curve, dtype=torch.float64))
    ref, got = curves
    assert ref[-1] < ref[0] - 0.2  # it learns
    assert_close(got, ref, 1e-5, "loss curve")


def graph_nodes(t):
    """The names of the autograd nodes ``t`` was computed through."""
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


def test_router_jitter_draws_as_hugging_face():
    ref, model = pair(overrides={"router_jitter_noise": 0.1})
    ref.train()
    model.train()
    ids = tokens()
    torch.manual_seed(5)
    a = ref(ids, labels=ids).loss
    torch.manual_seed(5)
    b = model(ids, labels=ids).loss
    assert_close(b, a, 2e-5, "loss with jitter")


@pytest.mark.parametrize("flag", FLAGS)
def test_each_flag_on_its_own(flag):
    ref, model = pair(**{**OFF, flag: True})
    layer = model.model.layers[0]
    if flag == "moe":
        assert type(layer.block_sparse_moe) is _hf_moe.block_class(
            modeling_mixtral.MixtralSparseMoeBlock)
    elif flag == "swiglu":  # the experts one by one on the SwiGLU op
        assert type(layer.block_sparse_moe) is modeling_mixtral.MixtralSparseMoeBlock
        assert type(layer.block_sparse_moe.experts[0]) is tit.TileOpsMixtralExpertMLP
    ids = tokens()
    model.train()
    ref.train()
    a, b = ref(ids, labels=ids), model(ids, labels=ids)
    assert_close(b.loss, a.loss, 2e-5, "loss")
    if flag == "fused_linear_cross_entropy":
        assert b.logits is None
    else:
        assert_close(b.logits, a.logits, 2e-5, "logits")


def test_instance_patch_stacks_the_experts():
    ref = build()
    model = build()
    model.load_state_dict(ref.state_dict())
    gate = model.model.layers[1].block_sparse_moe.gate.weight
    tit.apply_tileops_to_mixtral(model)
    block = model.model.layers[1].block_sparse_moe
    assert block.gate.weight is gate  # the router shared, the experts copied
    experts = ref.model.layers[1].block_sparse_moe.experts
    assert torch.equal(block.w13[2], torch.cat([experts[2].w1.weight, experts[2].w3.weight]))
    assert torch.equal(block.w2[3], experts[3].w2.weight)
    keys = {k for k in model.state_dict() if ".block_sparse_moe." in k}
    assert keys == {f"model.layers.{i}.block_sparse_moe.{n}" for i in range(2)
                    for n in ("gate.weight", "w13", "w2")}
    assert (block.w13.shape, block.w2.shape) == ((4, 192, 64), (4, 64, 96))
    # a Hugging Face state_dict's per-expert keys load into the patched model
    other = build(seed=3)
    model.load_state_dict(other.state_dict())
    ids = tokens()
    with torch.no_grad():
        assert_close(model(ids).logits, other(ids).logits, 2e-5, "logits after loading")


def test_class_level_patch(restored):
    ref = build()
    tit.apply_tileops_to_mixtral()
    model = build()
    block = model.model.layers[0].block_sparse_moe
    assert isinstance(block, tit.TileOpsMixtralSparseMoeBlock)
    assert isinstance(block, restored_block_class())
    assert type(model.model.rotary_emb) is tit.TileOpsRotaryEmbedding
    assert model.config._attn_implementation == "tileops"
    # the experts drawn as Hugging Face draws its Linears: normal, initializer_range
    assert abs(block.w13.std().item() - 0.02) < 2e-3
    model.load_state_dict(ref.state_dict())
    ids = tokens()
    with torch.no_grad():
        a = ref(ids, output_router_logits=True)
        b = model(ids, output_router_logits=True)
    assert_close(b.logits, a.logits, 2e-5, "logits")
    assert_close(b.aux_loss, a.aux_loss, 2e-5, "aux loss")


def restored_block_class():
    """transformers' own MixtralSparseMoeBlock (the module's name is patched)."""
    return tit._original(modeling_mixtral, "MixtralSparseMoeBlock")


def test_class_level_swiglu_experts(restored):
    tit.apply_tileops_to_mixtral(transformers.MixtralForCausalLM, moe=False)
    model = build()
    block = model.model.layers[0].block_sparse_moe
    assert type(block) is modeling_mixtral.MixtralSparseMoeBlock
    assert type(block.experts[1]) is tit.TileOpsMixtralExpertMLP
    assert list(block.experts[1].state_dict()) == ["w1.weight", "w2.weight", "w3.weight"]


def test_decode_with_cache_matches():
    ref, model = pair()
    ids = tokens(batch=1, seq=8)
    with torch.no_grad():
        a = ref.generate(ids, max_new_tokens=4, do_sample=False)
        b = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_refusals():
    gelu = build(hidden_act="gelu")
    with pytest.raises(ValueError) as e:
        tit.apply_tileops_to_mixtral(gelu, swiglu=False)
    assert str(e.value) == ("TileOpsMixtralSparseMoeBlock: config.hidden_act must be 'silu' "
                            "(the fused op computes silu(gate) * up), seen 'gelu'; patch with "
                            "moe=False and swiglu=False")
    assert type(gelu.model.norm) is not tit.TileOpsRMSNorm  # a refusal changes nothing
    with pytest.raises(TypeError) as e:
        tit.apply_tileops_to_mixtral(gelu, moe="yes")
    assert str(e.value) == ("apply_tileops_to_mixtral: argument moe must be a bool, seen str "
                            "'yes'")
    with pytest.raises(TypeError) as e:
        tit.apply_tileops_to_mixtral(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            vocab_size=8)))
    assert str(e.value).startswith("apply_tileops_to_mixtral: argument model_or_class must be "
                                   "a Mixtral model (a MixtralPreTrainedModel)")


@pytest.mark.cuda
def test_cuda_bf16_logits_within_bf16_tolerance():
    """bf16 on the kernels (the fused MoE op, attention at head dim 64): the patched model's
    logits are as close to a float32 copy's as the unpatched bf16 model's."""
    kw = dict(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=1000,
              num_local_experts=8)
    wide = build(torch.float32, **kw).cuda().eval()
    ref, model = (cast(build(torch.float32, **kw), "cuda", torch.bfloat16).eval()
                  for _ in range(2))
    tit.apply_tileops_to_mixtral(model)
    ids = tokens(batch=3, seq=333).cuda()  # lengths off every tile
    with torch.no_grad():
        exact = wide(ids).logits.float()
        err_ref = ((ref(ids).logits.float() - exact).abs().max() / exact.abs().max()).item()
        err = ((model(ids).logits.float() - exact).abs().max() / exact.abs().max()).item()
    assert err <= 2 * err_ref + 1e-3, (err, err_ref)


@pytest.mark.cuda
def test_cuda_training_step_matches():
    """A bf16 training step on the kernels (the MoE stage ops' gradients): the loss within 1%
    of the unpatched model's, and each gradient (the experts' as the stacked layer holds them)
    as close to a float32 copy's as the unpatched bf16 model's.

    The bar is the float32 copy, not the unpatched bf16 model: a router's top-2 picks between
    near-tied experts flip with the last bit of the layer below, so two bf16 models of the same
    weights route a few tokens differently and their router gradients part by 10% at this size
    while each stays as close to float32 as the other. The float32 copy holds the bf16 weights,
    so only the arithmetic differs."""
    kw = dict(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=1000,
              num_local_experts=8)
    ref, model = (cast(build(torch.float32, **kw), "cuda", torch.bfloat16).train()
                  for _ in range(2))
    wide = cast(build(torch.float32, **kw), "cuda", torch.float32).train()
    wide.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    tit.apply_tileops_to_mixtral(model)
    ids = tokens(batch=2, seq=257).cuda()
    runs = [m(ids, labels=ids, output_router_logits=True) for m in (wide, ref, model)]
    assert abs(runs[2].loss.item() - runs[1].loss.item()) <= 1e-2 * runs[1].loss.item()
    for out in runs:
        out.loss.backward()

    def rel(g, r):
        g, r = g.float(), r.float()
        return ((g - r).norm() / r.norm().clamp_min(1e-12)).item()

    def grads(m):
        found = {name: p.grad for name, p in m.named_parameters() if name.count("experts") == 0
                 and not name.endswith((".w13", ".w2"))}
        for i, layer in enumerate(m.model.layers):
            block = layer.block_sparse_moe
            w13, w2 = ((block.w13.grad, block.w2.grad) if hasattr(block, "w13")
                       else stacked_grads(block))
            found[f"layer {i} w13"], found[f"layer {i} w2"] = w13, w2
        return found

    exact, theirs, mine = (grads(m) for m in (wide, ref, model))
    assert exact.keys() == theirs.keys() == mine.keys()
    rows = [(name, rel(mine[name], g), rel(theirs[name], g)) for name, g in exact.items()]
    print("\n".join(f"{n:60s} {e:.4f} {r:.4f}" for n, e, r in rows))
    bad = [f"{n}: {e:.3g} against the unpatched model's {r:.3g}" for n, e, r in rows
           if e > 2 * r + 1e-2]
    assert not bad, "gradients off the float32 copy's:\n" + "\n".join(bad)
