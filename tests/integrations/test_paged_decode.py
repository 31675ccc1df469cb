"""generate_paged on the CPU (the reference target): greedy tokens over the paged KV cache equal
the unpatched model's ``generate(do_sample=False)`` for prompts of several lengths (one token,
within a page, a page multiple, past one) decoded in one batch, a rectangular batch, an eos
that stops sequences, a Mixtral, an unpatched model; the decode op serves every step; the
block table; the refusals by their text."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import transformers

import tileops.integrations.transformers as tit
from tileops.integrations import _hf_paged
from tileops.ops import GroupedQueryAttentionDecodePagedWithKVCacheFwdOp

sys.path.insert(0, str(Path(__file__).parent))
from _cast import cast  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_decode.py"
LENGTHS = (1, 5, 16, 37)  # pages of 16: within one, exactly one, past two


def llama(dtype=torch.float64, patched=True, seed=0, **overrides):
    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=128, tie_word_embeddings=False)
    kw.update(overrides)
    model = cast(transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)), dtype).eval()
    if patched:
        tit.apply_tileops_to_llama(model)
    return model


def mixtral(patched=True):
    """A tiny float32 Mixtral of seeded weights, patched with every flag."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    model = transformers.MixtralForCausalLM(config).eval()
    if patched:
        tit.apply_tileops_to_mixtral(model)
    return model


def prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g) for n in lengths]


def hf_tokens(model, prompt, new, **kw):
    """``generate``'s greedy tokens for one prompt alone, no padding."""
    with torch.no_grad():
        return model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel()),
                              max_new_tokens=new, do_sample=False, **kw)[0]


@pytest.fixture
def decode_calls(monkeypatch):
    """The decode op's calls, by a spy on the op cache the cache's attention asks."""
    calls = []
    op_for = _hf_paged.op_for

    def spy(cls, **params):
        op = op_for(cls, **params)
        if cls is GroupedQueryAttentionDecodePagedWithKVCacheFwdOp:
            calls.append(params)
        return op

    monkeypatch.setattr(_hf_paged, "op_for", spy)
    return calls


def test_ragged_prompts_match_generate(decode_calls):
    ref, model = llama(patched=False), llama()
    ps = prompts()
    got = tit.generate_paged(model, ps, 9, page_size=16)
    for p, tokens in zip(ps, got, strict=True):
        assert torch.equal(tokens, hf_tokens(ref, p, 9)), p.numel()
    # every layer of each of the 8 decode steps (the first token is the prefill's)
    assert len(decode_calls) == 8 * 2
    assert decode_calls[0] == {"scale": 16 ** -0.5, "softcap": None, "target": "reference"}


def test_rectangular_batch_matches_generate_float32():
    ref, model = llama(torch.float32, patched=False), llama(torch.float32)
    ids = torch.stack(prompts((70, 70, 70)))
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                            do_sample=False)
    got = tit.generate_paged(model, ids, 6)  # pages of 64: the prompts past one
    assert torch.equal(got, want)


def test_eos_stops_as_generate():
    """An eos the model emits mid-way: that sequence stops (ragged) or continues with pads
    (a batch) exactly as generate's."""
    ref, model = llama(patched=False), llama()
    ps = prompts((5, 5))
    free = hf_tokens(ref, ps[0], 8)
    eos = int(free[5 + 3])  # the fourth new token of the first prompt
    want = [hf_tokens(ref, p, 8, eos_token_id=eos, pad_token_id=0) for p in ps]
    got = tit.generate_paged(model, ps, 8, eos_token_id=eos, pad_token_id=0)
    assert got[0].numel() <= 5 + 4
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    ids = torch.stack(ps)
    with torch.no_grad():
        batch = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(tit.generate_paged(model, ids, 8, eos_token_id=eos, pad_token_id=0),
                       batch)


def test_unpatched_model_and_mixtral():
    """The loop runs over any model's modules: an unpatched Llama's, a patched Mixtral's."""
    ref, plain = llama(patched=False), llama(patched=False)
    ps = prompts((3, 20))
    for p, tokens in zip(ps, tit.generate_paged(plain, ps, 5, page_size=16), strict=True):
        assert torch.equal(tokens, hf_tokens(ref, p, 5))
    assert plain.config._attn_implementation == ref.config._attn_implementation  # put back
    mref, model = mixtral(patched=False), mixtral()
    for p, tokens in zip(ps, tit.generate_paged(model, ps, 5, page_size=16), strict=True):
        assert torch.equal(tokens, hf_tokens(mref, p, 5))


def test_cache_pages_and_block_table():
    model = llama()
    ps = prompts((5, 40))
    held = []
    tit.generate_paged(model, ps, 4, page_size=16, cache_out=held)
    cache = held[0]
    # 44 tokens at most: 3 pages a sequence, handed out in turn
    assert cache.block_table.tolist() == [[0, 2, 4], [1, 3, 5]]
    assert cache.lengths.tolist() == [5 + 3, 40 + 3]  # the last token is chosen, not cached
    assert cache.k[0].shape == (6, 16, 2, 16)
    # sequence 1's keys at position 17 are in its second page (pool page 3), row 1; the keys
    # of the tokens fed (prompt, then three new) recomputed by the model agree with them
    with torch.no_grad():
        out = model.model(torch.cat([ps[1], torch.zeros(3, dtype=torch.long)])[None],
                          use_cache=True)
    want = out.past_key_values.layers[0].keys[0, :, 17]  # [H_kv, D]
    assert torch.allclose(cache.k[0][3, 1], want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_decode_step_traces_whole(kind):
    """The decode step's forward (the model's, the pages written, the decode op; Mixtral's
    fused MoE op) traces as one graph under torch.compile(fullgraph=True): no host
    synchronisation or data-dependent branch in it, which a CUDA graph's capture needs too;
    its logits are the eager step's."""
    model = llama(torch.float32) if kind == "llama" else mixtral()
    held = []
    tit.generate_paged(model, torch.stack(prompts((20, 20))), 3, cache_out=held)
    cache = held[0]
    saved = model.config._attn_implementation
    model.config._attn_implementation = _hf_paged.ATTN_PAGED
    try:
        step = _hf_paged._Step(model, cache, 2, graphs=False)
        step.ids.fill_(3)
        step.positions.copy_(cache.decode())
        with torch.no_grad():
            want = step.forward()
            got = torch.compile(step.forward, fullgraph=True, backend="eager")()
    finally:
        model.config._attn_implementation = saved
    torch.testing.assert_close(got, want)


class _Graphs:
    """CPU stand-ins of torch.cuda's graph API for the loop's control flow: a capture runs the
    step's forward once and keeps its output tensor; a replay runs it again into that tensor
    (what a replay of a graph reading the step's input buffers computes)."""

    def __init__(self, monkeypatch, fail: bool) -> None:
        import contextlib

        self.captures = self.replays = 0
        self.capturing, self.step, self.out = False, None, None
        original = _hf_paged._Step.forward
        stand_in = self

        def forward(step):
            out = original(step)
            if stand_in.capturing:
                stand_in.step, stand_in.out = step, out
            return out

        class Graph:
            def replay(self):
                stand_in.replays += 1
                stand_in.out.copy_(original(stand_in.step))

        @contextlib.contextmanager
        def graph(g):
            if fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.captures += 1
            self.capturing = True
            yield
            self.capturing = False

        class Stream:
            def wait_stream(self, other):
                pass

        monkeypatch.setattr(_hf_paged._Step, "forward", forward)
        for name, value in (("CUDAGraph", Graph), ("graph", graph), ("Stream", Stream),
                            ("current_stream", Stream),
                            ("stream", lambda s: contextlib.nullcontext()),
                            ("synchronize", lambda: None)):
            monkeypatch.setattr(torch.cuda, name, value)


@pytest.mark.parametrize("fail", [False, True], ids=["captured", "capture-fails"])
def test_graph_steps_choose_the_eager_tokens(monkeypatch, fail):
    """The loop's graph path, through CPU stand-ins of the graph API: the first decode step is
    eager, the second captures (after two warm-ups) and replays, the later ones replay; the
    tokens are the eager loop's. A capture that fails leaves eager steps and a note."""
    model = llama(torch.float32)
    ps = torch.stack(prompts((9, 9)))
    want = tit.generate_paged(model, ps, 7)
    graphs = _Graphs(monkeypatch, fail)
    monkeypatch.setattr(_hf_paged._Step, "__init__", _on_cuda(_hf_paged._Step.__init__))
    held = []
    got = tit.generate_paged(model, ps, 7, graphs=True, cache_out=held)
    assert torch.equal(got, want)
    if fail:
        assert (graphs.captures, graphs.replays) == (0, 0)
        assert held[0].graph_note == ("CUDA graph capture failed, eager steps: RuntimeError: "
                                      "operation not permitted when stream is capturing")
    else:  # six decode steps: one eager, one captured and replayed, four replayed
        assert (graphs.captures, graphs.replays) == (1, 5)
        assert held[0].graph_note is None


def _on_cuda(init):
    """``_Step.__init__`` asked for graphs as on a CUDA device."""
    def wrapped(self, model, cache, batch, graphs):
        init(self, model, cache, batch, graphs)
        self.graphs = True
    return wrapped


def test_example_decodes_on_the_cpu(capsys):
    """examples/llama_decode.py --tiny, its training left out: a line a prompt, then the total."""
    spec = importlib.util.spec_from_file_location("llama_decode_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--tiny", "--train-steps", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[:3]] == [["prompt", "of", n] for n in
                                                        ("6", "13", "20")]
    assert lines[3].startswith("24 tokens in ") and len(lines) == 4


def test_refusals():
    model = llama()
    cases = [
        (dict(input_ids=[], max_new_tokens=4),
         "generate_paged: input_ids must hold at least one prompt of at least one token, seen "
         "lengths []"),
        (dict(input_ids=prompts((3,)), max_new_tokens=0),
         "generate_paged: max_new_tokens must be an int >= 1, seen 0"),
        (dict(input_ids=prompts((3,)), max_new_tokens=2, page_size=48),
         "generate_paged: page_size must be one of 16, 32, 64, 128, 256 (the decode op's "
         "pages), seen 48"),
    ]
    for kw, text in cases:
        with pytest.raises(ValueError) as e:
            tit.generate_paged(model, **kw)
        assert str(e.value) == text
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=128, sliding_window=8))
    with pytest.raises(ValueError) as e:
        tit.generate_paged(windowed, prompts((6,)), 4)
    assert str(e.value) == ("generate_paged: the model attends over a sliding window of 8 keys "
                            "and the decode op over every key; prompt and new tokens must fit "
                            "in the window, seen 10")


# --- on the GPU ----------------------------------------------------------------------------------


def near_argmax_gaps(wide, bf16, prompt, new):
    """Teacher-forced through the float32 model ``wide``: at each new token, how far its logit
    is below the step's best one, relative to the largest logit (0 where it is the argmax),
    and the largest error of the unpatched ``bf16`` model's logits there, relative alike."""
    ids = torch.cat([prompt, new])[None].cuda()
    with torch.no_grad():
        exact = wide(ids).logits[0, prompt.numel() - 1:-1].float()
        rounded = bf16(ids).logits[0, prompt.numel() - 1:-1].float()
    scale = exact.abs().max()
    chosen = exact.gather(1, new.cuda()[:, None])[:, 0]
    return (exact.max(-1).values - chosen) / scale, ((rounded - exact).abs().max() / scale).item()


@pytest.mark.cuda
def test_cuda_paged_decode_bf16():
    """bf16 on the kernels, head dim 128, pages of 64: each token is the float32 model's
    argmax or within bf16's rounding of it (a near tie of random weights may tip either way:
    a token whose logits are off by e at most is at most 2e below the best; e here within
    twice the unpatched bf16 model's), and the CUDA graph's steps choose exactly the eager
    steps' tokens."""
    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=2, head_dim=128, vocab_size=1000,
              max_position_embeddings=512)
    wide = llama(torch.float32, patched=False, **kw).cuda()
    ref = cast(llama(torch.float32, patched=False, **kw), "cuda", torch.bfloat16)
    model = cast(llama(torch.float32, patched=False, **kw), "cuda", torch.bfloat16)
    tit.apply_tileops_to_llama(model)
    ps = prompts((1, 63, 64, 200, 333))
    held = []
    graphed = tit.generate_paged(model, ps, 24, eos_token_id=None, graphs=True,
                                 cache_out=held)
    assert held[0].graph_note is None
    eager = tit.generate_paged(model, ps, 24, eos_token_id=None)
    for p, g, e in zip(ps, graphed, eager, strict=True):
        assert torch.equal(g, e)
        gaps, err_ref = near_argmax_gaps(wide, ref, p, g[p.numel():].cpu())
        assert gaps.max().item() <= 2 * (2 * err_ref + 1e-3), (gaps, err_ref)
