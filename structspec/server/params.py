"""Request fields -> :class:`~structspec.core.SamplingParams` (one per choice).

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, ``n`` 1. ``max_tokens`` (or chat's
``max_completion_tokens``) left out means "until the context is full", capped at
:data:`DEFAULT_MAX_TOKENS` because the scheduler reserves KV for ``max_tokens`` up front.
An explicit ``max_tokens`` with ``prompt + max_tokens > max_model_len`` is a 400 (as vLLM
answers), not clamped: the reservation is made for what was asked.
With ``n > 1`` choice ``i`` gets seed ``seed + i`` (when a seed is given; wrapped into the one
seed range, 0 to 2**63 - 1, :data:`structspec.core.SEED_MAX`, by
:func:`structspec.core.choice_seed`).

Penalties (:mod:`structspec.penalty_params`): ``presence_penalty`` / ``frequency_penalty``
(OpenAI: ``[-2, 2]``, output tokens), ``repetition_penalty`` (vLLM: ``[0.01, 100]``, prompt
and output tokens), ``logit_bias`` (``{"token_id": bias in [-100, 100]}``, at most 300
entries, ids below the vocabulary size) and structspec's ``repetition_stop`` (``true`` or
``{min_tokens, max_period, min_repeats}``: a looping output ends with ``finish_reason``
``length`` and ``stop_reason`` ``"repetition"``). A bad value (NaN, out of range, a key that
is not a token id) is a 400 naming the field.

Text: vLLM's ``include_stop_str_in_output`` (default false) keeps the stop string that
ended a choice (and the text of a stop token) in its text; ``skip_special_tokens`` (default
true) false keeps special tokens in it, and ``spaces_between_special_tokens`` (default true)
false then drops what the tokenizer's decoder puts between two added tokens of the output
(vLLM's rule; ``null`` is the default for each). Anything but a JSON boolean is a 400 naming
the field.

Prompt: vLLM's ``truncate_prompt_tokens`` keeps the last N tokens of the tokenized prompt
(:func:`prompt_keep`, :mod:`structspec.prompt_truncation`); the endpoints cut the prompt
before anything counts it, so the context checks, ``usage.prompt_tokens`` and ``echo`` see the
kept prompt, and the engine gets it already cut.

Log-probabilities (``logprobs`` / ``top_logprobs``) are the target model's log-softmax over
the vocabulary *after* ``logit_bias``, the penalties and the grammar mask and *before*
temperature and top-k/top-p/min-p, so with a grammar every token outside it has
log-probability -inf and is never listed. vLLM's ``prompt_logprobs`` (``[0, 20]``) are those
of the raw model distribution (no penalty or grammar applies to a prompt): the same as
``logprobs`` for a request without penalties or grammar.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from structspec.constraints import GrammarConstraint
from structspec.core import CONTEXT_LENGTH_EXCEEDED, SamplingParams, choice_seed, seed_error
from structspec.penalty_params import (
    RepetitionStop,
    logit_bias_from_json,
    out_of_vocab,
    repetition_stop_from_json,
)
from structspec.prompt_truncation import TRUNCATE_PARAM, kept_prompt_tokens
from structspec.server.errors import bad_request
from structspec.server.field_policy import check_unsupported
from structspec.server.protocol import ChatCompletionRequest, SamplingRequest

DEFAULT_MAX_TOKENS = 2048
MAX_N = 64
MAX_TOP_LOGPROBS = 20


def build_sampling_params(
    req: SamplingRequest,
    *,
    grammar: GrammarConstraint | None,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_len: int,
    max_model_len: int,
    max_tokens_param: str = "max_tokens",
    logprobs_param: str = "logprobs",
    vocab_size: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Sampling parameters of choice 0 (see :func:`per_choice` for the others).

    Args:
        max_tokens_param: the request field ``max_tokens`` came from (chat's
            ``max_completion_tokens`` when that was sent), named in its errors.
        logprobs_param: the request field the number of top log-probs came from (chat's
            ``top_logprobs``; completions' ``logprobs``), named in its errors.
        vocab_size: the served model's vocabulary size: ``logit_bias`` keys at or above it
            are refused (None: not checked here; the engine refuses them).
        prompt_logprobs: the top-k the engine scores each prompt position with (the
            request's ``prompt_logprobs``, or more for a completions ``echo`` with
            ``logprobs``); the request's own value is checked here, naming the field.

    Raises:
        APIError: 400 naming the bad or unsupported field; ``context_length_exceeded``
            when ``prompt_len + max_tokens`` does not fit in ``max_model_len``.
    """
    check_unsupported(req)  # also checked by the endpoints first; here for direct callers
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    if req.seed is not None and (why := seed_error(req.seed)) is not None:
        raise bad_request(why, "seed")
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, max_model_len - prompt_len))
    elif max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}",
                          max_tokens_param)
    else:
        check_context_length(prompt_len, max_tokens, max_model_len, max_tokens_param,
                             "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{logprobs_param} must be between 0 and {MAX_TOP_LOGPROBS}, got "
                          f"{logprobs}", logprobs_param)
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                          f"{req.prompt_logprobs}", "prompt_logprobs")
    stop: tuple[str, ...] = ()
    if isinstance(req.stop, str):
        stop = (req.stop,) if req.stop else ()
    elif req.stop:
        stop = tuple(req.stop)
    top_k = req.top_k if req.top_k is not None else 0
    if top_k == -1:  # vLLM's "disabled"
        top_k = 0
    logit_bias, repetition_stop = _penalty_extras(req, vocab_size)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=top_k,
        min_p=0.0 if req.min_p is None else float(req.min_p),
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
        spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
        grammar=grammar,
        logprobs=logprobs,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias,
        repetition_stop=repetition_stop,
        min_tokens=0 if req.min_tokens is None else req.min_tokens,
        allowed_token_ids=(None if req.allowed_token_ids is None
                           else tuple(req.allowed_token_ids)),
        prompt_logprobs=prompt_logprobs,
        bad_words=tuple(req.bad_words) if req.bad_words else None,
    )
    try:
        params.validate()
    except ValueError as e:
        # The message starts with the SamplingParams field (``logit_bias[5]``,
        # ``repetition_stop.min_tokens``: the field is the name before the bracket or dot);
        # name the request field it came from (chat's max_completion_tokens / top_logprobs
        # are stored as max_tokens / logprobs).
        field = re.split(r"[ .\[]", str(e), maxsplit=1)[0]
        field = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(field, field)
        raise bad_request(str(e), field if field.isidentifier() else None) from None
    return params


def prompt_keep(req: SamplingRequest, max_model_len: int, max_tokens: int | None
                ) -> int | None:
    """How many prompt tokens the request keeps (its ``truncate_prompt_tokens``; None: all),
    checked before the prompt is tokenized.

    Args:
        max_tokens: the completion length the request gave (chat's ``max_completion_tokens``
            when sent), None when it gave none: ``-1`` keeps ``max_model_len - max_tokens``
            tokens, as vLLM's server does.

    Raises:
        APIError: 400 naming ``truncate_prompt_tokens``: 0, below -1, or more than the context
            holds beside the completion.
    """
    try:
        return kept_prompt_tokens(req.truncate_prompt_tokens, max_model_len, max_tokens)
    except ValueError as e:
        raise bad_request(str(e), TRUNCATE_PARAM) from None


def _penalty_extras(req: SamplingRequest, vocab_size: int | None
                    ) -> tuple[dict[int, Any] | None, RepetitionStop | None]:
    """The request's ``logit_bias`` (token-id keys) and ``repetition_stop``.

    Raises:
        APIError: 400 for a ``logit_bias`` key that is not a token id (of this model, when
            ``vocab_size`` is given) or a bad ``repetition_stop``, naming the field.
    """
    try:
        logit_bias = logit_bias_from_json(req.logit_bias)
    except ValueError as e:
        raise bad_request(str(e), "logit_bias") from None
    if vocab_size is not None and (bad := out_of_vocab(logit_bias, vocab_size)) is not None:
        raise bad_request(f"logit_bias key {bad} is not a token id of this model (vocabulary "
                          f"size {vocab_size})", "logit_bias")
    allowed = req.allowed_token_ids or ()
    if vocab_size is not None and (bad := next((t for t in allowed if not 0 <= t < vocab_size),
                                               None)) is not None:
        raise bad_request(f"allowed_token_ids entry {bad} is not a token id of this model "
                          f"(vocabulary size {vocab_size})", "allowed_token_ids")
    try:
        repetition_stop = repetition_stop_from_json(req.repetition_stop)
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), "repetition_stop") from None
    return logit_bias, repetition_stop


def check_context_length(prompt_len: int, max_tokens: int, max_model_len: int, param: str,
                         prompt_word: str) -> None:
    """vLLM's check of an explicit ``max_tokens``: prompt + completion must fit the context.

    Args:
        prompt_word: what the prompt is called in the message (``messages`` / ``prompt``).

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``param``.
    """
    if prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_word}, "
            f"{max_tokens} in the completion). Please reduce the length of the {prompt_word} "
            "or completion.", param, code=CONTEXT_LENGTH_EXCEEDED)


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """``n`` copies of ``params``; copy ``i`` is seeded ``seed + i`` when a seed is set
    (:func:`structspec.core.choice_seed`: wrapped to stay in the seed range)."""
    seed = params.seed
    if seed is None:
        return [params] * n
    return [params if i == 0 else replace(params, seed=choice_seed(seed, i)) for i in range(n)]
