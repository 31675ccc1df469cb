"""The cross-entropy kernels' whole calls run on the host (tests/kernels/_host_run.py's
HostProgram in place of each compiled program's launch): the loss's one-pass row program and
its finish, the kept gradient's persistent two-pass program with the mean's count and the
scale program, and the backward's; against the op's own formulas in float64 (the ops package's,
so these tests are the ops package's), over label smoothing, the z-loss, the softcap, ignored
rows and each reduction."""

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

from tileops.kernels import cross_entropy as ce  # noqa: E402

sys.path.append(str(Path(__file__).parents[1] / "kernels"))  # the host runner, a test module
from _host_run import HostProgram  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling a kernel's source for the host needs nvcc")


#: the SMs the persistent grids are planned for: a device of 3 (a grid of a few CTAs, each
#: walking several rows, as the H200's 132 do over thousands; each host thread of a CTA's
#: 512 is a real one)
SMS = 3


@pytest.fixture
def on_host(monkeypatch):
    """The kernel classes building their programs for sm_90 and running them on the host, as
    on a device of :data:`SMS` SMs."""
    rows, finish, scale = ce.build_rows_kernel, ce.build_finish_kernel, ce.build_scale_kernel

    def rows_kernel(classes, dtype, options, grad, per_row_scale, sms=SMS, target=None,
                    with_loss=False):
        return HostProgram(rows(classes, dtype, options, grad, per_row_scale, sms, "sm_90",
                                with_loss))

    monkeypatch.setattr(ce, "build_rows_kernel", rows_kernel)
    monkeypatch.setattr(ce, "build_finish_kernel", lambda ignore, mean, grad, target=None:
                        HostProgram(finish(ignore, mean, grad, "sm_90")))
    monkeypatch.setattr(ce, "build_scale_kernel", lambda classes, dtype, sms=SMS, target=None:
                        HostProgram(scale(classes, dtype, sms, "sm_90")))
    monkeypatch.setattr(ce, "_sm_count", lambda device: SMS)


def _op(options: dict):
    """The op whose float64 formulas (``_loss``, ``_grad``) are the reference."""
    from tileops.ops import CrossEntropyFwdOp

    return CrossEntropyFwdOp(**options)


#: (rows, classes, dtype, options)
CASES = [
    pytest.param(6, 1000, "float32", dict(), id="plain-odd-classes"),
    pytest.param(5, 4096, "bfloat16", dict(label_smoothing=0.1, ignore_index=3),
                 id="smoothing-ignored"),
    pytest.param(4, 777, "float32", dict(lse_square_scale=1e-3, softcap=30.0), id="zloss-softcap"),
]


def _inputs(rows: int, classes: int, dtype: str, ignore: int):
    g = torch.Generator().manual_seed(rows * classes)
    logits = (torch.randn(rows, classes, generator=g, dtype=torch.float64) * 3).to(getattr(torch, dtype))
    target = torch.randint(0, classes, (rows,), generator=g)
    target[1] = ignore  # an ignored row (the default -100 included)
    return logits, target


def _spec(rows, classes, dtype, options, reduction, kept=False):
    return ce.CrossEntropySpec(
        device=torch.device("cpu"), rows=rows, classes=classes, dtype=dtype,
        ignore_index=options.get("ignore_index", -100), reduction=ce.Reduction(reduction),
        label_smoothing=options.get("label_smoothing", 0.0),
        lse_square_scale=options.get("lse_square_scale", 0.0),
        softcap=options.get("softcap"), kept=kept)


def _close(got, want, dtype: str) -> None:
    tol = 1e-4 if dtype == "float32" else 2e-2
    err = float(((got.double() - want).abs() / (want.abs() + 1e-3)).max())
    assert err <= tol, err


@pytest.mark.parametrize(("case", "reduction"), [
    (0, "none"), (0, "mean"), (1, "sum"), (1, "mean"), (2, "none"), (2, "sum")])
def test_the_loss_is_the_op_s_formula_on_the_host(on_host, case, reduction):
    rows, classes, dtype, options = CASES[case].values
    logits, target = _inputs(rows, classes, dtype, options.get("ignore_index", -100))
    entry = ce.CrossEntropyFwdKernel(_spec(rows, classes, dtype, options, reduction))
    loss = torch.full((rows,) if reduction == "none" else (), float("nan"))
    entry(logits, target, loss)
    op = _op({**options, "reduction": reduction})
    _close(loss, op._loss(logits.double(), target), dtype)


@pytest.mark.parametrize(("case", "reduction"), [(0, "mean"), (1, "mean"), (2, "sum")])
def test_the_kept_gradient_and_its_scale_are_the_op_s_on_the_host(on_host, case, reduction):
    """The forward that keeps the gradient for a unit upstream gradient, then the scale by
    the upstream gradient the backward receives."""
    rows, classes, dtype, options = CASES[case].values
    logits, target = _inputs(rows, classes, dtype, options.get("ignore_index", -100))
    entry = ce.CrossEntropyFwdKernel(_spec(rows, classes, dtype, options, reduction, True))
    loss = torch.full((), float("nan"))
    dlogits = torch.full((rows, classes), float("nan"), dtype=logits.dtype)
    entry(logits, target, loss, dlogits)
    op = _op({**options, "reduction": reduction})
    x = logits.double()
    _close(loss, op._loss(x, target), dtype)
    _close(dlogits, op._grad(x, target, torch.ones((), dtype=torch.float64)), dtype)
    dloss = torch.tensor(0.75)
    entry.scale(dlogits, dloss)
    _close(dlogits, op._grad(x, target, dloss.double()), dtype)


@pytest.mark.parametrize(("case", "reduction"), [(0, "none"), (1, "mean")])
def test_the_backward_is_the_op_s_gradient_on_the_host(on_host, case, reduction):
    rows, classes, dtype, options = CASES[case].values
    logits, target = _inputs(rows, classes, dtype, options.get("ignore_index", -100))
    entry = ce.CrossEntropyBwdKernel(_spec(rows, classes, dtype, options, reduction))
    g = torch.Generator().manual_seed(5)
    dloss = torch.rand(rows, generator=g) + 0.5 if reduction == "none" else torch.tensor(1.5)
    dlogits = torch.full((rows, classes), float("nan"), dtype=logits.dtype)
    entry(logits, target, dloss, dlogits)
    op = _op({**options, "reduction": reduction})
    _close(dlogits, op._grad(logits.double(), target, dloss.double()), dtype)


@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1)], ids=["plain", "smoothing"])
def test_the_loss_of_logits_far_from_zero_is_as_precise_as_near_it_on_the_host(on_host, options):
    """Logits near 1e4 (a common offset to every class): the loss is the log-sum-exp above the
    row's maximum plus the target's distance below it, so it keeps float32's precision of the
    distances (a log-sum-exp of 1e4 first, less the target's logit, rounds to 1e-3)."""
    rows, classes = 4, 1000
    logits, target = _inputs(rows, classes, "float32", -100)
    logits = logits + 1e4
    entry = ce.CrossEntropyFwdKernel(_spec(rows, classes, "float32", options, "none"))
    loss = torch.full((rows,), float("nan"))
    entry(logits, target, loss)
    want = torch.nn.functional.cross_entropy(logits.double(), target, reduction="none",
                                             label_smoothing=options.get("label_smoothing", 0.0))
    valid = target != -100
    assert float((loss.double() - want)[valid].abs().max()) < 2e-5
