"""The fused MoE layer's stages timed one by one: which stage holds a call's time.

    python benchmarks/moe_stages.py [-w LABEL ...] [--out DIR]
    python benchmarks/moe_stages.py --dry-run      # CPU, reference target, a tiny layer

- Workloads: FusedMoeFwdOp's spec rows (``-w``: shell patterns of their labels, default every
  bfloat16 row); ``--dry-run``: one tiny float32 layer on the CPU (the wiring, not a time).
- Stages: the layer's own (route, permute, gate_up, act, down, unpermute), each the delegate op
  the layer calls (MoeTopkGatingFwdOp, MoePermuteAlignFwdOp, GroupedGemmFwdOp, SiluAndMulFwdOp,
  GroupedGemmFwdOp, MoeUnpermuteFwdOp) built with the layer's params and called on what the
  stage before produced; then the whole layer. Each is timed alone by CUDA-graph replay
  (:func:`_common.graph_events`, device time), so the stages' sum is the layer's less what
  separates its launches.
- Floors: the bytes each stage must move at the device copy bandwidth (4.3 TB/s on the H200),
  the gate_up and down products' weights of the experts the routing picked; the ``% of
  layer`` column is the stage's share of the layer's time.
- Checks: the layer's output against the stages' (they are the same ops on the same tensors:
  equal), and the stages' outputs are the layer's delegates' (one construction each).

Results: ``moe_stages-<device>.json`` and ``.md`` under ``--out``; the table is printed last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
sys.path.insert(0, str(Path(__file__).parent))

#: the device copy bandwidth (bytes read + written a second) the floors are taken at
COPY_BPS = 4.3e12


def stages_of(layer, x, logits, w13, w2, bias):
    """``[(stage, op, args)]``: the layer's delegates in its order, each on the tensors the
    stage before produced (run once here to produce them), and the output."""
    from tileops.ops import (
        GroupedGemmFwdOp,
        MoePermuteAlignFwdOp,
        MoeTopkGatingFwdOp,
        MoeUnpermuteFwdOp,
        SiluAndMulFwdOp,
    )

    p = layer._point.params
    layout = p["layout"]
    target = layer.target
    route = MoeTopkGatingFwdOp(top_k=layer.top_k, scoring=layer.scoring,
                               renormalize=layer.renormalize, num_groups=layer.num_groups,
                               topk_groups=layer.topk_groups,
                               routed_scaling_factor=layer.routed_scaling_factor, target=target)
    permute = MoePermuteAlignFwdOp(num_experts=layer.num_experts, layout=layout, target=target)
    gate_up = GroupedGemmFwdOp(layout=layout, trans_b=True, target=target)
    act = SiluAndMulFwdOp(target=target)
    down = GroupedGemmFwdOp(layout=layout, trans_b=True, target=target)
    unpermute = MoeUnpermuteFwdOp(target=target)
    out = []
    weights, ids = route(logits, bias)
    out.append(("route", route, (logits, bias)))
    y, metadata, rows = permute(x, ids)
    out.append(("permute", permute, (x, ids)))
    h = gate_up(y, w13, metadata)
    out.append(("gate_up", gate_up, (y, w13, metadata)))
    a = act(h)
    out.append(("act", act, (h,)))
    o = down(a, w2, metadata)
    out.append(("down", down, (a, w2, metadata)))
    flat = o.view(-1, o.shape[-1])
    result = unpermute(flat, rows, weights)
    out.append(("unpermute", unpermute, (flat, rows, weights)))
    return out, result, ids


def floors(x, w13, w2, ids, m: int, top_k: int) -> dict[str, float]:
    """Bytes each stage must move (read + written once): the weights of the experts picked."""
    picked = int(ids.unique().numel())
    item = x.element_size()
    h, two_i = x.shape[1], w13.shape[1]
    slots = m * top_k
    return {
        "route": 0.0,
        "permute": 2 * slots * h * item,
        "gate_up": picked * two_i * h * item + slots * (h + two_i) * item,
        "act": slots * (two_i + two_i // 2) * item,
        "down": picked * h * (two_i // 2) * item + slots * (two_i // 2 + h) * item,
        "unpermute": slots * h * item + m * h * item,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-w", "--workload", action="append", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()

    import torch

    from _common import graph_events, header, md_table, title, write_results
    from tileops.ops import FusedMoeFwdOp
    from tileops.ops.workloads import cases_of, make_inputs

    if args.dry_run:
        g = torch.Generator().manual_seed(0)
        m, h, inter, e = 5, 16, 8, 4
        layer = FusedMoeFwdOp(num_experts=e, top_k=2, target="reference")
        cases = [("dry-run", layer, (torch.randn(m, h, generator=g),
                                     torch.randn(m, e, generator=g),
                                     torch.randn(e, 2 * inter, h, generator=g) / 4,
                                     torch.randn(e, h, inter, generator=g) / 4, None))]
    else:
        cases = [(c.label, FusedMoeFwdOp(**c.params), make_inputs(c, "cuda"))
                 for c in cases_of(FusedMoeFwdOp, labels=args.workload)
                 if c.dtypes.get("T") == "bfloat16"]
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    timed = dev.type == "cuda"
    head = header("moe_stages", dev)
    rows, doc = [], {**head, "workloads": []}
    for label, layer, inputs in cases:
        x, logits, w13, w2, bias = inputs
        whole = layer(*inputs)
        stages, result, ids = stages_of(layer, *inputs)
        if not torch.equal(whole, result):
            print(f"{label}: the stages' output differs from the layer's", file=sys.stderr)
            return 1
        need = floors(x, w13, w2, ids, x.shape[0], layer.top_k)
        times = {}
        for name, op, a in stages:
            times[name] = graph_events(lambda op=op, a=a: op(*a), 20) if timed else 0.0
        times["layer"] = graph_events(lambda f=layer, a=inputs: f(*a), 20) if timed else 0.0
        entry = {"workload": label, "ms": times, "floor_bytes": need}
        doc["workloads"].append(entry)
        for name, ms in times.items():
            floor_us = need.get(name, sum(need.values())) / COPY_BPS * 1e6
            share = f"{100 * ms / times['layer']:.0f}%" if times["layer"] else "-"
            rows.append([label, name, f"{ms * 1e3:.1f}", f"{floor_us:.1f}", share])
    md = title(head, "FusedMoeFwdOp's stages, each timed alone (CUDA-graph replay)")
    md += md_table(["workload", "stage", "us", "floor us (copy bandwidth)", "% of layer"], rows)
    if args.dry_run:  # the wiring checked; nothing timed, nothing written
        print("\n".join(md))
        return 0
    write_results(args.out, "moe_stages", dev, doc, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
