"""Auto tool calls in the Hermes format (``structspec serve --tool-call-parser hermes``), as
vLLM's ``--enable-auto-tool-choice --tool-call-parser hermes`` reads them, with each call's
arguments guaranteed by a structural tag.

With the parser on, a chat request with ``tools`` and ``tool_choice`` ``"auto"`` (or none) is
generated under a structural tag (:func:`hermes_tag`): the model writes free text until it
writes ``<tool_call>``; then the section is forced, one structure per tool::

    <tool_call>
    {"name": "<tool name>", "arguments": <the arguments, under the tool's parameters>}
    </tool_call>

(the begin is ``<tool_call>\\n{"name": <the name as JSON>, "arguments": ``, the end
``}\\n</tool_call>``). Each tool's ``parameters`` are normalised as for a forced call (an object
schema); the tag is strict when every tool is (``function.strict``), best effort otherwise, as
``tool_choice: "required"`` is. With ``parallel_tool_calls: false`` the tag is xgrammar's
current form with ``stop_after_first``: the grammar ends with the first call's section, so the
answer holds at most one call and generation stops there. vLLM (its PR 26233) instead drops
the calls after the first from the response, after generating them.

The output is read back by :func:`parse_hermes`: the text before the first ``<tool_call>`` is
the content; each complete section whose body is ``{"name": <a string>, "arguments": <an
object>}`` is a call. A section ends at the first ``</tool_call>`` before which its body reads
as a call, so the tag inside a JSON string (an argument's value, a tool's name) does not end
it. A section cut short (``max_tokens``, a stop string), or one whose body never reads as a
call, stays in the content, as text, with what follows it. Text between or after the sections is dropped,
as vLLM's Hermes parser drops it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from structspec.constraints import StructuralTagConstraint
from structspec.server.errors import bad_request
from structspec.server.tool_calls import check_tools, new_call_id, tool_parameters
from structspec.structural_tag import StructuralTagError, read_structural_tag

TOOL_CALL_START = "<tool_call>"
"""The trigger: the tag that opens a Hermes tool call."""

TOOL_CALL_END = "</tool_call>"
"""The tag that closes a Hermes tool call."""

TOOLS_PARAM = "tools"
"""The request field the auto tool-call grammar is read from (the ``param`` of its errors)."""


@dataclass(frozen=True)
class AutoToolPlan:
    """How a request's auto tool calls are generated.

    Attributes:
        grammar: the structural tag the output is generated under.
        grammar_param: the request field it came from (``tools``).
    """

    grammar: StructuralTagConstraint
    grammar_param: str = TOOLS_PARAM


@dataclass(frozen=True)
class HermesCall:
    """One complete tool call of an output.

    Attributes:
        name: the function's name.
        arguments: its arguments as JSON text.
    """

    name: str
    arguments: str


@dataclass(frozen=True)
class HermesOutput:
    """An output read as Hermes tool calls.

    Attributes:
        content: the text of the answer: before the first ``<tool_call>``, then each section
            that is not a complete call (cut short, or unreadable), as written.
        calls: the complete calls, in order.
    """

    content: str
    calls: tuple[HermesCall, ...]


def call_begin(name: str) -> str:
    """The begin string of the structure of the tool ``name`` (the name JSON-escaped)."""
    return f'{TOOL_CALL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


CALL_END = "}\n" + TOOL_CALL_END
"""The end string of every tool's structure (it closes the ``{"name", "arguments"}`` object)."""


#: where a tool's schema sits in the tag, per form: (prefix before the tool's index, the
#: path after it); legacy ``structures[i].schema``, current ``format.tags[i].content.json_schema``
_SCHEMA_PLACES = (("structures[", ".schema"), ("format.tags[", ".content.json_schema"))


def tool_place(where: str) -> str:
    """A place in the auto tool-call tag as the request field it came from:
    ``structures[i].schema...`` or ``format.tags[i].content.json_schema...`` ->
    ``tools[i].function.parameters...`` (tool ``i``'s parameters); any other place ->
    ``tools``."""
    for prefix, field in _SCHEMA_PLACES:
        index, _, rest = where[len(prefix):].partition("]")
        if where.startswith(prefix) and index.isdigit() and rest.startswith(field):
            return f"tools[{index}].function.parameters{rest[len(field):]}"
    return TOOLS_PARAM


def hermes_tag(functions: list[dict[str, Any]], *,
               parallel: bool = True) -> StructuralTagConstraint:
    """The structural tag of auto tool calls of ``functions``: trigger ``<tool_call>``, one
    structure per tool; in the legacy form, or with ``parallel`` False in xgrammar's current
    form (the same ``triggered_tags``, as xgrammar converts the legacy one) with
    ``stop_after_first``: the grammar ends after the first call.

    Args:
        functions: the request's checked tools (:func:`~structspec.server.tool_calls.check_tools`),
            at least one.
        parallel: the request's ``parallel_tool_calls`` is not ``false``.

    Raises:
        APIError: 400 naming ``tools[i].function.parameters`` for a schema the engine never
            serves (:func:`~structspec.structural_tag.read_structural_tag`'s checks).
    """
    tag: dict[str, Any]
    if parallel:
        tag = {"structures": [{"begin": call_begin(fn["name"]), "schema": tool_parameters(fn),
                               "end": CALL_END} for fn in functions],
               "triggers": [TOOL_CALL_START]}
    else:
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [TOOL_CALL_START],
            "tags": [{"type": "tag", "begin": call_begin(fn["name"]),
                      "content": {"type": "json_schema", "json_schema": tool_parameters(fn)},
                      "end": CALL_END} for fn in functions],
            "stop_after_first": True}}
    try:
        read_structural_tag(tag)
    except StructuralTagError as e:
        param = tool_place(e.where)
        raise bad_request(f"{param}: {e}", param) from None
    strict = all(bool(fn.get("strict", False)) for fn in functions)
    return StructuralTagConstraint(tag, strict=strict)


def plan_auto_tools(parser: str | None, tools: Any, tool_choice: Any,
                    parallel_tool_calls: bool | None = None) -> AutoToolPlan | None:
    """The auto tool-call plan of a request, or None: no parser, no tools, or a
    ``tool_choice`` other than ``"auto"`` / absent (``"none"``, or a forced call, which
    :func:`~structspec.server.tool_calls.plan_tool_calls` plans).

    Args:
        parser: the server's ``--tool-call-parser`` (``"hermes"`` or None).
        tools: the request's ``tools`` (already checked by ``plan_tool_calls``).
        tool_choice: the request's ``tool_choice``.
        parallel_tool_calls: the request's (already checked); ``False``: at most one call.

    Raises:
        APIError: as :func:`hermes_tag`.
    """
    if parser is None or tool_choice not in (None, "auto"):
        return None
    functions = check_tools(tools)
    if not functions:
        return None
    return AutoToolPlan(hermes_tag(functions, parallel=parallel_tool_calls is not False))


def _read_call(section: str) -> HermesCall | None:
    """The call a complete section's body holds (the text between the tags), or None."""
    try:
        body = json.loads(section)
    except (ValueError, RecursionError):
        return None
    if (not isinstance(body, dict) or not isinstance(body.get("name"), str)
            or not isinstance(body.get("arguments"), dict)):
        return None
    return HermesCall(body["name"], json.dumps(body["arguments"], ensure_ascii=False))


def split_sections(text: str) -> tuple[str, list[tuple[str, bool]]]:
    """``text`` as its content before the first ``<tool_call>`` and its sections, each as
    ``(text from its <tool_call>, closed)``; only the last one can be open."""
    first = text.find(TOOL_CALL_START)
    if first < 0:
        return text, []
    sections: list[tuple[str, bool]] = []
    at = first
    while at >= 0:
        end = _section_end(text, at)
        if end is None:
            sections.append((text[at:], False))
            break
        sections.append((text[at:end], True))
        at = text.find(TOOL_CALL_START, end)
    return text[:first], sections


def _section_end(text: str, at: int) -> int | None:
    """Where the section opened at ``at`` ends (past its ``</tool_call>``), or None while it
    is open: at the first ``</tool_call>`` before which the body reads as a call. A
    ``</tool_call>`` inside a JSON string of the body (an argument's value, a tool's name)
    does not close it; a body that never reads as a call stays open (text)."""
    start = at + len(TOOL_CALL_START)
    close = text.find(TOOL_CALL_END, start)
    while close >= 0:
        if _read_call(text[start:close]) is not None:
            return close + len(TOOL_CALL_END)
        close = text.find(TOOL_CALL_END, close + 1)
    return None


def section_call(section: str) -> HermesCall | None:
    """The call of a closed section (``<tool_call>...</tool_call>``), or None when its body
    is not ``{"name": <a string>, "arguments": <an object>}``."""
    return _read_call(section[len(TOOL_CALL_START):-len(TOOL_CALL_END)])


def parse_hermes(text: str) -> HermesOutput:
    """Read an output as Hermes tool calls (module docstring)."""
    content, sections = split_sections(text)
    calls: list[HermesCall] = []
    for section, closed in sections:
        call = section_call(section) if closed else None
        if call is None:
            content += section
        else:
            calls.append(call)
    return HermesOutput(content, tuple(calls))


def message_content(content: str) -> str | None:
    """The ``message.content`` of parsed content: None when empty or whitespace only."""
    return content if content.strip() else None


def tool_call_entry(call: HermesCall, call_id: str | None = None) -> dict[str, Any]:
    """A call as an entry of ``message.tool_calls`` (a fresh id unless ``call_id``)."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
