"""Shared pytest configuration.

Tests marked ``cuda`` need a CUDA GPU; they are skipped when torch is not installed or
``torch.cuda.is_available()`` is false. torch is imported only when such a test was
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    reason = _cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in cuda_items:
        item.add_marker(skip)
