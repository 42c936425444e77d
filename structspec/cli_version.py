"""``structspec --version``: the installed package's version and what it runs on, read from
package metadata (no torch import: the line prints in well under a second)."""

from __future__ import annotations

import argparse
import platform
from collections.abc import Sequence
from importlib import metadata
from typing import Any


def version_line() -> str:
    """``structspec 0.1.0 (torch 2.13.0+cpu, Python 3.11.7)``.

    The versions come from the installed distributions' metadata; one that is not installed
    (a source tree on ``PYTHONPATH`` without ``pip install``) shows as ``unknown``.
    """
    return (f"structspec {_dist_version('structspec')} (torch {_dist_version('torch')}, "
            f"Python {platform.python_version()})")


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


class VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` and exit 0 (argparse's own action would
    build the line even when the flag is not given)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()
