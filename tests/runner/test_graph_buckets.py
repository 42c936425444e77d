"""Batch buckets of the verify (and propose) CUDA graphs for an engine's max_batch_size."""

from __future__ import annotations

from structspec.runner.cuda_graph import DEFAULT_BATCH_SIZES, graph_batch_sizes, pick_bucket


def test_every_batch_up_to_the_max_has_a_bucket() -> None:
    assert graph_batch_sizes(8) == DEFAULT_BATCH_SIZES
    assert graph_batch_sizes(64) == DEFAULT_BATCH_SIZES
    assert graph_batch_sizes(256) == (*DEFAULT_BATCH_SIZES, 96, 128, 160, 192, 224, 256)
    assert graph_batch_sizes(100) == (*DEFAULT_BATCH_SIZES, 96, 100)
    for max_bs in (1, 63, 65, 200, 256, 300):
        buckets = graph_batch_sizes(max_bs)
        assert list(buckets) == sorted(set(buckets))
        for bs in range(1, max_bs + 1):
            bucket = pick_bucket(bs, buckets)
            assert bucket is not None and bucket - bs < 32
