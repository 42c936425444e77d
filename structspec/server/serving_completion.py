"""``POST /v1/completions`` (legacy text completions): raw prompts, no chat template.

``echo`` with ``logprobs`` lists the prompt's tokens in each choice's ``logprobs`` before the
generated ones, as OpenAI's legacy API and vLLM do: the first prompt token with ``null``
logprob and top logprobs, the others scored by the engine's prompt logprobs. vLLM's
``prompt_logprobs`` come on each choice (:mod:`structspec.server.prompt_logprobs`); when
streamed, in the choice's first chunk (vLLM refuses ``prompt_logprobs > 0`` with
``stream``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from structspec.core import PromptTooLongError, SamplingParams
from structspec.prompt_truncation import keep_last
from structspec.server.errors import bad_request
from structspec.server.field_policy import check_request_fields
from structspec.server.generation import ChoiceState, GenerationRun
from structspec.server.limits import (
    check_choices,
    check_grammar_size,
    check_prompt_chars,
    check_stop,
)
from structspec.server.params import build_sampling_params, per_choice, prompt_keep
from structspec.server.prompt_logprobs import echo_logprobs, join_logprobs, prompt_logprobs_json
from structspec.server.protocol import CompletionRequest, parse_request
from structspec.server.request_log import request_record
from structspec.server.serving import (
    ServerState,
    TextOffsets,
    check_prompt_length,
    completion_logprobs,
    finish_or_error,
    in_thread,
    json_response,
    prompt_too_long,
    read_json,
    sse_event,
    sse_response,
    start_stream,
    stream_choices,
)
from structspec.server.stream_usage import StreamUsage
from structspec.server.structured import grammar_and_field


async def create_completion(state: ServerState, request: Request) -> Response:
    """Handle one completions request; ``choices[p * n + i]`` is sample ``i`` of prompt
    ``p``."""
    record = request_record(request)  # the request's log line (server.request_log)
    state.require_ready()
    limits = state.limits
    req = parse_request(CompletionRequest, await read_json(request, limits.max_request_bytes))
    record.stream = bool(req.stream)
    state.check_model(req.model)
    check_request_fields(req)
    prompt_list = _prompt_list(req)
    # before anything is tokenized: 100 prompts x n=64 used to queue 6,400 engine requests
    check_choices(limits, len(prompt_list), req.n)
    check_prompt_chars(limits, sum(len(p) for p in prompt_list if isinstance(p, str)),
                       "prompt")
    grammar, grammar_param = grammar_and_field(req)
    record.grammar = grammar.kind if grammar is not None else "none"
    check_grammar_size(limits, grammar, grammar_param)
    check_stop(limits, req.stop, req.stop_token_ids, state.engine.info.vocab_size)
    keep = prompt_keep(req, state.max_model_len, req.max_tokens)
    prompts, cut = await _prompt_ids(state, req, keep)
    # echo: a prompt's text as sent, or the decoded kept tokens of a truncated one
    texts = [p if isinstance(p, str) and not was_cut else None
             for p, was_cut in zip(_prompt_list(req), cut, strict=True)]
    items: list[tuple[list[int], SamplingParams]] = []
    # what the prompt's scores serve: vLLM's prompt_logprobs, and echo's logprobs
    shown = _PromptScores(req.prompt_logprobs,
                          req.logprobs if req.echo and req.logprobs is not None else None)
    for ids in prompts:
        params = build_sampling_params(req, grammar=grammar, max_tokens=req.max_tokens,
                                       logprobs=req.logprobs, prompt_len=len(ids),
                                       max_model_len=state.max_model_len,
                                       vocab_size=state.engine.info.vocab_size,
                                       prompt_logprobs=shown.engine_top_k)
        items.extend((ids, p) for p in per_choice(params, req.n))
    prompt_tokens = sum(len(ids) for ids in prompts)
    rid = record.request_id
    run = GenerationRun(state.engine, state.codec, state.metrics, rid, items, record.start_s,
                        grammar_param=grammar_param, priority=req.priority or 0)
    record.run, record.prompt_tokens = run, prompt_tokens
    created = int(time.time())
    state.admit(len(run.choices))  # no await from here to run.start()
    echo = [_echo_text(state, texts[c.index // req.n], c.prompt_ids) if req.echo else ""
            for c in run.choices]
    as_token_ids = bool(req.return_tokens_as_token_ids)
    if req.stream:
        if not await start_stream(request, run):
            return Response(status_code=499)
        usage = StreamUsage.of(req.stream_options)
        return sse_response(_stream(state, run, rid, created, prompt_tokens, usage,
                                    req.logprobs is not None, echo, shown, as_token_ids))
    failed = await finish_or_error(state, request, run)
    if failed is not None:
        return failed
    return json_response({
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": [_choice(state, c, req.logprobs is not None, echo[c.index], shown,
                            as_token_ids)
                    for c in run.choices],
        "usage": run.usage(prompt_tokens),
        "system_fingerprint": None,
    })


@dataclass(frozen=True)
class _PromptScores:
    """Which prompt scores a completions request shows.

    Attributes:
        top_k: the request's ``prompt_logprobs`` (vLLM's per-choice field), or None.
        echo_top_k: its ``logprobs`` when it echoes the prompt (the prompt's tokens lead each
            choice's ``logprobs``), or None.
    """

    top_k: int | None
    echo_top_k: int | None

    @property
    def engine_top_k(self) -> int | None:
        """The top-k the engine scores the prompt with (None: it scores nothing)."""
        if self.top_k is None or self.echo_top_k is None:
            return self.top_k if self.echo_top_k is None else self.echo_top_k
        return max(self.top_k, self.echo_top_k)


_NO_PROMPT_SCORES = _PromptScores(None, None)
"""A request that shows no prompt scores."""


def _prompt_list(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in p):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


async def _prompt_ids(state: ServerState, req: CompletionRequest,
                      keep: int | None) -> tuple[list[list[int]], list[bool]]:
    """Each prompt's token ids, cut to its last ``keep`` tokens (``truncate_prompt_tokens``;
    None: whole), and whether the cut dropped any.

    Raises:
        APIError: 400 naming the prompt: empty, not valid Unicode, a token id outside the
            vocabulary (of the kept ids, as vLLM checks them after the cut), or longer than
            the context (``context_length_exceeded``, counted after the cut).
    """
    out, cut = [], []
    for i, p in enumerate(_prompt_list(req)):
        param = "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty", param)
            try:
                if keep is None:
                    ids = await in_thread(state.codec.encode_text, p, state.max_model_len - 1)
                    dropped = False
                else:  # the tail is kept, so no length guard (--max-prompt-chars bounds it)
                    ids, dropped = await in_thread(state.codec.encode_text_tail, p, keep)
            except PromptTooLongError as e:
                raise prompt_too_long(e.min_tokens, state.max_model_len, param,
                                      at_least=True) from None
            except ValueError as e:  # not valid Unicode
                raise bad_request(str(e), param) from None
        else:
            if not p:
                raise bad_request("prompt must not be empty", param)
            ids = keep_last(p, keep)
            dropped = len(ids) < len(p)
            vocab = state.engine.info.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"prompt token id {bad} is outside the vocabulary", param)
        check_prompt_length(len(ids), state.max_model_len, param)
        out.append(ids)
        cut.append(dropped)
    return out, cut


def _echo_text(state: ServerState, text: str | None, prompt_ids: list[int]) -> str:
    """The echoed prompt: ``text`` as sent, else (token ids, or a text cut by
    ``truncate_prompt_tokens``) the decoded prompt ids the completion continues. vLLM echoes
    a cut token-id prompt so, but a cut text prompt whole (its renderer keeps the text as
    sent); here both echo the kept prompt, which ``usage.prompt_tokens`` counts."""
    return text if text is not None else state.codec.decode(prompt_ids)


def _choice(state: ServerState, c: ChoiceState, with_logprobs: bool, echo: str,
            shown: _PromptScores = _NO_PROMPT_SCORES,
            as_token_ids: bool = False) -> dict[str, Any]:
    logprobs = None
    if with_logprobs:
        logprobs = _with_prompt(state, c, shown,
                                completion_logprobs(state.codec, c.logprobs,
                                                    _text_offsets(state, c, len(echo)),
                                                    as_token_ids=as_token_ids),
                                as_token_ids)
    out: dict[str, Any] = {
        "index": c.index,
        "text": echo + c.text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.final.stop_reason if c.final else None,
    }
    if shown.top_k is not None:
        out["prompt_logprobs"] = prompt_logprobs_json(state.codec, c.prompt_logprobs or [],
                                                      shown.top_k)
    if c.final is not None and c.final.schema_valid is not None:
        out["schema_valid"] = c.final.schema_valid
    if c.final is not None and c.final.grammar_backend is not None:
        out["grammar_backend"] = c.final.grammar_backend  # extension: who enforced the grammar
    return out


def _text_offsets(state: ServerState, c: ChoiceState, start: int) -> TextOffsets:
    """A choice's generated-token text offsets from ``start`` (after its echo), counted by
    a detokenizer as the engine decodes its text (the prompt as left context)."""
    return TextOffsets(start, state.codec.detokenizer(
        c.prompt_ids, skip_special_tokens=c.params.skip_special_tokens,
        spaces_between_special_tokens=c.params.spaces_between_special_tokens))


def _with_prompt(state: ServerState, c: ChoiceState, shown: _PromptScores,
                 generated: dict[str, Any], as_token_ids: bool) -> dict[str, Any]:
    """``generated`` (a choice's legacy ``logprobs``) led by its echoed prompt's tokens when
    the request echoes with logprobs and the engine scored the prompt (``as_token_ids``:
    their tokens as ``"token_id:N"``, as the generated ones)."""
    if shown.echo_top_k is None or c.prompt_logprobs is None:
        return generated
    return join_logprobs(echo_logprobs(state.codec, c.prompt_ids, c.prompt_logprobs,
                                       shown.echo_top_k, as_token_ids=as_token_ids),
                         generated)


async def _stream(state: ServerState, run: GenerationRun, rid: str, created: int,
                  prompt_tokens: int, usage: StreamUsage, with_logprobs: bool,
                  echo: list[str], shown: _PromptScores,
                  as_token_ids: bool) -> AsyncIterator[str]:
    """SSE chunks of text per choice, a finish chunk per choice, optional usage
    (:mod:`structspec.server.stream_usage`), [DONE].

    A choice's echoed prompt goes with its first generated text (with ``logprobs``, once the
    engine scored the prompt: its tokens lead that chunk's ``logprobs``), and vLLM's
    ``prompt_logprobs`` ride its first chunk after they arrive."""
    # each choice's text offsets, from its echo (only with logprobs: each holds a detokenizer)
    offsets = ({c.index: _text_offsets(state, c, len(echo[c.index])) for c in run.choices}
               if with_logprobs else {})

    def chunk(choices: list[dict[str, Any]], totals: Any = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                "model": state.model_name, "choices": choices}
        usage.add_to(body, run, totals)
        return sse_event(body)

    def with_prompt_logprobs(c: ChoiceState, choice: dict[str, Any]) -> dict[str, Any]:
        """``choice`` with vLLM's ``prompt_logprobs`` when they arrived and were not sent."""
        if shown.top_k is not None and c.prompt_logprobs is not None \
                and not c.prompt_logprobs_sent:
            c.prompt_logprobs_sent = True
            choice["prompt_logprobs"] = prompt_logprobs_json(state.codec, c.prompt_logprobs,
                                                             shown.top_k)
        return choice

    def progress(c: ChoiceState) -> list[str]:
        events = []
        if (echo[c.index] and with_logprobs and shown.echo_top_k is not None
                and c.prompt_logprobs is None and not c.finished):
            return events  # the echo waits for the prompt's scores (its first delta)
        text = c.take_text()
        lps = c.take_logprobs() if with_logprobs else []
        echoed = bool(echo[c.index])
        if echoed:
            text, echo[c.index] = echo[c.index] + text, ""
        if text or lps:
            lp = None
            if with_logprobs:
                lp = completion_logprobs(state.codec, lps, offsets[c.index],
                                         as_token_ids=as_token_ids)
                if echoed:
                    lp = _with_prompt(state, c, shown, lp, as_token_ids)
            events.append(chunk([with_prompt_logprobs(c, {
                "index": c.index, "text": text, "logprobs": lp, "finish_reason": None})]))
        if c.finished and not c.finish_sent:
            c.finish_sent = True
            events.append(chunk([with_prompt_logprobs(c, {
                "index": c.index, "text": "", "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.final.stop_reason if c.final else None})]))
        return events

    try:
        async for e in stream_choices(state, run, chunk, progress, include_usage=usage.include,
                                      prompt_tokens=prompt_tokens):
            yield e
    finally:
        run.abort()  # a closed outer generator does not close the inner one right away
