"""LLMEngine: the request-level loop (validate and add requests, abort, step, outputs).

Used directly by the offline :class:`structspec.LLM` and, in ``serve``, inside the engine
process. Everything here runs on the scheduler's thread. What the engine runs on (model
runner, grammar, drafter, scheduler) is built in one place, :mod:`structspec.engine.build`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from structspec.bad_words import BadWordIds, tokenize_bad_words
from structspec.config import EngineConfig
from structspec.core import (
    CONTEXT_LENGTH_EXCEEDED,
    ChatMessageError,
    ChatMessages,
    ChatTemplateOptions,
    PromptTooLongError,
    RequestError,
    RequestOutput,
    SamplingParams,
    now,
    stop_token_set,
    type_name,
)
from structspec.engine.build import build_engine
from structspec.engine.gc_heap import hold_startup_heap
from structspec.models.tokenizer import IncrementalDetokenizer, check_unicode
from structspec.penalty_params import out_of_vocab
from structspec.prompt_truncation import TRUNCATE_PARAM, kept_prompt_tokens
from structspec.prompt_truncation import keep_last as keep_last_ids
from structspec.scheduler.request import Req

PromptInput = str | list[int] | ChatMessages

__all__ = ["LLMEngine", "PromptInput", "RequestError"]  # RequestError lives in core (light)


class LLMEngine:
    """Validates and queues requests, steps the scheduler, reports outputs.

    Args:
        config: engine configuration, built into the engine's parts by
            :func:`structspec.engine.build.build_engine` ("auto" fields are resolved there).
            With ``load_format="dummy"`` the target (and a ``draft_model`` drafter's model)
            get seeded random weights (seed ``config.seed``) built on the device from
            config.json.

    Attributes:
        config, model_path, max_model_len, model_config, tokenizer, runner, grammar, drafter,
        scheduler: the parts (see :class:`~structspec.engine.build.EngineParts`).

    Raises:
        FileNotFoundError / ValueError: on a bad model path or config, naming what is wrong
            (e.g. a ``max_model_len`` above the model's context length, with both numbers:
            :func:`structspec.config.check_max_model_len`).
    """

    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        self.config = parts.config
        self.model_path = parts.model_path
        self.max_model_len = parts.max_model_len
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner
        self.grammar = parts.grammar
        self.drafter = parts.drafter
        self.scheduler = parts.scheduler
        self._next_id = 0
        #: outputs of requests added with :meth:`add_request` that finished while
        #: :meth:`generate_all` stepped the engine; :meth:`step` returns them first
        self._held_outputs: list[RequestOutput] = []
        #: set by :meth:`close`; a closed engine takes no requests and runs no steps
        self.closed = False
        #: detokenize every request in the engine (text in outputs). A front end that
        #: detokenizes itself sets this False: then only requests with stop strings are.
        self.detokenize = True
        # last: no full garbage collection walks the startup heap again (gc_heap.py); close()
        # releases the hold, or freeing an engine dropped unclosed does
        self._heap_hold = hold_startup_heap(self)

    # ------------------------------------------------------------------ requests

    def _check_token_ids(self, params: SamplingParams) -> None:
        """The checks of a request's token ids that need the model: ``logit_bias`` keys,
        ``allowed_token_ids`` and ``stop_token_ids`` within the vocabulary, and a
        ``min_tokens`` that some allowed token can meet.

        Raises:
            RequestError: naming the field.
        """
        bad_id = out_of_vocab(params.logit_bias, self.model_config.vocab_size)
        if bad_id is not None:
            raise RequestError(f"logit_bias key {bad_id} is not a token id of this model "
                               f"(vocabulary size {self.model_config.vocab_size})", "logit_bias")
        bad_allowed = next((t for t in params.allowed_token_ids or ()
                            if t >= self.model_config.vocab_size), None)
        if bad_allowed is not None:
            raise RequestError(f"allowed_token_ids entry {bad_allowed} is not a token id of "
                               f"this model (vocabulary size {self.model_config.vocab_size})",
                               "allowed_token_ids")
        if params.min_tokens and params.allowed_token_ids is not None:
            stops = stop_token_set(params, self.tokenizer.eos_token_ids)
            if set(params.allowed_token_ids) <= stops:  # min_tokens could never be met
                raise RequestError("min_tokens needs a token that does not stop the output, "
                                   "but allowed_token_ids holds only stop tokens (EOS, "
                                   "stop_token_ids)", "min_tokens")
        bad_stop = next((t for t in params.stop_token_ids
                         if t >= self.model_config.vocab_size), None)
        if bad_stop is not None:
            # never generated, so it would never stop anything: refused like the server does
            raise RequestError(f"stop_token_ids entry {bad_stop} is not a token id of this "
                               f"model (vocabulary size {self.model_config.vocab_size})",
                               "stop_token_ids")

    def _tokenize_bad_words(self, params: SamplingParams) -> BadWordIds | None:
        """The request's ``bad_words`` as token sequences (vLLM's rule,
        :mod:`structspec.bad_words`); None without words.

        Raises:
            RequestError: naming ``bad_words``: a word that is not valid Unicode, tokenizes to
                nothing or to too many tokens.
        """
        if not params.bad_words:
            return None
        try:
            for i, word in enumerate(params.bad_words):
                check_unicode(word, f"bad_words[{i}]")
            return tokenize_bad_words(
                params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                self.model_config.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), "bad_words") from None

    def tokenize_prompt(self, prompt: PromptInput, *, raw: bool = False,
                        chat_options: ChatTemplateOptions | None = None,
                        keep_last: int | None = None) -> list[int]:
        """Token ids for a prompt: chat messages go through the chat template; a string goes
        through it too (as one user message) unless ``raw`` or the model has none.
        ``chat_options`` (None: the defaults) says how the template renders: it applies
        wherever the template does, and token ids and raw strings do not use it.
        ``keep_last``: keep only the prompt's last tokens (``truncate_prompt_tokens``,
        :mod:`structspec.prompt_truncation`; a BOS the tokenizer adds to a raw string stays);
        the prompt is then not refused for its length here, whatever it is before the cut.

        Raises:
            RequestError: empty prompt, malformed chat messages (``param`` names the field,
                e.g. ``messages[1].content``), a chat ``chat_options`` cannot render (naming
                ``continue_final_message``), or chat messages for a model without a chat
                template.
        """
        # A prompt that cannot fit is refused before tokenization (Tokenizer.encode), unless
        # only its tail is kept
        limit = self.max_model_len - 1 if keep_last is None else None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            bad_type = next((i for i, t in enumerate(prompt) if isinstance(t, bool)), None)
            if bad_type is not None:  # True is an int to Python, never token id 1 to us
                raise RequestError(f"prompt[{bad_type}] must be an integer token id, got "
                                   f"bool {prompt[bad_type]!r}", "prompt")
            ids = list(prompt)
        elif isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty", "prompt")
            try:
                check_unicode(prompt, "prompt")  # before a template shifts the index
                if (raw or not self.tokenizer.has_chat_template) and keep_last is not None:
                    ids, _ = self.tokenizer.encode_tail(prompt, keep_last)
                elif raw or not self.tokenizer.has_chat_template:
                    ids = self.tokenizer.encode(prompt, max_tokens=limit)
                else:
                    ids = self.tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}], max_tokens=limit,
                        options=chat_options)
            except PromptTooLongError as e:
                raise self._too_long(e.min_tokens, "prompt", at_least=True) from None
            except ChatMessageError as e:  # an option this one-message chat cannot take
                raise RequestError(str(e), e.param, code=e.code) from None
            except ValueError as e:  # not valid Unicode
                raise RequestError(str(e), "prompt") from None
        elif isinstance(prompt, (list, tuple)) and prompt:
            # Not all token ids: a chat, whose malformed messages render_chat names.
            if not self.tokenizer.has_chat_template:
                raise RequestError("this model has no chat template; send a raw prompt", "messages")
            try:
                ids = self.tokenizer.apply_chat_template(list(prompt), max_tokens=limit,
                                                         options=chat_options)
            except PromptTooLongError as e:
                raise self._too_long(e.min_tokens, "messages", at_least=True) from None
            except ChatMessageError as e:
                raise RequestError(str(e), e.param, code=e.code) from None
            except Exception as e:  # e.g. the template's own complaint, already prefixed
                raise RequestError(str(e), "messages") from e
        else:
            raise RequestError("prompt must be a non-empty string, token id list or chat "
                               f"message list, got {_describe(prompt)}", "prompt")
        if not ids:
            raise RequestError("prompt is empty after tokenization", "prompt")
        # token ids and a chat's template output get no special tokens added: their tail is
        # the cut (a raw string's was cut by encode_tail)
        ids = keep_last_ids(ids, keep_last)
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary", "prompt")
        return ids

    def _too_long(self, num_tokens: int, param: str, *, at_least: bool = False) -> RequestError:
        return RequestError(
            f"prompt has {'at least ' if at_least else ''}{num_tokens} tokens; the context "
            f"holds {self.max_model_len} (prompt + at least one new token must fit)", param,
            code=CONTEXT_LENGTH_EXCEEDED)

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        raw_prompt: bool = False,
        priority: int = 0,
        chat_options: ChatTemplateOptions | None = None,
    ) -> str:
        """Validate and queue one request; returns its id.

        ``chat_options``: how the chat template renders the prompt (see
        :meth:`tokenize_prompt`; None: the defaults).

        ``priority`` (an int, as vLLM's): lower is served first; it orders admission ahead
        of arrival, and the running requests of the highest value (the newest among equals)
        are the first preempted when the KV cache runs out. 0 for every request is FCFS.

        Raises:
            RequestError: naming the field (prompt too long, bad sampling parameter, a
                priority that is not an int, ...).
            RuntimeError: the engine was closed (:meth:`close`).
        """
        self._check_open()
        check_priority(priority)
        try:
            params.validate()
        except ValueError as e:
            raise RequestError(str(e), _param_of(str(e))) from e
        self._check_token_ids(params)
        bad_words = self._tokenize_bad_words(params)
        try:  # vLLM's LLM: -1 keeps max_model_len tokens (no completion length counted)
            keep = kept_prompt_tokens(params.truncate_prompt_tokens, self.max_model_len)
        except ValueError as e:
            raise RequestError(str(e), TRUNCATE_PARAM) from e
        ids = self.tokenize_prompt(prompt, raw=raw_prompt, chat_options=chat_options,
                                   keep_last=keep)
        if len(ids) >= self.max_model_len:
            raise self._too_long(len(ids), "prompt")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        elif request_id in self.scheduler.requests:
            raise RequestError(f"duplicate request_id {request_id!r}", "request_id")
        req = Req(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            arrival_time=now(),
            max_new_tokens=min(params.max_tokens, self.max_model_len - len(ids)),
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_ids=ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
            if self.detokenize or params.stop else None,
            priority=priority,
            bad_words=bad_words,
        )
        try:
            self.scheduler.add(req)
        except RequestError:  # already names its field (or none)
            raise
        except ValueError as e:  # more KV than the cache holds
            raise RequestError(str(e), "max_tokens") from e
        return request_id

    def abort_request(self, request_id: str, reason: str = "aborted by client") -> bool:
        """Cancel a request; its final output (finish_reason abort) comes from the next step."""
        return self.scheduler.abort(request_id, reason)

    @property
    def report_unfinished(self) -> bool:
        """Whether :meth:`step` reports running requests that gained tokens (streaming, the
        default); False: only finished requests (:meth:`generate_all` and the distillation
        loop read nothing else, and skip a snapshot per running request and step)."""
        return self.scheduler.report_unfinished

    @report_unfinished.setter
    def report_unfinished(self, value: bool) -> None:
        self.scheduler.report_unfinished = bool(value)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of requests that progressed or finished
        (finished only, when :attr:`report_unfinished` is off).

        Raises:
            RuntimeError: the engine was closed (:meth:`close`).
        """
        self._check_open()
        held, self._held_outputs = self._held_outputs, []
        return held + self.scheduler.step()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed (close() was called); build a new one")

    def close(self) -> None:
        """Stop the grammar mask worker processes (freeing their shared memory) and the
        grammar compile threads. Idempotent. Afterwards :meth:`add_request` and :meth:`step`
        raise RuntimeError; requests still running are dropped. Without it the workers stop
        when the engine is garbage-collected or the interpreter exits."""
        self.closed = True
        self.scheduler.close()
        self._heap_hold()  # once: a second close() does nothing

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished > 0 or bool(self.scheduler._finished_unreported)
                or bool(self._held_outputs))

    def stats(self) -> dict[str, Any]:
        """Queue sizes, KV usage and prefix-cache counters (for logs and /metrics).

        ``kv_free_pages`` counts the cached pages no request holds (evictable) as free;
        ``prefix_cache_queried_tokens`` / ``prefix_cache_hit_tokens`` are the prompt tokens of
        admitted requests and those whose KV came from the cache, since the engine started,
        and ``prefix_cache_hit_rate`` their ratio (0.0 before any request);
        ``num_preemptions`` counts running requests preempted (the KV cache ran out, or a
        request of a higher priority needed room), ``preemption_recomputed_tokens`` the
        tokens their resumes prefilled again;
        ``num_prefilling`` the requests part-way through a chunked prefill.
        """
        s = self.scheduler
        cache = s.allocator.stats
        preempt = s.preemption.stats
        return {
            "num_running": len(s.running),
            "num_prefilling": len(s.chunks.prefilling),
            "num_waiting": len(s.waiting),
            "num_waiting_grammar": len(s.grammar_queue),
            "kv_free_pages": s.allocator.num_free_pages,
            "kv_total_pages": s.allocator.num_pages - 1,
            "kv_cached_pages": s.allocator.num_cached_pages,
            "prefix_cache_queried_tokens": cache.queried_tokens,
            "prefix_cache_hit_tokens": cache.hit_tokens,
            "prefix_cache_hit_rate": cache.hit_rate,
            "num_preemptions": preempt.preemptions,
            "preemption_recomputed_tokens": preempt.recomputed_tokens,
        }

    def tree_sizes(self) -> tuple[int, ...]:
        """Every verify tree size ``N`` this engine's steps can use, ascending: with adaptive
        tree sizing (``auto`` / ``on``) the sizer's choices (``1`` and powers of two below the
        drafter's ``N``, then ``N``), else the drafter's ``N`` alone (``1`` without one)."""
        sizer = self.scheduler.sizer
        if sizer is None or sizer.mode == "off":
            return (self.drafter.num_nodes,)
        return tuple(sizer.sizes)

    def warmup_cuda_graphs(self, batch_sizes: Sequence[int] | None = None,
                           kv_lens: Sequence[int] | None = None) -> int:
        """Capture, before any timing or traffic, every CUDA graph the given buckets can
        replay: the target's verify graphs for each of :meth:`tree_sizes` (with their post
        graphs, penalised ones included) and the drafter's propose graphs. Graphs are
        otherwise captured lazily at first use, and a capture (an eager warm-up forward plus
        the capture, tens of ms) lands inside the step that needed it: a stall for the
        running streams, and an outlier in a benchmark window. No-op off CUDA or with
        ``cuda_graph`` off.

        Args:
            batch_sizes: batch sizes whose buckets to capture (default: every bucket).
            kv_lens: KV lengths whose buckets to capture (default: every bucket).

        Returns:
            The number of graphs captured by this call (target forwards plus propose graphs).

        Raises:
            RuntimeError: the engine was closed.
            ValueError: naming the argument: ``batch_sizes`` / ``kv_lens`` that is not a
                list or tuple (a bare int, a string, a mapping...) or holds an item that is
                not a positive int.
        """
        self._check_open()
        batch_sizes = _bucket_values("batch_sizes", batch_sizes)
        kv_lens = _bucket_values("kv_lens", kv_lens)
        table = self.scheduler.penalties.table
        count = 0
        for n in self.tree_sizes():
            count += self.runner.warmup_cuda_graphs(n, batch_sizes=batch_sizes, kv_lens=kv_lens,
                                                    penalty_table=table)
        return count + self.drafter.warmup_cuda_graphs(batch_sizes=batch_sizes, kv_lens=kv_lens)

    def step_stats(self, reset: bool = False) -> dict[str, float]:
        """Mean verify-step timings since start or the last reset (ms; see
        :meth:`structspec.scheduler.step_stats.StepTimer.summary`): wall time, host time per
        phase, and on CUDA the GPU busy time, idle gap before each step and grammar stall."""
        out = self.scheduler.timer.summary()
        if reset:
            self.scheduler.timer.reset()
        return out

    def generate_all(
        self, prompts: Sequence[PromptInput], params: Sequence[SamplingParams], *,
        raw_prompt: bool = False, progress: Any = None,
        priorities: Sequence[int] | None = None,
        chat_options: ChatTemplateOptions | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; bad requests come back as ``abort`` outputs with an
        error instead of raising, so one bad request never stops the others.
        ``priorities``: one per prompt (None: 0 for all; see :meth:`add_request`);
        ``chat_options``: how the chat template renders every prompt it renders (None: the
        defaults; see :meth:`tokenize_prompt`).

        Requests added earlier with :meth:`add_request` keep running beside these; it returns
        once its own are done, and the final outputs of the others that finished meanwhile
        are kept for the next :meth:`step` (their streamed deltas are folded into them)."""
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        base = self._next_id
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            rid = f"gen-{base}-{i}"
            order.append(rid)
            try:
                self.add_request(p, sp, request_id=rid, raw_prompt=raw_prompt,
                                 priority=0 if priorities is None else priorities[i],
                                 chat_options=chat_options)
            except RequestError as e:
                results[rid] = RequestOutput.error_output(rid, str(e), e.param, e.code)
                if progress is not None:
                    progress.update(1)
        self._next_id += 1
        report = self.report_unfinished
        self.report_unfinished = False  # only final outputs are read here
        mine = set(order)
        held: list[RequestOutput] = []
        try:
            sched = self.scheduler  # not has_unfinished_requests(): held outputs are no work
            while len(results) < len(order) and (sched.num_unfinished > 0
                                                 or sched._finished_unreported):
                for out in self.step():
                    if out.request_id not in mine:
                        held.append(out)  # an add_request caller's: never dropped
                    elif out.finished:
                        results[out.request_id] = out
                        if progress is not None:
                            progress.update(1)
        finally:
            self.report_unfinished = report
            self._held_outputs = held + self._held_outputs
        return [results[r] for r in order]


def _bucket_values(name: str, values: object) -> tuple[int, ...] | None:
    """``values`` (a :meth:`LLMEngine.warmup_cuda_graphs` argument) as a tuple of positive
    ints, or None for None. Checked before anything is captured: a bare ``0`` or ``""`` is
    falsy and was taken for the default (every bucket) on CPU, while on CUDA the runner
    failed on it mid-capture without naming it; a generator was consumed by the check and
    then captured nothing. Any other non-string, non-mapping iterable is materialised once.

    Raises:
        ValueError: naming ``name``: not an iterable of items, or an item that is not a
            positive int (bools refused).
    """
    if values is None:
        return None
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list or tuple of positive ints (or None), got "
                         f"{type_name(values)} {values!r}")
    out = tuple(values)
    bad = [v for v in out if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ValueError(f"{name} must hold positive ints, got {bad[0]!r}")
    return out


def check_priority(priority: object) -> None:
    """Refuse a request ``priority`` that is not an int (bool included), naming the field.

    Raises:
        RequestError: with param ``priority``.
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError(f"priority must be an integer (lower is served first), got "
                           f"{type_name(priority)} {priority!r}", "priority")


def _describe(prompt: object) -> str:
    """What a refused prompt was, for its error: an empty list, or the type's name."""
    if isinstance(prompt, (list, tuple)) and not prompt:
        return f"an empty {type(prompt).__name__}"
    return type_name(prompt)


def _param_of(message: str) -> str | None:
    """The SamplingParams field a validation message starts with (they all do; a nested
    one, ``repetition_stop.min_tokens`` or ``logit_bias[5]``, names its field)."""
    head = re.split(r"[ .\[]", message, maxsplit=1)[0]
    return head if head.isidentifier() else None

