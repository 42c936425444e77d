"""An EAGLE engine through the prefill graphs' feature variant, on the CPU: each piece's
recorded function runs eagerly (``EagerPieces``, tests/runner/eager_pieces.py) where CUDA
replays it. Greedy output and every drafted tree (the drafts read the features) equal the eager
prefill's, whole prompts (two per prefill step: the padded ``[B, Q, H]`` rows), chunked, and
with prefix caching (the prompt feature store written by the pieces, and read back through
them by first chunks over cached pages)."""

from __future__ import annotations

from typing import Any

import pytest

from structspec.runner.cuda_graph import kv_len_buckets
from tests.runner.eager_pieces import EagerPieces

from .test_chunked_prefill import _params, chunked_llm, no_prefix_cache, unchunked
from .test_prefix_cache import QUESTIONS, SYSTEM


def _generate_in_pairs(llm: Any, prompts: list[str],
                       monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list]:
    """Each request's tokens, and every drafted tree's tokens (the drafts read the prompt
    features; output alone cannot tell: verification is lossless), two prompts per call: a
    prefill step of at most two requests takes the pieces."""
    draft = llm.engine.scheduler.draft
    real = draft.propose
    drafts: list = []

    def spy(*args: Any, **kw: Any) -> Any:
        tree = real(*args, **kw)
        drafts.append(tree.draft_tokens.tolist())
        return tree

    params = _params()
    tokens: list[list[int]] = []
    with monkeypatch.context() as m:
        m.setattr(draft, "propose", spy)
        for i in range(0, len(prompts), 2):
            got = llm.generate(prompts[i:i + 2], params[i:i + 2], raw_prompt=True)
            assert all(o.error is None for o in got)
            tokens += [o.token_ids for o in got]
    return tokens, drafts


def _runs(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list:
    """Tokens and drafts of four passes: whole prompts, chunk by chunk, then twice with prefix
    caching (the first computes and caches the shared prefix; the second starts over cached
    pages: its features come from the store)."""
    # a first page no other test's prompts share: the cache passes start from nothing cached
    prompts = ["(feature pieces) " + SYSTEM + q for q in QUESTIONS]
    with no_prefix_cache(llm):
        # the schema compiled first: on an engine's first use a request waits for its
        # compile, and the passes' batches (so their drafted trees) would differ
        llm.generate(["(warm-up) Hi."] * 2, _params()[:2], raw_prompt=True)
    with unchunked(llm, prefix_cache=False):
        runs = [_generate_in_pairs(llm, prompts, monkeypatch)]
    with no_prefix_cache(llm):
        runs.append(_generate_in_pairs(llm, prompts, monkeypatch))
    runs += [_generate_in_pairs(llm, prompts, monkeypatch) for _ in range(2)]
    return runs


def test_eagle_through_feature_pieces_equals_the_eager_prefill(
        make_llm, tiny_model_dir: str, tiny_drafters: dict,
        monkeypatch: pytest.MonkeyPatch) -> None:
    eager = chunked_llm(make_llm, model=tiny_model_dir, **tiny_drafters["eagle"])
    assert eager.engine.runner.prefill_graphs is None  # the CPU prefills eagerly
    want = _runs(eager, monkeypatch)
    # a second engine of the same model (another sampling seed: greedy output does not
    # depend on it, and the engine has its own prefix cache)
    llm = chunked_llm(make_llm, model=tiny_model_dir, seed=1,
                      **tiny_drafters["eagle"])
    runner = llm.engine.runner
    pieces = EagerPieces(runner.model, runner.kv_pool, page_size=runner.page_size,
                         page_buckets=sorted({-(-n // runner.page_size)
                                              for n in kv_len_buckets(512)}),
                         device=runner.device)
    runner.prefill_graphs = pieces
    try:
        got = _runs(llm, monkeypatch)
    finally:
        runner.prefill_graphs = None
    assert any(aux is not None for _, _, aux in pieces.graphs)  # the feature variant ran
    assert all(drafts for _, drafts in want)
    for name, g, w in zip(("whole", "chunked", "cache first", "cache hit"), got, want,
                          strict=True):
        assert g[0] == w[0], name  # tokens
        assert g[1] == w[1], name  # every drafted tree
    assert want[0][0] == want[1][0] == want[3][0]
