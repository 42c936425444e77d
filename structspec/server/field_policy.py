"""What the server does with request fields it does not implement: nothing is dropped
without a word.

- **Fields it knows but cannot honour** (:data:`UNSUPPORTED`: OpenAI's ``functions``,
  ``audio``, ``reasoning_effort``...; vLLM's sampling extras such as ``use_beam_search`` or
  ``length_penalty``): a 400 ``code: "unsupported"`` naming the field, unless
  the value asks for nothing (``null``, or the value that changes nothing: ``length_penalty:
  1``, ``store: false``, ``modalities: ["text"]``...). The penalties (``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``), ``logit_bias`` and vLLM's ``min_tokens``,
  ``allowed_token_ids``, ``bad_words``, ``include_stop_str_in_output``, ``skip_special_tokens``,
  ``spaces_between_special_tokens``, ``truncate_prompt_tokens``,
  ``return_tokens_as_token_ids`` and ``prompt_logprobs`` are served
  (:mod:`structspec.server.params` checks their values), and so are vLLM's chat template
  options ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``
  (:class:`structspec.core.ChatTemplateOptions` checks them), on ``/v1/chat/completions`` and
  ``/tokenize``; a per-request ``chat_template`` stays refused (it would run the client's
  Jinja in the server: the template is set at launch, ``serve --chat-template``), and so does
  ``documents``.
- **Fields it accepts without effect** (:data:`NO_EFFECT`): identifiers and hints that do not
  change an output (``user``, ``metadata``, ``safety_identifier``, ``prompt_cache_key``).
- **Unknown keys inside an object the server reads** (``stream_options`` here;
  ``response_format``, ``response_format.json_schema`` and ``structured_outputs`` in
  :mod:`structspec.server.structured`): a 400 naming the key, e.g.
  ``structured_outputs.jsn``. A misspelt option of a known object is a mistake, never
  something to skip.
- **Unknown top-level fields** (of every endpoint, ``/tokenize`` and ``/detokenize`` too)
  are accepted and ignored, as vLLM does, with a warning in the
  server log naming them (:func:`warn_unknown_fields`): clients written for another server
  send its own extras (``kv_transfer_params``, ``mm_processor_kwargs``...), and refusing every
  request of such a client would be worse than the warning. OpenAI refuses them; structspec follows
  vLLM here, and refuses every extra it knows changes an output (the table).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from structspec.server.errors import APIError, bad_request
from structspec.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)

logger = logging.getLogger("structspec.server")

CHAT, COMPLETIONS = "chat", "completions"
TOKENIZE, DETOKENIZE = "tokenize", "detokenize"
_BOTH = (CHAT, COMPLETIONS)

MAX_LOGGED_FIELDS = 8
"""Unknown field names one warning lists (a hostile body may carry thousands)."""
MAX_LOGGED_NAME_CHARS = 40
"""Characters of one unknown field name in the warning."""


@dataclass(frozen=True)
class Unsupported:
    """A field the server knows but does not implement.

    Attributes:
        name: the top-level request field.
        accepts: whether a value asks for nothing the server would leave undone
            (``None`` is always accepted: the field left out).
        accepted: the accepted values, in words, for the error message.
        endpoints: where OpenAI or vLLM define the field (``chat``, ``completions``,
            ``tokenize``); only there is it refused, elsewhere it is an unknown field.
    """

    name: str
    accepts: Callable[[Any, Any], bool]
    accepted: str
    endpoints: tuple[str, ...] = _BOTH


def _is(*values: Any) -> Callable[[Any, SamplingRequest], bool]:
    """Accepts exactly ``values`` (``True`` is not ``1``: compared with their types)."""
    return lambda v, _req: any(type(v) is type(x) and v == x for x in values)


def _number(value: float) -> Callable[[Any, SamplingRequest], bool]:
    """Accepts the JSON number ``value`` (``0`` or ``0.0``; never ``false``)."""
    return lambda v, _req: (isinstance(v, (int, float)) and not isinstance(v, bool)
                            and v == value)


def _empty(v: Any, _req: SamplingRequest) -> bool:
    return v in ([], {}, "")


def _never(_v: Any, _req: SamplingRequest) -> bool:
    return False


def _best_of(v: Any, req: SamplingRequest) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == req.n


UNSUPPORTED: tuple[Unsupported, ...] = (
    # OpenAI chat
    Unsupported("functions", _empty, "[] (use response_format to constrain the answer)",
                (CHAT,)),
    Unsupported("function_call", _is("none", "auto"), '"none" or "auto"', (CHAT,)),
    Unsupported("audio", _never, "null (text output only)", (CHAT,)),
    Unsupported("modalities", _is(["text"]), '["text"]', (CHAT,)),
    Unsupported("prediction", _never, "null", (CHAT,)),
    Unsupported("reasoning_effort", _never, "null (not a reasoning model)", (CHAT,)),
    Unsupported("verbosity", _never, "null", (CHAT,)),
    Unsupported("web_search_options", _never, "null", (CHAT,)),
    Unsupported("store", _is(False), "false (nothing is stored)", (CHAT,)),
    Unsupported("service_tier", _is("auto", "default"), '"auto" or "default"', (CHAT,)),
    # OpenAI completions
    Unsupported("suffix", _empty, '""', (COMPLETIONS,)),
    Unsupported("best_of", _best_of, "equal to n", (COMPLETIONS,)),
    # vLLM's sampling extras that change an output
    Unsupported("length_penalty", _number(1), "1"),
    Unsupported("use_beam_search", _is(False), "false"),
    # include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens,
    # truncate_prompt_tokens, return_tokens_as_token_ids, prompt_logprobs and bad_words are
    # served (SamplingRequest)
    Unsupported("guided_decoding_backend", _never,
                "null (the grammar backend is a server option: serve --grammar-backend)"),
    Unsupported("guided_whitespace_pattern", _never, "null"),
    Unsupported("echo", _is(False), "false", (CHAT,)),  # vLLM's chat echo; completions has it
    # add_generation_prompt, continue_final_message and chat_template_kwargs are served
    # (serving_chat.py); a per-request template would run the client's Jinja in the server
    Unsupported("chat_template", _never, "null (the server's template is used: the model's own, or serve --chat-template)", (CHAT,)),
    Unsupported("documents", _never, "null", (CHAT,)),
    # vLLM's /tokenize chat options beyond the chat endpoint's
    Unsupported("chat_template", _never, "null (the server's template is used: the model's own, or serve --chat-template)", (TOKENIZE,)),
    Unsupported("mm_processor_kwargs", _empty, "{} (text only)", (TOKENIZE,)),
)
"""Every field the server refuses unless its value asks for nothing (module docstring)."""

NO_EFFECT: frozenset[str] = frozenset({"user", "metadata", "safety_identifier",
                                       "prompt_cache_key"})
"""OpenAI fields accepted without effect: they identify the caller or hint a cache, and an
output is the same with or without them."""

STREAM_OPTIONS_KEYS = ("include_usage", "continuous_usage_stats", "include_obfuscation")


def endpoint_of(req: BaseModel) -> str:
    """``chat``, ``completions``, ``tokenize`` or ``detokenize``."""
    if isinstance(req, ChatCompletionRequest):
        return CHAT
    if isinstance(req, TokenizeRequest):
        return TOKENIZE
    if isinstance(req, DetokenizeRequest):
        return DETOKENIZE
    return COMPLETIONS


def field_value(req: BaseModel, name: str) -> Any:
    """The value sent for the top-level field ``name`` (declared or extra); None if absent."""
    if name in type(req).model_fields:
        return getattr(req, name)
    return (req.model_extra or {}).get(name)


def check_unsupported(req: BaseModel) -> None:
    """Refuse a field of :data:`UNSUPPORTED` whose value asks for something.

    Raises:
        APIError: 400 ``code: "unsupported"`` naming the field and what it accepts.
    """
    endpoint = endpoint_of(req)
    for entry in UNSUPPORTED:
        if endpoint not in entry.endpoints:
            continue
        value = field_value(req, entry.name)
        if value is None or entry.accepts(value, req):
            continue
        raise bad_request(f"{entry.name} is not supported by this server (accepted: "
                          f"{entry.accepted}; or leave it out)", entry.name,
                          code="unsupported")


def given_keys(model: BaseModel) -> dict[str, Any]:
    """The keys a client gave an object (declared by their JSON name, and extra ones) with a
    value other than ``null``: a ``null`` asks for nothing, as if the key were left out."""
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if value is not None:
            out[info.alias or name] = value
    out.update((k, v) for k, v in (model.model_extra or {}).items() if v is not None)
    return out


def refuse_unknown_keys(model: BaseModel, param: str, known: Iterable[str]) -> None:
    """Refuse a key of the object at ``param`` that is not one of ``known`` (a ``null``
    value is let through: it asks for nothing).

    Raises:
        APIError: 400 naming ``param.KEY`` and listing the known keys.
    """
    known = tuple(known)
    for key, value in (model.model_extra or {}).items():
        if value is not None and key not in known:
            raise unknown_key_error(param, key, known)


def unknown_key_error(param: str, key: str, known: Iterable[str]) -> APIError:
    """The 400 of an unknown ``key`` in the object at ``param``."""
    return bad_request(f"unknown field {param}.{key}; {param} takes {', '.join(known)}",
                       f"{param}.{key}")


def unknown_fields(req: BaseModel) -> list[str]:
    """Top-level fields of ``req`` that the server neither reads nor knows (module
    docstring), in the order sent."""
    endpoint = endpoint_of(req)
    known = {e.name for e in UNSUPPORTED if endpoint in e.endpoints} | NO_EFFECT
    return [k for k in (req.model_extra or {}) if k not in known]


def warn_unknown_fields(req: BaseModel, request_id: str | None = None) -> list[str]:
    """Log a warning naming the unknown top-level fields of ``req`` (vLLM's "fields were
    present in the request but ignored"); returns them. Names are cut to
    :data:`MAX_LOGGED_NAME_CHARS` characters and the list to :data:`MAX_LOGGED_FIELDS`."""
    names = unknown_fields(req)
    if names:
        shown = [ascii(n[:MAX_LOGGED_NAME_CHARS]) for n in names[:MAX_LOGGED_FIELDS]]
        more = len(names) - len(shown)
        logger.warning("request%s: ignored unknown field(s) %s%s (not known to this server)",
                       f" {request_id}" if request_id else "", ", ".join(shown),
                       f" and {more} more" if more > 0 else "")
    return names


def check_request_fields(req: SamplingRequest) -> None:
    """The field policy of one request, before anything else is done with it: refuse the
    unsupported fields, ``stream_options`` without ``stream`` and its unknown keys, warn about
    unknown top-level fields, and refuse an ``include_obfuscation`` the stream does not follow
    (``continuous_usage_stats`` is served: :mod:`structspec.server.stream_usage`).

    Raises:
        APIError: 400 naming the field.
    """
    check_unsupported(req)
    so = req.stream_options
    if so is not None:
        if not req.stream:  # as OpenAI and vLLM answer: the options are the stream's
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        refuse_unknown_keys(so, "stream_options", STREAM_OPTIONS_KEYS)
        if so.include_obfuscation:
            raise bad_request("stream_options.include_obfuscation is not supported (the "
                              "stream carries no obfuscation field)",
                              "stream_options.include_obfuscation", code="unsupported")
    warn_unknown_fields(req)


def check_tokenization_fields(req: TokenizeRequest | DetokenizeRequest) -> None:
    """The field policy of a ``/tokenize`` or ``/detokenize`` request: refuse vLLM's chat
    options the server cannot honour (``chat_template``, ``continue_final_message``...) unless
    they ask for nothing, and warn about unknown top-level fields (a chat request's body sent
    as is to count its prompt: its sampling fields are ignored with a warning).

    Raises:
        APIError: 400 ``code: "unsupported"`` naming the field.
    """
    check_unsupported(req)
    warn_unknown_fields(req)
