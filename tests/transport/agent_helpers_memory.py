"""A polling helper for the transport tests (kept apart from tests/engine's helpers)."""

import time


def wait_for(pred, timeout: float = 5.0) -> bool:
    """Poll ``pred`` every 5 ms until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return bool(pred())
