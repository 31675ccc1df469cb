"""``runtime.memory``: what a cache may keep of a tensor an op made."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tileops.runtime.memory import has_data, keepable


def test_a_real_tensor_is_kept_and_a_fake_or_meta_one_is_not() -> None:
    assert keepable(torch.ones(3)) and has_data(torch.ones(3))
    assert not keepable(torch.ones(3, device="meta"))
    with FakeTensorMode():
        fake = torch.ones(3)
    assert not keepable(fake) and not has_data(fake)


@pytest.mark.cuda
def test_a_tensor_made_during_graph_capture_is_not_kept() -> None:
    # its fill runs when the graph is replayed: an eager call before that would read it
    # unwritten
    made = []
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        t = torch.full((), 2.0, device="cuda")
        made.append(keepable(t))
    assert made == [False]
    assert keepable(torch.full((), 2.0, device="cuda"))
