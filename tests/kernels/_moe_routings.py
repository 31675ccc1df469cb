"""Routings that hold the routing programs to the reference's picks exactly: the cases and
their logits, shared by the host run of the thread-a-token program (tests/ops/test_moe_host.py)
and the GPU run of both programs (tests/kernels/test_moe_cuda.py)."""

from __future__ import annotations

import math

#: (id, experts, top_k, scoring, renormalize, groups, kept groups, scale, bias, logits)
ROUTINGS = [
    # Mixtral's, over small integers: ties, the lowest id first
    ("mixtral-ties", 8, 2, "softmax", True, 1, 1, 1.0, False, "ties"),
    # DeepSeek-V3's: groups and a correction bias
    ("deepseek", 256, 8, "sigmoid", True, 8, 4, 2.5, True, "normal"),
    # DeepSeek-V3's over ties: the groups' sums tie as well
    ("deepseek-ties", 256, 8, "sigmoid", True, 8, 4, 2.5, False, "ties"),
    # groups without a bias: the groups ranked by their scores' sums, not the logits'
    ("groups-no-bias", 8, 2, "sigmoid", True, 2, 1, 1.0, False, "groups"),
    ("no-renorm-ties", 64, 6, "softmax", False, 1, 1, 1.0, False, "ties"),
    # NaN logits: the sort puts a NaN first (before every number, NaNs by id), in the picks,
    # a group's two best and the groups
    ("nan-logits", 16, 4, "sigmoid", True, 1, 1, 1.0, False, "nan"),
    ("nan-groups", 32, 6, "sigmoid", True, 8, 3, 1.0, True, "nan"),
    ("nan-softmax", 128, 8, "softmax", True, 1, 1, 1.0, False, "nan"),
    ("nan-groups-160", 160, 6, "sigmoid", True, 8, 3, 1.0, True, "nan"),
    # a list of picks longer than the registers hold (it loops), over ties
    ("long-list", 40, 20, "softmax", True, 1, 1, 1.0, False, "ties"),
    # experts that do not fill the warp's lanes (60: two a lane, the last two lanes none)
    ("sixty-ties", 60, 4, "softmax", True, 1, 1, 1.0, False, "ties"),
    ("sixty-bias", 60, 4, "softmax", True, 1, 1, 1.0, True, "normal"),
    # slots and picks past what registers hold (19 a lane, 40 picks: both loop)
    ("wide-600", 600, 40, "softmax", True, 1, 1, 1.0, False, "ties"),
    # groups of one expert: a group's score is its one choice
    ("groups-of-one", 8, 3, "sigmoid", True, 8, 4, 1.0, True, "normal"),
    ("groups-of-one-32", 32, 3, "sigmoid", True, 32, 4, 1.0, True, "normal"),
]


def routing_inputs(torch, case: tuple, m: int):
    """The logits ``[m, E]`` (float32, on the CPU) and the bias (or None) of a case, drawn
    from the case's own seed."""
    _, e, top_k, _, _, _, _, _, bias, logits = case
    g = torch.Generator().manual_seed(e + top_k)
    if logits == "ties":
        x = torch.randint(-3, 3, (m, e), generator=g).float()
    elif logits == "groups":  # group 0's best logits (10, 0) outsum group 1's (4, 4); their
        # sigmoid scores do not (1.5 against 1.96)
        x = torch.tensor([[10.0, 0.0, -5.0, -5.0, 4.0, 4.0, -5.0, -5.0]]).repeat(m, 1)
        x[1:] += torch.randn(m - 1, e, generator=g) * 0.01
    else:
        x = torch.randn(m, e, generator=g)
    if logits == "nan":  # rows with one NaN, two, or none, at drawn places
        for row in range(m):
            for col in torch.randperm(e, generator=g)[:row % 3].tolist():
                x[row, col] = math.nan
    b = torch.randn(e, generator=g) * 0.1 if bias else None
    return x, b
