"""Compile the prefill attention programs of every spec workload, and those of the backward
sweep, in parallel processes before a GPU run (``benchmarks/gpu_attention.sh``, stage
prebuild).

    python benchmarks/prebuild_attention.py [--workers N] [--sweep-only | --fwd-sweep]

A program serves every batch and length of its head configuration and options, so each spec
workload (the masked flag depends on S_kv) gives the forward and, where the head dims have a
backward, the programs of the ops' backward on sm_90
(:class:`~tileops.kernels.attention_bwd.AttentionBwdTmaKernel`); the backward sweep's shapes
add the other implementations (the 32-row :class:`~tileops.kernels.attention_bwd.AttentionBwdKernel`
and :class:`~tileops.kernels.attention_bwd.AttentionBwdFragmentKernel`). ``--fwd-sweep``: the
forward sweep's plans on the same shapes (:func:`fwd_sweep_plans`). A file, not a
``python -``: the spawned workers import their main module by path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

#: the sm_90 backward's schedules the sweep times: (STATS_TMA, OVERLAP) of
#: :mod:`tileops.kernels.attention_bwd`
BWD_SCHEDULES = [(False, False), (True, False), (True, True)]
#: the backward sweep's shapes: (B, S, H, H_kv, D, causal)
BWD_SWEEP = [(4, 4096, 32, 32, 128, False), (4, 4096, 32, 32, 128, True),
             (2, 8192, 32, 8, 128, True), (16, 1024, 32, 32, 64, True)]


def bar_spec(b, s, h, h_kv, d, causal):
    """The forward call spec of one of :data:`BWD_SWEEP`'s shapes ([B, S, H, D], bf16)."""
    import torch

    from tileops.kernels import attention as A

    return A.AttentionFwdSpec(
        device=torch.device("cuda", 0), batch=b, seq_q=s, seq_kv=s, heads=h, heads_kv=h_kv,
        dim=d, dim_v=d, dtype="bfloat16", layout=A.AttentionLayout.BSHD, scale=d ** -0.5,
        window_left=-1, window_right=0 if causal else -1, softcap=None)


def sweep_keys() -> list:
    """The backward sweep's programs: the forward and every backward implementation (the
    sm_90 one under each of :data:`BWD_SCHEDULES`)."""
    from tileops.kernels import attention as A
    from tileops.kernels import attention_bwd as AB

    keys = {}
    for shape in BWD_SWEEP:
        spec = bar_spec(*shape)
        for kind in ("fwd", "bwd", "bwd_fragment"):
            keys[(kind, A.program_key(spec) if kind == "fwd" else AB.bwd_program_key(spec))] = None
        for schedule in BWD_SCHEDULES:  # the sm_90 kernel under each of its schedules
            keys[("bwd_tma", AB.bwd_program_key(spec) + schedule)] = None
    return list(keys)


def fwd_sweep_plans(d: int) -> list:
    """``(label, plan)`` of the forward sweep (``benchmarks/gpu_attention.sh``, stage sweep)
    at head dim ``d``: the served plan, with fast math off and with three stages, the plain
    schedule (no spare step), and the persistent grid of ``SMS`` CTAs with the served and
    the plain schedule."""
    from tileops.kernels import attention as A

    base = A.attention_plan(d, d)
    pers = base._replace(persistent=A.SMS)
    return [("st2 fm", base), ("st2", base._replace(fast_math=False)),
            ("st3 fm", base._replace(stages=3)),
            ("st3", base._replace(fast_math=False, stages=3)),
            ("plain", base._replace(overlap=False, turns=False)),
            (f"pers{A.SMS}", pers),
            (f"pers{A.SMS} plain", pers._replace(overlap=False, turns=False))]


def fwd_sweep_keys() -> list:
    """The forward sweep's programs: each shape's program key with each plan."""
    from tileops.kernels import attention as A

    return [("fwd_plan", (A.program_key(bar_spec(*shape)), plan)) for shape in BWD_SWEEP
            for _, plan in fwd_sweep_plans(shape[4])]


def program_keys() -> list:
    import torch

    import tileops.ops as ops
    from tileops.kernels import attention as A
    from tileops.kernels import attention_bwd as AB
    from tileops.ops.workloads import cases_of

    keys = {}
    for name in ("MultiHeadAttentionFwdOp", "GroupedQueryAttentionFwdOp"):
        cls = getattr(ops, name)
        for case in cases_of(cls):
            if case.dtype not in ("bfloat16", "float16"):
                continue  # the reference target's
            op, v = cls(**case.params), case.values
            left, right = op._bounds
            spec = A.AttentionFwdSpec(
                device=torch.device("cuda", 0), batch=v["B"], seq_q=v["S_q"], seq_kv=v["S_kv"],
                heads=v["H"], heads_kv=v.get("H_kv", v["H"]), dim=v["D"], dim_v=v["D_v"],
                dtype=case.dtype, layout=A.AttentionLayout(op.layout),
                scale=op.softmax_scale(v["D"]), window_left=left, window_right=right,
                softcap=op.softcap)
            keys[("fwd", A.program_key(spec))] = None
            if (spec.dim, spec.dim_v) in AB.BWD_HEAD_DIMS:
                keys[("bwd_tma", AB.bwd_program_key(spec))] = None
    cls = ops.GroupedQueryAttentionVarlenFwdOp
    for case in cases_of(cls):
        if case.dtype not in ("bfloat16", "float16"):
            continue
        op, v = cls(**case.params), case.values
        left, right = op._bounds
        spec = A.AttentionVarlenFwdSpec(
            device=torch.device("cuda", 0), total_q=v["Z_q"], total_kv=v["Z_kv"], batch=v["B"],
            heads=v["H"], heads_kv=v["H_kv"], dim=v["D"], dim_v=v["D_v"], dtype=case.dtype,
            scale=op.softmax_scale(v["D"]), window_left=left, window_right=right,
            softcap=op.softcap)
        keys[("varlen", A.varlen_program_key(spec))] = None
    return list(dict.fromkeys([*keys, *sweep_keys()]))


def main(argv=None) -> int:
    from _prebuild import build_all
    from test_attention_cuda import _build, _describe

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the backward sweep's programs (stage bwd_sweep)")
    ap.add_argument("--fwd-sweep", action="store_true",
                    help="only the forward sweep's programs (stage sweep)")
    args = ap.parse_args(argv)
    keys = fwd_sweep_keys() if args.fwd_sweep else sweep_keys() if args.sweep_only \
        else program_keys()
    return build_all(keys, _build, _describe, args.workers)


if __name__ == "__main__":
    sys.exit(main())
