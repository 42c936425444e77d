"""The offline Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from structspec.chat_template import load_chat_template
from structspec.config import (
    CacheConfig,
    EngineConfig,
    GrammarConfig,
    SchedulerConfig,
    SpecAlgorithmName,
    SpecConfig,
)
from structspec.core import (
    ChatMessages,
    ChatTemplateOptions,
    RequestOutput,
    SamplingParams,
    check_chat_messages,
    type_name,
)
from structspec.engine.llm_engine import LLMEngine, PromptInput


class LLM:
    """An engine for offline batch generation.

    Args:
        model: local HF checkpoint directory or ``.gguf`` file; None = SmolLM2-135M-Instruct.
        speculative_algorithm: ``none``, ``ngram``, ``draft_model`` or ``eagle`` (the
            drafter registry's names); None means ``none``.
        draft_model: checkpoint of the draft model / EAGLE head (those algorithms only).
        num_draft_tokens: verify-tree size N including node 0.
        speculative_adaptive: ``auto`` (default), ``on`` or ``off``: size each request's tree
            from its recent acceptance and the verify cost measured on this device, down to
            a plain decode (``SpecConfig.adaptive``; ``auto``: where a full tree's rows cost
            1.25x a decode or more, unless below 2.5x full trees already pay at the engine's
            average acceptance).
        speculative_draft_vocab: ``eagle``: ``auto`` (default) drafts over the head's draft
            vocabulary when it ships one (:mod:`structspec.speculative.draft_vocab`), ``full``
            over the whole vocabulary (``SpecConfig.draft_vocab``).
        device / dtype: "auto" picks cuda+bfloat16 when available, else cpu+float32.
        max_batch_size, kv_capacity_tokens, page_size, max_model_len, seed,
        grammar_compile_timeout_s, overlap, cuda_graph, speculative_depth, speculative_topk,
        min_prefill_batch: see :mod:`structspec.config` (``min_prefill_batch``: under a
        backlog a prefill step waits until it can admit that many requests; None = auto,
        ``max(1, max_batch_size // 8)``).
        grammar_workers: worker processes that build the grammar bitmasks of the draft trees
            (``GrammarConfig.mask_build_workers``; 0 = in the engine's process; None = auto:
            ``min(8, cores // 2)`` on CUDA, 0 on CPU, see
            :func:`structspec.config.default_grammar_workers`). They serve batches with at
            least as many constrained requests as workers.
        grammar_backend: ``xgrammar`` (default), ``llguidance`` or ``auto`` (per grammar:
            xgrammar when its strict check passes and it compiles in time, else llguidance when
            it compiles the grammar exactly; ``GrammarConfig.backend``). Each result reports
            the backend that served it (``RequestOutput.grammar_backend``).
        kernels: ``auto`` (fused Triton kernels on CUDA when triton imports, else torch),
            ``triton`` (required; ValueError without CUDA + triton) or ``torch`` (reference).
        batch_invariant: batch-invariant Triton kernels for the target model (needs
            ``kernels`` to resolve to ``triton``, else ValueError): a token's logits no longer
            depend on how many rows shared its forward, so with greedy decoding speculation
            on gives bitwise the output of speculation off (and of other batch sizes).
            Slower; see ``EngineConfig.batch_invariant``.
        load_format: ``auto`` reads the checkpoint's weights; ``dummy`` builds seeded random
            weights (``seed``) on the device from ``config.json`` alone, for the target and a
            ``draft_model`` draft model (benchmarks of large shapes without their weights).
        quantization: weight-only quantization of the target's linears on CPU
            (``EngineConfig.quantization``): ``none`` (float32 weights), ``int8``
            (per-output-channel scales), ``int4`` (groups of 32 input channels) or ``auto``
            (:data:`structspec.config.AUTO_CPU_QUANTIZATION` on CPU when ``dtype`` is
            ``auto``; ``none`` with an explicit ``dtype`` and on CUDA). int8/int4 on CUDA, or
            with a dtype other than float32, raise ValueError naming ``quantization``.
        enable_prefix_caching: reuse the KV of full prompt pages that earlier requests
            computed (``CacheConfig.enable_prefix_caching``, default on; the CLI's
            ``--no-prefix-cache`` turns it off). Each result reports its reused prompt tokens
            (``RequestOutput.cached_tokens``). With the ``eagle`` drafter the target's
            features of each prompt position are kept beside its KV (the head reads them).
        enable_chunked_prefill: prefill long prompts in chunks between the verify steps of
            the requests already decoding, so that a long prompt does not freeze their
            streams (``SchedulerConfig.enable_chunked_prefill``, default on; the CLI's
            ``--no-chunked-prefill`` turns it off: whole prompts, one prefill step each).
        max_num_batched_tokens: with chunking, the query rows one prefill step computes
            (requests x their longest chunk); None = auto, 512 on CUDA and 128 on CPU
            (:data:`structspec.config.DEFAULT_MAX_NUM_BATCHED_TOKENS`). ValueError naming
            ``max_num_batched_tokens`` below 1 or not an integer.
        chat_template: a Jinja chat template used instead of the model's own (vLLM's
            ``--chat-template``): the path of a template file, or the template text (with a
            ``{{ ... }}`` or ``{% ... %}`` tag); ValueError naming ``chat_template`` when it
            is neither or does not parse.

    Raises:
        FileNotFoundError / ValueError: bad model path or option, with the reason.

    Example::

        llm = LLM()
        out = llm.generate("Give me a JSON person", SamplingParams(
            max_tokens=64, grammar=JsonSchemaConstraint({"type": "object"})))[0]
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        speculative_algorithm: SpecAlgorithmName | None = "none",
        draft_model: str | None = None,
        num_draft_tokens: int = 8,
        speculative_depth: int = 4,
        speculative_topk: int = 2,
        speculative_adaptive: str = "auto",
        speculative_draft_vocab: str = "auto",
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 64,
        kv_capacity_tokens: int | None = None,
        page_size: int = 16,
        max_model_len: int | None = None,
        seed: int = 0,
        grammar_compile_timeout_s: float = 30.0,
        overlap: bool = True,
        cuda_graph: bool = True,
        kernels: str = "auto",
        batch_invariant: bool = False,
        load_format: str = "auto",
        grammar_workers: int | None = None,
        grammar_backend: str = "xgrammar",
        min_prefill_batch: int | None = None,
        chat_template: str | None = None,
        quantization: str = "auto",
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        config = EngineConfig(
            model=model,
            chat_template=(None if chat_template is None
                           else load_chat_template(chat_template, "chat_template")),
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            cuda_graph=cuda_graph,
            kernels=kernels,
            batch_invariant=batch_invariant,
            load_format=load_format,
            quantization=quantization,
            cache=CacheConfig(page_size=page_size, kv_capacity_tokens=kv_capacity_tokens,
                              enable_prefix_caching=enable_prefix_caching),
            # None: no drafter, as vLLM's speculative_config=None reads
            spec=SpecConfig(algorithm="none" if speculative_algorithm is None
                            else speculative_algorithm, num_draft_tokens=num_draft_tokens,
                            depth=speculative_depth, topk=speculative_topk,
                            draft_model=draft_model, adaptive=speculative_adaptive,
                            draft_vocab=speculative_draft_vocab),
            grammar=GrammarConfig(compile_timeout_s=grammar_compile_timeout_s,
                                  mask_build_workers=grammar_workers,
                                  backend=grammar_backend),
            scheduler=SchedulerConfig(max_batch_size=max_batch_size, overlap=overlap,
                                      min_prefill_batch=min_prefill_batch,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      max_num_batched_tokens=max_num_batched_tokens),
        )
        self.engine = LLMEngine(config)
        # The engine steps on one thread: two generate() calls stepping it at once each took
        # the other's finished outputs and failed with KeyError('gen-5-0'), and interleaved
        # scheduler steps. Concurrent calls therefore run one after the other.
        self._generate_lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        raw_prompt: bool = False,
        use_tqdm: bool = False,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts (strings, token-id lists or chats).

        A string is sent as one user message through the chat template unless ``raw_prompt``.
        ``priority`` (vLLM's): one int for every prompt or one per prompt; lower is served
        first (admission order, and the last preempted when the KV cache runs out); None
        is 0 for all (first come, first served).
        A request with bad input comes back finished with ``finish_reason == "abort"`` and
        ``error`` set; the other requests run normally. Calls from several threads are safe:
        they run one after the other, each returning its own prompts' outputs.

        Returns:
            One :class:`RequestOutput` per prompt, in order.

        Raises:
            TypeError: ``prompts`` is not a string, a list of token ids, a chat or a
                list/tuple of those (``generate(5)``), ``sampling_params`` is not a
                :class:`SamplingParams` or a list/tuple of them, or ``priority`` is not an
                int or a list/tuple of ints; naming the argument.
            ValueError: a list of ``sampling_params`` or ``priority`` whose length is not
                the number of prompts.
        """
        return self._generate(_as_prompt_list(prompts), sampling_params,
                              raw_prompt=raw_prompt, use_tqdm=use_tqdm, priority=priority)

    def chat(
        self, messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_tqdm: bool = False,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Like :meth:`generate` for chat conversations: one conversation (a list of
        ``{role, content}`` messages) or a list of conversations. A conversation with a
        malformed message comes back as an ``abort`` output whose error names the field
        (``messages[1].content: ...``; see :func:`structspec.core.check_chat_messages`).

        The chat template options are vLLM's ``LLM.chat`` ones and apply to every
        conversation (:class:`structspec.core.ChatTemplateOptions`).

        Args:
            add_generation_prompt: end the prompt with the assistant header (the default);
                False: it ends after the last message.
            continue_final_message: leave the final message open so that the model
                continues it (each output is only the continuation); needs
                ``add_generation_prompt=False``, and a conversation whose final message is
                not the assistant's comes back as an ``abort`` output whose ``error_param``
                is ``continue_final_message``.
            chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking":
                False}``): string keys, JSON values, none of the template's own arguments
                (:data:`structspec.core.RESERVED_CHAT_TEMPLATE_KWARGS`).
            use_tqdm, priority: as in :meth:`generate`.

        Raises:
            ChatMessageError: ``messages`` is not a list, or is empty; or a bad option
                (both flags true, a flag that is not a bool, a reserved or non-string key or
                a non-JSON value of ``chat_template_kwargs``), naming it (a ValueError).
        """
        options = ChatTemplateOptions(add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      chat_template_kwargs=chat_template_kwargs)
        return self._generate(_as_chat_list(messages), sampling_params, chat_options=options,
                              use_tqdm=use_tqdm, priority=priority)

    def _generate(
        self, batch: list[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, *,
        raw_prompt: bool = False, use_tqdm: bool = False,
        priority: int | Sequence[int] | None = None,
        chat_options: ChatTemplateOptions | None = None,
    ) -> list[RequestOutput]:
        """:meth:`generate` of a list of prompts (``chat_options``: how the chat template
        renders them, None for the defaults)."""
        params = _as_params_list(sampling_params, len(batch))
        priorities = _as_priority_list(priority, len(batch))
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(batch), desc="generate", unit="req")
        try:
            with self._generate_lock:
                return self.engine.generate_all(batch, params, raw_prompt=raw_prompt,
                                                progress=progress, priorities=priorities,
                                                chat_options=chat_options)
        finally:
            if progress is not None:
                progress.close()

    def close(self) -> None:
        """Stop the engine's worker processes and threads (:meth:`LLMEngine.close`)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def replace_config(self, **changes: Any) -> EngineConfig:
        """The engine config with ``changes`` applied (for building a sibling engine)."""
        return dataclasses.replace(self.engine.config, **changes)


_PROMPTS_ACCEPTED = ("a string, a list of token ids, a chat (a list of {role, content} "
                     "dicts) or a list/tuple of those")


def _as_prompt_list(prompts: Any) -> list[PromptInput]:
    """``LLM.generate``'s ``prompts`` as a list of prompts; each is checked by the engine (a
    bad one fails alone, naming ``prompt``).

    Raises:
        TypeError: ``prompts`` is of another type (an int, a dict, bytes, None...): it used to
            fail deep inside as ``'int' object is not iterable``, or (a dict) to run its keys.
    """
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        got = "None" if prompts is None else f"{type_name(prompts)} {_short_repr(prompts)}"
        raise TypeError(f"prompts must be {_PROMPTS_ACCEPTED}, got {got}")
    if prompts and all(isinstance(t, int) for t in prompts):
        # one token-id prompt (a bool among them is refused by the engine, naming `prompt`)
        return [list(prompts)]
    if prompts and any(isinstance(m, dict) for m in prompts):
        # One chat: a dict is never a prompt of its own, so a chat with a bad element (a
        # string among the messages) is refused as a chat, naming that element.
        return [list(prompts)]
    return list(prompts)


def _as_params_list(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    """``LLM.generate``'s ``sampling_params`` as one :class:`SamplingParams` per prompt
    (None: the defaults for every prompt).

    Raises:
        TypeError: not a :class:`SamplingParams` nor a list/tuple of them, naming
            ``sampling_params`` (or ``sampling_params[i]``).
        ValueError: a list whose length is not ``num_prompts``.
    """
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams, a list/tuple of them or "
                        f"None, got {type_name(sampling_params)} "
                        f"{_short_repr(sampling_params)}")
    for i, p in enumerate(sampling_params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got "
                            f"{type_name(p)} {_short_repr(p)}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} sampling_params for {num_prompts} "
                         "prompts")
    return list(sampling_params)


def _as_priority_list(priority: Any, num_prompts: int) -> list[int] | None:
    """``LLM.generate``'s ``priority`` as one int per prompt (None: all 0).

    Raises:
        TypeError: not an int nor a list/tuple of ints (a bool is not a priority), naming
            ``priority`` (or ``priority[i]``).
        ValueError: a list whose length is not ``num_prompts``.
    """
    if priority is None:
        return None
    if isinstance(priority, int) and not isinstance(priority, bool):
        return [priority] * num_prompts
    if not isinstance(priority, (list, tuple)):
        raise TypeError(f"priority must be an int or a list/tuple of ints (lower is served "
                        f"first), got {type_name(priority)} {_short_repr(priority)}")
    for i, p in enumerate(priority):
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(f"priority[{i}] must be an int, got {type_name(p)} "
                            f"{_short_repr(p)}")
    if len(priority) != num_prompts:
        raise ValueError(f"got {len(priority)} priorities for {num_prompts} prompts")
    return list(priority)


def _short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (an error must not echo a huge value)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _as_chat_list(messages: Any) -> list[PromptInput]:
    """``LLM.chat``'s argument as a list of conversations: a list whose items are all lists
    is several, any other list is one (checked per message by the engine).

    Raises:
        ChatMessageError: ``messages`` is not a list or tuple, or is empty.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        check_chat_messages(messages)  # raises, naming `messages`
    if all(isinstance(c, (list, tuple)) for c in messages):
        return [list(c) for c in messages]
    return [list(messages)]
