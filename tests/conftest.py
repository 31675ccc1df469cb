"""Shared pytest configuration.

Tests marked ``cuda`` need a CUDA GPU; they are skipped when torch is not installed or
``torch.cuda.is_available()`` is false. Tests marked ``cuda2`` need two (a host of several
GPUs: ``pytest -m cuda2``); they are skipped where fewer are visible. torch is imported only when such a test was
collected, so the spec and signature suites run without it.
"""

from __future__ import annotations

import pytest


def _cuda_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs a CUDA GPU: torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    return None


def _two_gpus_unavailable_reason() -> str | None:
    reason = _cuda_unavailable_reason()
    if reason is not None:
        return reason.replace("a CUDA GPU", "two CUDA GPUs", 1)
    import torch

    if torch.cuda.device_count() < 2:
        return f"needs two CUDA GPUs: torch.cuda.device_count() is {torch.cuda.device_count()}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, why in (("cuda", _cuda_unavailable_reason),
                        ("cuda2", _two_gpus_unavailable_reason)):
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if not marked:
            continue
        reason = why()
        if reason is None:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in marked:
            item.add_marker(skip)
