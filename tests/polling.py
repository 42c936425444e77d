"""Waiting in tests for a state, not for a time: a fixed sleep is either too short on a
loaded 2-core machine (a flaky test) or longer than needed everywhere else."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(what: str, check: Callable[[], bool], timeout_s: float,
             every_s: float = 0.02) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` after ``timeout_s``.

    Raises:
        AssertionError: ``check`` was still false at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)
