"""Prefill graphs (structspec/runner/prefill_graph.py): the piece split everywhere; on CUDA a
replayed chunk gives the logits and the KV of the eager prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structspec.runner.cuda_graph import kv_len_buckets
from structspec.runner.model_runner import ModelRunner
from structspec.runner.prefill_graph import PrefillGraph, plan_pieces, split_chunk
from tests.runner.tiny_runner import tiny_runner


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 512, 1000, 2047, 2048, 2049, 7000])
def test_split_chunk_sums_to_the_chunk_in_bucket_sizes(n: int) -> None:
    pieces = split_chunk(n)
    assert sum(pieces) == n
    assert all(p & (p - 1) == 0 and p <= 2048 for p in pieces)
    assert pieces == sorted(pieces, reverse=True)
    rest = [p for p in pieces if p < 2048]
    assert len(rest) == len(set(rest))  # each smaller bucket at most once


def test_split_chunk_examples_and_errors() -> None:
    assert split_chunk(1000) == [512, 256, 128, 64, 32, 8]
    assert split_chunk(5000) == [2048, 2048, 512, 256, 128, 8]
    assert split_chunk(6, max_piece=4) == [4, 2]
    with pytest.raises(ValueError, match="num_tokens=0"):
        split_chunk(0)
    with pytest.raises(ValueError, match="max_piece=3"):
        split_chunk(5, max_piece=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_graph_matches_the_eager_prefill_on_cuda() -> None:
    """A prompt prefilled eagerly, then again in two chunks through the graphs (pieces of
    several buckets, the second over the first's KV) into other pages: the last position's
    logits and every position's K/V agree (float32: only the attention's split order
    differs)."""
    from structspec import LLM

    llm = LLM(device="cuda", dtype="float32", max_batch_size=4)
    try:
        runner = llm.engine.runner
        assert runner.prefill_graphs is not None
        page = runner.page_size
        ids = torch.randint(100, 20000, (700,), generator=torch.Generator().manual_seed(0))
        prompt = ids.tolist()
        npages = -(-len(prompt) // page)
        eager_pages = list(range(1, 1 + npages))
        graph_pages = list(range(1 + npages, 1 + 2 * npages))
        want = runner.prefill([prompt], [eager_pages]).logits
        runner.prefill([prompt[:300]], [graph_pages], logits_only=True)
        got = runner.prefill([prompt], [graph_pages], [300], logits_only=True)
        assert got.hidden_states.shape[1] == 0
        assert len(runner.prefill_graphs.graphs) >= 2  # 256 + 32 + ... pieces
        torch.testing.assert_close(got.logits, want, atol=2e-3, rtol=2e-3)
        k = runner.kv_pool.k_cache[5]
        slots = lambda pages: torch.tensor(  # noqa: E731
            [pages[p // page] * page + p % page for p in range(len(prompt))], device="cuda")
        torch.testing.assert_close(k[slots(graph_pages)], k[slots(eager_pages)],
                                   atol=2e-3, rtol=2e-3)
    finally:
        llm.close()



@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """Page size 4: a 300-token prompt spans 75 pages."""
    return tiny_runner(Path(tmp_path_factory.mktemp("prefill_graph")),
                       max_position_embeddings=512, num_pages=200)


def test_chain_pieces_equal_the_eager_prefill_on_cpu(tiny: ModelRunner) -> None:
    """What a prefill graph records, run eagerly on the CPU: a prompt computed as chain-tree
    pieces over its cached prefix (two chunks, pieces of several buckets, page-table widths
    from the verify graphs' buckets) gives the eager prefill's last logits and K/V."""
    runner = tiny
    page = runner.page_size
    buckets = sorted({-(-n // page) for n in kv_len_buckets(512)})
    prompt = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    npages = -(-len(prompt) // page)
    eager_pages = list(range(1, 1 + npages))
    piece_pages = list(range(1 + npages, 1 + 2 * npages))
    want = runner.prefill([prompt], [eager_pages]).logits
    got = None
    with torch.inference_mode():
        for start, end in ((0, 100), (100, len(prompt))):  # pieces 64+32+4, then 128+64+8
            for pos, n, width in plan_pieces(start, end, page_size=page, page_buckets=buckets):
                g = PrefillGraph(n, width, torch.device("cpu"))
                g.fill(g.ints.numpy(), prompt[:end], piece_pages, pos)
                got = g.forward(runner.model, runner.kv_pool, page)
    assert got is not None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    k = runner.kv_pool.k_cache[1]
    slots = lambda pages: torch.tensor(  # noqa: E731
        [pages[p // page] * page + p % page for p in range(len(prompt))])
    torch.testing.assert_close(k[slots(piece_pages)], k[slots(eager_pages)],
                               atol=1e-5, rtol=1e-5)
