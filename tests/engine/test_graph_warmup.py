"""``LLMEngine.warmup_cuda_graphs``: every tree size the engine can verify with is captured
ahead of time, so that no step captures a graph lazily (a capture inside a step is a stall for
the running streams and an outlier in a benchmark window).

CPU: the tree sizes per configuration, and the warm-up is a no-op (no graphs off CUDA).
GPU (marker ``gpu``): after the warm-up of one batch bucket and one KV bucket, a generate at
that batch size with the adaptive sizer on captures no further verify graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from structspec import SamplingParams


@pytest.mark.parametrize(("kw", "sizes"), [
    ({"speculative_algorithm": "ngram", "num_draft_tokens": 8, "speculative_adaptive": "on"},
     (1, 2, 4, 8)),
    ({"speculative_algorithm": "ngram", "num_draft_tokens": 6, "speculative_adaptive": "on"},
     (1, 2, 4, 6)),
    ({"speculative_algorithm": "ngram", "num_draft_tokens": 8, "speculative_adaptive": "off"},
     (8,)),
    ({"speculative_algorithm": "none"}, (1,)),
])
def test_tree_sizes_and_cpu_warmup(make_llm: Callable[..., Any], kw: dict,
                                   sizes: tuple[int, ...]) -> None:
    engine = make_llm(**kw).engine
    assert engine.tree_sizes() == sizes
    assert engine.warmup_cuda_graphs(batch_sizes=[1]) == 0  # CPU: no graphs
    for kwargs, name in (({"batch_sizes": [0]}, "batch_sizes"), ({"kv_lens": [256, -1]}, "kv_lens"),
                         ({"batch_sizes": [1.5]}, "batch_sizes"), ({"kv_lens": [True]}, "kv_lens"),
                         ({"batch_sizes": [1, None]}, "batch_sizes"),
                         # not a list: a bare int (0 and False are falsy: they were taken for
                         # the default), a string, a mapping
                         ({"batch_sizes": 4}, "batch_sizes"), ({"batch_sizes": 0}, "batch_sizes"),
                         ({"kv_lens": False}, "kv_lens"), ({"kv_lens": ""}, "kv_lens"),
                         ({"batch_sizes": "4"}, "batch_sizes"), ({"kv_lens": {256: 1}}, "kv_lens")):
        with pytest.raises(ValueError, match=name):
            engine.warmup_cuda_graphs(**kwargs)


def test_warmup_bucket_arguments_are_materialised_once() -> None:
    """A generator is read once, checked, and the same values reach every capture (the
    runner's per tree size and the drafter's); a bad item in it is still named."""
    from structspec.engine.llm_engine import _bucket_values

    assert _bucket_values("batch_sizes", None) is None
    assert _bucket_values("batch_sizes", (b for b in (1, 2))) == (1, 2)
    assert _bucket_values("kv_lens", range(256, 1024, 256)) == (256, 512, 768)
    assert _bucket_values("batch_sizes", []) == ()
    with pytest.raises(ValueError, match="kv_lens must hold positive ints, got -1"):
        _bucket_values("kv_lens", (v for v in (256, -1)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warmup_captures_every_tree_size_on_cuda() -> None:
    from structspec import LLM

    llm = LLM(device="cuda", speculative_algorithm="ngram", num_draft_tokens=8,
              max_batch_size=4, speculative_adaptive="on", enable_prefix_caching=False)
    try:
        engine = llm.engine
        graphs = engine.runner.graphs
        assert graphs is not None

        def captured() -> set:
            return {k for k, g in graphs.graphs.items() if g.captured}

        count = engine.warmup_cuda_graphs(batch_sizes=[1], kv_lens=[256])
        keys = captured()
        assert count == len(keys) == len(engine.tree_sizes()), sorted(keys)
        assert sorted(k[1] for k in keys) == list(engine.tree_sizes())
        assert engine.warmup_cuda_graphs(batch_sizes=[1], kv_lens=[256]) == 0  # idempotent
        out = llm.generate(["Name three colours, as a list."],
                           SamplingParams(max_tokens=24, temperature=0.0))[0]
        assert out.error is None and len(out.token_ids) > 0
        assert captured() == keys  # nothing captured lazily inside a step
    finally:
        llm.close()
