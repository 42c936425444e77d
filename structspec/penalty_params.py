"""Sampling penalties, logit bias and the repetition stop of one request: their ranges, their
checks and the repetition stop's record.

Semantics (what :mod:`structspec.layers.penalties` computes on the logits, in this order):

- ``logit_bias``: ``{token_id: bias}``, each bias in ``[-100, 100]`` added to that token's
  logit (OpenAI).
- ``repetition_penalty`` (vLLM / Hugging Face): every token that occurs in the prompt or in
  the output so far has its logit divided by the penalty when positive, multiplied by it
  when negative. 1 is off; > 1 discourages repeats.
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI): ``logit -= frequency * count +
  presence * (count > 0)``, where ``count`` is how often the token occurs in the *output*
  so far (the prompt does not count). 0 is off; range ``[-2, 2]``.
- ``repetition_stop`` (:class:`RepetitionStop`): end the request, ``finish_reason`` ``length``
  with ``stop_reason`` ``"repetition"``, as soon as the output ends with one unit of tokens
  repeated (see the class).

Imports nothing heavy: the API, the CLI and the server check values with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PENALTY_MIN = -2.0
PENALTY_MAX = 2.0
"""The range of ``presence_penalty`` and ``frequency_penalty`` (OpenAI's)."""

REPETITION_PENALTY_MIN = 0.01
REPETITION_PENALTY_MAX = 100.0
"""The range of ``repetition_penalty``. vLLM takes any value > 0; the bounds keep a divided or
multiplied float32 logit finite (a logit of 30 divided by 1e-38 is inf, which would read as a
model fault and end the request), far beyond the values in use (1.0 to 1.5)."""

LOGIT_BIAS_MIN = -100.0
LOGIT_BIAS_MAX = 100.0
"""The range of one ``logit_bias`` value (OpenAI's)."""

MAX_LOGIT_BIAS_ENTRIES = 300
"""Most ``logit_bias`` entries in one request (OpenAI's limit)."""

MAX_TOKEN_ID = 2**31 - 1
"""Largest ``logit_bias`` key the Python check lets through; the engine then refuses ids at or
above its vocabulary size (``LLMEngine.add_request``, the server before it)."""

REPETITION_STOP_REASON = "repetition"
"""The ``stop_reason`` of a request ended by its :class:`RepetitionStop` (``finish_reason``
stays ``length``: OpenAI's set has no reason for it)."""


@dataclass(frozen=True)
class RepetitionStop:
    """Stop a request whose output ends in a loop.

    The output's tail is a loop when its last ``L`` tokens are one unit of ``p`` tokens
    repeated: token ``i`` equals token ``i - p`` for each of them after the first ``p``, with
    ``1 <= p <= max_period``, ``L >= min_repeats * p`` and ``L >= min_tokens``. The check runs
    after every committed token, on committed tokens only, so a request stops at the same
    token with speculation on or off.

    Attributes:
        min_tokens: the shortest looping tail that stops (in tokens).
        max_period: the longest unit looked for (in tokens).
        min_repeats: the fewest repeats of the unit that stop.
    """

    min_tokens: int = 48
    max_period: int = 32
    min_repeats: int = 4

    def check(self, name: str = "repetition_stop") -> None:
        """Raise ``ValueError`` naming ``name.<field>`` for a value out of range."""
        limits = {"min_tokens": (2, 1 << 20), "max_period": (1, 512),
                  "min_repeats": (2, 1 << 20)}
        for field, (low, high) in limits.items():
            value = getattr(self, field)
            if not _is_int(value) or not low <= value <= high:
                raise ValueError(f"{name}.{field} must be an integer in [{low}, {high}], got "
                                 f"{value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def penalty_error(name: str, value: object) -> str | None:
    """Why ``value`` is not a ``presence_penalty`` / ``frequency_penalty`` (a finite number
    in ``[-2, 2]``), as a message starting with ``name``; None when it is one."""
    if not _is_number(value):
        return f"{name} must be a number, got {value!r}"
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or not PENALTY_MIN <= number <= PENALTY_MAX:
        return f"{name} must be a finite number in [-2, 2] (0 = off), got {value}"
    return None


def repetition_penalty_error(value: object, name: str = "repetition_penalty") -> str | None:
    """Why ``value`` is not a ``repetition_penalty`` (a finite number in ``[0.01, 100]``);
    None when it is one."""
    if not _is_number(value):
        return f"{name} must be a number, got {value!r}"
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or not REPETITION_PENALTY_MIN <= number <= REPETITION_PENALTY_MAX:
        return (f"{name} must be a finite number in [0.01, 100] (1 = off; > 1 discourages "
                f"repeats), got {value}")
    return None


def logit_bias_error(bias: object, name: str = "logit_bias") -> str | None:
    """Why ``bias`` is not a logit bias (a mapping of at most 300 integer token ids ``>= 0``
    to finite numbers in ``[-100, 100]``); None when it is one. The vocabulary bound is
    checked where the vocabulary is known (the engine, the server)."""
    if not isinstance(bias, Mapping):
        return f"{name} must be a mapping of token ids to numbers, got {type(bias).__name__}"
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        return f"{name} has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
    for token, value in bias.items():
        if not _is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
            return f"{name} key {token!r} is not a token id (an integer >= 0)"
        if not _is_number(value) or not math.isfinite(value) or not (
                LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX):
            return (f"{name}[{token}] must be a finite number in [-100, 100], got "
                    f"{value!r}")
    return None


def out_of_vocab(bias: Mapping[int, float] | None, vocab_size: int) -> int | None:
    """The first ``logit_bias`` key that is not below ``vocab_size``, or None."""
    if not bias:
        return None
    return next((t for t in bias if t >= vocab_size), None)


def as_repetition_stop(value: Any) -> Any:
    """``SamplingParams.repetition_stop`` normalised: ``True`` -> the defaults, ``False`` /
    None -> None, a :class:`RepetitionStop` as is; anything else is returned unchanged for
    :meth:`SamplingParams.validate` to refuse."""
    if value is True:
        return RepetitionStop()
    if value is False or value is None:
        return None
    return value


def logit_bias_from_json(value: object, name: str = "logit_bias") -> dict[int, Any] | None:
    """A ``logit_bias`` as JSON carries it (an object whose keys are token ids written as
    decimal strings, OpenAI's form) -> ``{token_id: value}``; None for ``null``. The values
    are checked later (:func:`logit_bias_error`).

    Raises:
        ValueError: not an object, or a key that is not a decimal token id, naming ``name``.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object mapping token ids to biases, got "
                         f"{type(value).__name__}")
    out: dict[int, Any] = {}
    for key, bias in value.items():
        if _is_int(key):
            token = key
        elif isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        else:
            raise ValueError(f"{name} key {key!r} is not a token id (a non-negative integer)")
        if token in out:  # "5" and "05": two biases for one token, neither would be right
            raise ValueError(f"{name} key {key!r} names token {token} a second time")
        out[token] = bias
    return out


_STOP_FIELDS = ("min_tokens", "max_period", "min_repeats")


def repetition_stop_from_json(value: object,
                              name: str = "repetition_stop") -> RepetitionStop | None:
    """A ``repetition_stop`` as JSON carries it: ``true`` (the defaults), ``false`` / ``null``
    (off), or an object with any of ``min_tokens``, ``max_period``, ``min_repeats``.

    Raises:
        ValueError: another value, an unknown key or a value out of range, naming
            ``name`` (or ``name.key``).
    """
    if value is None or value is False:
        return None
    if value is True:
        return RepetitionStop()
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be true, false or an object with "
                         f"{', '.join(_STOP_FIELDS)}, got {type(value).__name__}")
    unknown = [k for k in value if k not in _STOP_FIELDS]
    if unknown:
        raise ValueError(f"{name}.{unknown[0]} is not a field of {name} (it takes "
                         f"{', '.join(_STOP_FIELDS)})")
    stop = RepetitionStop(**{k: v for k, v in value.items() if v is not None})
    stop.check(name)
    return stop
