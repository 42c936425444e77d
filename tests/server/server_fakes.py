"""A fake engine and a character-level codec for protocol-level server tests (no model).

The fake engine "generates" a scripted text one character (= token) per tick, following the
engine's semantics: stop strings end the request with the text cut before them (after
them with ``include_stop_str_in_output``),
``max_tokens`` ends it with ``length``, a grammar decides the script, and a grammar whose
text contains ``BAD(`` (a regex, an EBNF grammar, a JSON Schema, a choice) fails to "compile":
an error delta before any token whose ``error_param`` is the one the real engine gives
(:data:`ENGINE_GRAMMAR_PARAM`, by grammar kind, whatever field the client used). A structural
tag goes through the real engine's checks before its compile (shape, and each JSON Schema's
satisfiability and strict check: tokenizer-free), whose refusal names the place in the tag.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from typing import Any

from structspec.constraints import (
    PARAM_BY_KIND,
    ChoiceConstraint,
    EbnfConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuralTagConstraint,
)
from structspec.core import ChatTemplateOptions, SamplingParams, SpecMetrics
from structspec.server.ipc import EngineDelta, EngineInfo, EngineStats
from structspec.stop_strings import first_stop_ending_after

EOS = 0

ENGINE_GRAMMAR_PARAM = PARAM_BY_KIND
"""The engine's grammar error ``param`` by grammar kind (checked equal in test_app.py)."""


def grammar_text(g: Any) -> str:
    """The client-written text of a grammar spec (where the fake looks for ``BAD(``)."""
    if isinstance(g, RegexConstraint):
        return g.pattern
    if isinstance(g, EbnfConstraint):
        return g.grammar
    if isinstance(g, JsonSchemaConstraint):
        return json.dumps(g.schema)
    if isinstance(g, ChoiceConstraint):
        return " ".join(g.choices)
    return ""


EOS_TEXT = "</s>"
"""The text of token 0 (EOS) when special tokens are kept (``skip_special_tokens`` false)."""


class CharDetokenizer:
    """One token = one character; token 0 (EOS) has no text, or :data:`EOS_TEXT` when
    special tokens are kept."""

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self.eos_text = "" if skip_special_tokens else EOS_TEXT

    def add(self, token_ids: Iterable[int]) -> str:
        return "".join(self.eos_text if t == EOS else chr(t) for t in token_ids)

    def flush(self) -> str:
        return ""


class FakeCodec:
    """Character-level :class:`~structspec.server.codec.Codec` (no special tokens: the
    ``add_special_tokens`` / ``skip_special_tokens`` / ``spaces_between_special_tokens`` flags
    change nothing; a truncated text keeps its last characters)."""

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    max_tokens: int | None = None,
                    options: ChatTemplateOptions | None = None, *,
                    add_special_tokens: bool = False) -> list[int]:
        """``<role>content`` lines, then ``<assistant>`` (unless ``options`` turn the
        generation prompt off); a final message left open has no newline."""
        options = options or ChatTemplateOptions()
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if options.continue_final_message:
            text = text[:-1]
        if options.add_generation_prompt:
            text += "<assistant>"
        return [ord(c) for c in text]

    def encode_text(self, text: str, max_tokens: int | None = None, *,
                    add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def encode_text_tail(self, text: str, keep: int, *,
                         add_special_tokens: bool = True) -> tuple[list[int], bool]:
        return [ord(c) for c in text[-keep:]], len(text) > keep

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids if t != EOS)

    def token_pieces(self, token_ids: Sequence[int]) -> list[str]:
        return [chr(t) for t in token_ids]

    def detokenizer(self, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> CharDetokenizer:
        return CharDetokenizer(skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        return "" if token_id == EOS else chr(token_id)


def script_for(params: SamplingParams) -> str:
    """What the fake model writes for ``params``."""
    g = params.grammar
    if isinstance(g, ChoiceConstraint):
        return g.choices[-1]
    if isinstance(g, JsonSchemaConstraint):
        schema = g.schema if isinstance(g.schema, dict) else json.loads(g.schema)
        if schema.get("type") == "array":  # tool_choice "required": one call of the first tool
            items = schema["items"]
            first = items["anyOf"][0] if "anyOf" in items else items
            name = first["properties"]["name"]["const"]
            return json.dumps([{"name": name, "parameters": {"city": "Paris"}}])
        return json.dumps({"name": "Ada", "age": 36})
    if isinstance(g, JsonObjectConstraint):
        return json.dumps({"ok": True})
    if isinstance(g, RegexConstraint):
        return "2024-01-02"
    if isinstance(g, EbnfConstraint):
        return "yes"
    if isinstance(g, StructuralTagConstraint):
        tag = g.parsed_tag()
        if tag.get("triggers") == ["<tool_call>"]:  # auto tool calls (Hermes): call tool 0
            begin = tag["structures"][0]["begin"]
            return f"Let me check. {begin}{{\"city\": \"Paris\"}}}}\n</tool_call>"
        return "Let me check. <function=get_weather>{\"city\": \"Paris\"}</function>"
    return "Hello world! STOP here. " * 20


def fake_prompt_logprobs(prompt: list[int], top_k: int | None) -> Any:
    """The fake's prompt scores: None at position 0, then each token at -0.5 with rank 2,
    behind ``?`` at -0.25 (top-k: ``?``, then the token)."""
    if top_k is None:
        return None
    return [None] + [(t, -0.5, 2, [(ord("?"), -0.25), (t, -0.5)][:top_k]) for t in prompt[1:]]


class FakeEngine:
    """An :class:`~structspec.server.engine_client.AsyncEngine` that runs scripts."""

    def __init__(self, *, max_model_len: int = 512, tick_s: float = 0.001,
                 ready: bool = True) -> None:
        self.info = EngineInfo(model_path="/fake/model", max_model_len=max_model_len,
                               vocab_size=0x110000, device="cpu", dtype="float32",
                               speculative_algorithm="none", num_draft_tokens=1,
                               kv_capacity_tokens=4096, max_batch_size=8, pid=0)
        self.tick_s = tick_s
        self._ready = ready
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sinks: dict[str, asyncio.Queue[EngineDelta]] = {}
        self.added: list[tuple[str, list[int], SamplingParams]] = []
        self.priorities: list[int] = []  # each add_request's priority
        self.aborted: list[str] = []
        self._listeners: list[Any] = []
        #: prompt tokens each request reports as reused from the prefix cache
        self.cached_tokens = 0
        #: what every request writes, in place of :func:`script_for`'s text (when set)
        self.script: str | None = None

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._tasks), kv_free_pages=10, kv_total_pages=10)

    @property
    def num_inflight(self) -> int:
        return len(self._tasks)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    def add_listener(self, listener: Any) -> None:
        self._listeners.append(listener)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, sink: asyncio.Queue[EngineDelta], *,
                    priority: int = 0) -> None:
        self.added.append((request_id, prompt_token_ids, params))
        self.priorities.append(priority)
        self._sinks[request_id] = sink
        self._tasks[request_id] = asyncio.get_running_loop().create_task(
            self._run(request_id, prompt_token_ids, params, sink))

    def abort_request(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is None:
            return
        self.aborted.append(request_id)
        task.cancel()
        self._sinks.pop(request_id).put_nowait(EngineDelta(
            request_id=request_id, finished=True, finish_reason="abort",
            error="aborted by client"))

    def abort_all(self) -> None:
        for rid in list(self._tasks):
            self.abort_request(rid)

    async def _run(self, rid: str, prompt: list[int], params: SamplingParams,
                   sink: asyncio.Queue[EngineDelta]) -> None:
        await asyncio.sleep(self.tick_s)
        g = params.grammar
        if g is not None and "BAD(" in grammar_text(g):
            self._finish(rid, sink, EngineDelta(
                request_id=rid, finished=True, finish_reason="abort", rejected=False,
                error=f"Failed to compile {g.kind} grammar: missing ')'",
                error_param=ENGINE_GRAMMAR_PARAM[g.kind], num_prompt_tokens=len(prompt)))
            return
        if isinstance(g, StructuralTagConstraint):
            from structspec.grammar.errors import GrammarError
            from structspec.grammar.structural_tag_grammar import check_structural_tag

            try:
                check_structural_tag(g)
            except GrammarError as e:
                self._finish(rid, sink, EngineDelta(
                    request_id=rid, finished=True, finish_reason="abort", rejected=False,
                    error=str(e), error_param=e.param, num_prompt_tokens=len(prompt)))
                return
        text = self.script if self.script is not None else script_for(params)
        out: list[int] = []
        steps = 0
        # the prompt's scores ride the request's first delta, as the engine sends them
        first = fake_prompt_logprobs(prompt, params.prompt_logprobs)
        for ch in text:
            steps += 1
            tok = ord(ch)
            out.append(tok)
            lps = None
            if params.logprobs is not None:
                top = [(tok, -0.1), (ord("?"), -2.5)][: params.logprobs]
                lps = [(tok, -0.1, top)]
            so_far = "".join(chr(t) for t in out)
            # the engine's rule: none inside the first min_tokens tokens (one char each)
            found = (first_stop_ending_after(so_far, params.stop, params.min_tokens)
                     if len(out) > params.min_tokens else None)
            if found is not None:
                idx, hit = found
                end = idx + (len(hit) if params.include_stop_str_in_output else 0)
                self._finish(rid, sink, self._final(rid, [tok], lps, prompt, out, "stop", hit,
                                                    so_far[:end], steps, first))
                return
            if len(out) >= params.max_tokens:
                self._finish(rid, sink, self._final(rid, [tok], lps, prompt, out, "length", None,
                                                    so_far, steps, first))
                return
            sink.put_nowait(EngineDelta(request_id=rid, new_token_ids=[tok], new_logprobs=lps,
                                        prompt_logprobs=first))
            first = None
            await asyncio.sleep(self.tick_s)
        out.append(EOS)
        lps = [(EOS, -0.05, [])] if params.logprobs is not None else None
        # the end of the script is the model's EOS (or the grammar's end): stop_reason None,
        # as the engine and vLLM report it
        self._finish(rid, sink, self._final(rid, [EOS], lps, prompt, out, "stop", None,
                                            "".join(chr(t) for t in out if t), steps + 1,
                                            first))

    def _final(self, rid: str, new: list[int], lps: Any, prompt: list[int], out: list[int],
               reason: str, stop: str | int | None, text: str, steps: int,
               prompt_logprobs: Any = None) -> EngineDelta:
        return EngineDelta(
            request_id=rid, new_token_ids=new, new_logprobs=lps, finished=True,
            prompt_logprobs=prompt_logprobs,
            finish_reason=reason, stop_reason=stop, text=text, num_prompt_tokens=len(prompt),
            num_completion_tokens=len(out), num_cached_tokens=self.cached_tokens,
            spec=SpecMetrics(verify_steps=steps, committed_tokens=len(out)))

    def _finish(self, rid: str, sink: asyncio.Queue[EngineDelta], delta: EngineDelta) -> None:
        self._tasks.pop(rid, None)
        self._sinks.pop(rid, None)
        sink.put_nowait(delta)
        for listener in self._listeners:
            listener(self.stats)
