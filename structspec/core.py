"""Request-level types shared by the API, the scheduler and the server.

Nothing here touches torch devices: these are plain host-side records.
"""

from __future__ import annotations

import enum
import json
import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import structspec.constraints
from structspec.bad_words import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS
from structspec.constraints import CONSTRAINT_TYPES as _CONSTRAINT_TYPES
from structspec.constraints import ChoiceConstraint, GrammarConstraint
from structspec.penalty_params import (
    RepetitionStop,
    as_repetition_stop,
    logit_bias_error,
    penalty_error,
    repetition_penalty_error,
)
from structspec.prompt_truncation import truncate_value_error
from structspec.schema_structure import MAX_SCHEMA_NESTING, json_nesting

# ---------------------------------------------------------------------------------------------
# Sampling parameters
# ---------------------------------------------------------------------------------------------


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The error code of a prompt (or prompt + ``max_tokens``) that the context cannot hold."""
INVALID_REQUEST_PARAMETER = "invalid_request_parameter"
"""The generic error code of a request field the engine refused (OpenAI's and vLLM's name)."""


def request_error_code(param: str | None, code: str | None = None) -> str | None:
    """The machine-readable code of a refused request, the same in the Python API
    (``RequestOutput.error_code``) and in the server's HTTP 400s: ``code`` when the error
    has its own (``grammar_too_complex``, :data:`CONTEXT_LENGTH_EXCEEDED`), else
    :data:`INVALID_REQUEST_PARAMETER` when it names a field other than ``prompt``, else None
    (an unusable prompt: the field is the code's whole information)."""
    if code is not None:
        return code
    return INVALID_REQUEST_PARAMETER if param is not None and param != "prompt" else None


class RequestError(ValueError):
    """A request was rejected before it ran; ``param`` names the offending field and
    ``code`` is its machine-readable code (:func:`request_error_code`).

    Raised by ``LLMEngine.add_request``; defined here, with no heavy import, so that the
    server's engine loop can catch it without importing the engine.
    """

    def __init__(self, message: str, param: str | None = None, *,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = request_error_code(param, code)


class PromptTooLongError(ValueError):
    """A prompt refused before tokenization because it cannot fit the context.

    Attributes:
        min_tokens: a lower bound on its token count.
        max_tokens: the limit it was checked against.
    """

    def __init__(self, min_tokens: int, max_tokens: int) -> None:
        super().__init__(f"the prompt has at least {min_tokens} tokens; at most {max_tokens} "
                         "fit")
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens


_FLOAT32_MAX = 3.4028234663852886e38


def _is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, not to requests)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _as_list(value: object) -> object:
    """A stored tuple shown as the list the caller most likely gave (messages only)."""
    return list(value) if isinstance(value, tuple) else value


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages (a stop list may hold
    thousands of strings)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_tuple(value: object) -> object:
    """``value`` as a tuple when it is None (empty) or an iterable other than a mapping or
    bytes; else as is (for ``validate()`` to refuse)."""
    if value is None:
        return ()
    if isinstance(value, (tuple, Mapping, bytes, bytearray)) or not isinstance(value, Iterable):
        return value
    return tuple(value)


MAX_LOGPROBS = 20
"""The largest ``logprobs`` / ``prompt_logprobs`` (top-k alternatives per position), as in
OpenAI's API and vLLM's default ``max_logprobs``."""

SEED_MIN = 0
SEED_MAX = 2**63 - 1
"""The one range of a seed, inclusive, in the Python API (``SamplingParams.seed``,
``LLM(seed=...)``), the CLI (``--request-seed``, ``--seed``) and the server (``seed``): the
non-negative int64 values, which every generator takes and an int64 tensor holds. The server
seeds choice ``i`` of ``n`` with :func:`choice_seed`, which stays inside it."""


def seed_error(value: object, name: str = "seed") -> str | None:
    """Why ``value`` is not a seed (an ``int`` in ``[SEED_MIN, SEED_MAX]``, not a ``bool``),
    as a message starting with ``name``; None when it is one."""
    if not _is_int(value):
        return f"{name} must be an integer, got {value!r}"
    if not SEED_MIN <= value <= SEED_MAX:  # type: ignore[operator]
        return f"{name} must be in [{SEED_MIN}, {SEED_MAX}] (0 to 2**63 - 1), got {value}"
    return None


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed`` (``seed + index``, wrapped
    to stay in ``[SEED_MIN, SEED_MAX]``)."""
    return SEED_MIN + (seed - SEED_MIN + index) % (SEED_MAX - SEED_MIN + 1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy. ``top_k <= 0`` / ``top_p == 1`` / ``min_p == 0`` disable
    those filters. ``seed`` makes a sampled request reproducible on its own: its token at
    output position ``p`` is drawn with a uniform keyed by ``(seed, p)``
    (:mod:`structspec.layers.keyed_sampling`), so with float32 weights the output is the same
    in any batch, with any drafter or none, and whatever tree sizes the adaptive sizer picks.
    With int4 or bf16 weights the logits shift slightly with the batch's shape (a verify row
    against a decode), so a draw near a boundary of the distribution can take the other
    token, and the outputs part from there.

    ``min_tokens`` (vLLM's): no stop token (EOS unless ``ignore_eos``, ``stop_token_ids``)
    and no stop string ends the output before it has ``min_tokens`` tokens; their logits are
    -inf at those positions (each verify-tree row at its own position, so speculation does not
    change the output). A grammar goes first: where its structure is complete and only a stop
    token is allowed, the request ends there, shorter.

    ``allowed_token_ids`` (vLLM's): only these ids may be chosen (every other logit is -inf,
    before the grammar mask; a grammar that allows none of them at some step ends the request
    with an error naming ``allowed_token_ids``). It shares the penalty table with
    ``logit_bias``, so speculation keeps the output exact.

    ``bad_words`` (vLLM's): words never generated. The engine tokenizes each word as is and
    with a leading space (vLLM's rule, :mod:`structspec.bad_words`); a one-token word's token
    is -inf everywhere (in the penalty table, like ``allowed_token_ids``: a grammar that
    allows only such tokens at some point ends the request with an error naming
    ``bad_words``); a longer word's last token is -inf where the output so far (not the
    prompt, as in vLLM) ends with its other tokens, each verify-tree row for its own path
    (:mod:`structspec.layers.bad_words`), so speculation does not change the output. That ban
    comes after the grammar mask, and a row where the grammar allows nothing but such a last
    token keeps it (the grammar goes first, as with ``min_tokens``). At most 128 words of at
    most 256 characters.

    ``presence_penalty`` / ``frequency_penalty`` (OpenAI, output tokens, ``[-2, 2]``, 0 =
    off), ``repetition_penalty`` (vLLM / Hugging Face, prompt and output tokens, ``[0.01,
    100]``, 1 = off) and ``logit_bias`` (``{token_id: bias in [-100, 100]}``) change the logits
    before the grammar mask, temperature and the filters
    (:mod:`structspec.penalty_params`). Under speculation every draft-tree row is penalised
    for its own path, so greedy output with speculation equals greedy output without it and
    sampling stays exact. ``repetition_stop`` (``True`` for the defaults, or a
    :class:`~structspec.penalty_params.RepetitionStop`) ends a request whose output loops,
    ``finish_reason`` ``length`` with ``stop_reason`` ``"repetition"``.

    A stop string (``stop``) ends the text right before it; with
    ``include_stop_str_in_output`` (vLLM's) right after it, so the text keeps it (the token
    ids are the same either way: they end with the token that completed the stop string).
    ``skip_special_tokens`` (vLLM's, default True) drops special tokens (``<|im_end|>``,
    added control tokens) from the text; False keeps them, and stop strings are then matched
    against the text with them. The token that ended a request at token level (EOS, a
    ``stop_token_ids`` id) is in its token ids, and in its text only with
    ``include_stop_str_in_output`` (:func:`stop_token_hidden`, vLLM's rule).
    ``spaces_between_special_tokens`` (vLLM's, default True) matters only with
    ``skip_special_tokens=False``: False drops what the tokenizer's decoder puts between two
    added tokens that follow each other in the output (a space, for decoders that join
    tokens with spaces), as vLLM's detokenizer does for a fast tokenizer; True is the
    tokenizer's own decode (:class:`structspec.models.tokenizer.IncrementalDetokenizer`).

    ``truncate_prompt_tokens`` (vLLM's): ``k >= 1`` keeps only the last ``k`` tokens of the
    tokenized prompt (a BOS the tokenizer adds to a text prompt stays), ``-1`` the most the
    context holds (``max_model_len``); ``RequestOutput.prompt_token_ids`` is the kept prompt
    (:mod:`structspec.prompt_truncation`).

    ``prompt_logprobs`` (vLLM's, ``[0, 20]``): the log-probability of every prompt token
    given the tokens before it, with its rank and the ``k`` most likely tokens at that
    position (``RequestOutput.prompt_logprobs``), computed in the prompt's prefill from the
    raw logits. Such a request never reuses prefix-cached KV (its prefill must compute every
    position), and its prefill steps run eagerly, scoring the LM head over the prompt in
    slices of bounded rows (:mod:`structspec.runner.prompt_logprobs`). Requests without it
    are not affected.

    Construction only normalizes ``stop`` / ``stop_token_ids`` / ``bad_words`` to tuples, ``logit_bias`` to a
    dict of its own and ``repetition_stop`` ``True`` / ``False`` to a record / None;
    :meth:`validate` checks types and ranges (``LLMEngine.add_request`` calls it, so a bad
    value fails that request, naming the field).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: GrammarConstraint | None = None
    logprobs: int | None = None  # None: none; k >= 0: chosen token's logprob plus top-k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    repetition_stop: RepetitionStop | None = None
    # new fields go last: a positional construction keeps its meaning
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    # None: none; k >= 0: each prompt token's logprob plus the top-k (RequestOutput doc)
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    bad_words: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # Accept a single string, None (none, as in vLLM and the OpenAI API) and any iterable
        # for convenience, store tuples (frozen + hashable). A non-iterable or a mapping stays
        # as given for validate() to refuse naming the field (tuple() of an int raised a bare
        # TypeError; of a dict it kept the keys).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _as_tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, str):  # one word, as ``stop`` takes one string
            object.__setattr__(self, "bad_words", (self.bad_words,))
        elif self.bad_words is not None:  # an empty list is None: no word
            words = _as_tuple(self.bad_words)
            object.__setattr__(self, "bad_words", None if words == () else words)
        if isinstance(self.logit_bias, Mapping):  # a copy: the caller's dict may change later
            object.__setattr__(self, "logit_bias", dict(self.logit_bias) or None)
        object.__setattr__(self, "repetition_stop", as_repetition_stop(self.repetition_stop))

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty, logit bias or ``allowed_token_ids`` changes this request's
        logits (they share the penalty table)."""
        return bool(self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                    or self.repetition_penalty != 1.0 or self.logit_bias
                    or self.allowed_token_ids is not None)

    def validate(self) -> None:
        """Check types and ranges; raise ``ValueError`` naming the field on bad input."""
        for name in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs",
                     "prompt_logprobs"):
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs", "prompt_logprobs"):
                continue
            if not _is_int(value):  # 2.5 / 2.0 / "2" / True are not silently truncated
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.seed is not None and (why := seed_error(self.seed)) is not None:
            raise ValueError(why)
        if not isinstance(self.ignore_eos, bool):  # "false" is truthy: it would ignore EOS
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):  # no truthiness: "false" is truthy
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens] (max_tokens is "
                             f"{self.max_tokens}), got {self.min_tokens}")
        # The sampler divides float32 logits by it: a value past float32's range becomes inf
        # there, and -inf / inf (a masked logit) is NaN.
        if (not math.isfinite(self.temperature) or self.temperature < 0
                or self.temperature > _FLOAT32_MAX):
            raise ValueError(f"temperature must be a finite number >= 0 that fits float32 "
                             f"(<= 3.4e38), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:  # it travels to the device as an int64 column
            raise ValueError(f"top_k must be in [0, 2**31) (0 disables it; a value >= the "
                             f"vocabulary size keeps every token), got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s
                                                   for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got "
                             f"{_shown(_as_list(self.stop))}")
        if not isinstance(self.stop_token_ids, tuple) or any(
                not _is_int(t) or not 0 <= t < 2**63 for t in self.stop_token_ids):
            # token ids travel as int64; 2**64 used to be accepted and could never match
            raise ValueError(f"stop_token_ids must be a list of integers in [0, 2**63), got "
                             f"{_shown(_as_list(self.stop_token_ids))}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, tuple) or not self.allowed_token_ids
                or any(not _is_int(t) or not 0 <= t < 2**63 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be None or a non-empty list of integers "
                             f"in [0, 2**63), got {_shown(_as_list(self.allowed_token_ids))}")
        self._validate_bad_words()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if (why := truncate_value_error(self.truncate_prompt_tokens)) is not None:
            raise ValueError(why)
        if self.grammar is not None and not isinstance(self.grammar, _CONSTRAINT_TYPES):
            # a string such as "text" used to fail later as an AttributeError naming no field
            raise ValueError(f"grammar must be None or one of "
                             f"{', '.join(t.__name__ for t in _CONSTRAINT_TYPES)}, got "
                             f"{type(self.grammar).__name__} {self.grammar!r}")
        if isinstance(self.grammar, ChoiceConstraint):
            if not self.grammar.choices or any(not c for c in self.grammar.choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        self._validate_penalties()

    def _validate_bad_words(self) -> None:
        """The checks of ``bad_words`` that need no tokenizer (the engine tokenizes them,
        :mod:`structspec.bad_words`)."""
        words = self.bad_words
        if words is None:
            return
        if not isinstance(words, tuple) or any(not isinstance(w, str) or not w.strip()
                                               for w in words):
            # a blank word lstrips to "" (vLLM refuses what tokenizes to nothing)
            raise ValueError(f"bad_words must be None or a list of strings that are not "
                             f"empty or blank, got {_shown(_as_list(words))}")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {len(words)} entries; at most {MAX_BAD_WORDS}")
        long = next((i for i, w in enumerate(words) if len(w) > MAX_BAD_WORD_CHARS), None)
        if long is not None:
            raise ValueError(f"bad_words[{long}] has {len(words[long])} characters; at most "
                             f"{MAX_BAD_WORD_CHARS}")

    def _validate_penalties(self) -> None:
        """The checks of the penalty, logit-bias and repetition-stop fields."""
        for name in ("presence_penalty", "frequency_penalty"):
            if (why := penalty_error(name, getattr(self, name))) is not None:
                raise ValueError(why)
        if (why := repetition_penalty_error(self.repetition_penalty)) is not None:
            raise ValueError(why)
        if self.logit_bias is not None and (why := logit_bias_error(self.logit_bias)):
            raise ValueError(why)
        if self.repetition_stop is not None:
            if not isinstance(self.repetition_stop, RepetitionStop):
                raise ValueError(f"repetition_stop must be True, False, None or a "
                                 f"RepetitionStop, got {self.repetition_stop!r}")
            self.repetition_stop.check()


def stop_token_set(params: SamplingParams, eos_token_ids: Iterable[int]) -> set[int]:
    """The ids that end a request of ``params`` at token level: the model's EOS ids unless
    ``ignore_eos``, and ``stop_token_ids`` (what ``min_tokens`` bans)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return ids


def stop_holdback(params: SamplingParams) -> int:
    """Characters at the end of a running request's text that streaming holds back (the
    engine's ``RequestOutput.new_text`` and the server's stream both): ``len(longest stop) -
    1``, what could be the start of a stop string that the final text will not keep. 0
    without stop strings, and with ``include_stop_str_in_output``: the final text then ends
    right after the first stop string, which ends in the text of the request's last token,
    so everything before that token's text stays and can be sent at once."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def stop_token_hidden(params: SamplingParams, finish_reason: str | None,
                      stop_reason: str | int | None) -> bool:
    """Whether the last output token of a finished request stays out of its text: the token
    that ended it at token level (``finish_reason`` ``stop`` with no stop *string* as
    ``stop_reason``: the model's EOS, a ``stop_token_ids`` id, or the stop token that ended
    its grammar), unless ``include_stop_str_in_output`` (vLLM's rule; the token id is
    reported either way). With ``skip_special_tokens`` (the default) an EOS decodes to no
    text anyway; a ``stop_token_ids`` id of an ordinary token shows only with
    ``include_stop_str_in_output``."""
    return (finish_reason == "stop" and not isinstance(stop_reason, str)
            and not params.include_stop_str_in_output)


# ---------------------------------------------------------------------------------------------
# Finishing and results
# ---------------------------------------------------------------------------------------------


class FinishReason(enum.StrEnum):
    """Why a request ended (OpenAI's ``finish_reason`` values)."""

    STOP = "stop"  # EOS, stop string/token, or the grammar reached its end
    LENGTH = "length"  # max_tokens, the context length, or the repetition stop (stop_reason)
    ABORT = "abort"  # error or cancellation; RequestOutput.error says why


@dataclass
class SpecMetrics:
    """Speculative decoding counters of one request (or summed over many).

    ``accept_length`` = committed tokens per verify step, bonus included (1.0 without spec).
    ``tree_sizes`` counts verify steps per tree size ``N`` (node 0 included) the request was
    verified with; ``steps_without_draft`` the steps it ran as a plain decode row (``N = 1``)
    although a drafter is on (adaptive tree sizing found drafting would not pay, or the
    n-gram found nothing to propose).
    """

    verify_steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    draft_tokens_rejected_by_grammar: int = 0
    committed_tokens: int = 0
    steps_without_draft: int = 0
    tree_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def mean_tree_nodes(self) -> float:
        """Mean verified tree size over the steps (0.0 before the first)."""
        steps = sum(self.tree_sizes.values())
        return sum(n * c for n, c in self.tree_sizes.items()) / steps if steps else 0.0

    @property
    def accept_length(self) -> float:
        return self.committed_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def accept_rate(self) -> float:
        if not self.draft_tokens_proposed:
            return 0.0
        return self.draft_tokens_accepted / self.draft_tokens_proposed

    def add(self, other: SpecMetrics) -> None:
        self.verify_steps += other.verify_steps
        self.draft_tokens_proposed += other.draft_tokens_proposed
        self.draft_tokens_accepted += other.draft_tokens_accepted
        self.draft_tokens_rejected_by_grammar += other.draft_tokens_rejected_by_grammar
        self.committed_tokens += other.committed_tokens
        self.steps_without_draft += other.steps_without_draft
        for n, c in other.tree_sizes.items():
            self.tree_sizes[n] = self.tree_sizes.get(n, 0) + c

    def to_dict(self) -> dict[str, Any]:
        return {
            "verify_steps": self.verify_steps,
            "draft_tokens_proposed": self.draft_tokens_proposed,
            "draft_tokens_accepted": self.draft_tokens_accepted,
            "draft_tokens_rejected_by_grammar": self.draft_tokens_rejected_by_grammar,
            "accept_length": round(self.accept_length, 4),
            "accept_rate": round(self.accept_rate, 4),
            "steps_without_draft": self.steps_without_draft,
            "mean_tree_nodes": round(self.mean_tree_nodes, 4),
            "tree_sizes": {str(n): c for n, c in sorted(self.tree_sizes.items())},
        }


@dataclass
class TokenLogprob:
    """Log-probability of a token under the target model.

    An emitted token (``RequestOutput.logprobs``): after the penalties and the grammar mask,
    before temperature and the filters. ``top_logprobs``: up to ``SamplingParams.logprobs``
    ``(token_id, logprob)`` pairs, most likely first; tokens the grammar forbids are left
    out, so a constrained position may list fewer. ``rank`` is None.

    A prompt token (``RequestOutput.prompt_logprobs``): the raw model distribution
    (log-softmax of the logits; no penalty, grammar or temperature applies to a prompt),
    ``top_logprobs`` the ``SamplingParams.prompt_logprobs`` most likely tokens, and ``rank``
    the token's 1-based rank in that distribution (1 + the number of tokens with a strictly
    larger logprob; vLLM's ``Logprob.rank``).
    """

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class RequestOutput:
    """What a request produced so far (``finished`` tells whether this is final).

    Timings are wall-clock seconds since the request was added (``time.perf_counter``).
    ``text`` is the full decoded completion; ``new_text``/``new_token_ids`` hold only what this
    step added (for streaming).

    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``, vLLM's): one entry per
    prompt position, ``None`` at position 0 (nothing predicts it), then the
    :class:`TokenLogprob` of prompt token ``p`` given tokens ``< p`` (raw model
    distribution, its ``rank`` set). Present in every output once the prompt's prefill is
    complete (the same list each time); None before, and without the option.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_param: str | None = None  # which request field caused ``error`` (for HTTP 400s)
    error_code: str | None = None  # machine-readable code of ``error`` (grammar_too_complex)
    # the stop string / token that ended it; "repetition" for the repetition stop
    stop_reason: str | int | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    schema_valid: bool | None = None  # best-effort (strict=False) JSON Schema check
    # the grammar backend that served the request ("xgrammar" / "llguidance"); None without a
    # grammar (or before its compile finished)
    grammar_backend: str | None = None
    # leading prompt tokens whose KV was reused from the prefix cache (OpenAI's
    # usage.prompt_tokens_details.cached_tokens)
    cached_tokens: int = 0
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @classmethod
    def error_output(cls, request_id: str, error: str, param: str | None = None,
                     code: str | None = None) -> RequestOutput:
        """A finished ``abort`` output for a request rejected before it ran (``code``: its
        :func:`request_error_code`)."""
        t = now()
        return cls(request_id=request_id, prompt_token_ids=[], token_ids=[], text="",
                   finished=True, finish_reason=FinishReason.ABORT, error=error,
                   error_param=param, error_code=code, arrival_time=t, finish_time=t)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record (the CLI's ``--output json`` line)."""
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
            "stop_reason": self.stop_reason,
            "error": self.error,
            "error_param": self.error_param,
            "error_code": self.error_code,
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "schema_valid": self.schema_valid,
            "grammar_backend": self.grammar_backend,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "latency_s": None if self.latency_s is None else round(self.latency_s, 6),
            "speculative": self.spec.to_dict(),
        }


Role = Literal["system", "user", "assistant", "tool"]
ChatMessages = Sequence[dict[str, Any]]


# ---------------------------------------------------------------------------------------------
# Chat messages (checked once, before any chat template sees them)
# ---------------------------------------------------------------------------------------------


class ChatMessageError(ValueError):
    """A malformed chat message list, refused before the chat template renders it (a
    template's own error, e.g. "'dict object' has no attribute 'content'", names no field),
    or a bad chat template option (:class:`ChatTemplateOptions`).

    The message is ``"<param>: <reason>"``, e.g. ``messages[1].content: expected a string or
    a list of text parts, got int``.

    Attributes:
        param: the field at fault (``messages``, ``messages[1].role``,
            ``continue_final_message``, ``chat_template_kwargs.tools``...): an HTTP 400's
            ``param``.
        code: ``"unsupported"`` for a message OpenAI accepts but structspec does not serve
            (an image part, an assistant turn that only carries tool calls); else None.
    """

    def __init__(self, param: str, reason: str, code: str | None = None) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.code = code


def type_name(value: object) -> str:
    """A value's type as error messages name it (``null`` for None, as JSON spells it)."""
    return "null" if value is None else type(value).__name__


def check_chat_messages(messages: object) -> list[dict[str, Any]]:
    """Check an OpenAI-style chat and return it as chat templates expect it.

    The one check that every path taking messages goes through (the Python API and the CLI
    via :meth:`structspec.models.tokenizer.Tokenizer.render_chat`, the HTTP server before it
    tokenizes). Accepted, as OpenAI accepts it: a non-empty list of objects, each with a
    non-empty string ``role`` and a ``content`` that is a string or a list of ``{"type":
    "text", "text": ...}`` parts (joined into one string); ``name``, when given, is a string.
    Other keys pass through to the template.

    Returns:
        New message dicts (the input is not modified) whose ``content`` is a string.

    Raises:
        ChatMessageError: naming the field; with code ``unsupported`` for a non-text content
            part, and for a ``content`` of null or left out on an assistant message with
            ``tool_calls`` (OpenAI's shape for a pure tool call: tool calls are not supported).
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatMessageError("messages", f"expected a list of messages, got "
                                           f"{type_name(messages)}")
    if not messages:
        raise ChatMessageError("messages", "expected at least one message, got an empty list")
    return [_check_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _check_message(message: object, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ChatMessageError(where, "expected a message object with 'role' and 'content', "
                                      f"got {type_name(message)}")
    if "role" not in message:
        raise ChatMessageError(f"{where}.role", "missing (expected a string such as 'user')")
    role = message["role"]
    if not isinstance(role, str):
        raise ChatMessageError(f"{where}.role", f"expected a string, got {type_name(role)}")
    if not role:
        raise ChatMessageError(f"{where}.role", "expected a non-empty string, got ''")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise ChatMessageError(f"{where}.name", f"expected a string, got {type_name(name)}")
    out = dict(message)
    out["content"] = _message_text(message, where)
    return out


def _message_text(message: dict[str, Any], where: str) -> str:
    """The text of ``message["content"]``: a string, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if not content:  # OpenAI refuses it too; joined it was a silent empty message
            raise ChatMessageError(f"{where}.content", "expected a string or a non-empty list "
                                                       "of text parts, got an empty list")
        return "".join(_part_text(part, f"{where}.content[{j}]")
                       for j, part in enumerate(content))
    if content is None and message["role"] == "assistant" and (
            message.get("tool_calls") or message.get("function_call")):
        raise ChatMessageError(f"{where}.content", "an assistant message with tool_calls or "
                               "function_call and no content is not supported here (the "
                               "server's chat endpoint renders tool_calls turns; the legacy "
                               "function_call is not read); send the turn as text content",
                               code="unsupported")
    if "content" not in message:
        raise ChatMessageError(f"{where}.content", "missing (expected a string or a list of "
                                                   "text parts)")
    raise ChatMessageError(f"{where}.content", "expected a string or a list of text parts, "
                                               f"got {type_name(content)}")


def _part_text(part: object, where: str) -> str:
    if not isinstance(part, dict):
        raise ChatMessageError(where, "expected a content part object ({\"type\": \"text\", "
                                      f"\"text\": ...}}), got {type_name(part)}")
    kind = part.get("type")
    if kind != "text":
        raise ChatMessageError(f"{where}.type", f"content part type {kind!r} is not supported "
                                                "(text parts only)", code="unsupported")
    text = part.get("text")
    if not isinstance(text, str):
        raise ChatMessageError(f"{where}.text", f"expected a string, got {type_name(text)}")
    return text


# ---------------------------------------------------------------------------------------------
# Chat template options (vLLM's add_generation_prompt, continue_final_message,
# chat_template_kwargs)
# ---------------------------------------------------------------------------------------------


RESERVED_CHAT_TEMPLATE_KWARGS: frozenset[str] = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""Keys ``chat_template_kwargs`` may not hold: the arguments of transformers'
``apply_chat_template`` (and ``messages``, the name the template reads the chat by). Passed on,
such a key would not be a template variable but would override how the chat is rendered:
``chat_template`` would run the client's own Jinja, ``documents`` and ``tools`` would bypass
their request fields' checks, ``tokenize`` or ``messages`` would fail to render."""


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a chat is rendered through the chat template: vLLM's chat options, taken by
    ``LLM.chat`` and by the server's ``/v1/chat/completions``.

    Attributes:
        add_generation_prompt: end the prompt with the template's assistant header, so that
            the model writes a new assistant message (the default); False: the prompt ends
            with the last message's end of turn (the template decides what it renders).
        continue_final_message: leave the final message open, without its end of turn, so
            that the model continues it ("prefill" of the answer; the output is only the
            continuation). Needs ``add_generation_prompt=False`` and a final message of role
            ``assistant`` (:meth:`check_messages`).
        chat_template_kwargs: extra variables for the template, e.g.
            ``{"enable_thinking": False}``: string keys, JSON values (None, bool, numbers,
            strings, lists, dicts), none of :data:`RESERVED_CHAT_TEMPLATE_KWARGS`. Kept as a
            copy; None means none.

    Raises:
        ChatMessageError: naming the field (``add_generation_prompt``,
            ``continue_final_message``, ``chat_template_kwargs`` or
            ``chat_template_kwargs.<key>``): a flag that is not a bool, both flags true, or a
            bad ``chat_template_kwargs``.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ChatMessageError(name, f"expected true or false, got {type_name(value)} "
                                             f"{_shown(value)}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ChatMessageError(
                "continue_final_message", "cannot be true while add_generation_prompt is true "
                "(a generation prompt starts a new assistant message; continue_final_message "
                "continues the last one): set add_generation_prompt to false")
        if self.chat_template_kwargs is not None:
            object.__setattr__(self, "chat_template_kwargs",
                               _checked_template_kwargs(self.chat_template_kwargs))

    def check_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Refuse a chat these options cannot render: with ``continue_final_message``, one
        whose final message is not the assistant's (vLLM's rule: only an answer is continued).

        Raises:
            ChatMessageError: naming ``continue_final_message`` (and the final message's role).
        """
        if not self.continue_final_message or not messages:
            return
        last = len(messages) - 1
        role = messages[last].get("role")
        if role != "assistant":
            raise ChatMessageError(
                "continue_final_message", f"the final message must be the assistant's, to be "
                f"continued; messages[{last}].role is {_shown(role)}")

    def template_args(self) -> dict[str, Any]:
        """The keyword arguments of transformers' ``apply_chat_template`` for these options:
        the template variables, then the two flags."""
        return {**(self.chat_template_kwargs or {}),
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def kwargs_chars(self) -> int:
        """Characters of ``chat_template_kwargs`` as JSON (0 for none): text a template may
        render into the prompt, counted with the messages by the server's prompt bound."""
        if not self.chat_template_kwargs:
            return 0
        return len(json.dumps(self.chat_template_kwargs, ensure_ascii=False))


def _checked_template_kwargs(kwargs: object) -> dict[str, Any]:
    """A copy of ``chat_template_kwargs`` once checked (see :class:`ChatTemplateOptions`).

    Raises:
        ChatMessageError: not a mapping, a key that is not a string or is reserved, or a value
            that is not JSON; naming ``chat_template_kwargs`` or ``chat_template_kwargs.<key>``.
    """
    if not isinstance(kwargs, Mapping):
        raise ChatMessageError("chat_template_kwargs", "expected an object of template "
                                                       f"variables, got {type_name(kwargs)}")
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise ChatMessageError("chat_template_kwargs", f"keys must be strings, got "
                                                           f"{type_name(key)} {_shown(key)}")
        param = f"chat_template_kwargs.{key}"
        if key in RESERVED_CHAT_TEMPLATE_KWARGS:
            raise ChatMessageError(param, f"{key!r} is reserved: it is an argument of the chat "
                                          "template's rendering, not a template variable "
                                          "(messages, tools and the template's flags have "
                                          "fields of their own)")
        if json_nesting(value) > MAX_SCHEMA_NESTING:  # the template's rendering recursed
            raise ChatMessageError(param, f"the value nests deeper than {MAX_SCHEMA_NESTING} "
                                          "levels")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            raise ChatMessageError(param, "expected a JSON value (null, a boolean, a finite "
                                          "number, a string, a list or an object), got "
                                          f"{type_name(value)}") from None
        out[key] = value
    return out


def now() -> float:
    """Monotonic wall clock in seconds (all request timings use it)."""
    return time.perf_counter()


_DEPRECATED_NAMES = {
    "JsonSchemaSpec": "JsonSchemaConstraint",
    "JsonObjectSpec": "JsonObjectConstraint",
    "RegexSpec": "RegexConstraint",
    "EbnfSpec": "EbnfConstraint",
    "ChoiceSpec": "ChoiceConstraint",
    "GrammarSpec": "GrammarConstraint",
}
"""Names of the grammar constraint types before 0.2 (``*Spec``), still importable from here
and from :mod:`structspec` with a :class:`DeprecationWarning`."""


def deprecated_constraint_name(name: str) -> Any:
    """The constraint type an old ``*Spec`` name stands for, with a DeprecationWarning.

    Raises:
        AttributeError: ``name`` is not one of the old names.
    """
    new = _DEPRECATED_NAMES.get(name)
    if new is None:
        raise AttributeError(name)
    warnings.warn(f"{name} is deprecated; use structspec.{new}", DeprecationWarning,
                  stacklevel=3)
    return getattr(structspec.constraints, new)


def __getattr__(name: str) -> Any:
    try:
        return deprecated_constraint_name(name)
    except AttributeError:
        raise AttributeError(f"module 'structspec.core' has no attribute {name!r}") from None
