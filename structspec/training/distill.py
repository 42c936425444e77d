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
distinct schemas would otherwise enter one window together); the prompts behind a held-back
one go in meanwhile, so the window, and the engine's batch, stay full while schemas compile.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

from structspec.core import FinishReason, RequestOutput, SamplingParams
from structspec.engine.llm_engine import PromptInput, RequestError
from structspec.llm import LLM
from structspec.training.distill_progress import DistillProgress
from structspec.training.prompts import TrainPrompt
from structspec.training.sequences import TrainSequence

log = logging.getLogger(__name__)

_run_ids = itertools.count()

#: Requests that may wait for their grammar's compile at once (the engine compiles on
#: ``GrammarConfig.num_compile_threads`` threads, 4 by default, and a compile times out
#: ``compile_timeout_s`` after its submission, queueing included).
MAX_WAITING_FOR_GRAMMAR = 16

#: ``on_result(prompt index, sequence or None, error)``: see :func:`distill`.
ResultCallback = Callable[[int, TrainSequence | None, str], None]


def distill(llm: LLM, prompts: Sequence[TrainPrompt], *, max_tokens: int, batch_size: int,
            temperature: float = 0.0, progress: bool = True,
            order: Sequence[int] | None = None, on_result: ResultCallback | None = None,
            should_stop: Callable[[], bool] | None = None,
            clock: Callable[[], float] = time.monotonic) -> list[TrainSequence]:
    """Generate the target's response to every prompt and return prompt + response ids.

    Each prompt runs as one request on ``llm``'s engine, under its grammar, greedy
    (``temperature == 0``) or sampled with seed = the prompt's index (reproducible in any
    batch, and in a resumed run). A request that fails on its own (refused: prompt too long
    for the context, a schema that does not compile or compiles past the timeout; or finished
    with ``abort``, or with no token) is skipped and counted; the others go on. The counts are
    logged (warning level when any failed, with the most common errors).

    Prompts enter in ``order``; a grammar prompt that finds :data:`MAX_WAITING_FOR_GRAMMAR`
    requests waiting for their compile is held back (up to ``batch_size`` of them) and the
    prompts behind it go first, so slow schema compiles never leave the window, and the
    engine's batch, short of prompts that need no compile.

    Progress: a tqdm bar when ``progress`` and stderr is a terminal; otherwise a line on
    stderr every ~15 s, when a source finishes, and at the end
    (:class:`~structspec.training.distill_progress.DistillProgress`).

    Text is not detokenized while this runs (only ids are kept), which saves the engine's
    host work per token, and the engine reports finished requests only (no snapshot of every
    running request per step); ``llm.engine.detokenize`` and ``report_unfinished`` are
    restored afterwards.

    Args:
        llm: the target model's engine (any device; its speculation settings are used).
        prompts: the prompts (:func:`structspec.training.prompts.build_prompt_set`).
        max_tokens: response length limit per prompt (>= 1); a response cut there is kept
            (finish reason ``length``, no EOS).
        batch_size: requests in flight at once (>= 1); use a few times the engine's
            ``max_batch_size`` so that admission always finds waiting requests.
        temperature: 0 = greedy.
        progress: show a tqdm bar (on a terminal) instead of progress lines.
        order: the indices into ``prompts`` to run, in submission order (default: all, in
            order); the others are not run.
        on_result: called once per finished prompt as ``on_result(index, sequence, error)``:
            the sequence, or None and why the prompt was skipped. Not called for prompts cut
            off by ``should_stop``.
        should_stop: checked before every engine step; once it returns True no prompt is
            added, the requests in flight are aborted (their partial responses dropped) and
            the sequences finished so far are returned.
        clock: monotonic seconds for the progress lines (injectable for tests).

    Returns:
        One :class:`TrainSequence` per prompt that succeeded, in prompt order: its
        ``token_ids`` are the request's prompt ids (chat-templated) followed by its output ids
        (EOS included when it finished with ``stop``), ``num_prompt_tokens`` the prompt's
        length, ``source`` the prompt's.

    Raises:
        ValueError: ``prompts`` or ``order`` is empty, an ``order`` index out of range or
            repeated, or a bad ``max_tokens`` / ``batch_size`` / ``temperature``, naming it.
        RuntimeError: the engine is closed. An error of the engine's step (or of
            ``on_result``) propagates, after the requests still in flight are aborted.
    """
    if not prompts:
        raise ValueError("prompts is empty: nothing to distill")
    for name, value in (("max_tokens", max_tokens), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    todo = list(range(len(prompts))) if order is None else [int(i) for i in order]
    if not todo:
        raise ValueError("order is empty: nothing to distill")
    if len(set(todo)) != len(todo) or min(todo) < 0 or max(todo) >= len(prompts):
        raise ValueError(f"order must hold distinct indices in [0, {len(prompts) - 1}]")
    engine = llm.engine
    run = next(_run_ids)
    results: dict[int, TrainSequence] = {}
    failures: Counter[str] = Counter()
    failed_by_source: Counter[str] = Counter()
    in_flight: dict[str, int] = {}  # request id -> prompt index
    report = DistillProgress(Counter(prompts[i].source for i in todo),
                             bar=progress and sys.stderr.isatty(), clock=clock)

    def finish(i: int, seq: TrainSequence | None, error: str) -> None:
        if seq is None:
            failures[error[:120]] += 1
            failed_by_source[prompts[i].source] += 1
        else:
            results[i] = seq
        report.record(prompts[i].source, seq)
        if on_result is not None:
            on_result(i, seq, error)

    def add(i: int) -> bool:
        """Submit prompt ``i``; False when the engine refused it (counted as skipped)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                seed=i if temperature > 0 else None, grammar=prompts[i].grammar)
        rid = f"distill-{run}-{i}"
        try:
            engine.add_request(_prompt_input(prompts[i]), params, request_id=rid)
        except RequestError as e:
            finish(i, None, str(e))
            return False
        in_flight[rid] = i
        return True

    pending = deque(todo)
    held: deque[int] = deque()  # grammar prompts held back while the compile queue is full

    def top_up() -> None:
        # Requests waiting for a compile: read once, then counted up as grammar prompts go in
        # (a cached grammar may skip the queue: the count only over-estimates).
        waiting: int | None = None

        def compile_slot() -> bool:
            nonlocal waiting
            if waiting is None:
                waiting = engine.stats()["num_waiting_grammar"]
            return waiting < MAX_WAITING_FOR_GRAMMAR

        while held and len(in_flight) < batch_size and compile_slot():
            if add(held.popleft()):
                waiting = (waiting or 0) + 1
        while pending and len(in_flight) < batch_size:
            i = pending[0]
            if prompts[i].grammar is not None and not compile_slot():
                if len(held) >= batch_size:
                    break  # look no further ahead; the compiles in flight first
                held.append(pending.popleft())
                continue
            pending.popleft()
            if add(i) and prompts[i].grammar is not None:
                waiting = (waiting or 0) + 1

    detokenize, report_unfinished = engine.detokenize, engine.report_unfinished
    engine.detokenize = False
    engine.report_unfinished = False  # only finished outputs are read below
    stopped = False
    try:
        while pending or held or in_flight:
            if should_stop is not None and should_stop():
                stopped = True
                break
            top_up()
            if not in_flight and not engine.has_unfinished_requests():
                continue  # every prompt added so far was refused; add the next ones
            for out in engine.step():
                i = in_flight.get(out.request_id)
                if not out.finished or i is None:
                    continue
                del in_flight[out.request_id]
                seq, error = _sequence(out, prompts[i].source)
                finish(i, seq, error)
            report.tick()
        if stopped:
            for rid in in_flight:
                engine.abort_request(rid, "distill stopped")
            in_flight.clear()
            while engine.has_unfinished_requests():  # the aborts' outputs: leave it clean
                engine.step()
    finally:
        for rid in in_flight:  # only after an error: leave the engine reusable
            engine.abort_request(rid, "distill stopped")
        engine.detokenize = detokenize
        engine.report_unfinished = report_unfinished
        report.close("stopped early" if stopped else "")
    seqs = [results[i] for i in sorted(results)]
    _log_summary(len(todo), seqs, failures, failed_by_source)
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
