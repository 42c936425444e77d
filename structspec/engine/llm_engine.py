"""LLMEngine: turns prompts into requests and steps the scheduler.

Used directly by the offline :class:`structspec.LLM` and, in ``serve``, inside the engine
process. Everything here runs on the scheduler's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from structspec.config import EngineConfig, check_max_model_len, resolve_engine_config
from structspec.core import (
    ChatMessageError,
    ChatMessages,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
    now,
    type_name,
)
from structspec.grammar.backend import GrammarBackend
from structspec.models.default_model import resolve_model_path
from structspec.models.loader import load_model, load_model_config
from structspec.models.tokenizer import IncrementalDetokenizer, Tokenizer, check_unicode
from structspec.runner.model_runner import ModelRunner
from structspec.scheduler.request import Req
from structspec.scheduler.scheduler import Scheduler
from structspec.speculative.registry import create_drafter

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | ChatMessages


class RequestError(ValueError):
    """A request was rejected before it ran; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class LLMEngine:
    """Loads the model, tokenizer, grammar backend and drafter; runs the scheduler.

    Args:
        config: engine configuration ("auto" fields are resolved here). With
            ``load_format="dummy"`` the target (and a ``draft_model`` drafter's model) get
            seeded random weights (seed ``config.seed``) built on the device from config.json.

    Raises:
        FileNotFoundError / ValueError: on a bad model path or config, naming what is wrong
            (e.g. a ``max_model_len`` above the model's context length, with both numbers:
            :func:`structspec.config.check_max_model_len`).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = resolve_engine_config(config)
        if config.torch_device.type == "cpu":
            # Activations of these models underflow into float32 denormals, which x86 cores
            # process ~20x slower (measured: a 120-token SmolLM2 forward takes 3.1 s with
            # denormals, 0.15 s flushed). Flushing them to zero changes logits by < 1e-30.
            # NOTE: the flag is per thread and threads inherit it when created, so it is set
            # before the first torch op spawns the OpenMP pool.
            torch.set_flush_denormal(True)
        self.model_path = resolve_model_path(config.model)
        # From config.json alone: a context the model does not have fails before the weights
        # load.
        self.max_model_len = check_max_model_len(
            config.max_model_len, load_model_config(self.model_path).max_position_embeddings)
        device, dtype = config.torch_device, config.torch_dtype
        torch.manual_seed(config.seed)
        model, model_config = load_model(self.model_path, device=device, dtype=dtype,
                                         load_format=config.load_format, seed=config.seed)
        self.model_config = model_config
        self.tokenizer = Tokenizer(self.model_path)
        self.runner = ModelRunner(model, model_config, config.cache, device=device, dtype=dtype,
                                  use_cuda_graph=config.cuda_graph,
                                  max_model_len=self.max_model_len + config.spec.tree_size,
                                  kernels=config.kernels,
                                  batch_invariant=config.batch_invariant)
        # One request must fit in the KV cache with its draft tree (Scheduler.add): a longer
        # context could only be refused per request, so advertise what fits (like sglang).
        kv_limit = ((self.runner.kv_pool.num_pages - 1) * self.runner.page_size
                    - config.spec.tree_size)
        if kv_limit < 1:
            raise ValueError(f"kv_capacity_tokens is too small for one request with a "
                             f"{config.spec.tree_size}-node draft tree")
        if kv_limit < self.max_model_len:
            logger.warning("max_model_len %d lowered to %d: the KV cache (%d tokens) must hold "
                           "one whole request and its draft tree; raise kv_capacity_tokens "
                           "for more", self.max_model_len, kv_limit,
                           (self.runner.kv_pool.num_pages - 1) * self.runner.page_size)
            self.max_model_len = kv_limit
        self.grammar = GrammarBackend(
            self.tokenizer.hf,
            vocab_size=model_config.vocab_size,
            stop_token_ids=list(self.tokenizer.eos_token_ids),
            config=config.grammar,
        )
        self.drafter = create_drafter(config.spec, target=self.runner, device=device, dtype=dtype,
                                      max_batch_size=config.scheduler.max_batch_size,
                                      load_format=config.load_format, seed=config.seed)
        self.scheduler = Scheduler(config, self.runner, self.grammar, self.drafter)
        if config.grammar.mask_build_workers > 0:
            from structspec.grammar.worker_pool import MaskWorkerPool

            self.scheduler.mask_pool = MaskWorkerPool(
                self.grammar.tokenizer_info, num_workers=config.grammar.mask_build_workers,
                vocab_size=model_config.vocab_size,
                max_rows=config.scheduler.max_batch_size * self.drafter.num_nodes,
                stop_token_ids=list(self.tokenizer.eos_token_ids),
                pin=device.type == "cuda")
        self._next_id = 0
        #: set by :meth:`close`; a closed engine takes no requests and runs no steps
        self.closed = False
        #: detokenize every request in the engine (text in outputs). A front end that
        #: detokenizes itself sets this False: then only requests with stop strings are.
        self.detokenize = True

    # ------------------------------------------------------------------ requests

    def tokenize_prompt(self, prompt: PromptInput, *, raw: bool = False) -> list[int]:
        """Token ids for a prompt: chat messages go through the chat template; a string goes
        through it too (as one user message) unless ``raw`` or the model has none.

        Raises:
            RequestError: empty prompt, malformed chat messages (``param`` names the field,
                e.g. ``messages[1].content``), or chat messages for a model without a chat
                template.
        """
        # A prompt that cannot fit is refused before tokenization (Tokenizer.encode).
        limit = self.max_model_len - 1
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty", "prompt")
            try:
                check_unicode(prompt, "prompt")  # before a template shifts the index
                if raw or not self.tokenizer.has_chat_template:
                    ids = self.tokenizer.encode(prompt, max_tokens=limit)
                else:
                    ids = self.tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}], max_tokens=limit)
            except PromptTooLongError as e:
                raise self._too_long(e.min_tokens, "prompt", at_least=True) from None
            except ValueError as e:  # not valid Unicode
                raise RequestError(str(e), "prompt") from None
        elif isinstance(prompt, (list, tuple)) and prompt:
            # Not all token ids: a chat, whose malformed messages render_chat names.
            if not self.tokenizer.has_chat_template:
                raise RequestError("this model has no chat template; send a raw prompt", "messages")
            try:
                ids = self.tokenizer.apply_chat_template(list(prompt), max_tokens=limit)
            except PromptTooLongError as e:
                raise self._too_long(e.min_tokens, "messages", at_least=True) from None
            except ChatMessageError as e:
                raise RequestError(str(e), e.param) from None
            except Exception as e:  # e.g. the template's own complaint, already prefixed
                raise RequestError(str(e), "messages") from e
        else:
            raise RequestError("prompt must be a non-empty string, token id list or chat "
                               f"message list, got {_describe(prompt)}", "prompt")
        if not ids:
            raise RequestError("prompt is empty after tokenization", "prompt")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary", "prompt")
        return ids

    def _too_long(self, num_tokens: int, param: str, *, at_least: bool = False) -> RequestError:
        return RequestError(
            f"prompt has {'at least ' if at_least else ''}{num_tokens} tokens; the context "
            f"holds {self.max_model_len} (prompt + at least one new token must fit)", param)

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        raw_prompt: bool = False,
    ) -> str:
        """Validate and queue one request; returns its id.

        Raises:
            RequestError: naming the field (prompt too long, bad sampling parameter, ...).
            RuntimeError: the engine was closed (:meth:`close`).
        """
        self._check_open()
        try:
            params.validate()
        except ValueError as e:
            raise RequestError(str(e), _param_of(str(e))) from e
        ids = self.tokenize_prompt(prompt, raw=raw_prompt)
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
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids=ids)
            if self.detokenize or params.stop else None,
        )
        try:
            self.scheduler.add(req)
        except ValueError as e:  # more KV than the cache holds
            raise RequestError(str(e), "max_tokens") from e
        return request_id

    def abort_request(self, request_id: str, reason: str = "aborted by client") -> bool:
        """Cancel a request; its final output (finish_reason abort) comes from the next step."""
        return self.scheduler.abort(request_id, reason)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of requests that progressed or finished.

        Raises:
            RuntimeError: the engine was closed (:meth:`close`).
        """
        self._check_open()
        return self.scheduler.step()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed (close() was called); build a new one")

    def close(self) -> None:
        """Stop the grammar mask worker processes (freeing their shared memory) and the
        grammar compile threads. Idempotent. Afterwards :meth:`add_request` and :meth:`step`
        raise RuntimeError; requests still running are dropped. Without it the workers stop
        when the engine is garbage-collected or the interpreter exits."""
        self.closed = True
        pool, self.scheduler.mask_pool = self.scheduler.mask_pool, None
        if pool is not None:
            pool.close()
        self.grammar.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.scheduler._finished_unreported)

    def stats(self) -> dict[str, Any]:
        """Queue sizes and KV usage (for logs and /metrics)."""
        s = self.scheduler
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_waiting_grammar": len(s.grammar_queue),
            "kv_free_pages": s.allocator.num_free_pages,
            "kv_total_pages": s.allocator.num_pages - 1,
        }

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
    ) -> list[RequestOutput]:
        """Run prompts to completion; bad requests come back as ``abort`` outputs with an
        error instead of raising, so one bad request never stops the others."""
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        base = self._next_id
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            rid = f"gen-{base}-{i}"
            order.append(rid)
            try:
                self.add_request(p, sp, request_id=rid, raw_prompt=raw_prompt)
            except RequestError as e:
                results[rid] = RequestOutput.error_output(rid, str(e), e.param)
                if progress is not None:
                    progress.update(1)
        self._next_id += 1
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        return [results[r] for r in order]


def _describe(prompt: object) -> str:
    """What a refused prompt was, for its error: an empty list, or the type's name."""
    if isinstance(prompt, (list, tuple)) and not prompt:
        return f"an empty {type(prompt).__name__}"
    return type_name(prompt)


def _param_of(message: str) -> str | None:
    """The SamplingParams field a validation message starts with (they all do)."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None

