"""Prefill graphs (structspec/runner/prefill_graph.py): the piece split everywhere; what a graph
records (logits, and the feature variant's hidden states) equals the eager prefill on the CPU;
on CUDA a replayed chunk gives the logits, the KV and the features of the eager prefill."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from structspec.env_flags import env_flag
from structspec.runner import prefill_graph
from structspec.runner.cuda_graph import kv_len_buckets
from structspec.runner.model_runner import ModelRunner
from structspec.runner.prefill_graph import (
    FeatureBuffers,
    PrefillGraph,
    plan_pieces,
    split_chunk,
)
from tests.runner.eager_pieces import EagerPieces
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
    """A prompt prefilled eagerly, then again in two chunks through the graphs (padded
    pieces, the second over the first's KV) into other pages: the last position's logits and
    every position's K/V agree (float32: only the attention's split order differs)."""
    from structspec import LLM

    llm = LLM(device="cuda", dtype="float32", max_batch_size=4, max_model_len=2048)
    try:
        runner = llm.engine.runner
        assert runner.prefill_graphs is not None
        page = runner.page_size
        ids = torch.randint(100, 20000, (700,), generator=torch.Generator().manual_seed(0))
        prompt = ids.tolist()
        npages = -(-len(prompt) // page)
        eager_pages = list(range(1, 1 + npages))
        graph_pages = list(range(1 + npages, 1 + 2 * npages))
        graphs, runner.prefill_graphs = runner.prefill_graphs, None
        want = runner.prefill([prompt], [eager_pages]).logits  # eager
        runner.prefill_graphs = graphs
        runner.prefill([prompt[:300]], [graph_pages], logits_only=True)
        got = runner.prefill([prompt], [graph_pages], [300], logits_only=True)
        assert got.hidden_states.shape[1] == 0
        assert runner.prefill_graphs.graphs  # the padded 512-token pieces
        torch.testing.assert_close(got.logits, want, atol=2e-3, rtol=2e-3)
        k = runner.kv_pool.k_cache[5]
        slots = lambda pages: torch.tensor(  # noqa: E731
            [pages[p // page] * page + p % page for p in range(len(prompt))], device="cuda")
        torch.testing.assert_close(k[slots(graph_pages)], k[slots(eager_pages)],
                                   atol=2e-3, rtol=2e-3)
    finally:
        llm.close()



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_feature_graphs_match_the_eager_prefill_on_cuda() -> None:
    """With the shipped EAGLE-3 head (aux layers and, prefix caching on, the prompt feature
    store): a prompt's second chunk through the feature graphs (a padded piece over the first
    chunk's KV) gives the eager prefill's logits, final hidden states, aux layers' outputs and
    feature-store rows (float32)."""
    from structspec import LLM

    llm = LLM(device="cuda", dtype="float32", max_batch_size=4, max_model_len=2048,
              speculative_algorithm="eagle")
    try:
        runner = llm.engine.runner
        assert runner.aux_hidden_layers and runner.prefill_graphs is not None
        page = runner.page_size
        prompt = torch.randint(100, 20000, (700,),
                               generator=torch.Generator().manual_seed(3)).tolist()
        npages = -(-len(prompt) // page)
        eager_pages = list(range(1, 1 + npages))
        graph_pages = list(range(1 + npages, 1 + 2 * npages))
        graphs, runner.prefill_graphs = runner.prefill_graphs, None
        want = runner.prefill([prompt], [eager_pages], gather_prompt_features=False)
        runner.prefill_graphs = graphs
        runner.prefill([prompt[:300]], [graph_pages], gather_prompt_features=False)
        got = runner.prefill([prompt], [graph_pages], [300], gather_prompt_features=False)
        assert any(k[2] is not None for k in graphs.graphs)  # the feature variant replayed
        close = dict(atol=1e-2, rtol=2e-3)
        torch.testing.assert_close(got.logits, want.logits, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got.hidden_states[0], want.hidden_states[0, 300:], **close)
        assert len(got.aux_hidden_states) == len(runner.aux_hidden_layers)
        for g, w in zip(got.aux_hidden_states, want.aux_hidden_states, strict=True):
            torch.testing.assert_close(g[0], w[0, 300:], **close)
        store = runner.prompt_features
        if store is not None:
            slots = lambda pages: torch.tensor(  # noqa: E731
                [pages[p // page] * page + p % page for p in range(300, len(prompt))],
                device="cuda")
            torch.testing.assert_close(store[slots(graph_pages)], store[slots(eager_pages)],
                                       **close)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """Page size 4: a 300-token prompt spans 75 pages."""
    return tiny_runner(Path(tmp_path_factory.mktemp("prefill_graph")),
                       max_position_embeddings=512, num_pages=200)


def test_plan_pieces_pads_the_rest_to_one_bucket() -> None:
    buckets = (16, 32, 64, 128)  # pages of 16 tokens: up to 2,048 positions
    # 7,000-token prompts end with 344 tokens: one 512 piece (344 real), not 256+64+16+8
    assert plan_pieces(0, 344, page_size=16, page_buckets=buckets) == [(0, 512, 32, 344)]
    assert plan_pieces(100, 2148 - 48, page_size=16, page_buckets=(64, 128, 256)) == [
        (100, 2048, 256, 2000)]
    got = plan_pieces(0, 2053, page_size=16, page_buckets=(64, 128, 256))
    assert got == [(0, 2048, 128, 2048), (2048, 8, 256, 5)]
    # near the largest bucket the rest is split unpadded: 2,000 + 40 = 2,040 fits 2,048 but
    # 2,000 + 64 does not
    assert plan_pieces(2000, 2040, page_size=16, page_buckets=buckets) == [
        (2000, 32, 128, 32), (2032, 8, 128, 8)]
    with pytest.raises(ValueError, match="start=5, end=5"):
        plan_pieces(5, 5, page_size=16, page_buckets=buckets)
    with pytest.raises(ValueError, match="exceed the largest page bucket"):
        plan_pieces(2040, 2050, page_size=16, page_buckets=buckets)


def test_fill_pads_with_token_zero_and_points_at_the_last_real_position() -> None:
    g = PrefillGraph(8, 3, torch.device("cpu"))
    out = np.full(g.ints.numel(), -1, dtype=np.int64)
    g.fill(out, list(range(100, 113)), [7, 9], 10, real=3)
    assert out.tolist() == [10, 2, 7, 9, 0, 110, 111, 112, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="real=4"):
        g.fill(out, list(range(100, 113)), [7, 9], 10, real=4)  # only 3 ids left
    with pytest.raises(ValueError, match="real=9"):
        g.fill(out, list(range(100, 200)), [7, 9], 10, real=9)


def test_chain_pieces_equal_the_eager_prefill_on_cpu(tiny: ModelRunner) -> None:
    """What a prefill graph records, run eagerly on the CPU: a prompt computed as chain-tree
    pieces over its cached prefix (two chunks, each ending in a padded piece; page-table
    widths from the verify graphs' buckets) gives the eager prefill's last logits and K/V,
    and the padding writes nothing outside the request's own pages and the sink."""
    runner = tiny
    page = runner.page_size
    buckets = sorted({-(-n // page) for n in kv_len_buckets(512)})
    prompt = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    npages = -(-len(prompt) // page)
    eager_pages = list(range(1, 1 + npages))
    piece_pages = list(range(1 + npages, 1 + 2 * npages))
    want = runner.prefill([prompt], [eager_pages]).logits
    others = [p for p in range(1, runner.kv_pool.k_cache[1].shape[0] // page)
              if p not in piece_pages]
    slots = lambda pages: torch.tensor(  # noqa: E731
        [p * page + i for p in pages for i in range(page)])
    before = runner.kv_pool.k_cache[1][slots(others)].clone()
    got = None
    plans = []
    with torch.inference_mode():
        for start, end in ((0, 100), (100, len(prompt))):  # 100 -> 128, then 200 -> 256
            plan = plan_pieces(start, end, page_size=page, page_buckets=buckets)
            plans.append(plan)
            for pos, n, width, real in plan:
                g = PrefillGraph(n, width, torch.device("cpu"))
                g.fill(g.ints.numpy(), prompt[:end], piece_pages, pos, real)
                got, hidden, aux = g.forward(runner.model, runner.kv_pool, page)
                assert hidden is None and aux == ()  # the logits-only variant
    assert [[(n, real) for _, n, _, real in p] for p in plans] == [[(128, 100)], [(256, 200)]]
    assert got is not None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    k = runner.kv_pool.k_cache[1]
    positions = lambda pages: torch.tensor(  # noqa: E731
        [pages[p // page] * page + p % page for p in range(len(prompt))])
    torch.testing.assert_close(k[positions(piece_pages)], k[positions(eager_pages)],
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(k[slots(others)], before)  # padding: own pages and the sink only


@pytest.fixture
def feature_runner(tmp_path: Path) -> ModelRunner:
    """A tiny runner as an EAGLE-3 target keeps it: aux layer 0, a prompt feature store."""
    runner = tiny_runner(tmp_path, max_position_embeddings=512, num_pages=300)
    runner.aux_hidden_layers = (0,)
    runner.keep_prompt_features()
    return runner


def test_feature_graphs_give_the_eager_prefill_outputs_and_store(
        feature_runner: ModelRunner) -> None:
    """Two requests prefilled through the feature pieces (the second as a later chunk over
    its own first chunk's KV: hidden rows start at the chunk) against the eager prefill of
    the same chunks on other pages: logits, final hidden states, the aux layer's outputs (each
    request's real rows of ``[B, Q, H]``) and the feature store's rows at every computed
    position's KV slot agree."""
    runner = feature_runner
    page = runner.page_size
    buckets = sorted({-(-n // page) for n in kv_len_buckets(512)})
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (37, 150)]
    first = 90  # the second request's first chunk
    npages = [-(-len(p) // page) for p in prompts]
    eager_pages = [list(range(1, 1 + npages[0])),
                   list(range(1 + npages[0], 1 + sum(npages)))]
    base = 1 + sum(npages)
    graph_pages = [list(range(base, base + npages[0])),
                   list(range(base + npages[0], base + sum(npages)))]
    outs = {}
    for name, pages, graphs in (("eager", eager_pages, None),
                                ("graphs", graph_pages, EagerPieces(
                                    runner.model, runner.kv_pool, page_size=page,
                                    page_buckets=buckets, device=torch.device("cpu")))):
        runner.prefill_graphs = graphs
        runner.prefill([prompts[1][:first]], [pages[1]], gather_prompt_features=False)
        outs[name] = runner.prefill([prompts[0], prompts[1]], pages, [0, first],
                                    gather_prompt_features=False)
    runner.prefill_graphs = None
    want, got = outs["eager"], outs["graphs"]
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    for b, n in enumerate((len(prompts[0]), len(prompts[1]) - first)):
        torch.testing.assert_close(got.hidden_states[b, :n], want.hidden_states[b, :n],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.aux_hidden_states[0][b, :n],
                                   want.aux_hidden_states[0][b, :n], atol=1e-5, rtol=1e-5)
    assert got.hidden_states.shape[1] == len(prompts[1]) - first  # padded to the longest chunk
    store = runner.prompt_features
    assert store is not None
    for p, ep, gp in zip(prompts, eager_pages, graph_pages, strict=True):
        eager_slots, graph_slots = (torch.tensor([pages[i // page] * page + i % page
                                                  for i in range(len(p))])
                                    for pages in (ep, gp))
        assert store[graph_slots].abs().sum() > 0
        torch.testing.assert_close(store[graph_slots], store[eager_slots], atol=1e-5, rtol=1e-5)


def test_feature_graphs_gather_the_prompt_features_like_the_eager_prefill(
        feature_runner: ModelRunner) -> None:
    """A prefill over cached KV that gathers every prompt position's features from the store
    (an EAGLE first chunk after a prefix-cache hit), two requests of different lengths (one
    with 40 cached positions, one with none): through the pieces it returns the eager
    prefill's ``prompt_hidden_states`` / ``prompt_aux_hidden_states`` at every real position
    (the padding rows past a prompt's length differ by design: the eager path writes junk rows
    there, the graphs zeros)."""
    runner = feature_runner
    page = runner.page_size
    buckets = sorted({-(-n // page) for n in kv_len_buckets(512)})
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (60, 30)]
    pages = {name: [list(range(1 + 20 * i + 40 * j, 21 + 20 * i + 40 * j)) for i in range(2)]
             for j, name in enumerate(("eager", "graphs"))}
    outs = {}
    for name, graphs in (("eager", None), ("graphs", EagerPieces(
            runner.model, runner.kv_pool, page_size=page, page_buckets=buckets,
            device=torch.device("cpu")))):
        runner.prefill_graphs = None
        runner.prefill([prompts[0][:40]], [pages[name][0]])  # the cached prefix
        runner.prefill_graphs = graphs
        outs[name] = runner.prefill(prompts, pages[name], [40, 0], gather_prompt_features=True)
        if graphs is not None:
            assert graphs.graphs
    runner.prefill_graphs = None
    want, got = outs["eager"], outs["graphs"]
    assert got.prompt_hidden_states is not None and want.prompt_hidden_states is not None
    assert got.prompt_hidden_states.shape == want.prompt_hidden_states.shape == (2, 60, 32)
    assert got.prompt_aux_hidden_states is not None and want.prompt_aux_hidden_states is not None
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        torch.testing.assert_close(got.prompt_hidden_states[b, :n],
                                   want.prompt_hidden_states[b, :n], atol=1e-5, rtol=1e-5)
        for got_aux, want_aux in zip(got.prompt_aux_hidden_states,
                                     want.prompt_aux_hidden_states, strict=True):
            torch.testing.assert_close(got_aux[b, :n], want_aux[b, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)


def test_logits_only_prefill_skips_the_features(feature_runner: ModelRunner,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a feature store a logits-only prefill replays the logits-only pieces (no
    hidden states)."""
    runner = feature_runner
    buckets = sorted({-(-n // runner.page_size) for n in kv_len_buckets(512)})
    cache = EagerPieces(runner.model, runner.kv_pool, page_size=runner.page_size,
                        page_buckets=buckets, device=torch.device("cpu"))
    runner.prefill_graphs = cache
    monkeypatch.setattr(runner, "prompt_features", None)
    out = runner.prefill([list(range(1, 41))], [list(range(11, 21))], logits_only=True)
    assert out.hidden_states.shape[1] == 0
    assert [k[2] for k in cache.graphs] == [None]


def test_feature_graphs_switch_off(feature_runner: ModelRunner,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``STRUCTSPEC_FEATURE_PREFILL_GRAPHS=0`` (the module flag): a prefill that reads
    features runs eagerly, a logits-only one still replays."""
    runner = feature_runner
    buckets = sorted({-(-n // runner.page_size) for n in kv_len_buckets(512)})
    cache = EagerPieces(runner.model, runner.kv_pool, page_size=runner.page_size,
                        page_buckets=buckets, device=torch.device("cpu"))
    runner.prefill_graphs = cache
    monkeypatch.setattr(prefill_graph, "FEATURE_GRAPHS", False)
    out = runner.prefill([list(range(1, 30))], [list(range(1, 9))])
    assert out.hidden_states.shape[1] == 29 and not cache.graphs
    monkeypatch.setattr(runner, "prompt_features", None)
    runner.prefill([list(range(1, 30))], [list(range(9, 17))], logits_only=True)
    assert [k[2] for k in cache.graphs] == [None]


@pytest.mark.parametrize(("value", "want"), [(None, True), ("0", False), (" Off ", False),
                                             ("no", False), ("FALSE", False), ("1", True),
                                             ("yes", True)])
def test_env_flag(monkeypatch: pytest.MonkeyPatch, value: str | None, want: bool) -> None:
    if value is None:
        monkeypatch.delenv("STRUCTSPEC_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("STRUCTSPEC_TEST_FLAG", value)
    assert env_flag("STRUCTSPEC_TEST_FLAG") is want
    assert env_flag("STRUCTSPEC_TEST_FLAG", default=False) is (want if value is not None
                                                               else False)


def test_feature_buffers_are_one_set_for_every_piece_size() -> None:
    """Pieces of 8 and 3 rows write the same storage (allocated once, at the largest piece),
    and each gets back the rows it wrote."""
    buffers = FeatureBuffers(16)
    first, first_aux = buffers.write(torch.ones(1, 8, 4), [torch.full((1, 8, 4), 2.0)])
    second, second_aux = buffers.write(torch.full((1, 3, 4), 5.0), [torch.zeros(1, 3, 4)])
    assert buffers.hidden is not None and buffers.hidden.shape == (1, 16, 4)
    assert first.data_ptr() == second.data_ptr() == buffers.hidden.data_ptr()
    assert second.shape == (1, 3, 4) and torch.equal(second, torch.full((1, 3, 4), 5.0))
    assert torch.equal(first[0, 3:], torch.ones(5, 4))  # rows past the short piece: unchanged
    assert torch.equal(second_aux[0], torch.zeros(1, 3, 4)) and len(first_aux) == 1
