"""Polling helper shared by the in-process transport tests."""

from __future__ import annotations

import time


def wait_until(cond, timeout: float = 15.0) -> bool:
    """Poll `cond()` every 10 ms until it is true (True) or `timeout` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False
