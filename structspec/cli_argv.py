"""Command-line words that argparse would misread, rewritten before parsing.

argparse takes a word that starts with ``-`` for an option unless it looks like a plain
negative number (``-1``, ``-0.5``): ``--temperature -inf``, ``--presence-penalty -1e3`` or
``--logit-bias``-style values such as ``-nan`` used to end in ``argument --temperature:
expected one argument``, which hides the real problem (the value). Joining such a value to
its flag (``--temperature=-inf``) lets the flag's own check name what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Sequence


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--flag VALUE`` whose VALUE is a negative float spelling that
    argparse mistakes for an option (``-inf``, ``-nan``, ``-1e5``) written as
    ``--flag=VALUE``; every other word is kept as it is.

    Only a word right after a ``--long-option`` without ``=`` is joined: a flag that takes no
    value then fails with argparse's own "ignored explicit argument" error, as it would have
    failed on the lone value.
    """
    out: list[str] = []
    for word in argv:
        prev = out[-1] if out else ""
        if (_is_negative_float(word) and prev.startswith("--") and "=" not in prev
                and prev != "--"):
            out[-1] = f"{prev}={word}"
        else:
            out.append(word)
    return out


def _is_negative_float(word: str) -> bool:
    if not word.startswith("-") or word.startswith("--"):
        return False
    try:
        float(word)
    except ValueError:
        return False
    return True
