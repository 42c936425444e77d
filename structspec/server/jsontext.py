"""JSON text from clients -> Python values, every refusal a 400.

Python's parser refuses some *valid* JSON: an integer literal longer than
``sys.get_int_max_str_digits()`` (4300 by default; a ``ValueError`` that is not a
``JSONDecodeError``) and nesting deeper than the interpreter's recursion limit
(``RecursionError``). Both are the client's input, so both must be an
``invalid_request_error`` rather than an unhandled exception (a 500). An over-long integer is
located (re-parsed with a ``parse_int`` hook, only on that error path, so ordinary bodies keep
the C parser's speed) and the field holding it is named.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from structspec.server.errors import APIError, bad_request

Loc = tuple[str | int, ...]


class _HugeInt:
    """Stands in for an integer literal ``int()`` refuses, so that its place can be found."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def loads_client_json(text: str | bytes, *, what: str, param: str | None = None) -> Any:
    """Parse JSON the client sent.

    Args:
        text: the JSON text (bytes are decoded as UTF-8/16/32, as :func:`json.loads` does).
        what: how messages call the text, e.g. ``"the request body"`` or ``"json_schema"``.
        param: the request field the text is the value of (a schema sent as a string); None
            for the whole body, where an over-long integer is named by its own path.

    Raises:
        APIError: 400 ``invalid_request_error`` when the text is not JSON, nests too deeply,
            or holds an integer literal over the digit limit.
    """
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"{what} is not valid JSON: {e}", param) from None
    except RecursionError:
        # The C decoder recurses once per nesting level; nothing says where, so no path.
        raise bad_request(f"{what} nests arrays/objects too deeply to be parsed "
                          f"(limit about {sys.getrecursionlimit()} levels)", param) from None
    except ValueError as e:  # int() refused a literal (the digit limit); valid JSON though
        raise _huge_int_error(text, what, param, e) from None


def _huge_int_error(text: str | bytes, what: str, param: str | None,
                    original: ValueError) -> APIError:
    """The 400 for an integer literal over the digit limit, naming where it is."""

    def parse_int(literal: str) -> int | _HugeInt:
        try:
            return int(literal)
        except ValueError:
            return _HugeInt(len(literal.lstrip("-")))

    try:
        value = json.loads(text, parse_int=parse_int)
    except (ValueError, RecursionError):  # some other refusal: report the first one as is
        return bad_request(f"{what} cannot be parsed: {original}", param)
    found = _find_huge_int(value)
    if found is None:
        return bad_request(f"{what} cannot be parsed: {original}", param)
    loc, huge = found
    limit = sys.get_int_max_str_digits()
    reason = (f"an integer literal of {huge.digits} digits exceeds the limit of {limit} "
              "digits")
    if param is None:  # the request body: the value's own path is the field at fault
        field = _loc_to_param(loc)
        return bad_request(f"invalid value for '{field}': {reason}" if field
                           else f"{what} cannot be parsed: {reason}", field or None)
    where = "/" + "/".join(str(p) for p in loc) if loc else "/"
    return bad_request(f"{what} cannot be parsed: {reason} (at {where})", param)


def _find_huge_int(value: Any) -> tuple[Loc, _HugeInt] | None:
    """The first :class:`_HugeInt` in ``value`` and its path (iterative: the value may nest
    nearly as deep as the recursion limit)."""
    stack: list[tuple[Loc, Any]] = [((), value)]
    while stack:
        loc, item = stack.pop()
        if isinstance(item, _HugeInt):
            return loc, item
        if isinstance(item, dict):
            children = [(loc + (k,), v) for k, v in item.items()]
        elif isinstance(item, list):
            children = [(loc + (i,), v) for i, v in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))  # document order: first child popped first
    return None


def _loc_to_param(loc: Loc) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content`` (as pydantic errors are
    named in :func:`structspec.server.protocol.parse_request`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out
