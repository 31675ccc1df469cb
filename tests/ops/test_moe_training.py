"""The mixture-of-experts gradients of the routing and the permutation on the CPU:
MoeTopkGatingBwdOp and MoePermuteAlignBwdOp through their forwards' public ops (gradcheck in
float64 over the routing configs the models use, the correction bias given in float32 as the
layer holds it), their closed forms against a pick-by-pick loop written out here (repeated and
out-of-range ids, dropped picks) and, by hypothesis over routings and layouts, against torch's
autograd of the forwards' torch ops, and each op's own forward through a CPU stand-in of its
kernel slot (the call spec it builds, the unit weights it hands the unpermutation's kernel, the
dtypes it refuses by name).

The generic gradient tests take every workload; this file covers the configurations and the
edge values they do not draw.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels.moe import MoeGatingBwdInterface, MoeUnpermuteInterface
from tileops.ops._moe_layout import (
    LayoutValue,
    gating_bwd_reference,
    gating_reference,
    permute_bwd_reference,
    permute_reference,
    unpermute_reference,
)
from tileops.ops.moe import (
    ContiguousLayoutSpec,
    MaskedLayoutSpec,
    MoePermuteAlignBwdOp,
    MoePermuteAlignFwdOp,
    MoeTopkGatingBwdOp,
    MoeTopkGatingFwdOp,
)
from tileops.runtime import Kernel, targets

#: routing configurations: Mixtral's, DeepSeek-V3's (sigmoid, groups, bias, scale), Qwen's
#: unrenormalised softmax, and an unrenormalised sigmoid
ROUTES = {
    "mixtral": dict(top_k=2),
    "deepseek": dict(top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2,
                     routed_scaling_factor=2.5),
    "no-renorm": dict(top_k=3, renormalize=False),
    "sigmoid-no-renorm": dict(top_k=2, scoring="sigmoid", renormalize=False,
                              routed_scaling_factor=1.5),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("route", list(ROUTES))
def test_gating_weights_gradcheck_through_the_public_op(route, bias) -> None:
    op = MoeTopkGatingFwdOp(**ROUTES[route])
    logits = torch.randn(6, 16, generator=_gen(1), dtype=torch.float64, requires_grad=True)
    cb = torch.randn(16, generator=_gen(2)) / 4 if bias else None
    assert torch.autograd.gradcheck(lambda z: op(z, cb)[0], (logits,), atol=1e-8, rtol=1e-6)


def _gating_bwd_loop(dw, logits, ids, *, top_k, scoring, renormalize, scale):
    """The chain rule a token and a pick at a time, from the scores' definitions."""
    z = logits.double()
    m, e = z.shape
    out = torch.zeros_like(z)
    for t in range(m):
        s = torch.softmax(z[t], 0) if scoring == "softmax" else torch.sigmoid(z[t])
        picks = [(j, i) for j, i in enumerate(ids[t].tolist()) if 0 <= i < e]
        total = sum(float(s[i]) for _, i in picks)
        ds = torch.zeros(e, dtype=torch.float64)
        for j, i in picks:
            g = scale * float(dw[t, j])
            if renormalize:  # w_j = s_i / total: d w_j / d s_o = (delta - w_j) / total
                for _, other in picks:
                    ds[other] -= g * float(s[i]) / total**2
                ds[i] += g / total
            else:
                ds[i] += g
        for i in range(e):
            if scoring == "softmax":
                out[t, i] = s[i] * (ds[i] - float((ds * s).sum()))
            else:
                out[t, i] = ds[i] * s[i] * (1 - s[i])
    return out


@pytest.mark.parametrize("route", list(ROUTES))
def test_the_gating_gradient_sums_repeated_ids_and_skips_out_of_range(route) -> None:
    r = ROUTES[route]
    k, e = r["top_k"], 8
    bwd = MoeTopkGatingBwdOp(top_k=k, scoring=r.get("scoring", "softmax"),
                             renormalize=r.get("renormalize", True),
                             routed_scaling_factor=r.get("routed_scaling_factor", 1.0))
    logits = torch.randn(4, e, generator=_gen(3), dtype=torch.float64)
    ids = torch.randint(0, e, (4, k), generator=_gen(4), dtype=torch.int32)
    ids[0, :] = 5  # every pick the same expert
    ids[1, 0] = -1  # dropped
    ids[2, k - 1] = e  # past the experts
    dw = torch.randn(4, k, generator=_gen(5), dtype=torch.float64)
    got = bwd(dw, logits, ids)
    want = _gating_bwd_loop(dw, logits, ids, top_k=k, scoring=bwd.scoring,
                            renormalize=bwd.renormalize, scale=bwd.routed_scaling_factor)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_gating_gradient_ignores_the_bias_and_groups_given_the_picks() -> None:
    """The bias and the groups choose the picks; the weights' gradient is the picks' alone:
    the forward's autograd with a bias equals the backward op fed the same ids."""
    fwd = MoeTopkGatingFwdOp(**ROUTES["deepseek"])
    logits = torch.randn(5, 16, generator=_gen(6), dtype=torch.float64, requires_grad=True)
    cb = torch.randn(16, generator=_gen(7)) / 4
    weights, ids = fwd(logits, cb)
    dw = torch.randn(weights.shape, generator=_gen(8), dtype=torch.float64)
    (got,) = torch.autograd.grad(weights, logits, dw)
    want = gating_bwd_reference(dw, logits.detach(), ids, top_k=4, scoring="sigmoid",
                                renormalize=True, scale=2.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("layout", "dropped"), [
    (ContiguousLayoutSpec(), False),
    (ContiguousLayoutSpec(packing="aligned", alignment=4), True),
    (MaskedLayoutSpec(2), True),  # blocks of 2 rows: some picks overflow and are dropped
])
def test_the_permutation_gradcheck_through_the_public_op(layout, dropped) -> None:
    op = MoePermuteAlignFwdOp(num_experts=4, layout=layout)
    x = torch.randn(5, 3, generator=_gen(9), dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 4, (5, 2), generator=_gen(10), dtype=torch.int32)
    if dropped:
        ids[1, 1] = -1
        ids[3, 0] = 4
    assert torch.autograd.gradcheck(lambda v: op(v, ids)[0], (x,), atol=1e-10, rtol=1e-8)


def test_the_permutation_gradient_is_the_unit_unpermutation() -> None:
    dy = torch.randn(3, 4, 6, generator=_gen(11), dtype=torch.float64)  # masked [E, max_m, H]
    rows = torch.tensor([[0, 5], [11, -1], [5, 5]], dtype=torch.int32)
    dx = MoePermuteAlignBwdOp()(dy, rows)
    flat = dy.reshape(-1, 6)
    want = torch.stack([flat[0] + flat[5], flat[11], 2 * flat[5]])
    torch.testing.assert_close(dx, want, rtol=0, atol=1e-15)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 6), groups=st.sampled_from([1, 2, 4]), per=st.integers(2, 5),
       data=st.data())
def test_the_gating_closed_form_is_torch_autograd_over_routings(m, groups, per, data) -> None:
    """Over routings (scoring, groups, a bias, renormalisation, scale): the closed form at the
    forward's picks is torch's autograd of the forward's torch ops."""
    e = groups * per
    topk_groups = data.draw(st.integers(1, groups))
    top_k = data.draw(st.integers(1, topk_groups * per))
    route = dict(top_k=top_k, scoring=data.draw(st.sampled_from(["softmax", "sigmoid"])),
                 renormalize=data.draw(st.booleans()), num_groups=groups,
                 topk_groups=topk_groups, scale=data.draw(st.sampled_from([1.0, 2.5])))
    seed = data.draw(st.integers(0, 2**16))
    logits = torch.randn(m, e, generator=_gen(seed), dtype=torch.float64, requires_grad=True)
    bias = torch.randn(e, generator=_gen(seed + 1)) / 4 if data.draw(st.booleans()) else None
    weights, ids = gating_reference(logits, bias, **route)
    dw = torch.randn(weights.shape, generator=_gen(seed + 2), dtype=torch.float64)
    (want,) = torch.autograd.grad(weights, logits, dw)
    got = gating_bwd_reference(dw, logits.detach(), ids, top_k=top_k, scoring=route["scoring"],
                               renormalize=route["renormalize"], scale=route["scale"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 8), k=st.integers(1, 3), experts=st.integers(1, 5),
       lay=st.sampled_from([LayoutValue(masked=False), LayoutValue(masked=False, alignment=4),
                            LayoutValue(masked=True, max_m=2)]),
       seed=st.integers(0, 2**16))
def test_the_permutation_closed_form_is_torch_autograd_over_routings(m, k, experts, lay,
                                                                    seed) -> None:
    """Over routings with dropped ids (-1, past the experts) and overflowing blocks: the unit
    unpermutation of the grouped rows' gradient is torch's autograd of the gather."""
    x = torch.randn(m, 3, generator=_gen(seed), dtype=torch.float64, requires_grad=True)
    ids = torch.randint(-1, experts + 1, (m, k), generator=_gen(seed + 1), dtype=torch.int32)
    y, _, rows = permute_reference(x, ids, experts, lay)
    dy = torch.randn(y.shape, generator=_gen(seed + 2), dtype=torch.float64)
    (want,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(permute_bwd_reference(dy, rows), want, rtol=1e-12, atol=1e-14)


# --- the ops' own forwards, through CPU stand-ins of their slots -------------------------------


class _GatingBwdStandIn(Kernel, MoeGatingBwdInterface):
    devices = ("cpu",)
    general = True
    specs: list = []

    def __call__(self, dweights, logits, ids, dlogits) -> None:
        s = self.spec
        type(self).specs.append(s)
        dlogits.copy_(gating_bwd_reference(dweights, logits, ids, top_k=s.top_k,
                                           scoring=s.scoring, renormalize=s.renormalize,
                                           scale=s.scale))


class _UnpermuteStandIn(Kernel, MoeUnpermuteInterface):
    devices = ("cpu",)
    general = True
    weights: list = []

    def __call__(self, y, rows, weights, out) -> None:
        type(self).weights.append(weights.clone())
        out.copy_(unpermute_reference(y, rows, weights))


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=_gen(seed)).to(torch.bfloat16)


def test_the_gating_gradient_builds_its_call_spec_from_the_routing() -> None:
    _GatingBwdStandIn.specs.clear()
    op = MoeTopkGatingBwdOp(top_k=3, scoring="sigmoid", renormalize=False,
                            routed_scaling_factor=2.5, target=targets.IN_TREE,
                            kernel_map={MoeGatingBwdInterface: _GatingBwdStandIn})
    logits = _bf16(7, 12, seed=12)
    ids = torch.randint(0, 12, (7, 3), generator=_gen(13), dtype=torch.int32)
    dw = torch.randn(7, 3, generator=_gen(14))
    got = op(dw, logits, ids)
    (spec,) = _GatingBwdStandIn.specs
    assert (spec.e, spec.top_k, spec.dtype, spec.scoring, spec.renormalize, spec.scale) == \
        (12, 3, "bfloat16", "sigmoid", False, 2.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), op.fp64_reference(dw, logits, ids)[0],
                               rtol=2e-2, atol=1e-3)


def test_the_gating_gradient_refuses_float64_on_the_kernels_by_name() -> None:
    op = MoeTopkGatingBwdOp(top_k=2, target=targets.IN_TREE,
                            kernel_map={MoeGatingBwdInterface: _GatingBwdStandIn})
    logits = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(TypeError) as info:
        op(torch.randn(3, 2, dtype=torch.float64), logits, torch.zeros(3, 2, dtype=torch.int32))
    assert str(info.value) == (
        "MoeTopkGatingBwdOp: the in-tree gating kernels serve bfloat16, float16, float32, not "
        "float64; construct the op with target='reference' for float64")


def test_the_permutation_gradient_hands_the_unpermutation_unit_weights() -> None:
    _UnpermuteStandIn.weights.clear()
    op = MoePermuteAlignBwdOp(target=targets.IN_TREE,
                              kernel_map={MoeUnpermuteInterface: _UnpermuteStandIn})
    dy = _bf16(4, 2, 8, seed=15)
    rows = torch.tensor([[0, 7], [3, -1], [6, 6]], dtype=torch.int32)
    dx = op(dy, rows)
    (w,) = _UnpermuteStandIn.weights
    assert w.dtype == torch.float32 and torch.equal(w, torch.ones(3, 2))
    assert torch.equal(dx.double(), op.fp64_reference(dy, rows)[0].to(torch.bfloat16).double())


def test_the_permutation_gradient_refuses_float32_on_the_kernels_by_name() -> None:
    op = MoePermuteAlignBwdOp(target=targets.IN_TREE,
                              kernel_map={MoeUnpermuteInterface: _UnpermuteStandIn})
    with pytest.raises(TypeError) as info:
        op(torch.randn(4, 8), torch.zeros(2, 1, dtype=torch.int32))
    assert str(info.value) == (
        "MoePermuteAlignBwdOp: the in-tree unpermutation kernels serve bfloat16, float16, not "
        "float32; construct the op with target='reference' for float32")
