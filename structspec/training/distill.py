"""Self-distillation: the target model answers every training prompt with our own engine, and
each (prompt ids, response ids) pair becomes a :class:`TrainSequence`.

The requests go straight to the engine through a window of at most ``batch_size`` in flight,
topped up after every step. ``LLM.generate`` on the whole list would instead queue every
request at once: all prompts tokenized and every grammar compile started up front (a compile's
timeout counts from its submission, so a schema queued behind many others can time out
unstarted), and the scheduler's per-request queue bookkeeping grows with the queue. A window
of a few times the engine's ``max_batch_size`` keeps every verify step full until the last
prompts, without either cost. For the same timeout, a request with a grammar is added only
while fewer than :data:`MAX_WAITING_FOR_GRAMMAR` requests wait for their compile (hundreds of
distinct schemas would otherwise enter one window together).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from structspec.core import FinishReason, RequestOutput, SamplingParams
from structspec.engine.llm_engine import PromptInput, RequestError
from structspec.llm import LLM
from structspec.training.prompts import TrainPrompt
from structspec.training.sequences import TrainSequence

log = logging.getLogger(__name__)

_run_ids = itertools.count()

#: Requests that may wait for their grammar's compile at once (the engine compiles on
#: ``GrammarConfig.num_compile_threads`` threads, 4 by default, and a compile times out
#: ``compile_timeout_s`` after its submission, queueing included).
MAX_WAITING_FOR_GRAMMAR = 16


def distill(llm: LLM, prompts: Sequence[TrainPrompt], *, max_tokens: int, batch_size: int,
            temperature: float = 0.0, progress: bool = True) -> list[TrainSequence]:
    """Generate the target's response to every prompt and return prompt + response ids.

    Each prompt runs as one request on ``llm``'s engine, under its grammar, greedy
    (``temperature == 0``) or sampled with seed = the prompt's index (reproducible in any
    batch). A request that fails on its own (refused: prompt too long for the context, a
    schema that does not compile or compiles past the timeout; or finished with ``abort``, or
    with no token) is skipped and counted; the others go on. The counts are logged (warning
    level when any failed, with the most common errors) and shown on the progress bar.

    Text is not detokenized while this runs (only ids are kept), which saves the engine's
    host work per token; ``llm.engine.detokenize`` is restored afterwards.

    Args:
        llm: the target model's engine (any device; its speculation settings are used).
        prompts: the prompts (:func:`structspec.training.prompts.build_prompt_set`).
        max_tokens: response length limit per prompt (>= 1); a response cut there is kept
            (finish reason ``length``, no EOS).
        batch_size: requests in flight at once (>= 1); use a few times the engine's
            ``max_batch_size`` so that admission always finds waiting requests.
        temperature: 0 = greedy.
        progress: show a tqdm bar (prompts done, failures).

    Returns:
        One :class:`TrainSequence` per prompt that succeeded, in prompt order: its
        ``token_ids`` are the request's prompt ids (chat-templated) followed by its output ids
        (EOS included when it finished with ``stop``), ``num_prompt_tokens`` the prompt's
        length, ``source`` the prompt's.

    Raises:
        ValueError: ``prompts`` is empty, or a bad ``max_tokens`` / ``batch_size`` /
            ``temperature``, naming it.
        RuntimeError: the engine is closed. An error of the engine's step itself propagates
            (after the requests still in flight are aborted).
    """
    if not prompts:
        raise ValueError("prompts is empty: nothing to distill")
    for name, value in (("max_tokens", max_tokens), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    engine = llm.engine
    run = next(_run_ids)
    results: list[TrainSequence | None] = [None] * len(prompts)
    failures: Counter[str] = Counter()
    failed_by_source: Counter[str] = Counter()
    in_flight: dict[str, int] = {}  # request id -> prompt index
    bar = _progress_bar(len(prompts), progress)

    def fail(i: int, error: str) -> None:
        failures[error[:120]] += 1
        failed_by_source[prompts[i].source] += 1
        bar.update(1)
        bar.set_postfix(failed=sum(failures.values()), refresh=False)

    detokenize = engine.detokenize
    engine.detokenize = False
    next_i = 0
    try:
        while next_i < len(prompts) or in_flight:
            while next_i < len(prompts) and len(in_flight) < batch_size:
                if prompts[next_i].grammar is not None and (
                        engine.stats()["num_waiting_grammar"] >= MAX_WAITING_FOR_GRAMMAR):
                    break  # the compiles in flight first; added again after the next step
                i, next_i = next_i, next_i + 1
                rid = f"distill-{run}-{i}"
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                        seed=i if temperature > 0 else None,
                                        grammar=prompts[i].grammar)
                try:
                    engine.add_request(_prompt_input(prompts[i]), params, request_id=rid)
                except RequestError as e:
                    fail(i, str(e))
                    continue
                in_flight[rid] = i
            if not in_flight and not engine.has_unfinished_requests():
                continue  # every prompt added so far was refused; add the next ones
            for out in engine.step():
                i = in_flight.get(out.request_id)
                if not out.finished or i is None:
                    continue
                del in_flight[out.request_id]
                seq, error = _sequence(out, prompts[i].source)
                if seq is None:
                    fail(i, error)
                    continue
                results[i] = seq
                bar.update(1)
    finally:
        for rid in in_flight:  # only after an error of the step: leave the engine reusable
            engine.abort_request(rid, "distill stopped")
        engine.detokenize = detokenize
        bar.close()
    seqs = [s for s in results if s is not None]
    _log_summary(len(prompts), seqs, failures, failed_by_source)
    return seqs


def _prompt_input(prompt: TrainPrompt) -> PromptInput:
    """A single user turn goes as its text (the engine applies the chat template, or sends it
    raw to a model without one, as ``LLM.generate`` does); a longer chat as its messages."""
    if len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user":
        return prompt.messages[0]["content"]
    return [dict(m) for m in prompt.messages]


def _sequence(out: RequestOutput, source: str) -> tuple[TrainSequence | None, str]:
    """The finished output as a sequence, or (None, why it cannot be one)."""
    if out.finish_reason is FinishReason.ABORT:
        return None, out.error or "aborted"
    if not out.token_ids:
        return None, "no response token"
    if not out.prompt_token_ids:
        return None, "no prompt token"
    ids = tuple(out.prompt_token_ids) + tuple(out.token_ids)
    return TrainSequence(ids, len(out.prompt_token_ids), source), ""


def _progress_bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="distill", unit="req", disable=not enabled)


def _log_summary(num_prompts: int, seqs: list[TrainSequence], failures: Counter[str],
                 failed_by_source: Counter[str]) -> None:
    prompt_tokens = sum(s.num_prompt_tokens for s in seqs)
    response_tokens = sum(s.num_response_tokens for s in seqs)
    num_failed = sum(failures.values())
    log.info("distilled %d of %d prompts: %d prompt + %d response tokens", len(seqs),
             num_prompts, prompt_tokens, response_tokens)
    if num_failed:
        common = "; ".join(f"{n}x {e}" for e, n in failures.most_common(5))
        log.warning("distill skipped %d of %d prompts (by source: %s); most common errors: %s",
                    num_failed, num_prompts, dict(failed_by_source), common)
