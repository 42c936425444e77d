"""A prefill that starts over KV already in its pages (a prefix-cache hit) gives the full
prefill's logits and hidden states for the positions it computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structspec.runner.batch_builder import build_prefill_batch
from structspec.runner.model_runner import ModelRunner
from tests.runner.tiny_runner import tiny_runner

CPU = torch.device("cpu")
PAGE = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    return tiny_runner(Path(tmp_path_factory.mktemp("prefill_cache")),
                       max_position_embeddings=128, num_pages=32, page_size=PAGE)


def test_prefill_over_cached_pages_matches_the_full_prefill(runner: ModelRunner) -> None:
    a = [5, 9, 2, 33, 7, 7, 1, 40, 12, 3, 8]  # 11 tokens: pages 0-1 full
    b = [5, 9, 2, 33, 6, 60, 2]  # shares page 0 with ``a``
    full = runner.prefill([a, b], [[1, 2, 3], [4, 5]])
    # a and b again, in new pages whose first pages hold the cached prefixes (copied KV)
    pool, ps = runner.kv_pool, PAGE
    for src, dst in ((1, 6), (2, 7), (4, 8)):
        pool.copy_slots(torch.arange(src * ps, src * ps + ps), torch.arange(dst * ps, dst * ps + ps))
    part = runner.prefill([a, b], [[6, 7, 9], [8, 10]], num_cached=[8, 4])
    torch.testing.assert_close(part.logits, full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part.hidden_states[0, :3], full.hidden_states[0, 8:11],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part.hidden_states[1, :3], full.hidden_states[1, 4:7],
                               rtol=1e-5, atol=1e-5)
    # the KV written for the computed positions equals the full prefill's
    kv = pool.kv_buffer
    torch.testing.assert_close(kv[:, :, 9 * ps: 9 * ps + 3], kv[:, :, 3 * ps: 3 * ps + 3],
                               rtol=1e-5, atol=1e-5)


def test_num_cached_must_leave_a_token_to_compute() -> None:
    with pytest.raises(ValueError, match="num_cached"):
        build_prefill_batch([[1, 2, 3, 4]], [[1]], page_size=PAGE, device=CPU, num_cached=[4])


def test_prompt_features_cover_the_cached_positions(runner: ModelRunner) -> None:
    """With the prompt feature store (EAGLE), a prefill over cached KV returns every prompt
    position's final and aux hidden states, the cached positions' from the store."""
    runner.aux_hidden_layers = (0, 1)
    runner.keep_prompt_features()
    try:
        a = [4, 8, 15, 16, 23, 42, 7, 1, 9]
        full = runner.prefill([a], [[11, 12, 13]])
        assert full.prompt_hidden_states is None  # nothing cached: hidden_states has them all
        runner.kv_pool.copy_slots(torch.arange(11 * PAGE, 13 * PAGE),
                                  torch.arange(14 * PAGE, 16 * PAGE))
        store = runner.prompt_features
        assert store is not None
        store[14 * PAGE: 16 * PAGE] = store[11 * PAGE: 13 * PAGE]  # the cached pages' features
        part = runner.prefill([a], [[14, 15, 16]], num_cached=[8])
        assert part.prompt_hidden_states is not None and part.prompt_aux_hidden_states is not None
        torch.testing.assert_close(part.prompt_hidden_states, full.hidden_states,
                                   rtol=1e-5, atol=1e-5)
        for got, want in zip(part.prompt_aux_hidden_states, full.aux_hidden_states, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        runner.aux_hidden_layers = ()
        runner.prompt_features = None
