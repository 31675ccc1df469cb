"""tileops.integrations: TileOPs inside other libraries' models.

:mod:`tileops.integrations.transformers` patches Hugging Face ``transformers`` models (Llama,
Qwen2, Qwen3, Mistral, Mixtral) to run their norms, rotary embedding, MLP or experts, attention
and loss on TileOPs ops, and decodes them greedily over a paged KV cache. Each integration imports its library only when it is called, so importing this package,
``tileops.ops`` or ``tileops.nn`` never imports one; the library is an extra of tileops-ops
(``pip install 'tileops-ops[transformers]'``).
"""
