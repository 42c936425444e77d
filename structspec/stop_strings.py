"""Where a stop string ends an output: one rule for the engine and the server's front end.

Torch-free: the front end (which detokenizes in its own process) imports it to cut its text
at the place the engine decided.
"""

from __future__ import annotations

from collections.abc import Sequence


def first_stop_ending_after(text: str, stops: Sequence[str],
                            end_after: int) -> tuple[int, str] | None:
    """The earliest occurrence of any of ``stops`` in ``text`` that ends past index
    ``end_after`` (that is, in the text added since then), as ``(index, stop string)``, or
    None.

    ``end_after`` 0 searches the whole text. Checked as each token's text arrives (the
    engine's :func:`~structspec.scheduler.commit.process_text`), this finds a stop string as
    soon as it is complete. With ``min_tokens`` the engine starts checking at the first token
    past it, and the front end passes the text length of the first ``min_tokens`` tokens, so a
    stop string wholly inside that text counts for neither.
    """
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, end_after - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
