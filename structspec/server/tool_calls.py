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
  constrain ``required``. The tools' ``$defs`` move to the array's root, where their local
  ``$ref``s (``#/$defs/...``) then resolve; two tools defining one name differently are a 400.
- ``"auto"`` / ``"none"`` / absent: nothing is forced; ``tools`` only reach the chat template.

``strict`` follows the tools' ``function.strict`` (all of them for ``required``; OpenAI's
default ``false`` is best effort, as for ``response_format``). The response carries the calls
in ``message.tool_calls`` (``content`` null) with ``finish_reason`` ``"tool_calls"`` when the
grammar finished, the finish reason as is otherwise (``length``: the arguments may be cut);
a ``required`` output that is not a complete JSON array (cut by ``max_tokens``) comes back as
``content`` with no calls. Streaming sends a named call's id and name first, then its
arguments as they are generated; ``required`` calls are sent whole when the output is complete.

An assistant message of the history with ``tool_calls`` and no ``content`` (what a client
sends back after a call) is rendered with its calls as JSON text
(:func:`history_message`), so a chat template that knows nothing of tool calls still shows
them to the model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from structspec.constraints import JsonSchemaConstraint
from structspec.server.errors import bad_request

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


def _function_of(tool: Any, i: int) -> dict[str, Any]:
    """``tools[i].function``, checked: a name and, when given, an object ``parameters``."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}}",
                          where)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function: expected an object with a 'name'",
                          f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name: expected a non-empty string",
                          f"{where}.function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters: expected a JSON Schema object",
                          f"{where}.function.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict: expected a boolean",
                          f"{where}.function.strict")
    return fn


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    """The tool's arguments schema (an object without fixed properties when none is given)."""
    params = fn.get("parameters")
    return dict(params) if params is not None else {"type": "object", "properties": {}}


def plan_tool_calls(tools: Any, tool_choice: Any,
                    parallel_tool_calls: Any = None) -> ToolCallPlan | None:
    """The forced calls a request asks for, or None (``auto``, ``none``, no ``tool_choice``).

    Raises:
        APIError: 400 naming the field: a malformed tool, a ``tool_choice`` that is not
            ``auto``/``none``/``required``/a named function, a named function not in
            ``tools``, ``required`` or a named function without ``tools``, a
            ``parallel_tool_calls`` that is not a boolean, or two tools defining one
            ``$defs`` name differently.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls: expected a boolean", "parallel_tool_calls")
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tool_choice: forcing a tool call needs a non-empty 'tools' list",
                          "tool_choice")
    functions = [_function_of(t, i) for i, t in enumerate(tools)]
    if tool_choice == "required":
        return _required(functions, parallel_tool_calls is not False)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice: expected \"auto\", \"none\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")
        for i, f in enumerate(functions):
            if f["name"] == name:
                return ToolCallPlan("named", JsonSchemaConstraint(
                    _parameters(f), strict=bool(f.get("strict", False))),
                    f"tools[{i}].function.parameters", name=name)
        raise bad_request(f"tool_choice: no tool named {name!r} in 'tools' (have "
                          f"{[f['name'] for f in functions]})", "tool_choice")
    raise bad_request("tool_choice: expected \"auto\", \"none\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def _required(functions: list[dict[str, Any]], parallel: bool) -> ToolCallPlan:
    """``tool_choice: "required"``: an array of calls, one ``anyOf`` branch per tool."""
    defs: dict[str, Any] = {}
    branches = []
    for i, fn in enumerate(functions):
        params = _parameters(fn)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise bad_request(f"tools[{i}].function.parameters.$defs.{key}: another tool "
                                  "defines this name differently (with tool_choice "
                                  "\"required\" the tools' $defs are shared)", "tools")
            defs[key] = value
        branches.append({"type": "object",
                         "properties": {"name": {"const": fn["name"]}, "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": branches[0] if len(branches) == 1
                              else {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
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
    except ValueError:
        return None
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None  # best effort (strict off) may leave the schema: no calls to report
    return [{"id": ids[i] if ids and i < len(ids) else new_call_id(), "type": "function",
             "function": {"name": c["name"],
                          "arguments": json.dumps(c.get("parameters", {}), ensure_ascii=False)}}
            for i, c in enumerate(calls)]


def finish_reason(reason: str | None) -> str | None:
    """The choice's ``finish_reason``: ``tool_calls`` when the calls were generated to the end
    (the grammar's ``stop``), the engine's reason otherwise."""
    return TOOL_CALLS_FINISH if reason == "stop" else reason


def history_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant message with ``tool_calls`` and no text, as text a chat template shows:
    ``content`` becomes the calls as JSON (``[{"name": ..., "arguments": ...}]``), and the
    ``tool_calls`` key goes (a template that renders it would show the calls twice). Other
    messages are returned as they are.

    Raises:
        APIError: 400 naming the field when a call is not ``{"function": {"name", "arguments"}}``.
    """
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls or message.get("content") not in (None, ""):
        return message
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where}: expected a list", where)
    shown = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{j}]: expected {{\"function\": {{\"name\", "
                              "\"arguments\"}}}}", f"{where}[{j}]")
        args = fn.get("arguments", "")
        try:
            args = json.loads(args) if isinstance(args, str) and args else args
        except ValueError:
            pass  # arguments a model cut short: shown as the text they are
        shown.append({"name": fn["name"], "arguments": args})
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = json.dumps(shown, ensure_ascii=False)
    return out
