"""The running requests' KV page lists as rows of one host array, gathered per step.

A verify step hands the runner every request's first ``P`` pages as a ``[B, P]`` int64 table.
Built from the per-request Python lists each step, that cost grows with ``B * P``: a list
slice, a padding list and, above all, the conversion of every page id from a Python int
(~1.5 ms per step at batch 256 with ~100 pages per row on the 2-core CPU). A request's pages
only grow while it runs (a few pages now and then, as its output grows), so the scheduler
writes them into a row of a :class:`HostPageTable` at admission, appends the new ones
(:meth:`HostPageTable.extend`) and each step gathers the batch's rows with one numpy
indexing (:meth:`PageRows.take`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PageRows:
    """A batch's page lists: rows of a :class:`HostPageTable`, in batch order.

    Valid until the table next grows (:meth:`HostPageTable.add`), i.e. within one step.

    Attributes:
        table: ``int64 [R, W]`` the table's array (page 0, the sink, past each row's pages).
        rows: ``int64 [B]`` the table row of each request of the batch.
    """

    table: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def take(self, width: int) -> np.ndarray:
        """``int64 [B, width]``: each request's first ``width`` pages, padded with page 0.

        A fresh array (one numpy gather), never a view of the table.
        """
        have = min(width, self.table.shape[1])
        if have == width:
            return self.table[self.rows, :width]
        out = np.zeros((len(self), width), dtype=np.int64)
        out[:, :have] = self.table[self.rows, :have]
        return out


class HostPageTable:
    """Rows of KV page ids for the requests that hold pages (host int64, zero-padded).

    Rows are handed out at admission and returned at retirement; the array grows (rows or
    columns, doubling) when a request needs more, so no size has to be known up front. A
    row's list may grow (:meth:`extend`: a request's pages follow its length).

    Args:
        num_rows: initial rows (the engine's ``max_batch_size``: at most that many requests
            hold pages at once).
        num_pages: initial columns (pages per request).
    """

    def __init__(self, num_rows: int = 64, num_pages: int = 64) -> None:
        self.array = np.zeros((max(1, num_rows), max(1, num_pages)), dtype=np.int64)
        self._free = list(range(self.array.shape[0] - 1, -1, -1))  # pop() gives low rows first
        self._width = [0] * self.array.shape[0]  # pages written in each row

    @property
    def num_free_rows(self) -> int:
        """Rows not held by a request."""
        return len(self._free)

    def add(self, pages: Sequence[int]) -> int:
        """Write a request's pages into a free row (growing the table if needed); returns it."""
        if not self._free:
            old = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * old - 1, old - 1, -1))
            self._width += [0] * old
        if len(pages) > self.array.shape[1]:
            self._grow_columns(len(pages))
        row = self._free.pop()
        self.array[row, : len(pages)] = pages
        self._width[row] = len(pages)
        return row

    def extend(self, row: int, pages: Sequence[int]) -> None:
        """Append pages to a row's list (a drafter's pages grow with its request)."""
        start = self._width[row]
        end = start + len(pages)
        if end > self.array.shape[1]:
            self._grow_columns(end)
        self.array[row, start:end] = pages
        self._width[row] = end

    def width(self, rows: Sequence[int]) -> int:
        """The longest page list among ``rows`` (at least 1: a table is never 0 wide)."""
        w = self._width
        return max(max((w[r] for r in rows), default=1), 1)

    def remove(self, row: int) -> None:
        """Free a row (its pages are cleared back to page 0).

        Raises:
            ValueError: ``row`` is out of range or already free.
        """
        if not 0 <= row < self.array.shape[0] or row in self._free:
            raise ValueError(f"page table row {row} is not in use")
        self.array[row, : self._width[row]] = 0
        self._width[row] = 0
        self._free.append(row)

    def _grow_columns(self, need: int) -> None:
        width = max(need, 2 * self.array.shape[1])
        grown = np.zeros((self.array.shape[0], width), dtype=np.int64)
        grown[:, : self.array.shape[1]] = self.array
        self.array = grown

    def rows(self, row_ids: Sequence[int]) -> PageRows:
        """The batch's rows, in the given order (one per request)."""
        return PageRows(self.array, np.asarray(row_ids, dtype=np.int64))
