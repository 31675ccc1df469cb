"""One op instance over two GPUs of one host (``pytest -m cuda2``): a call on ``cuda:0`` and
then on ``cuda:1`` builds and caches a kernel entry on each device, each call's result right
against float64; the same from one thread per device; ``request_tune()`` reaches each device's
entry once. The CPU suite proves the same rules with the ``cpu`` and ``meta`` devices
(tests/runtime/test_devices_threads.py); this runs the in-tree kernels."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from tileops.ops import GemmFwdOp, RMSNormFwdOp  # noqa: E402

pytestmark = pytest.mark.cuda2

DEVICES = ("cuda:0", "cuda:1")


def _rms_norm_case(device: str, seed: int, n: int = 4096, rows: int = 333):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, n, generator=g, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, generator=g, device=device, dtype=torch.bfloat16)
    x64, w64 = x.double(), w.double()
    want = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64
    return x, w, want


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _devices_of_entries(op) -> list[torch.device]:
    return sorted((e.spec.device for entries in op.built_entries.values()
                   for e in entries.values()), key=str)


def test_one_instance_builds_an_entry_on_each_device() -> None:
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-6)
    for seed in range(3):  # the first call on each device builds, the others reuse
        for device in DEVICES:
            x, w, want = _rms_norm_case(device, seed)
            y = op(x, w)
            assert y.device == torch.device(device) and op.last_call.device == y.device
            assert _rel(y, want) < 1e-2, (device, seed)
    assert op.serving_target == "tileops"
    assert _devices_of_entries(op) == [torch.device(d) for d in DEVICES]


def test_one_thread_per_device_shares_the_instance() -> None:
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-6)
    errors: list[str] = []
    start = threading.Barrier(len(DEVICES))

    def work(device: str) -> None:
        try:
            torch.cuda.set_device(device)
            start.wait()
            for seed in range(20):
                x, w, want = _rms_norm_case(device, seed, rows=1 + 37 * seed)
                y = op(x, w)
                err = _rel(y, want)
                if y.device != torch.device(device) or not err < 1e-2:
                    errors.append(f"{device} seed {seed}: {y.device}, rel. error {err:.2e}")
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - reported below with its thread
            errors.append(f"{device}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(d,)) for d in DEVICES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert _devices_of_entries(op) == [torch.device(d) for d in DEVICES]


def test_request_tune_reaches_each_devices_entry_once() -> None:
    op = GemmFwdOp(trans_b=True)
    shapes = {}
    for device in DEVICES:
        g = torch.Generator(device=device).manual_seed(1)
        a = torch.randn(1000, 512, generator=g, device=device, dtype=torch.bfloat16)
        b = torch.randn(768, 512, generator=g, device=device, dtype=torch.bfloat16)
        shapes[device] = (a, b)
        op(a, b)
    entries = [e for built in op.built_entries.values() for e in built.values()]
    assert sorted({str(e.spec.device) for e in entries}) == list(DEVICES)
    tunable = [e for e in entries if hasattr(e, "_tune_pending")]
    assert sorted(str(e.spec.device) for e in tunable) == list(DEVICES)
    op.request_tune()
    assert [e._tune_pending for e in tunable] == [True, True]
    for device, (a, b) in shapes.items():  # each device's next call tunes its own entry
        c = op(a, b)
        want = a.double() @ b.double().T
        assert _rel(c, want) < 1e-2, device
    assert [e._tune_pending for e in tunable] == [False, False]
    assert len([e for built in op.built_entries.values() for e in built.values()]) == \
        len(entries)  # tuning replaced no entry
