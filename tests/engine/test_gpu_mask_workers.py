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


def _assert_valid(outs: list) -> None:
    """No output ends with an error; every constrained output that stops is valid."""
    import jsonschema

    for out, params in zip(outs, _params(), strict=True):
        assert out.error is None, out.error
        if params.grammar is not None and out.finish_reason.value == "stop":
            jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)


def test_eagle_with_mask_workers_does_not_sync_and_stays_valid() -> None:
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
    _assert_valid(outs)


def test_the_device_gate_serves_the_steps_and_outputs_stay_valid() -> None:
    """The uploads wait on the device for the workers' flags (the default on CUDA), and the
    constrained outputs that stop are valid."""
    pooled = _eagle(2)
    try:
        pool = pooled.engine.scheduler.mask_pool
        assert pool is not None and pool.device_gate
        outs = pooled.generate(PROMPTS[:8], _params())
        assert pool.num_deferred_builds > 5
    finally:
        pooled.close()
    _assert_valid(outs)


def test_a_worker_killed_under_the_device_gate_neither_hangs_nor_breaks_the_grammar() -> None:
    """A worker dies with a gated build in flight (killed right before its job is posted):
    its flag never comes, so this process rebuilds the rows, releases the flags and drains
    the device before the segment is freed; the run finishes, every constrained output that
    stops is valid, and no request ends with an error."""
    pooled = _eagle(2)
    try:
        engine = pooled.engine
        pool = engine.scheduler.mask_pool
        assert pool is not None and pool.device_gate
        send_job = pool._send_job
        jobs = [0]

        def kill_then_send(w: int, msg: tuple) -> None:
            if w == 0 and msg[5] and msg[7]:  # a gated build with a tree for worker 0
                jobs[0] += 1
                if jobs[0] == 6:
                    proc = pool._procs[0]
                    proc.kill()
                    proc.wait()
            send_job(w, msg)

        pool._send_job = kill_then_send  # type: ignore[method-assign]
        outs = pooled.generate(PROMPTS[:8], _params())
        assert engine.scheduler.grammar.num_gate_failovers == 1
        assert pool.num_deferred_builds >= 6
    finally:
        pooled.close()
    _assert_valid(outs)
