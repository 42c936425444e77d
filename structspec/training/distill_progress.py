"""Progress of self-distillation: a tqdm bar on a terminal, plain lines otherwise.

A run in a batch job (``--no-progress``, or stderr redirected to a log) still reports its
rate: one line every :data:`REPORT_INTERVAL_S` seconds, one when a source's last prompt
finishes, and one at the end, each with prompts done / total, skipped prompts, sequences/s,
response tokens/s, elapsed seconds and the same counts per source.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from structspec.training.sequences import TrainSequence

#: Seconds between two progress lines.
REPORT_INTERVAL_S = 15.0


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class DistillProgress:
    """Counts finished prompts per source and shows them.

    Args:
        totals: prompts of each source this run will try (source -> count); sources with 0
            are left out of the lines.
        bar: show a tqdm bar instead of lines (the caller passes ``progress and
            stderr.isatty()``).
        interval_s: seconds between two periodic lines (None: :data:`REPORT_INTERVAL_S`).
        clock: monotonic seconds (injectable for tests).
        write: where a line goes (default: stderr, flushed).
    """

    def __init__(self, totals: Mapping[str, int], *, bar: bool,
                 interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 write: Callable[[str], None] = _stderr_line) -> None:
        self.totals = {k: v for k, v in totals.items() if v > 0}
        self.clock = clock
        self.write = write
        self.interval_s = REPORT_INTERVAL_S if interval_s is None else interval_s
        self.start_s = clock()
        self._last_line_s = self.start_s
        self.done: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.response_tokens = 0
        self._bar: Any = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(total=sum(self.totals.values()), desc="distill", unit="req")

    @property
    def num_done(self) -> int:
        """Prompts finished so far (sequences and skipped)."""
        return sum(self.done.values())

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def record(self, source: str, seq: TrainSequence | None) -> None:
        """One prompt of ``source`` finished: ``seq`` is its sequence, or None when it was
        skipped (failed). Writes a line when it was the source's last prompt."""
        self.done[source] += 1
        if seq is None:
            self.skipped[source] += 1
        else:
            self.response_tokens += seq.num_response_tokens
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(failed=self.num_skipped, refresh=False)
        elif self.done[source] == self.totals.get(source, -1):
            self._line(f"{source} finished")

    def tick(self) -> None:
        """Write a line when :attr:`interval_s` passed since the last one (call after every
        engine step)."""
        if self._bar is None and self.clock() - self._last_line_s >= self.interval_s:
            self._line("")

    def close(self, note: str = "") -> None:
        """The final line (``note`` appended), or close the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            self._line(note)

    def line(self) -> str:
        """The progress line: totals, rates, elapsed time, then each source's counts."""
        elapsed = max(self.clock() - self.start_s, 1e-9)
        seqs = self.num_done - self.num_skipped
        per_source = ", ".join(
            f"{s} {self.done[s]}/{n}" + (f" ({self.skipped[s]} skipped)" if self.skipped[s]
                                         else "")
            for s, n in self.totals.items())
        return (f"distill: {self.num_done}/{sum(self.totals.values())} done, "
                f"{self.num_skipped} skipped, {seqs / elapsed:.2f} sequences/s, "
                f"{self.response_tokens / elapsed:.0f} response tokens/s, {elapsed:.0f} s "
                f"elapsed | {per_source}")

    def _line(self, note: str) -> None:
        self._last_line_s = self.clock()
        self.write(self.line() + (f" | {note}" if note else ""))
