"""On/off switches read from the environment (A/B runs and escape hatches, e.g.
``STRUCTSPEC_GEMV=0``)."""

from __future__ import annotations

import os

_OFF = ("0", "false", "off", "no")


def env_flag(name: str, default: bool = True) -> bool:
    """Whether the switch ``name`` is on: unset gives ``default``; ``0`` / ``false`` / ``off``
    / ``no`` (any case, surrounding spaces ignored) turn it off; any other value turns it on.

    Args:
        name: the environment variable, e.g. ``"STRUCTSPEC_GEMV"``.
        default: the value when the variable is unset.
    """
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _OFF
