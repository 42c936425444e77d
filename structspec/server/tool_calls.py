"""Forced tool calls on ``POST /v1/chat/completions``: ``tool_choice`` ``"required"`` or a named
function, enforced by the grammar, returned as ``message.tool_calls``.

What a client sends (OpenAI's shapes): ``tools``, a list of ``{"type": "function", "function":
{"name", "description"?, "parameters"?, "strict"?}}``, and ``tool_choice``:

- ``{"type": "function", "function": {"name": N}}``: the answer is one call of ``N``; the output
  is its arguments, generated under the tool's ``parameters`` JSON Schema (an object with no
  fixed properties when the tool gives none).
- ``"required"``: the answer is one or more calls (one when ``parallel_tool_calls`` is
  false); the output is a JSON array of ``{"name": <a tool's name>, "parameters": <its
  arguments>}`` objects, generated under a schema whose items are one branch per tool (the
  name as a ``const``, the arguments under that tool's ``parameters``), as vLLM and sglang
  constrain ``required``. Each tool's schema becomes a root ``$defs`` entry its branch
  references, and its local ``$ref``s (``#``, ``#/$defs/...``, ``#/definitions/...``,
  ``#/properties/...``) are rebased onto that entry, so they resolve as in the tool's own
  schema.
- ``"auto"`` / ``"none"`` / absent: nothing is forced; ``tools`` only reach the chat template
  (with ``--tool-call-parser hermes``, ``"auto"`` / absent answers are read as tool calls:
  :mod:`structspec.server.hermes_tools`).

The tools are checked whatever ``tool_choice`` says (they reach the chat template): OpenAI's
keys only (a misspelt ``parameter`` is a 400 naming it, where it used to be skipped and the
call generated without its schema), a name, no two tools of one name, and ``parameters`` an
object schema (``type`` ``object`` or left out: arguments are keyword arguments).

``strict`` follows the tools' ``function.strict`` (all of them for ``required``; OpenAI's
default ``false`` is best effort, as for ``response_format``: a ``parameters`` schema the
grammar cannot enforce, e.g. ``allOf [{"type": "string"}]`` or ``type`` beside a ``$ref``, may
then give arguments outside it, flagged by ``schema_valid`` false; ``strict: true`` refuses
such a schema up front). The response carries the calls
in ``message.tool_calls`` (``content`` null) with ``finish_reason`` ``"tool_calls"`` when the
grammar finished, the finish reason as is otherwise (``length``, or ``stop`` with its
``stop_reason`` at a stop string or stop token id: the arguments are cut there);
a ``required`` output that is not a complete JSON array (cut by ``max_tokens``) comes back as
``content`` with no calls. Streaming sends a named call's id and name first, then its
arguments as they are generated; ``required`` calls are sent whole when the output is complete.

An assistant message of the history with ``tool_calls`` (what a client sends back after a
call) is rendered with its calls as JSON text after its content, if any
(:func:`history_message`), so a chat template that knows nothing of tool calls still shows
them to the model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from structspec.constraints import JsonSchemaConstraint
from structspec.schema_structure import (
    DATA_KEYWORDS,
    MAX_SCHEMA_NESTING,
    NAME_MAP_KEYWORDS,
    json_nesting,
)
from structspec.server.errors import bad_request
from structspec.server.field_policy import unknown_key_error

#: ``finish_reason`` of an answer whose forced tool calls were generated to the end
TOOL_CALLS_FINISH = "tool_calls"


@dataclass(frozen=True)
class ToolCallPlan:
    """How a request's forced tool calls are generated and read back.

    Attributes:
        mode: ``"named"`` (one call of ``name``) or ``"required"`` (a JSON array of calls).
        grammar: the JSON Schema the output is generated under.
        grammar_param: the request field the schema came from (the ``param`` of its errors).
        name: the named tool (``"named"`` only).
    """

    mode: str
    grammar: JsonSchemaConstraint
    grammar_param: str
    name: str | None = None


#: keys of a tool, of its ``function``, and of a named ``tool_choice`` (OpenAI's); any other
#: key is a 400 naming it, as for every object the server reads (a misspelt ``parameter`` used
#: to be skipped, and the call generated without its schema)
TOOL_KEYS = frozenset({"type", "function"})
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
CHOICE_KEYS = frozenset({"type", "function"})
CHOICE_FUNCTION_KEYS = frozenset({"name"})


def _refuse_unknown(obj: dict[str, Any], known: frozenset[str], where: str) -> None:
    """The server's 400 for an unknown key of the object at ``where`` (a ``null`` value asks
    for nothing and passes, as elsewhere)."""
    for key, value in obj.items():
        if value is not None and key not in known:
            raise unknown_key_error(where, key, sorted(known))


def _function_of(tool: Any, i: int) -> dict[str, Any]:
    """``tools[i].function``, checked: known keys only, a name, and ``parameters`` (when
    given) an object schema."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}}",
                          where)
    _refuse_unknown(tool, TOOL_KEYS, where)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function: expected an object with a 'name'",
                          f"{where}.function")
    _refuse_unknown(fn, FUNCTION_KEYS, f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name: expected a non-empty string",
                          f"{where}.function.name")
    for key, kind, expected in (("parameters", dict, "a JSON Schema object"),
                                ("description", str, "a string"), ("strict", bool, "a boolean")):
        value = fn.get(key)
        if value is not None and not isinstance(value, kind):
            raise bad_request(f"{where}.function.{key}: expected {expected}",
                              f"{where}.function.{key}")
    params = fn.get("parameters")
    if params is not None and json_nesting(params) > MAX_SCHEMA_NESTING:
        # checked whatever tool_choice says: the chat template renders every tool
        raise bad_request(f"{where}.function.parameters: the schema nests deeper than "
                          f"{MAX_SCHEMA_NESTING} levels", f"{where}.function.parameters")
    if params is not None and params.get("type", "object") != "object":
        # the arguments are keyword arguments: OpenAI requires an object schema too
        raise bad_request(f"{where}.function.parameters.type: expected \"object\" (a tool's "
                          f"arguments are a JSON object), got {params.get('type')!r}",
                          f"{where}.function.parameters.type")
    return fn


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` as their checked ``function`` objects (empty when none).

    Raises:
        APIError: 400 naming the field: not a list, a malformed tool (above), or two tools
            of one name.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools: expected a list of tools", "tools")
    functions = [_function_of(t, i) for i, t in enumerate(tools)]
    seen: set[str] = set()
    for i, fn in enumerate(functions):
        if fn["name"] in seen:
            raise bad_request(f"tools[{i}].function.name: {fn['name']!r} names another tool "
                              "too", f"tools[{i}].function.name")
        seen.add(fn["name"])
    return functions


def tool_parameters(fn: dict[str, Any]) -> dict[str, Any]:
    """The tool's arguments schema, an object schema (one without fixed properties when the
    tool gives none)."""
    params = fn.get("parameters")
    if params is None:
        return {"type": "object", "properties": {}}
    return {"type": "object", **params}


def plan_tool_calls(tools: Any, tool_choice: Any,
                    parallel_tool_calls: Any = None) -> ToolCallPlan | None:
    """Check the request's tools and return the forced calls it asks for, or None (``auto``,
    ``none``, no ``tool_choice``).

    Raises:
        APIError: 400 naming the field: a malformed tool or two of one name (checked whatever
            ``tool_choice`` says: the tools reach the chat template), a ``tool_choice`` that is
            not ``auto``/``none``/``required``/a named function, a named function not in
            ``tools``, ``auto``, ``required`` or a named function without ``tools``, or a
            ``parallel_tool_calls`` that is not a boolean.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls: expected a boolean", "parallel_tool_calls")
    functions = check_tools(tools)
    if tool_choice == "auto" and not functions:
        # as vLLM and OpenAI answer ("When using `tool_choice`, `tools` must be set"); "none"
        # without tools asks for nothing and stays accepted
        raise bad_request("tool_choice: \"auto\" needs a non-empty 'tools' list",
                          "tool_choice")
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not functions:
        raise bad_request("tool_choice: forcing a tool call needs a non-empty 'tools' list",
                          "tool_choice")
    if tool_choice == "required":
        return _required(functions, parallel_tool_calls is not False)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice: expected \"auto\", \"none\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")
        _refuse_unknown(tool_choice, CHOICE_KEYS, "tool_choice")
        _refuse_unknown(fn, CHOICE_FUNCTION_KEYS, "tool_choice.function")  # type: ignore[arg-type]
        for i, f in enumerate(functions):
            if f["name"] == name:
                return ToolCallPlan("named", JsonSchemaConstraint(
                    tool_parameters(f), strict=bool(f.get("strict", False))),
                    f"tools[{i}].function.parameters", name=name)
        raise bad_request(f"tool_choice: no tool named {name!r} in 'tools' (have "
                          f"{[f['name'] for f in functions]})", "tool_choice")
    raise bad_request("tool_choice: expected \"auto\", \"none\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def _rebased(node: Any, base: str, *, names: bool = False) -> Any:
    """``node`` with every local ``$ref`` (``#...``) moved under ``base``, the JSON pointer of
    where the schema now sits. The values of data keywords (``const``, ``enum``...) are left
    as they are; the keys of a name map (``properties``, ``$defs``...) are names, so a
    property named ``enum`` still holds a schema (``names``: ``node`` is such a map)."""
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {key: _rebased(value, base) for key, value in node.items()}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, base, names=key in NAME_MAP_KEYWORDS)
    return out


#: where ``required`` puts tool ``i``'s parameters schema: a root ``$defs`` entry, so that
#: every rebased pointer goes through object keys only (xgrammar does not follow an array
#: index such as ``#/items/anyOf/0`` in a ``$ref``)
_TOOL_DEF = "tool_{}"


def _required(functions: list[dict[str, Any]], parallel: bool) -> ToolCallPlan:
    """``tool_choice: "required"``: an array of calls, one ``anyOf`` branch per tool. Each
    tool's parameters schema becomes a root ``$defs`` entry that its branch references, and
    its own local ``$ref``s (``#``, ``#/$defs/...``, ``#/properties/...``) are rebased onto
    that entry, so they resolve as in the tool's own schema."""
    defs: dict[str, Any] = {}
    branches = []
    for i, fn in enumerate(functions):
        name = _TOOL_DEF.format(i)
        defs[name] = _rebased(tool_parameters(fn), f"#/$defs/{name}")
        branches.append({"type": "object",
                         "properties": {"name": {"const": fn["name"]},
                                        "parameters": {"$ref": f"#/$defs/{name}"}},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": branches[0] if len(branches) == 1
                              else {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    strict = all(bool(fn.get("strict", False)) for fn in functions)
    return ToolCallPlan("required", JsonSchemaConstraint(schema, strict=strict), "tools")


def new_call_id() -> str:
    """A fresh tool call id (``call_`` and 24 hex digits, as OpenAI's look)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def calls_from_output(plan: ToolCallPlan, text: str,
                      ids: list[str] | None = None) -> list[dict[str, Any]] | None:
    """The ``tool_calls`` of an output, or None when it is not a complete ``required`` array.

    Args:
        plan: the request's plan.
        text: the generated text (the named call's arguments, or the array of calls).
        ids: call ids to use, in order (a stream's, sent earlier); fresh ones otherwise.
    """
    if plan.mode == "named":
        return [{"id": ids[0] if ids else new_call_id(), "type": "function",
                 "function": {"name": plan.name, "arguments": text}}]
    try:
        calls = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None  # best effort (strict off) may leave the schema: no calls to report
    return [{"id": ids[i] if ids and i < len(ids) else new_call_id(), "type": "function",
             "function": {"name": c["name"],
                          "arguments": json.dumps(c.get("parameters", {}), ensure_ascii=False)}}
            for i, c in enumerate(calls)]


def finish_reason(reason: str | None, stop_reason: str | int | None) -> str | None:
    """The choice's ``finish_reason``: ``tool_calls`` when the calls were generated to the
    grammar's end (``stop`` at the end-of-sequence token, ``stop_reason`` None); the engine's
    reason otherwise (``length``, or ``stop`` at a stop string or stop token id, which cut
    the arguments)."""
    return TOOL_CALLS_FINISH if reason == "stop" and stop_reason is None else reason


def history_message(message: dict[str, Any], index: int, *,
                    hermes: bool = False) -> dict[str, Any]:
    """An assistant message with ``tool_calls``, as text a chat template shows: the calls as
    JSON (``[{"name": ..., "arguments": ...}]``; with ``hermes``, the server's
    ``--tool-call-parser hermes``, each as the ``<tool_call>`` section the model is asked to
    write) after its text, if any, and no ``tool_calls`` key (a template that renders it
    would show the calls twice). Other messages are returned as they are.

    Raises:
        APIError: 400 naming the field when ``tool_calls`` is not a list of ``{"function":
            {"name", "arguments"}}``.
    """
    calls = message.get("tool_calls")
    if calls is None:
        return message
    where = f"messages[{index}].tool_calls"
    if message.get("role") != "assistant":  # it would be dropped without a word
        raise bad_request(f"{where}: only an assistant message carries tool calls", where)
    if not isinstance(calls, list):
        raise bad_request(f"{where}: expected a list", where)
    shown = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f'{where}[{j}]: expected {{"function": {{"name": ..., '
                              f'"arguments": ...}}}}', f"{where}[{j}]")
        args = fn.get("arguments", "")
        try:
            args = json.loads(args) if isinstance(args, str) and args else args
        except (ValueError, RecursionError):
            pass  # arguments a model cut short (or nested past the parser): shown as text
        shown.append({"name": fn["name"], "arguments": args})
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if not shown:
        return out
    if hermes:  # as the model writes them under the auto tool-call grammar
        text = "\n".join(f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
                         for call in shown)
    else:
        text = json.dumps(shown, ensure_ascii=False)
    content = message.get("content")
    if isinstance(content, str) and content:
        text = f"{content}\n{text}"
    elif content not in (None, ""):  # text parts: the calls as one more part
        return {**out, "content": [*content, {"type": "text", "text": "\n" + text}]} \
            if isinstance(content, list) else out
    out["content"] = text
    return out
