"""Greedy decoding over a paged KV cache: :func:`generate_paged` runs a Hugging Face causal LM
(patched or not) token by token with its keys and values in :class:`PagedKVCache`, each decode
step's attention :class:`~tileops.ops.GroupedQueryAttentionDecodePagedWithKVCacheFwdOp`.

It is a decode loop of its own over the model's modules, not ``generate``: every step is one
call of the model's ``forward`` (``use_cache=False``, the positions given, ``logits_to_keep=1``)
under the attention implementation ``"tileops_paged"`` (:func:`paged_attention_forward`), which
the loop sets on the config for its calls and puts back after. That function takes the cache
from the call's keyword arguments (Hugging Face hands a forward's extra keywords down to the
attention function): it writes the call's keys and values into the layer's pages, then

- in the prefill (a prompt's tokens from position 0), attends with the ``"tileops"``
  implementation (:func:`~tileops.integrations._hf_attention.attention_forward`: the prefill
  op) over the keys of the call itself;
- in a decode step (one token a sequence), attends with the paged decode op over the pages,
  each sequence's first ``length + 1`` keys.

So the model's own modules run every step (its norms, projections, RoPE, MLP or experts, head:
patched or not) and only the cache and the attention are the loop's. The cache holds no
padding: sequences of different lengths are prefilled in groups of equal length and then
decoded together, each at its own length. Hugging Face's ``DynamicCache`` concatenates each
layer's keys at every step (a copy of the whole cache a step); the pages take one token's
row a step.

Pages are ``page_size`` tokens (64 by default); sequence ``b``'s ``j``-th page is page ``j * B +
b`` of the pool: the pages handed out in order as the batch's sequences grow page by page (an
allocator's order, not one sequence's pages side by side), so the block table is a real map.
The greedy choice is Hugging Face's: the argmax of the last position's logits (the first of
equal ones, as ``torch.argmax``); a sequence that has emitted ``eos_token_id`` continues with
``pad_token_id`` and the loop stops when every sequence has (``generate``'s rule), or after
``max_new_tokens``.

With ``graphs=True`` (CUDA) each decode step after the first is a replay of one CUDA graph of
the model's forward: the step's tokens, positions, page slots and lengths are written into the
graph's input tensors in place. A forward that cannot be captured (a host synchronisation in
it, say) is run eagerly instead, and :attr:`PagedKVCache.graph_note` says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tileops.nn.functional import op_for
from tileops.ops import GroupedQueryAttentionDecodePagedWithKVCacheFwdOp

from . import _hf_attention

__all__ = ["ATTN_PAGED", "PAGE_SIZE", "PagedKVCache", "generate_paged",
           "paged_attention_forward", "paged_mask", "register"]

#: the attention implementation the decode loop's calls run under
ATTN_PAGED = "tileops_paged"
#: the keyword the cache travels under, from the model's forward to the attention function
CACHE_KWARG = "tileops_paged_cache"
PAGE_SIZE = 64
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def register() -> None:
    """Register :func:`paged_attention_forward` and :func:`paged_mask` as ``"tileops_paged"``
    with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_PAGED, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_PAGED, paged_mask)


def paged_mask(*args: Any, **kwargs: Any) -> None:
    """No mask: the config names ``"tileops_paged"`` only for the loop's own calls, each a
    prefill of unpadded prompts from position 0 (the prefill op's causal mask, and its window
    where the model has one) or a decode step (the lengths are its mask). Hugging Face would
    otherwise build a packed-sequence mask every step from the positions the loop passes."""
    return None


class PagedKVCache:
    """Every layer's keys and values in pages: pools ``k[layer]``, ``v[layer]`` of ``[B *
    max_pages, page_size, H_kv, D]``, the block table ``[B, max_pages]`` int32 (the module
    docstring gives its order) and each sequence's ``lengths`` (int32 ``[B]``, the keys
    held). A call's step state (the page slots its tokens go to, the lengths after it, whether
    it decodes) is set by :meth:`prefill` and :meth:`decode` before the model's forward and
    read by every layer."""

    def __init__(self, config: Any, batch: int, capacity: int, *, page_size: int = PAGE_SIZE,
                 device: Any = None, dtype: Any = None) -> None:
        heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.page_size = page_size
        self.max_pages = max(1, math.ceil(capacity / page_size))
        pool = batch * self.max_pages
        shape = (pool, page_size, self.kv_heads, self.head_dim)
        layers = config.num_hidden_layers
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        pages = torch.arange(pool, device=device, dtype=torch.int32)
        self.block_table = pages.view(self.max_pages, batch).t().contiguous()
        self.lengths = torch.zeros(batch, device=device, dtype=torch.int32)
        #: the pool rows of a prefill's tokens ``[n * S]`` (a decode step's: ``slots``, ``[B]``)
        self.prefill_slots = torch.zeros(0, device=device, dtype=torch.int64)
        self.slots = torch.zeros(batch, device=device, dtype=torch.int64)
        self.seqlens = torch.zeros(batch, device=device, dtype=torch.int32)
        self.decoding = False
        self.graph_note: str | None = None

    def slots_of(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The flat pool rows (page * page_size + offset) of ``positions`` ``[n, S]`` of the
        sequences ``rows`` ``[n]``."""
        page = self.block_table[rows[:, None], positions // self.page_size].long()
        return page * self.page_size + positions % self.page_size

    def prefill(self, rows: torch.Tensor, length: int) -> None:
        """Set up a call of the prompts of ``rows``, ``length`` tokens each from position 0."""
        positions = torch.arange(length, device=rows.device)[None].expand(rows.shape[0], -1)
        self.decoding = False
        self.prefill_slots = self.slots_of(rows, positions).reshape(-1)
        self.lengths[rows] = length

    def decode(self) -> torch.Tensor:
        """Set up a decode step of every sequence, in place (the graph's inputs): its token
        goes to position ``lengths[b]``; returns those positions ``[B, 1]`` (int64)."""
        self.decoding = True
        rows = torch.arange(self.lengths.shape[0], device=self.lengths.device)
        positions = self.lengths.long()[:, None]
        self.slots.copy_(self.slots_of(rows, positions)[:, 0])
        self.seqlens.copy_(self.lengths + 1)
        return positions

    def finish_decode(self) -> None:
        self.lengths.add_(1)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The call's keys and values ``[n, H_kv, S, D]`` into ``layer``'s pages."""
        slots = self.slots if self.decoding else self.prefill_slots
        for pool, new in ((self.k[layer], key), (self.v[layer], value)):
            rows = new.transpose(1, 2).reshape(-1, self.kv_heads, self.head_dim)
            pool.view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, rows.to(pool.dtype))

    def attend(self, layer: int, query: torch.Tensor, scale: float | None,
               softcap: float | None) -> torch.Tensor:
        """The decode op over ``layer``'s pages: ``[B, 1, H, D]`` for a ``[B, H, 1, D]``
        query."""
        op = op_for(GroupedQueryAttentionDecodePagedWithKVCacheFwdOp, scale=scale,
                    softcap=softcap, target=_hf_attention.target_for(query.device))
        o = op(query[:, :, 0], self.k[layer], self.v[layer], self.seqlens, self.block_table)
        return o[:, None]


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            softcap: float | None = None, **kwargs: Any) -> tuple:
    """The ``"tileops_paged"`` attention function (see the module docstring); a call without
    the loop's cache (none of its keyword) is the ``"tileops"`` implementation's."""
    cache: PagedKVCache | None = kwargs.pop(CACHE_KWARG, None)
    if cache is not None:
        cache.write(module.layer_idx, key, value)
        if cache.decoding:
            return cache.attend(module.layer_idx, query, scaling, softcap), None
    return _hf_attention.attention_forward(module, query, key, value, attention_mask,
                                           dropout=dropout, scaling=scaling, softcap=softcap,
                                           **kwargs)


_DEFAULT = object()


def generate_paged(model: Any, input_ids: torch.Tensor | Sequence[Any], max_new_tokens: int,
                   *, page_size: int = PAGE_SIZE, eos_token_id: Any = _DEFAULT,
                   pad_token_id: Any = _DEFAULT, graphs: bool = False,
                   on_step: Callable[[], None] | None = None,
                   cache_out: list | None = None) -> Any:
    """Greedy tokens of ``model`` (a Hugging Face causal LM: Llama, Mistral, Qwen2/3,
    Mixtral...) over a :class:`PagedKVCache` (the module docstring says how).

    ``input_ids`` is a ``[B, S]`` tensor (returns ``[B, S + n]`` as ``generate`` does, ``n``
    the steps run) or a sequence of 1-D prompts of any lengths (returns a list: each prompt
    with its tokens up to its ``eos_token_id`` or ``max_new_tokens``, as ``generate`` returns
    for that prompt alone). ``eos_token_id`` and ``pad_token_id`` default to the model's
    ``generation_config``'s (an int, a list of ints, or None). ``on_step`` is called after
    each step's tokens are chosen (the prefill's, then each decode step's); ``cache_out``, a
    list, receives the cache."""
    name = "generate_paged"
    ragged = not torch.is_tensor(input_ids)
    prompts = [torch.as_tensor(p).reshape(-1) for p in input_ids] if ragged \
        else list(input_ids)
    if not prompts or min(p.numel() for p in prompts) < 1:
        raise ValueError(f"{name}: input_ids must hold at least one prompt of at least one "
                         f"token, seen lengths {[p.numel() for p in prompts]}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{name}: max_new_tokens must be an int >= 1, seen {max_new_tokens!r}")
    if page_size not in (16, 32, 64, 128, 256):
        raise ValueError(f"{name}: page_size must be one of 16, 32, 64, 128, 256 (the decode "
                         f"op's pages), seen {page_size!r}")
    config = model.config
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    longest = max(p.numel() for p in prompts) + max_new_tokens
    window = getattr(config, "sliding_window", None)
    if window is not None and longest > window:
        raise ValueError(f"{name}: the model attends over a sliding window of {window} keys "
                         f"and the decode op over every key; prompt and new tokens must fit "
                         f"in the window, seen {longest}")
    if device.type == "cuda" and dtype not in _KERNEL_DTYPES:
        raise ValueError(f"{name}: on CUDA the decode kernels serve float16 and bfloat16 "
                         f"models, seen {str(dtype).removeprefix('torch.')}")
    eos = _ids(model.generation_config.eos_token_id if eos_token_id is _DEFAULT
               else eos_token_id)
    pad = model.generation_config.pad_token_id if pad_token_id is _DEFAULT else pad_token_id
    if pad is None and eos:
        pad = eos[0]
    batch = len(prompts)
    cache = PagedKVCache(config, batch, longest, page_size=page_size, device=device,
                         dtype=dtype)
    if cache_out is not None:
        cache_out.append(cache)
    register()
    saved = config._attn_implementation
    config._attn_implementation = ATTN_PAGED
    try:
        with torch.no_grad():
            tokens = _loop(model, cache, prompts, max_new_tokens, eos, pad, graphs, on_step)
    finally:
        config._attn_implementation = saved
    if not ragged:
        return torch.cat([torch.stack(prompts).to(device), tokens], dim=1)
    out = []
    for b, p in enumerate(prompts):
        new = tokens[b]
        if eos:
            hit = torch.isin(new, torch.tensor(eos, device=device)).nonzero()
            if hit.numel():
                new = new[:int(hit[0, 0]) + 1]
        out.append(torch.cat([p.to(device), new]))
    return out


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _loop(model: Any, cache: PagedKVCache, prompts: list[torch.Tensor], steps: int,
          eos: list[int], pad: Any, graphs: bool,
          on_step: Callable[[], None] | None) -> torch.Tensor:
    """The prefill, then decode steps: the new tokens ``[B, n]``."""
    device = cache.lengths.device
    batch = len(prompts)
    first = torch.empty(batch, dtype=torch.long, device=device)
    by_length: dict[int, list[int]] = {}
    for b, p in enumerate(prompts):
        by_length.setdefault(p.numel(), []).append(b)
    for length, members in by_length.items():
        rows = torch.tensor(members, device=device)
        ids = torch.stack([prompts[b] for b in members]).to(device)
        cache.prefill(rows, length)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1,
                       **{CACHE_KWARG: cache}).logits
        first[rows] = logits[:, -1].argmax(-1)
    eos_t = torch.tensor(eos, device=device) if eos else None
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    chosen = [_finish(first, done, eos_t, pad)]
    if on_step is not None:
        on_step()
    step = _Step(model, cache, batch, graphs and device.type == "cuda")
    for _ in range(steps - 1):
        if eos_t is not None and bool(done.all()):
            break
        logits = step(chosen[-1])
        chosen.append(_finish(logits.argmax(-1), done, eos_t, pad))
        if on_step is not None:
            on_step()
    return torch.stack(chosen, dim=1)


def _finish(tokens: torch.Tensor, done: torch.Tensor, eos: torch.Tensor | None,
            pad: Any) -> torch.Tensor:
    """``generate``'s rule: a finished sequence's token is the pad; one that emits an eos is
    finished from then on (``done`` updated in place)."""
    if eos is None:
        return tokens
    tokens = torch.where(done, torch.full_like(tokens, pad if pad is not None else 0), tokens)
    done |= torch.isin(tokens, eos)
    return tokens


class _Step:
    """One decode step of every sequence: the model's forward on the step's tokens, eagerly or
    as a CUDA graph's replay (the module docstring)."""

    def __init__(self, model: Any, cache: PagedKVCache, batch: int, graphs: bool) -> None:
        self.model, self.cache, self.graphs = model, cache, graphs
        device = cache.lengths.device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None
        self.calls = 0

    def forward(self) -> torch.Tensor:
        return self.model(input_ids=self.ids, position_ids=self.positions, use_cache=False,
                          logits_to_keep=1, **{CACHE_KWARG: self.cache}).logits[:, -1]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(tokens[:, None])
        self.positions.copy_(self.cache.decode())
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        elif self.graphs and self.calls >= 2:
            logits = self._capture()
        else:
            logits = self.forward()
        self.cache.finish_decode()
        return logits

    def _capture(self) -> torch.Tensor:
        """Capture this step's forward (warmed up on a side stream: the same step run again
        writes the same keys into the same slots) and replay it; the eager forward where the
        capture fails."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # cuBLAS's and the ops' first calls on it
                for _ in range(2):
                    self.forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self.forward()
            graph.replay()
            self.graph = graph
            return self.logits
        except Exception as exc:  # noqa: BLE001 - the eager step serves instead, noted
            torch.cuda.synchronize()
            self.graphs = False
            self.cache.graph_note = f"CUDA graph capture failed, eager steps: " \
                                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            return self.forward()
