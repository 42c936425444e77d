"""Streaming of auto tool calls in the Hermes format (:mod:`structspec.server.hermes_tools`):
one choice's text, as it is generated, into ``content`` and ``tool_calls`` deltas.

Content is streamed while no ``<tool_call>`` has started; the end of the text that could be
the start of one (``<tool_`` ...) is held back, as stop strings are, and so is content that is
whitespace only so far (the answer's ``content`` is null then). Each call is sent when its
section closes: a delta with its ``id``, ``type`` and ``function.name`` (``arguments`` ``""``),
then one with its ``function.arguments``, both with the call's ``index``. A section that does
not read as a call, or one still open when the choice ends (``max_tokens``, a stop string), is
sent as content. The deltas add up to what :func:`~structspec.server.hermes_tools.parse_hermes`
reads from the whole text.
"""

from __future__ import annotations

from typing import Any

from structspec.server.hermes_tools import (
    TOOL_CALL_START,
    section_call,
    split_sections,
    tool_call_entry,
)


def partial_start(text: str) -> int:
    """Characters at the end of ``text`` that could begin a ``<tool_call>`` (a proper prefix
    of it): held back while streaming content."""
    for n in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:n]):
            return n
    return 0


class HermesStream:
    """One choice's Hermes stream state (module docstring)."""

    def __init__(self) -> None:
        self.text = ""
        #: where the first ``<tool_call>`` starts, once seen
        self.prefix_end: int | None = None
        #: characters of the content before the first ``<tool_call>`` already sent
        self.content_sent = 0
        #: where the next unread section may start (past the last closed one)
        self.scan_from = 0
        #: the calls sent so far
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas for ``text``, the next safe part of the choice's text (``finished``:
        it is the last part)."""
        self.text += text
        deltas: list[dict[str, Any]] = []
        if self.prefix_end is None:
            found = self.text.find(TOOL_CALL_START, max(0, self.content_sent
                                                        - len(TOOL_CALL_START)))
            if found >= 0:
                self.prefix_end = self.scan_from = found
        if self.prefix_end is None:
            safe = len(self.text) if finished else len(self.text) - partial_start(self.text)
            self._content(safe, "", deltas)
            return deltas
        self._content(self.prefix_end, "", deltas)
        _, sections = split_sections(self.text[self.scan_from:])
        for section, closed in sections:
            if not closed:
                if finished:  # cut short: the rest is text
                    self._content(self.prefix_end, section, deltas)
                break
            self.scan_from = self.text.index(section, self.scan_from) + len(section)
            call = section_call(section)
            if call is None:
                self._content(self.prefix_end, section, deltas)
                continue
            entry = tool_call_entry(call)
            head = {"index": self.num_calls, "id": entry["id"], "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            deltas.append({"tool_calls": [head]})
            deltas.append({"tool_calls": [{"index": self.num_calls,
                                           "function": {"arguments": call.arguments}}]})
            self.num_calls += 1
        return deltas

    def _content(self, end: int, extra: str, deltas: list[dict[str, Any]]) -> None:
        """Send the content before ``end`` not sent yet, then ``extra``; content that is
        whitespace only so far waits (it is dropped if nothing else comes)."""
        unsent = self.text[self.content_sent:end]
        if not extra and not self.text[:end].strip():
            return
        self.content_sent = max(self.content_sent, end)
        if unsent or extra:
            deltas.append({"content": unsent + extra})
