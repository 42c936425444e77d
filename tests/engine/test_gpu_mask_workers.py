"""The mask workers on CUDA with a device-tree drafter (the shipped EAGLE head): their mirror
matchers run the grammar barrier and the tree walks (``GrammarService._mirrors_serve``), the
steps make no host sync, and every constrained output that stops is valid. (Equality with the
in-process build is checked on the CPU, tests/engine/test_spec.py: two CUDA engines may batch
differently as their grammar compiles land, and bf16 logits then differ at near-ties.)"""

from __future__ import annotations

import json

import pytest
import torch

from structspec import JsonSchemaConstraint, SamplingParams
from tests.engine.conftest import PERSON_SCHEMA, PROMPTS, step_under_sync_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _eagle(workers: int):  # noqa: ANN202 - an LLM
    from structspec import LLM

    return LLM(device="cuda", speculative_algorithm="eagle", num_draft_tokens=8,
               max_batch_size=16, grammar_workers=workers, speculative_adaptive="off")


def _params() -> list[SamplingParams]:
    """Six of eight requests constrained: at least as many as the two workers, so the
    mirrors serve the barrier."""
    return [SamplingParams(max_tokens=40,
                           grammar=JsonSchemaConstraint(PERSON_SCHEMA) if i % 4 else None)
            for i in range(8)]


def test_eagle_with_mask_workers_does_not_sync_and_stays_valid() -> None:
    import jsonschema

    pooled = _eagle(2)
    try:
        engine = pooled.engine
        pool = engine.scheduler.mask_pool
        assert pool is not None
        for p, params in zip(PROMPTS[:8], _params(), strict=True):
            engine.add_request(p, params)
        while engine.scheduler.waiting or engine.scheduler.grammar_queue:
            engine.step()
        engine.step()  # the first verify step's captures outside the check
        builds = pool.num_builds
        assert step_under_sync_check(engine, 20) > 3
        assert pool.num_builds > builds  # the workers built the masks under the check
        outs = pooled.generate(PROMPTS[:8], _params())
    finally:
        pooled.close()
    for out, params in zip(outs, _params(), strict=True):
        assert out.error is None, out.error
        if params.grammar is not None and out.finish_reason.value == "stop":
            jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)
