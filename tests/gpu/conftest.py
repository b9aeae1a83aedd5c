"""GPU test group: runs on a CUDA host, skips elsewhere with the reason (no GPU is the one allowed skip)."""

from __future__ import annotations

import pytest


def _cuda_devices() -> tuple[int, str]:
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        return 0, "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    return torch.cuda.device_count(), ""


@pytest.fixture(scope="session")
def cuda() -> int:
    """Number of CUDA GPUs; skips the test when there is none."""
    count, why = _cuda_devices()
    if not count:
        pytest.skip(f"GPU test skipped: {why}")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("GPU test skipped: cupy is not installed (the GPU path needs it)")
    return count
