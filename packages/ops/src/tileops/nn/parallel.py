"""Tensor parallelism over ``torch.distributed``: column- and row-parallel ``Linear`` layers and
the Llama MLP and attention blocks built from them, each rank running
:class:`~tileops.ops.GemmFwdOp` on its shard (and the attention block RoPE and
:class:`~tileops.ops.GroupedQueryAttentionFwdOp` on its heads).

The layout is Megatron-LM's. A :class:`ColumnParallelLinear` holds a block of the weight's
rows (output features) and reads the whole input; a :class:`RowParallelLinear` holds a block of
its columns (input features), reads the matching slice of the input, and sums the partial
products of all ranks. A column layer followed by a row layer (:class:`TensorParallelMLP`)
communicates once in forward (the row layer's all-reduce) and once in backward (the column
layer's input gradient).

Communication is torch.distributed's own collectives (``all_reduce``, ``all_gather``; NCCL on
GPUs, gloo on the CPU), each called on a fresh tensor, in the forms that torch 2.11 to 2.13
neither deprecate nor restrict to one backend. What this module adds is which
collective runs in which direction. Tensors on either side of a parallel region are
*replicated*: every rank holds the same value and the loss computed from it is counted once,
not once a rank. Their gradients follow from that, in four autograd functions, each a
collective one way and local work the other way:

- ``_CopyToParallel``: identity forward; backward all-reduces (sums) the input gradient, since
  each rank's shard contributes a part of it;
- ``_ReduceFromParallel``: all-reduce forward; identity backward (the output is replicated, so
  its gradient already is);
- ``_GatherFromParallel``: all-gather along the last axis forward; backward keeps this rank's
  slice;
- ``_ScatterToParallel``: keeps this rank's slice forward; backward all-gathers.

``torch.distributed.nn.functional``'s differentiable collectives are not used: their adjoints
are those of per-rank outputs whose losses are summed over ranks (an all-reduce's backward
all-reduces again), which counts a replicated loss world-size times, and torch 2.13 deprecates
them. These layers run eagerly; running them under ``torch.compile`` is not claimed here.

A shard is built from the full layer (:meth:`ColumnParallelLinear.from_linear`, and the same on
the other classes), each rank taking its slice, so a sharded model starts from exactly the state
of a single-device one; a freshly constructed shard is drawn from the full layer's init
distribution on its own, which ranks seeded alike draw alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tileops.ops import GemmFwdOp, GroupedQueryAttentionFwdOp, SwiGLUFwdOp

from ._holder import HoldsOp, PassesTarget
from .attention import heads_of, projections_of
from .functional import linear_with
from .rotary import RotaryEmbedding

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelAttention",
           "TensorParallelMLP"]


def _world(layer: str, group: Any) -> tuple[Any, int, int]:
    """``(group, world size, rank in it)``, ``group`` as given (None: the default group);
    refuses where torch.distributed is not set up."""
    if not dist.is_available():
        raise RuntimeError(f"{layer}: torch.distributed is not available in this build of "
                           f"torch; tensor-parallel layers need it")
    if not dist.is_initialized():
        raise RuntimeError(f"{layer}: torch.distributed is not initialised; expected "
                           f"torch.distributed.init_process_group() to have been called (torchrun "
                           f"sets up its environment) before the layer is built")
    resolved = dist.group.WORLD if group is None else group
    return group, dist.get_world_size(resolved), dist.get_rank(resolved)


def _shard(layer: str, argument: str, value: int, world: int) -> int:
    if value % world:
        raise ValueError(f"{layer}: argument {argument} is {value}, not divisible by the "
                         f"tensor-parallel world size {world}; expected a multiple of {world}")
    return value // world


def _check_full(layer: str, argument: str, module: Any) -> None:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{layer}.from_linear: argument {argument} must be a torch.nn.Linear "
                        f"(the full, unsharded layer), seen {type(module).__name__}")


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The ranks' ``x`` concatenated along the last axis, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _local_slice(x: torch.Tensor, group: Any) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[-1] // world
    return x.narrow(-1, rank * n, n).contiguous()


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _local_slice(grad, ctx.group), None


class _ScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _local_slice(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_last(grad, ctx.group), None


class _ParallelLinear(HoldsOp, nn.Module):
    """What both layouts share: the shard's ``weight`` ``[local_out, local_in]`` and ``bias``
    (``state_dict`` keys ``weight`` and ``bias``, the shard's), the op
    (``GemmFwdOp(trans_b=True)``, as :class:`~tileops.nn.Linear`), and an init drawn from the
    full ``torch.nn.Linear``'s distribution (``kaiming_uniform_(a=sqrt(5))`` over the full
    ``in_features`` is uniform in ``1/sqrt(in_features)``, as is the bias).

    ``in_features`` and ``out_features`` are the full layer's; ``world_size`` and ``rank`` are
    this rank's place in ``group`` (the default group where None), fixed at construction."""

    op_class = GemmFwdOp
    op_fixed = {"trans_b": True}

    def _init_shard(self, in_features: int, out_features: int, local_in: int, local_out: int,
                    bias_features: int | None, device: Any, dtype: Any) -> None:
        self.in_features = in_features
        self.out_features = out_features
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(local_out, local_in, **kw))
        if bias_features is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.empty(bias_features, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    @property
    def group(self) -> Any:
        """The process group the layer is sharded over (the default group where None was given:
        only that one is stored, so a layer over it copies and pickles)."""
        return dist.group.WORLD if self._group is None else self._group

    def load_full(self, linear: nn.Linear) -> None:
        """Copy this rank's shard of the full layer ``linear`` into this layer's parameters."""
        name = type(self).__name__
        _check_full(name, "linear", linear)
        seen = (linear.in_features, linear.out_features, linear.bias is not None)
        if seen != (self.in_features, self.out_features, self.bias is not None):
            raise ValueError(f"{name}: argument linear does not match the layer; expected "
                             f"in_features={self.in_features}, out_features={self.out_features}, "
                             f"bias={self.bias is not None}, seen in_features={seen[0]}, "
                             f"out_features={seen[1]}, bias={seen[2]}")
        weight, bias = self._shard_of(linear)  # each layout's slices
        with torch.no_grad():
            self.weight.copy_(weight)
            if self.bias is not None:
                self.bias.copy_(bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, world_size={self.world_size}, "
                f"rank={self.rank}" + self._target_repr())


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` with this rank holding ``out_features / world_size`` rows of
    the weight and of the bias (rank ``r`` the ``r``-th block): the output's last axis is split
    across ranks.

    The input is replicated (every rank passes the same ``x``); its gradient is summed over
    ranks in backward. With ``gather_output`` the ranks' outputs are all-gathered along the
    last axis (every rank gets the full ``y``); without it each rank returns its
    ``out_features / world_size`` slice, which a :class:`RowParallelLinear` reads as it is."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Any = None, gather_output: bool = False, device: Any = None,
                 dtype: Any = None, target: str | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        self._group, self.world_size, self.rank = _world(name, group)
        local_out = _shard(name, "out_features", out_features, self.world_size)
        self.gather_output = gather_output
        self._init_shard(in_features, out_features, in_features, local_out,
                         local_out if bias else None, device, dtype)
        self.target = target
        self._build_op()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, *, gather_output: bool = False,
                    target: str | None = None) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (its rows, and its slice of the bias), on
        ``linear``'s device and dtype."""
        _check_full(cls.__name__, "linear", linear)
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    group=group, gather_output=gather_output, device=w.device, dtype=w.dtype,
                    target=target)
        layer.load_full(linear)
        return layer

    def _shard_of(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = self.weight.shape[0]
        rows = slice(self.rank * n, (self.rank + 1) * n)
        return linear.weight[rows], None if linear.bias is None else linear.bias[rows]

    def local_forward(self, input: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the output, with no communication: the input's gradient is
        this rank's part only. :class:`TensorParallelMLP` calls it on an input it has passed
        through the copy to the parallel region once for both of its column layers."""
        return linear_with(self.op, input, self.weight, self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = self.local_forward(_CopyToParallel.apply(input, self.group))
        return _GatherFromParallel.apply(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gather_output={self.gather_output}"


class RowParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` with this rank holding ``in_features / world_size`` columns
    of the weight (rank ``r`` the ``r``-th block) and the whole bias: each rank multiplies its
    slice of the input, the partial products are all-reduced (summed), and the bias is added
    once, after the sum. The output is replicated.

    With ``input_is_parallel`` (the default: the output of a :class:`ColumnParallelLinear`
    without ``gather_output``) the input is this rank's ``in_features / world_size`` slice;
    otherwise it is the full input, sliced here (and its gradient all-gathered in backward)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Any = None, input_is_parallel: bool = True, device: Any = None,
                 dtype: Any = None, target: str | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        self._group, self.world_size, self.rank = _world(name, group)
        local_in = _shard(name, "in_features", in_features, self.world_size)
        self.input_is_parallel = input_is_parallel
        self._init_shard(in_features, out_features, local_in, out_features,
                         out_features if bias else None, device, dtype)
        self.target = target
        self._build_op()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, *,
                    input_is_parallel: bool = True,
                    target: str | None = None) -> RowParallelLinear:
        """This rank's shard of ``linear`` (its columns, and the whole bias), on ``linear``'s
        device and dtype."""
        _check_full(cls.__name__, "linear", linear)
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    group=group, input_is_parallel=input_is_parallel, device=w.device,
                    dtype=w.dtype, target=target)
        layer.load_full(linear)
        return layer

    def _shard_of(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = self.weight.shape[1]
        return linear.weight[:, self.rank * n:(self.rank + 1) * n], linear.bias

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            input = _ScatterToParallel.apply(input, self.group)
        y = _ReduceFromParallel.apply(linear_with(self.op, input, self.weight, None),
                                      self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}"


class TensorParallelMLP(PassesTarget, nn.Module):
    """The Llama MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, tensor-parallel:
    ``gate_proj`` and ``up_proj`` are :class:`ColumnParallelLinear` (``intermediate /
    world_size`` features a rank), ``down_proj`` a :class:`RowParallelLinear` reading them. The
    input and output are replicated ``[..., hidden]`` tensors; one all-reduce runs in forward
    (``down_proj``'s) and one in backward (the input gradient, shared by both column layers).
    The submodules' names are Hugging Face's ``LlamaMLP``'s, so its ``state_dict`` keys are the
    shard's ``gate_proj.weight``, ``up_proj.weight`` and ``down_proj.weight``.

    SiLU and the product are one :class:`~tileops.ops.SwiGLUFwdOp` call on this rank's shards
    (elementwise, so it shards with them): it reads the two projections once and writes the
    product once."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False, group: Any = None,
                 device: Any = None, dtype: Any = None, target: str | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        group, world, _ = _world(name, group)
        _shard(name, "intermediate", intermediate, world)
        kw = {"group": group, "device": device, "dtype": dtype, "target": target}
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, bias, **kw)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias, **kw)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, **kw)
        self.target = target
        self._build_held()
        self._parts_done()

    def _build_held(self) -> None:
        self.swiglu = SwiGLUFwdOp(target=self.target)

    @classmethod
    def from_mlp(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, group: Any = None, *,
                 target: str | None = None) -> TensorParallelMLP:
        """This rank's shard of the MLP whose projections are the full layers ``gate``,
        ``up`` (``hidden -> intermediate``) and ``down`` (``intermediate -> hidden``)."""
        name = cls.__name__
        for argument, linear in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{name}.from_mlp: argument {argument} must be a "
                                f"torch.nn.Linear (the full, unsharded layer), seen "
                                f"{type(linear).__name__}")
        hidden, intermediate = gate.in_features, gate.out_features
        for argument, linear, shape in (("up", up, (intermediate, hidden)),
                                        ("down", down, (hidden, intermediate))):
            if (linear.out_features, linear.in_features) != shape:
                raise ValueError(f"{name}.from_mlp: argument {argument} does not match gate "
                                 f"({hidden} -> {intermediate}); expected {shape[1]} -> "
                                 f"{shape[0]}, seen {linear.in_features} -> "
                                 f"{linear.out_features}")
        biases = {linear.bias is not None for linear in (gate, up, down)}
        if len(biases) != 1:
            raise ValueError(f"{name}.from_mlp: gate, up and down must all have a bias or all "
                             f"have none; seen gate {gate.bias is not None}, up "
                             f"{up.bias is not None}, down {down.bias is not None}")
        w = gate.weight
        mlp = cls(hidden, intermediate, bias=biases.pop(), group=group, device=w.device,
                  dtype=w.dtype, target=target)
        for layer, linear in ((mlp.gate_proj, gate), (mlp.up_proj, up), (mlp.down_proj, down)):
            layer.load_full(linear)
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToParallel.apply(x, self.down_proj.group)
        h = self.swiglu(self.gate_proj.local_forward(x), self.up_proj.local_forward(x))
        return self.down_proj(h)


class TensorParallelAttention(PassesTarget, nn.Module):
    """Llama's attention block, tensor-parallel over heads: ``q_proj``, ``k_proj`` and
    ``v_proj`` are :class:`ColumnParallelLinear` (``num_heads / world_size`` query heads and
    ``num_kv_heads / world_size`` key/value heads a rank, each rank the ``r``-th block of
    heads), the rotary embedding (:class:`~tileops.nn.RotaryEmbedding`, Llama's halves) and
    causal :class:`~tileops.ops.GroupedQueryAttentionFwdOp` run on this rank's heads, and
    ``o_proj`` is a :class:`RowParallelLinear` reading them. A block of query heads keeps the
    key/value heads it reads (query head ``h`` reads ``h // (num_heads / num_kv_heads)``), so
    attention needs no communication; as in :class:`TensorParallelMLP`, one all-reduce runs in
    forward (``o_proj``'s) and one in backward (the input gradient). The input and output are
    replicated ``[B, S, hidden]`` tensors; ``position_ids`` (``[B, S]`` or ``[S]``) defaults
    to ``0 .. S-1``. The submodules' names are Hugging Face's ``LlamaAttention``'s."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, rope_theta: float = 10000.0,
                 bias: bool = False, group: Any = None, device: Any = None, dtype: Any = None,
                 target: str | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        group, world, _ = _world(name, group)
        num_kv_heads, head_dim = heads_of(name, hidden, num_heads, num_kv_heads, head_dim)
        self.local_heads = _shard(name, "num_heads", num_heads, world)
        self.local_kv_heads = _shard(name, "num_kv_heads", num_kv_heads, world)
        self.hidden, self.num_heads, self.num_kv_heads = hidden, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        kw = {"group": group, "device": device, "dtype": dtype, "target": target}
        self.q_proj = ColumnParallelLinear(hidden, num_heads * head_dim, bias, **kw)
        self.k_proj = ColumnParallelLinear(hidden, num_kv_heads * head_dim, bias, **kw)
        self.v_proj = ColumnParallelLinear(hidden, num_kv_heads * head_dim, bias, **kw)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, False, **kw)
        self.rotary = RotaryEmbedding(head_dim, base=rope_theta, target=target)
        self.target = target
        self._build_held()
        self._parts_done()

    def _build_held(self) -> None:
        self.attention = GroupedQueryAttentionFwdOp(is_causal=True, target=self.target)

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear,
                     num_heads: int, num_kv_heads: int | None = None, group: Any = None, *,
                     rope_theta: float = 10000.0,
                     target: str | None = None) -> TensorParallelAttention:
        """This rank's shard of the attention block whose projections are the full layers
        ``q``, ``k``, ``v`` (``hidden -> heads * head_dim``, Llama's head-major features) and
        ``o`` (``num_heads * head_dim -> hidden``, no bias)."""
        name = f"{cls.__name__}.from_linears"
        hidden, num_kv_heads, head_dim, bias = projections_of(
            name, q, k, v, o, num_heads, num_kv_heads, " (the full, unsharded layer)")
        if o.bias is not None:
            raise ValueError(f"{name}: argument o has a bias; Llama's o_proj has none, and "
                             f"this block adds none")
        w = q.weight
        block = cls(hidden, num_heads, num_kv_heads, head_dim, rope_theta=rope_theta,
                    bias=bias, group=group, device=w.device, dtype=w.dtype,
                    target=target)
        for layer, linear in ((block.q_proj, q), (block.k_proj, k), (block.v_proj, v),
                              (block.o_proj, o)):
            layer.load_full(linear)
        return block

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        d = self.head_dim
        x = _CopyToParallel.apply(x, self.o_proj.group)
        q = self.q_proj.local_forward(x).view(b, s, self.local_heads, d)
        k = self.k_proj.local_forward(x).view(b, s, self.local_kv_heads, d)
        v = self.v_proj.local_forward(x).view(b, s, self.local_kv_heads, d)
        q, k = self.rotary(q, k, position_ids)
        o = self.attention(q, k, v)
        return self.o_proj(o.reshape(b, s, self.local_heads * d))

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"local_heads={self.local_heads}")
