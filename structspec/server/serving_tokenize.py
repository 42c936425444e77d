"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): count a prompt's tokens, map ids back
to text.

``/tokenize`` takes either ``prompt`` (text, encoded as ``/v1/completions`` encodes it) or
``messages`` (a chat, checked, rendered and encoded exactly as ``/v1/chat/completions`` builds
its prompt: the same message checks, the same tools, the same codec call); the answer is
``{"count", "max_model_len", "tokens", "token_strs"}``, ``token_strs`` being the vocabulary
entries of the ids (HF ``convert_ids_to_tokens``) when ``return_token_strs`` is true, else
null. ``/detokenize`` takes ``tokens`` and answers ``{"prompt": text}``, special tokens kept
(as vLLM decodes), so that ``/detokenize`` of a chat's ids is its rendered template.

Both bound their input as the generation endpoints do: the body's bytes, the prompt's
characters (``--max-prompt-chars``), and the context: a prompt of more than ``max_model_len``
tokens, or more than ``max_model_len`` ids to detokenize, is a 400 (as vLLM's endpoints
bound them), so that neither ties up the front end's one tokenizer thread for long. The work
runs on that thread (:func:`~structspec.server.serving.in_thread`), off the event loop.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from structspec.core import (
    CONTEXT_LENGTH_EXCEEDED,
    ChatMessageError,
    ChatTemplateOptions,
    PromptTooLongError,
)
from structspec.server.codec import Codec
from structspec.server.errors import bad_request
from structspec.server.field_policy import check_tokenization_fields
from structspec.server.limits import check_prompt_chars
from structspec.server.protocol import DetokenizeRequest, TokenizeRequest, parse_request
from structspec.server.serving import (
    ServerState,
    in_thread,
    json_response,
    prompt_too_long,
    read_json,
)
from structspec.server.serving_chat import (
    check_chat_prompt,
    check_continuation,
    template_messages,
    template_options,
    template_tools,
)
from structspec.server.tool_calls import plan_tool_calls

CHAT_ONLY_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                    "tools", "tool_choice")
"""``/tokenize`` fields that apply to ``messages`` only (a 400 beside ``prompt``)."""


async def create_tokenize(state: ServerState, request: Request) -> Response:
    """Handle one ``POST /tokenize``.

    Args:
        state: the server's state (codec, limits, model name, engine info).
        request: the HTTP request; its body is a :class:`~structspec.server.protocol.
            TokenizeRequest`.

    Returns:
        200 ``{"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] |
        null}``.

    Raises:
        APIError: 503 while the engine is not serving; 413 for a body over
            ``--max-request-bytes``; 404 for a ``model`` not served; 400 naming the field for
            a body that is not a JSON object, a field of the wrong type, an unsupported vLLM
            option, both or neither of ``prompt`` and ``messages``, a chat-only field beside
            ``prompt``, malformed messages or tools, a prompt over ``--max-prompt-chars``
            characters (``prompt_too_large``) or over ``max_model_len`` tokens
            (``context_length_exceeded``), text that is not valid Unicode, or a chat template
            that fails to render.
    """
    state.require_ready()
    limits = state.limits
    req = parse_request(TokenizeRequest, await read_json(request, limits.max_request_bytes))
    state.check_model(req.model)
    check_tokenization_fields(req)
    max_len = state.max_model_len
    if req.prompt is not None and req.messages is not None:
        raise bad_request("messages: send either prompt (text) or messages (a chat), not both",
                          "messages")
    if req.prompt is not None:
        for name in CHAT_ONLY_FIELDS:
            if getattr(req, name) is not None:
                raise bad_request(f"{name} applies to messages only, not to prompt", name)
        param = "prompt"
        check_prompt_chars(limits, len(req.prompt), param)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        encode = partial(_encode_text, state.codec, req.prompt, max_len, add_special)
    elif req.messages is not None:
        param = "messages"
        # the chat endpoint's checks, in its order: template options, tools (and
        # tool_choice), messages, size
        options = template_options(req)
        check_continuation(plan_tool_calls(req.tools, req.tool_choice), options)
        messages = template_messages(req.messages, hermes=state.tool_call_parser == "hermes")
        tools = template_tools(req.tools, req.tool_choice)
        check_chat_prompt(limits, messages, tools, options)
        add_special = bool(req.add_special_tokens)  # vLLM's default for a chat: false
        encode = partial(_encode_chat, state.codec, messages, tools, max_len, options,
                         add_special)
    else:
        raise bad_request("'prompt' (text) or 'messages' (a chat) is required", "prompt")
    try:
        ids, pieces = await in_thread(encode, bool(req.return_token_strs))
    except PromptTooLongError as e:
        raise prompt_too_long(e.min_tokens, max_len, param, at_least=True,
                              completion=False) from None
    except ChatMessageError as e:  # the template cannot leave the final message open
        raise bad_request(str(e), e.param, code=e.code) from None
    except ValueError as e:  # not valid Unicode; no chat template, or it failed to render
        raise bad_request(str(e), param) from None
    if len(ids) > max_len:
        raise prompt_too_long(len(ids), max_len, param, completion=False)
    return json_response({"count": len(ids), "max_model_len": max_len, "tokens": ids,
                          "token_strs": pieces})


async def create_detokenize(state: ServerState, request: Request) -> Response:
    """Handle one ``POST /detokenize``.

    Args:
        state: the server's state (codec, limits, model name, engine info).
        request: the HTTP request; its body is a :class:`~structspec.server.protocol.
            DetokenizeRequest`.

    Returns:
        200 ``{"prompt": str}``: the text of the ids, special tokens included.

    Raises:
        APIError: 503 while the engine is not serving; 413 for a body over
            ``--max-request-bytes``; 404 for a ``model`` not served; 400 naming ``tokens``
            for ids missing, not integers, outside the vocabulary ``[0, vocab_size)``, or more
            than ``max_model_len`` of them; 400 naming the field for a body that is not a JSON
            object or a field of the wrong type.
    """
    state.require_ready()
    req = parse_request(DetokenizeRequest,
                        await read_json(request, state.limits.max_request_bytes))
    state.check_model(req.model)
    check_tokenization_fields(req)
    ids = req.tokens
    max_len = state.max_model_len
    if len(ids) > max_len:
        raise bad_request(f"tokens: {len(ids)} ids; at most {max_len} (the model's maximum "
                          "context length)", "tokens", code=CONTEXT_LENGTH_EXCEEDED)
    vocab = state.engine.info.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab})",
                          "tokens")
    text = await in_thread(_decode, state.codec, ids)
    return json_response({"prompt": text})


def _encode_text(codec: Codec, text: str, max_tokens: int, add_special_tokens: bool,
                 with_pieces: bool) -> tuple[list[int], list[str] | None]:
    """``text``'s ids (and their vocabulary entries when ``with_pieces``), on the tokenizer
    thread. Raises: as :meth:`Codec.encode_text`."""
    ids = codec.encode_text(text, max_tokens, add_special_tokens=add_special_tokens)
    return ids, _pieces(codec, ids, max_tokens, with_pieces)


def _encode_chat(codec: Codec, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None, max_tokens: int,
                 options: ChatTemplateOptions, add_special_tokens: bool,
                 with_pieces: bool) -> tuple[list[int], list[str] | None]:
    """The chat's prompt ids (and their vocabulary entries when ``with_pieces``), on the
    tokenizer thread. Raises: as :meth:`Codec.encode_chat`."""
    ids = codec.encode_chat(messages, tools, max_tokens, options,
                            add_special_tokens=add_special_tokens)
    return ids, _pieces(codec, ids, max_tokens, with_pieces)


def _pieces(codec: Codec, ids: list[int], max_tokens: int,
            with_pieces: bool) -> list[str] | None:
    """The vocabulary entries of ``ids`` when asked for (not for a prompt over the context:
    the caller refuses it)."""
    return codec.token_pieces(ids) if with_pieces and len(ids) <= max_tokens else None


def _decode(codec: Codec, ids: list[int]) -> str:
    """The text of ``ids`` with special tokens kept, on the tokenizer thread."""
    return codec.decode(ids, skip_special_tokens=False)

