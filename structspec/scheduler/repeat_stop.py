"""The repetition stop's detector: does the committed output end in a loop?

:class:`RepeatDetector` sees every committed token once, in order (``commit.cut_run`` feeds
it), and keeps for each period ``p <= max_period`` the length of the current run of positions
where a token equals the token ``p`` before it. The tail of ``run + p`` tokens is then one
unit of ``p`` tokens repeated, and it stops the request once it is long enough
(:class:`~structspec.penalty_params.RepetitionStop`). Because it sees committed tokens only,
one at a time, a speculative step that commits several tokens is cut at exactly the token
where plain decoding would have stopped.
"""

from __future__ import annotations

from structspec.penalty_params import RepetitionStop


class RepeatDetector:
    """Incremental loop detection over one request's committed output (host only).

    Args:
        config: the request's :class:`RepetitionStop`.

    Cost: ``O(max_period)`` integer comparisons per token.
    """

    def __init__(self, config: RepetitionStop) -> None:
        self.config = config
        period = config.max_period
        self._recent: list[int] = [-1] * period  # ring of the last ``max_period`` tokens
        self._pos = 0  # tokens seen
        self._runs = [0] * (period + 1)  # _runs[p]: tail positions equal to the token p back
        # the shortest looping tail that stops, per period
        self._needed = [0] + [max(config.min_tokens, config.min_repeats * p)
                              for p in range(1, period + 1)]

    def push(self, token: int) -> bool:
        """Add the next committed token; True when the output now ends in a loop."""
        period = self.config.max_period
        pos = self._pos
        recent, runs, needed = self._recent, self._runs, self._needed
        hit = False
        for p in range(1, min(period, pos) + 1):
            if recent[(pos - p) % period] == token:
                runs[p] += 1
                if runs[p] + p >= needed[p]:
                    hit = True
            else:
                runs[p] = 0
        recent[pos % period] = token
        self._pos = pos + 1
        return hit
