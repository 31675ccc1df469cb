"""Train a Llama model on TileOPs: a Hugging Face ``LlamaForCausalLM`` patched in place with
``apply_tileops_to_llama``, then an ordinary PyTorch training loop.

    python examples/llama_train.py                 # a Llama-3-8B-shaped stack of 2 layers, bf16, CUDA
    python examples/llama_train.py --layers 4 --steps 50 --batch 8 --seq 4096
    python examples/llama_train.py --tiny          # a tiny float32 model on the CPU

The model is built from a config with random weights (nothing is downloaded); a model from
``LlamaForCausalLM.from_pretrained(...)`` is patched the same way. The patch swaps the RMSNorms,
the rotary embedding, the MLPs, the attention and the loss for TileOPs' layers, which hold the
model's own parameters, so the optimizer is made as usual (before or after the patch). With
``fused_linear_cross_entropy=True`` a training step with labels never forms the
``[tokens, vocab]`` logits: ``out.logits`` is None there. The data are synthetic rows counting
by 3 from a random start, which the model learns in a few dozen steps.
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
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from tileops.integrations.transformers import apply_tileops_to_llama  # noqa: E402


def config_for(args: argparse.Namespace) -> LlamaConfig:
    if args.tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                           max_position_embeddings=256)
    # Llama 3.1 8B's shapes, with fewer layers
    return LlamaConfig(hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=args.layers, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=max(8192, args.seq), rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model on the CPU")
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        args.batch, args.seq, args.lr = 2, 32, 3e-3

    config = config_for(args)
    torch.manual_seed(0)
    with torch.device(device):
        # made in dtype (as from_pretrained(dtype=...) does), its rotary buffer kept in float32
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    apply_tileops_to_llama(model, fused_linear_cross_entropy=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    g = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        start = torch.randint(0, config.vocab_size, (args.batch, 1), generator=g)
        ids = ((start + 3 * torch.arange(args.seq)) % config.vocab_size).to(device)
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()  # waits for the step
        ms = (time.perf_counter() - t) * 1e3
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step:3d}  loss {loss:.4f}  {ms:8.1f} ms")
    if device == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
