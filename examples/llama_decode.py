"""Greedy decoding on TileOPs over a paged KV cache: a Hugging Face ``LlamaForCausalLM`` patched
with ``apply_tileops_to_llama``, then ``generate_paged``.

    python examples/llama_decode.py                # a Llama-3-8B-shaped stack of 2 layers, bf16, CUDA
    python examples/llama_decode.py --layers 4 --batch 32 --new 128
    python examples/llama_decode.py --tiny         # a tiny float32 model on the CPU

``generate_paged(model, prompts, max_new_tokens)`` takes prompts of any lengths at once (no
padding: each sequence keeps its own length in the cache), keeps every layer's keys and values
in pages of 64 tokens with a block table a sequence, and runs each decode step's attention
through the paged decode op (on CUDA, with ``graphs=True``, the steps after the first replay
one CUDA graph). The tokens are ``generate(do_sample=False)``'s.

With ``--tiny`` the model first learns rows counting by 3 (``--train-steps`` AdamW steps, 60 by
default), so the decoded continuations can be read: each prompt's next tokens go on counting
by 3. Otherwise
the weights are random (nothing is downloaded) and the example prints the decode rate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for src in sorted((ROOT / "packages").glob("*/src"), reverse=True):
    if str(src) not in sys.path:  # run from a checkout without installing the packages
        sys.path.insert(0, str(src))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tileops.integrations.transformers import (  # noqa: E402
    apply_tileops_to_llama,
    generate_paged,
)

if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling, for the config
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_train import config_for  # noqa: E402


def counting(g: torch.Generator, rows: int, length: int, vocab: int) -> torch.Tensor:
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    return (start + 3 * torch.arange(length)) % vocab


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048, help="the longest prompt's tokens")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model on the CPU")
    ap.add_argument("--train-steps", type=int, default=60,
                    help="with --tiny: AdamW steps on rows counting by 3 first (default 60)")
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        args.batch, args.prompt, args.new = 3, 20, 8
    args.seq = args.prompt + args.new  # the positions the config must cover

    config = config_for(args)
    torch.manual_seed(0)
    with torch.device(device):
        # made in dtype (as from_pretrained(dtype=...) does), its rotary buffer kept in float32
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    apply_tileops_to_llama(model)
    g = torch.Generator().manual_seed(1)
    if args.tiny:  # learn to count by 3
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(args.train_steps):
            ids = counting(g, 4, 24, config.vocab_size)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    model.eval()
    model.generation_config.eos_token_id = None  # every prompt runs --new steps

    # prompts of several lengths, decoded together
    lengths = [max(1, args.prompt * (i + 1) // args.batch) for i in range(args.batch)]
    prompts = [counting(g, 1, n, config.vocab_size)[0].to(device) for n in lengths]
    t = time.perf_counter()
    out = generate_paged(model, prompts, args.new, graphs=device == "cuda")
    if device == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t
    for p, tokens in zip(prompts, out, strict=True):
        new = tokens[p.numel():].tolist()
        print(f"prompt of {p.numel():5d} tokens ending {p[-3:].tolist()} -> {new[:8]}")
    print(f"{args.batch * args.new} tokens in {secs:.2f} s (the prefill and the first steps' "
          f"kernel builds included)")


if __name__ == "__main__":
    main()
