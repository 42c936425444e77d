"""The scheduler's and the drafters' host page tables, and the verify inputs built from them."""

from __future__ import annotations

import numpy as np
import pytest

from structspec.kvcache.page_table import HostPageTable
from structspec.runner.batch_builder import (
    fill_seq_lens_and_pages,
    page_rows,
    page_table_array,
)


def test_rows_are_gathered_padded_and_reused() -> None:
    table = HostPageTable(num_rows=2, num_pages=2)
    a = table.add([5, 6])
    b = table.add([7])
    c = table.add([8, 9, 10])  # grows rows and columns
    assert len({a, b, c}) == 3 and table.array.shape[1] >= 3
    rows = table.rows([c, a, b])
    assert rows.take(2).tolist() == [[8, 9], [5, 6], [7, 0]]
    assert rows.take(5).tolist() == [[8, 9, 10, 0, 0], [5, 6, 0, 0, 0], [7, 0, 0, 0, 0]]
    table.extend(b, [11, 12])
    assert table.rows([b]).take(3).tolist() == [[7, 11, 12]]
    assert table.width([a, b]) == 3 and table.width([]) == 1
    table.remove(c)
    with pytest.raises(ValueError, match="not in use"):
        table.remove(c)
    d = table.add([1])  # the freed row, cleared
    assert d == c and table.rows([d]).take(3).tolist() == [[1, 0, 0]]


@pytest.mark.parametrize("as_rows", [False, True])
def test_verify_heads_match_the_list_layout(as_rows: bool) -> None:
    """The staged ``seq_lens | page_table`` of the eager and the graph verify paths, from
    page lists or from table rows, equal the flat lists the runner used to build."""
    pages = [[3, 4, 5, 6], [7], [8, 9, 10]]
    seq_lens = [40, 3, 30]
    table = HostPageTable(num_rows=4, num_pages=3)
    arg = table.rows([table.add(p) for p in pages]) if as_rows else pages
    need = 3
    assert page_table_array(arg, need).tolist() == np.array(
        page_rows(pages, need, 3)).reshape(3, need).tolist()
    eager = np.empty(3 * (1 + need), dtype=np.int64)
    fill_seq_lens_and_pages(eager, seq_lens, arg, need, 3)
    assert eager.tolist() == seq_lens + page_rows(pages, need, 3)
    gbsz, gpages = 8, 5  # a graph bucket: dummy rows and a wider page table
    graph = np.full(gbsz * (1 + gpages), -7, dtype=np.int64)
    fill_seq_lens_and_pages(graph, seq_lens, arg, need, gbsz, width=gpages)
    assert graph.tolist() == (seq_lens + [0] * (gbsz - 3)
                              + page_rows([p[:need] for p in pages], gpages, gbsz))
