"""Pydantic models of the OpenAI requests the server accepts.

Unknown fields are kept (``extra="allow"``) for :mod:`structspec.server.field_policy`, which
refuses the known ones the server cannot honour and unknown keys inside known objects, and
logs the unknown top-level ones; a known field of the wrong type is a 400 naming the field
(:func:`parse_request`). Types are not coerced: integer fields
take JSON integers only (``StrictInt``), number fields JSON numbers only (:data:`JsonFloat`:
an integer or a float, never ``"0.5"`` or ``true``), boolean fields ``true``/``false`` only
(``StrictBool``: never ``"yes"`` or ``1``). Besides the OpenAI fields, requests
accept the structured-output keys of sglang, vLLM (current ``structured_outputs`` and the
older ``guided_*``), TensorRT-LLM and llama.cpp; :mod:`structspec.server.structured` maps
them to one grammar. Responses are plain dicts built in ``serving_*.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from structspec.server.errors import APIError, bad_request

SchemaValue = dict[str, Any] | StrictBool | str
"""A JSON Schema: an object, a boolean schema (``true``/``false`` only: a lax bool would
take ``1`` as ``true``, the schema that allows everything), or JSON text."""


def _json_number(value: Any) -> Any:
    """Let only JSON numbers through to the float validator.

    Pydantic's lax ``float`` also takes numeric strings (``"0.5"``) and booleans (``true`` ->
    1.0), which would run a request with a value the client never sent as a number. Its
    ``StrictFloat`` is not used because whether it accepts an ``int`` has varied between
    pydantic versions, and a JSON ``1`` for ``temperature`` must stay valid. ``bool`` is
    checked first because it is a subclass of ``int``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:  # a JSON number all the same; say why it is refused
            raise PydanticCustomError("finite_number",
                                      "Input should be a finite number") from None
    return value


JsonFloat = Annotated[float, BeforeValidator(_json_number)]
"""A float field that accepts JSON numbers only (int or float; not bool, not a string)."""


class OpenAIModel(BaseModel):
    """Base: unknown fields are kept in ``model_extra`` (for
    :mod:`structspec.server.field_policy`); aliases and field names both accepted."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, protected_namespaces=())


# --------------------------------------------------------------------------- structured outputs


class JsonSchemaFormat(OpenAIModel):
    """``response_format.json_schema``: ``{name, description, schema, strict}``."""

    name: str | None = None
    description: str | None = None
    schema_: SchemaValue | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    """``response_format``: ``type`` is text, json_object, json_schema (OpenAI), json
    (TensorRT-LLM), regex, ebnf/grammar (TensorRT-LLM style), choice, or structural_tag
    (xgrammar's, as vLLM and sglang take it: ``format``, or the legacy ``structures`` and
    ``triggers``; kept as sent, read by :mod:`structspec.structural_tag`).

    ``schema`` next to ``type`` is llama.cpp's / TensorRT-LLM's shape.
    """

    type: str
    json_schema: JsonSchemaFormat | None = None
    schema_: SchemaValue | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    regex: str | None = None
    pattern: str | None = None
    ebnf: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    choices: list[str] | None = None
    format: Any = None
    structures: Any = None
    triggers: Any = None


class StructuredOutputs(OpenAIModel):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object, structural_tag (JSON text, as vLLM types it, or an object); and structspec's ``bounded_numbers`` (``false``: the request's JSON grammar,
    given here or elsewhere, without the default number bounds)."""

    json_: SchemaValue | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: Any = None
    # structspec's loop guard on the request's JSON grammar (wherever it was given);
    # false lifts the default number bounds
    bounded_numbers: StrictBool | None = None


class StreamOptions(OpenAIModel):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage``;
    ``continuous_usage_stats`` (vLLM) gives each choice chunk its usage so far
    (:mod:`structspec.server.stream_usage`); ``include_obfuscation`` (OpenAI) is refused when
    true (:mod:`structspec.server.field_policy`)."""

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False
    include_obfuscation: StrictBool | None = None


# --------------------------------------------------------------------------- common fields


class SamplingRequest(OpenAIModel):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: JsonFloat | None = None
    top_p: JsonFloat | None = None
    top_k: StrictInt | None = None
    min_p: JsonFloat | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt | None = None  # vLLM's
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's: words never generated ([] = none)
    # vLLM's: keep the stop string (and a stop token's text) in the text; keep special tokens
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    # vLLM's: with special tokens kept, false drops the decoder's space between two of them
    spaces_between_special_tokens: StrictBool | None = None
    # vLLM's: keep the last N prompt tokens (-1: what the context holds beside the completion)
    truncate_prompt_tokens: StrictInt | None = None
    # vLLM's: log-prob tokens as "token_id:N" instead of their text
    return_tokens_as_token_ids: StrictBool | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: JsonFloat | None = None
    frequency_penalty: JsonFloat | None = None
    repetition_penalty: JsonFloat | None = None
    logit_bias: dict[str, JsonFloat] | None = None
    # vLLM's: lower is served first (admission and preemption order); null = 0
    priority: StrictInt | None = None
    # vLLM's: each prompt token's logprob, rank and top-k (server/prompt_logprobs.py)
    prompt_logprobs: StrictInt | None = None
    # structspec's loop stop: true (defaults) or {min_tokens, max_period, min_repeats}
    repetition_stop: StrictBool | dict[str, Any] | None = None
    user: str | None = None
    # structured outputs, every shape clients send
    response_format: ResponseFormat | None = None
    json_schema: SchemaValue | None = None  # sglang / llama.cpp
    regex: str | None = None  # sglang
    ebnf: str | None = None  # sglang
    grammar: str | None = None  # llama.cpp (GBNF)
    choice: list[str] | None = None
    guided_json: SchemaValue | None = None  # vLLM < 0.12
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM >= 0.12


# --------------------------------------------------------------------------- chat


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``.

    ``messages`` is taken as sent and checked by the endpoint with
    :func:`structspec.core.check_chat_messages`, the check the Python API and the CLI use
    too, so that every path names a malformed message's field the same way.
    """

    messages: Any
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's chat template options (structspec.core.ChatTemplateOptions; null: the default)
    add_generation_prompt: StrictBool | None = True
    continue_final_message: StrictBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


# --------------------------------------------------------------------------- completions


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``; ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None


# --------------------------------------------------------------------------- tokenization


class TokenizeRequest(OpenAIModel):
    """``POST /tokenize`` (vLLM's): either ``prompt`` (text, tokenized as
    ``/v1/completions`` tokenizes it) or ``messages`` (a chat, rendered and tokenized as
    ``/v1/chat/completions`` builds its prompt); the endpoint refuses both or neither.

    ``add_special_tokens`` defaults by shape as in vLLM: true for ``prompt`` (e.g. a BOS),
    false for ``messages`` (the chat template holds them). ``add_generation_prompt``,
    ``continue_final_message``, ``chat_template_kwargs``, ``tools`` and ``tool_choice`` go
    with ``messages`` only. ``tool_choice`` is the chat
    endpoint's (``"none"`` keeps the tools out of the template), so a chat request's body
    counts as that request's prompt.
    """

    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class DetokenizeRequest(OpenAIModel):
    """``POST /detokenize`` (vLLM's): ``tokens``, the ids to turn back into text."""

    model: str | None = None
    tokens: list[StrictInt]


# --------------------------------------------------------------------------- parsing

ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_request(model: type[ModelT], body: Any) -> ModelT:
    """Validate a JSON body into ``model``.

    Raises:
        APIError: 400 naming the first bad field and why.
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _to_api_error(e) from None


def _to_api_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    param = _loc_to_param(err.get("loc", ()))
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        return bad_request(f"'{param}' is a required field", param)
    return bad_request(f"invalid value for '{param}': {msg}", param)


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    """``('messages', 0, 'role')`` -> ``messages[0].role`` (union branch names dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in _UNION_TAGS):
            continue  # pydantic's union-member labels such as 'list[int]'
        else:
            out += ("." if out else "") + str(part)
    return out


_UNION_TAGS = {"str", "int", "bool", "float", "dict", "list", "function-after", "nullable"}
