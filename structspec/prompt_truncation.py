"""vLLM's ``truncate_prompt_tokens``: keep only the last tokens of a prompt.

The rule, as vLLM applies it (``vllm/sampling_params.py``: ``truncate_prompt_tokens``
``>= 1`` or ``-1``; ``vllm/renderers/params.py``, ``TokenizeParams``):

- ``None``: no truncation.
- ``k >= 1``: keep the last ``k`` tokens of the prompt once it is tokenized (a chat after its
  template). A text prompt is cut as Hugging Face's left truncation cuts it (vLLM tokenizes
  generation prompts with ``truncation_side="left"``): the special tokens the tokenizer adds
  (a BOS) stay and the text's first tokens go. A prompt of ``k`` tokens or fewer is left as
  it is.
- ``-1``: keep as many as the context holds beside the completion, ``max_model_len -
  max_tokens`` (``max_tokens`` only when the request gives one; the Python API passes none,
  as vLLM's ``LLM`` does, so there ``-1`` is ``max_model_len``).
- ``0``, below ``-1``, or more than ``-1`` would keep: refused, naming the field.

Imports nothing heavy: the API, the engine and the server check values with it.
"""

from __future__ import annotations

from collections.abc import Sequence

TRUNCATE_PARAM = "truncate_prompt_tokens"
"""The field's name, in the Python API and in requests."""


def truncate_value_error(value: object) -> str | None:
    """Why ``value`` is not a ``truncate_prompt_tokens`` (None, ``-1`` or an int ``>= 1``; a
    bool is not an int here), as a message starting with the field's name; None when it is
    one."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{TRUNCATE_PARAM} must be an integer >= 1 or -1, got {value!r}"
    if value == 0 or value < -1:
        return (f"{TRUNCATE_PARAM} must be an integer >= 1 (keep the last N prompt tokens) or "
                f"-1 (keep what the context holds), got {value}")
    return None


def kept_prompt_tokens(value: int | None, max_model_len: int,
                       max_tokens: int | None = None) -> int | None:
    """How many prompt tokens a request with ``truncate_prompt_tokens=value`` keeps at most
    (None: all of them).

    Args:
        max_model_len: the model's context length.
        max_tokens: the completion length the request asked for (None when it gave none).
            When it alone fills the context, no truncation can help: the prompt is cut to one
            token and the request's context-length check names ``max_tokens``.

    Raises:
        ValueError: ``value`` is not None, ``-1`` or an int ``>= 1``, or it is more than the
            context holds beside the completion; the message starts with the field's name.
    """
    if (why := truncate_value_error(value)) is not None:
        raise ValueError(why)
    if value is None:
        return None
    room = max_model_len - max(max_tokens or 0, 0)
    if room < 1:
        return 1
    if value == -1:
        return room
    if value > room:
        detail = (f"max_model_len - max_tokens = {max_model_len} - {max_tokens} = {room}"
                  if max_tokens else f"max_model_len = {max_model_len}")
        raise ValueError(f"{TRUNCATE_PARAM}={value} cannot be greater than {detail}; request "
                         "a smaller truncation size (-1 keeps what the context holds)")
    return value


def keep_last(ids: Sequence[int], keep: int | None) -> list[int]:
    """The last ``keep`` ids (all of them when ``keep`` is None or not less than their
    number)."""
    if keep is None or keep >= len(ids):
        return list(ids)
    return list(ids[len(ids) - keep:])
