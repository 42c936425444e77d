"""``POST /v1/chat/completions``: request -> prompt ids + params -> response or SSE stream."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from structspec.core import (
    ChatMessageError,
    ChatTemplateOptions,
    PromptTooLongError,
    check_chat_messages,
)
from structspec.prompt_truncation import keep_last
from structspec.server.errors import bad_request
from structspec.server.field_policy import check_request_fields
from structspec.server.generation import ChoiceState, GenerationRun, LogprobEntry
from structspec.server.hermes_stream import HermesStream
from structspec.server.hermes_tools import (
    AutoToolPlan,
    message_content,
    parse_hermes,
    plan_auto_tools,
    tool_call_entry,
)
from structspec.server.limits import (
    ServerLimits,
    check_choices,
    check_grammar_size,
    check_prompt_chars,
    check_stop,
)
from structspec.server.params import build_sampling_params, per_choice, prompt_keep
from structspec.server.prompt_logprobs import PromptLogprobsJSON, prompt_logprobs_json
from structspec.server.protocol import ChatCompletionRequest, TokenizeRequest, parse_request
from structspec.server.request_log import request_record
from structspec.server.serving import (
    ServerState,
    chat_logprobs,
    check_prompt_length,
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
from structspec.server.tool_calls import (
    ToolCallPlan,
    calls_from_output,
    finish_reason,
    history_message,
    new_call_id,
    plan_tool_calls,
)

ROLES = {"system", "user", "assistant", "tool", "developer"}


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    """Handle one chat completion request (see module docstring)."""
    record = request_record(request)  # the request's log line (server.request_log)
    state.require_ready()
    limits = state.limits
    req = parse_request(ChatCompletionRequest,
                        await read_json(request, limits.max_request_bytes))
    record.stream = bool(req.stream)
    state.check_model(req.model)
    check_request_fields(req)
    check_choices(limits, 1, req.n)
    options = template_options(req)
    plan = plan_tool_calls(req.tools, req.tool_choice, req.parallel_tool_calls)
    check_continuation(plan, options)
    # auto tool calls (--tool-call-parser): generated under a structural tag of the tools
    auto = (plan_auto_tools(state.tool_call_parser, req.tools, req.tool_choice,
                            req.parallel_tool_calls)
            if plan is None else None)
    # a forced or auto tool call's grammar is one more constraint (at most one per request,
    # and structured_outputs.bounded_numbers applies to it)
    forced = (("tool_choice", (plan.grammar, plan.grammar_param)) if plan is not None
              else ("tools", (auto.grammar, auto.grammar_param)) if auto is not None else None)
    grammar, grammar_param = grammar_and_field(req, forced)
    record.grammar = grammar.kind if grammar is not None else "none"
    check_grammar_size(limits, grammar, grammar_param)
    check_stop(limits, req.stop, req.stop_token_ids, state.engine.info.vocab_size)
    messages = template_messages(req.messages, hermes=state.tool_call_parser == "hermes")
    tools = template_tools(req.tools, req.tool_choice)
    check_chat_prompt(limits, messages, tools, options)
    # truncate_prompt_tokens: the rendered prompt's last tokens (no special tokens are added
    # to it, so its tail is the cut vLLM makes); the whole chat is rendered, unguarded
    keep = prompt_keep(req, state.max_model_len,
                       req.max_completion_tokens if req.max_completion_tokens is not None
                       else req.max_tokens)
    try:
        prompt_ids = keep_last(await in_thread(
            state.codec.encode_chat, messages, tools,
            state.max_model_len - 1 if keep is None else None, options), keep)
    except PromptTooLongError as e:
        raise prompt_too_long(e.min_tokens, state.max_model_len, "messages",
                              at_least=True) from None
    except ChatMessageError as e:  # the template cannot leave the final message open
        raise bad_request(str(e), e.param, code=e.code) from None
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    check_prompt_length(len(prompt_ids), state.max_model_len, "messages")
    logprobs = None
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    elif req.top_logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
        if req.max_tokens is not None and req.max_tokens < 1:
            # max_completion_tokens wins, but a bad max_tokens beside it is still bad input
            # (it used to be ignored: -7 was a 200)
            raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}",
                              "max_tokens")
    else:
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
    params = build_sampling_params(req, grammar=grammar, max_tokens=max_tokens,
                                   logprobs=logprobs, prompt_len=len(prompt_ids),
                                   max_model_len=state.max_model_len,
                                   max_tokens_param=max_tokens_param,
                                   logprobs_param="top_logprobs",
                                   vocab_size=state.engine.info.vocab_size,
                                   prompt_logprobs=req.prompt_logprobs)
    rid = record.request_id
    run = GenerationRun(state.engine, state.codec, state.metrics, rid,
                        [(prompt_ids, p) for p in per_choice(params, req.n)], record.start_s,
                        grammar_param=grammar_param, priority=req.priority or 0)
    record.run, record.prompt_tokens = run, len(prompt_ids)
    created = int(time.time())
    as_token_ids = bool(req.return_tokens_as_token_ids)
    state.admit(len(run.choices))  # no await from here to run.start()
    if req.stream:
        if not await start_stream(request, run):
            return Response(status_code=499)
        usage = StreamUsage.of(req.stream_options)
        return sse_response(_stream(state, run, rid, created, len(prompt_ids), usage,
                                    logprobs is not None, plan, auto, req.prompt_logprobs,
                                    as_token_ids))
    failed = await finish_or_error(state, request, run)
    if failed is not None:
        return failed
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": state.model_name,
        "choices": [_choice(state, c, logprobs is not None, plan, auto, as_token_ids)
                    for c in run.choices],
        "usage": run.usage(len(prompt_ids)),
        "system_fingerprint": None,
    }
    if req.prompt_logprobs is not None:  # vLLM's: top-level (every choice has one prompt)
        body["prompt_logprobs"] = prompt_logprobs_json(
            state.codec, run.choices[0].prompt_logprobs or [], req.prompt_logprobs)
    return json_response(body)


def _choice(state: ServerState, c: ChoiceState, with_logprobs: bool,
            plan: ToolCallPlan | None, auto: AutoToolPlan | None = None,
            as_token_ids: bool = False) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    reason = c.finish_reason
    calls = calls_from_output(plan, c.text) if plan is not None else None
    if plan is not None and calls is not None:  # a forced call: the calls, no content
        message.update(content=None, tool_calls=calls)
        reason = finish_reason(reason, c.final.stop_reason if c.final else None)
    if auto is not None:  # Hermes: the text before the first call, then the calls
        parsed = parse_hermes(c.text)
        message["content"] = message_content(parsed.content)
        if parsed.calls:
            message["tool_calls"] = [tool_call_entry(call) for call in parsed.calls]
            reason = finish_reason(reason, c.final.stop_reason if c.final else None)
    out: dict[str, Any] = {
        "index": c.index,
        "message": message,
        "logprobs": (chat_logprobs(state.codec, c.logprobs, as_token_ids=as_token_ids)
                     if with_logprobs else None),
        "finish_reason": reason,
        "stop_reason": c.final.stop_reason if c.final else None,
    }
    if c.final is not None and c.final.schema_valid is not None:
        out["schema_valid"] = c.final.schema_valid
    if c.final is not None and c.final.grammar_backend is not None:
        out["grammar_backend"] = c.final.grammar_backend  # extension: who enforced the grammar
    return out


async def _stream(state: ServerState, run: GenerationRun, rid: str, created: int,
                  prompt_tokens: int, usage: StreamUsage,
                  with_logprobs: bool, plan: ToolCallPlan | None,
                  auto: AutoToolPlan | None = None,
                  prompt_top_k: int | None = None,
                  as_token_ids: bool = False) -> AsyncIterator[str]:
    """SSE chunks: a role chunk per choice, content deltas, a finish chunk per choice,
    then (``include_usage``) a usage chunk, then ``[DONE]`` (``usage``:
    :mod:`structspec.server.stream_usage`). A failure after output started
    is sent as an ``{"error": ...}`` event before ``[DONE]``. With a forced tool call
    (``plan``) the deltas are ``tool_calls`` instead of ``content``: a named call's id and
    name, then its arguments as they come; ``required`` calls whole at the end. With auto
    tool calls (``auto``) content deltas, then each call once its section closes
    (:mod:`structspec.server.hermes_stream`). With ``prompt_top_k`` (the request's
    ``prompt_logprobs``) the first choice chunk after the engine scored the prompt carries
    vLLM's top-level ``prompt_logprobs``."""
    call_ids: dict[int, str] = {}  # per choice: its named call's id, once sent
    hermes = {c.index: HermesStream() for c in run.choices} if auto is not None else {}
    # per choice: auto tool calls' logprobs of text held back, sent with the next delta
    held_logprobs: dict[int, list[LogprobEntry]] = {}
    # the prompt's scores waiting for the next choice chunk (sent once per request)
    pending: list[PromptLogprobsJSON] = []

    def chunk(choices: list[dict[str, Any]], totals: Any = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                                "created": created, "model": state.model_name,
                                "choices": choices}
        usage.add_to(body, run, totals)
        if pending and choices:
            body["prompt_logprobs"] = pending.pop()
        return sse_event(body)

    def take_prompt_logprobs(c: ChoiceState) -> None:
        """Queue the prompt's scores for the next chunk once the engine sent them."""
        if prompt_top_k is None or c.prompt_logprobs is None:
            return
        if not any(o.prompt_logprobs_sent for o in run.choices):
            pending.append(prompt_logprobs_json(state.codec, c.prompt_logprobs, prompt_top_k))
        for o in run.choices:  # every choice has the same prompt: one copy in the stream
            o.prompt_logprobs_sent = True

    def delta_of(c: ChoiceState, text: str, finishing: bool,
                 calls: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """The delta carrying ``text``; None while a ``required`` answer is incomplete
        (``calls``: its parsed calls once it is, ``finishing``)."""
        if plan is None:
            return {"content": text}
        if plan.mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if c.index not in call_ids:  # the first delta names the call
                call_ids[c.index] = new_call_id()
                call.update(id=call_ids[c.index], type="function")
                call["function"] = {"name": plan.name, "arguments": text}
            return {"tool_calls": [call]}
        if not finishing:
            return None
        if calls is None:  # not a complete array of calls (cut by max_tokens): as text
            return {"content": c.text}
        return {"tool_calls": [dict(call, index=i) for i, call in enumerate(calls)]}

    def auto_progress(c: ChoiceState) -> list[str]:
        """A choice's news as Hermes content and tool-call deltas. Logprobs ride the first
        chunk with a delta: those of text the stream holds back (a possible ``<tool_call>``,
        a section still open) wait for it, instead of going out in chunks with an empty
        delta (vLLM drops them); whatever waits when the choice ends goes with an empty
        delta before the finish chunk."""
        stream = hermes[c.index]
        finishing = c.finished and not c.finish_sent
        deltas = stream.feed(c.take_text(), finishing)
        lps = held_logprobs.pop(c.index, [])
        if with_logprobs:
            lps += c.take_logprobs()
        if lps and not deltas:
            if not finishing:
                held_logprobs[c.index] = lps
                return []
            deltas = [{}]
        events = [chunk([{"index": c.index, "delta": d,
                          "logprobs": (chat_logprobs(state.codec, lps,
                                                     as_token_ids=as_token_ids)
                                       if with_logprobs and i == 0 else None),
                          "finish_reason": None}]) for i, d in enumerate(deltas)]
        if finishing:
            c.finish_sent = True
            stop_reason = c.final.stop_reason if c.final else None
            reason = (finish_reason(c.finish_reason, stop_reason) if stream.num_calls
                      else c.finish_reason)
            events.append(chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                  "finish_reason": reason, "stop_reason": stop_reason}]))
        return events

    def progress(c: ChoiceState) -> list[str]:
        take_prompt_logprobs(c)
        if auto is not None:
            return auto_progress(c)
        events = []
        text = c.take_text()
        lps = c.take_logprobs() if with_logprobs else []
        finishing = c.finished and not c.finish_sent
        # a required answer's calls, parsed once when it ends (its delta and finish reason)
        calls = (calls_from_output(plan, c.text)
                 if finishing and plan is not None and plan.mode == "required" else None)
        ends_required = finishing and plan is not None and plan.mode == "required"
        delta = delta_of(c, text, finishing, calls) if text or lps or ends_required else None
        if delta is not None or lps:
            events.append(chunk([{
                "index": c.index, "delta": delta if delta is not None else {},
                "logprobs": (chat_logprobs(state.codec, lps, as_token_ids=as_token_ids)
                             if with_logprobs else None),
                "finish_reason": None}]))
        if finishing:
            c.finish_sent = True
            reason = c.finish_reason
            if plan is not None and (plan.mode == "named" or calls is not None):
                reason = finish_reason(reason, c.final.stop_reason if c.final else None)
            events.append(chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                  "finish_reason": reason,
                                  "stop_reason": c.final.stop_reason if c.final else None}]))
        return events

    head = [chunk([{"index": c.index,
                    "delta": {"role": "assistant", "content": "" if plan is None else None},
                    "logprobs": None, "finish_reason": None}]) for c in run.choices]
    try:
        async for e in stream_choices(state, run, chunk, progress, include_usage=usage.include,
                                      prompt_tokens=prompt_tokens, head=head):
            yield e
    finally:
        run.abort()  # a closed outer generator does not close the inner one right away


def check_continuation(plan: ToolCallPlan | None, options: ChatTemplateOptions) -> None:
    """Refuse ``continue_final_message`` beside a forced tool call (``plan``).

    Raises:
        APIError: 400 naming ``continue_final_message``: the call is a new assistant message,
            not a continuation of the final one.
    """
    if plan is not None and options.continue_final_message:
        raise bad_request("continue_final_message cannot be used with a forced tool call "
                          "(tool_choice \"required\" or a named function): the call is a new "
                          "assistant message, not a continuation of the final one",
                          "continue_final_message")


def check_chat_prompt(limits: ServerLimits, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, options: ChatTemplateOptions) -> None:
    """The checks of a chat's prompt before it is rendered (the chat endpoint's and
    ``/tokenize``'s): ``options`` against the messages (a final message to continue), the
    template variables' and then the whole prompt's characters (``--max-prompt-chars``).

    Raises:
        APIError: 400 naming ``continue_final_message``, ``chat_template_kwargs`` or
            ``messages``.
    """
    try:
        options.check_messages(messages)
    except ChatMessageError as e:
        raise bad_request(str(e), e.param, code=e.code) from None
    kwargs_chars = options.kwargs_chars()  # the variables' JSON, counted once
    check_prompt_chars(limits, kwargs_chars, "chat_template_kwargs")
    check_prompt_chars(limits, prompt_chars(messages, tools) + kwargs_chars, "messages")


def template_tools(tools: list[dict[str, Any]] | None,
                   tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools the chat template renders: the request's ``tools`` unless the client turned
    them off (``tool_choice`` ``"none"``); None when there are none. Check them first
    (:func:`~structspec.server.tool_calls.plan_tool_calls`)."""
    return tools if tools and tool_choice != "none" else None


def prompt_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Characters of prompt text a chat's messages and tools bring (what
    ``--max-prompt-chars`` bounds, with the ``chat_template_kwargs``: :func:`check_chat_prompt`):
    message contents plus tools as JSON.

    Args:
        messages: as :func:`template_messages` returns them (string contents).
        tools: as :func:`template_tools` returns them, already checked (their nesting is
            bounded, so the JSON encoder cannot recurse too deep).
    """
    chars = sum(len(m["content"]) for m in messages)
    if tools:
        chars += len(json.dumps(tools, ensure_ascii=False))
    return chars


def template_options(req: ChatCompletionRequest | TokenizeRequest) -> ChatTemplateOptions:
    """The request's chat template options: vLLM's ``add_generation_prompt`` (default true),
    ``continue_final_message`` (default false) and ``chat_template_kwargs`` (``null`` is the
    default for each).

    Raises:
        APIError: 400 naming the field: both flags true (``continue_final_message``), or a
            reserved ``chat_template_kwargs`` key (``chat_template_kwargs.<key>``).
    """
    try:
        return ChatTemplateOptions(
            add_generation_prompt=req.add_generation_prompt is not False,
            continue_final_message=req.continue_final_message is True,
            chat_template_kwargs=req.chat_template_kwargs)
    except ChatMessageError as e:
        raise bad_request(str(e), e.param, code=e.code) from None


def template_messages(messages: Any, *, hermes: bool = False) -> list[dict[str, Any]]:
    """The request's messages as the chat template expects them: checked (and text parts
    joined) by :func:`check_chat_messages`, roles limited to OpenAI's, developer -> system;
    tool-call turns as text (:func:`~structspec.server.tool_calls.history_message`; ``hermes``:
    in the ``<tool_call>`` format of ``--tool-call-parser hermes``).

    Raises:
        APIError: 400 naming the field (``code`` ``unsupported`` for an image part or a tool
            call turn).
    """
    if isinstance(messages, list):  # a tool-call turn of the history, as text (tool_calls)
        messages = [history_message(m, i, hermes=hermes) if isinstance(m, dict) else m
                    for i, m in enumerate(messages)]
    try:
        checked = check_chat_messages(messages)
    except ChatMessageError as e:
        raise bad_request(str(e), e.param, code=e.code) from None
    for i, m in enumerate(checked):
        if m["role"] not in ROLES:
            raise bad_request(f"messages[{i}].role: unknown role {m['role']!r}; expected one of "
                              f"{sorted(ROLES)}", f"messages[{i}].role")
        if m["role"] == "developer":
            m["role"] = "system"
    return checked
