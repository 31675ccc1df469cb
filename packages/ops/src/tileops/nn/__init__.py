"""tileops.nn: ``torch.nn`` layers that run TileOPs ops.

:class:`RMSNorm`, :class:`LayerNorm` and :class:`Linear` are subclasses of their
``torch.nn`` namesakes that replace only ``forward`` (and take one more keyword, ``target``,
the op's). Being subclasses, they are what code written for torch.nn's layers expects: the
same constructor, parameters, init and ``state_dict`` by construction, and ``isinstance``
holds where training code groups parameters or initializes weights by layer type (no weight
decay on norms, ``normal_`` on every ``nn.Linear``). :class:`SiLU`, :class:`GELU` and
:class:`ReLU` are torch.nn's activations the same way. :class:`FusedAddRMSNorm` has no torch.nn
counterpart; its parameter is RMSNorm's. :class:`SwiGLUMLP` is the Llama MLP with Hugging
Face's submodule names, on the GEMM and the fused SwiGLU. :class:`CrossEntropyLoss` is
torch.nn's loss over class indices; :class:`FusedLinearCrossEntropyLoss` is a language model's
head and loss in one, never holding every row's logits. :class:`RotaryEmbedding` rotates q and
k by a model config's ``rope_scaling`` (default, llama3, yarn, longrope). The pooling layers
(:class:`MaxPool2d`, :class:`AvgPool2d`, :class:`AdaptiveAvgPool2d` and their 1-D and 3-D
namesakes) are torch.nn's, returning what torch's return. :class:`ScaledDotProductAttention` is
FlashAttention's attention (GQA, bottom-right causal mask, window, softcap) as a parameter-free
layer; :class:`Attention` is a decoder layer's grouped-query attention block around it (q, k, v
and o projections on the GEMM, a rotary embedding or another position hook), with Hugging
Face's submodule names.
:class:`MoE` is a mixture-of-experts layer on the fused MoE op (Mixtral and DeepSeek-V3
configs; it trains through the stage ops); :class:`ExpertParallelMoE` shards its experts over a
process group (torch.distributed's all-to-all).

Each layer holds its op, built from the layer's attributes and left out of its pickled state
(``_holder.py`` says when it is rebuilt); :mod:`tileops.nn.functional` has the same
computations as functions over a cache of op instances.
"""

from . import functional
from .activation import GELU, ReLU, SiLU, SwiGLUMLP
from .attention import Attention, ScaledDotProductAttention
from .expert_parallel import ExpertParallelMoE
from .linear import Linear
from .loss import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from .moe import MoE
from .norm import FusedAddRMSNorm, LayerNorm, RMSNorm
from .parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelAttention,
    TensorParallelMLP,
)
from .pooling import (
    AdaptiveAvgPool2d,
    AdaptiveMaxPool2d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
)
from .rotary import RotaryEmbedding

__all__ = [
    "AdaptiveAvgPool2d",
    "AdaptiveMaxPool2d",
    "Attention",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "ColumnParallelLinear",
    "CrossEntropyLoss",
    "ExpertParallelMoE",
    "FusedAddRMSNorm",
    "FusedLinearCrossEntropyLoss",
    "GELU",
    "LayerNorm",
    "Linear",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "MoE",
    "RMSNorm",
    "ReLU",
    "RotaryEmbedding",
    "RowParallelLinear",
    "ScaledDotProductAttention",
    "SiLU",
    "SwiGLUMLP",
    "TensorParallelAttention",
    "TensorParallelMLP",
    "functional",
]
