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
import re
import sys
from typing import Any

from structspec.server.errors import APIError, bad_request

Loc = tuple[str | int, ...]


class _HugeInt:
    """Stands in for an integer literal ``int()`` refuses, so that its place can be found."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def loads_client_json(text: str | bytes, *, what: str, param: str | None = None,
                      unicode_check: bool = False) -> Any:
    """Parse JSON the client sent.

    Args:
        text: the JSON text (bytes are decoded as UTF-8/16/32, as :func:`json.loads` does).
        what: how messages call the text, e.g. ``"the request body"`` or ``"json_schema"``.
        param: the request field the text is the value of (a schema sent as a string); None
            for the whole body, where an over-long integer is named by its own path.
        unicode_check: refuse a string (or key) holding a lone surrogate, naming its field
            (:func:`find_lone_surrogate`).

    Raises:
        APIError: 400 ``invalid_request_error`` when the text is not JSON, nests too deeply,
            holds an integer literal over the digit limit, or (``unicode_check``) a string
            that is not valid Unicode.
    """
    value = _loads(text, what, param)
    if unicode_check and _may_hold_surrogate(text):
        found = find_lone_surrogate(value)
        if found is not None:
            loc, index, char = found
            field = _loc_to_param(loc) or param
            raise bad_request(f"invalid value for '{field}': not valid Unicode: a lone "
                              f"surrogate (U+{ord(char):04X}) at character {index}", field)
    return value


_SURROGATE_HINT_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE_HINT_TEXT = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")


def _may_hold_surrogate(text: str | bytes) -> bool:
    """Cheap pre-test: a ``\\uD8..`` - ``\\uDF..`` escape or a UTF-8-encoded surrogate
    (``ED A0..BF``, which :func:`json.loads` decodes with ``surrogatepass``) occurs in the
    text. A valid surrogate pair (an emoji as two escapes) passes it; the walk then finds
    nothing."""
    if isinstance(text, bytes):
        return _SURROGATE_HINT_BYTES.search(text) is not None
    return _SURROGATE_HINT_TEXT.search(text) is not None


def find_lone_surrogate(value: Any) -> tuple[Loc, int, str] | None:
    """The first string (or object key) in ``value`` holding a lone surrogate: its path,
    the character index and the surrogate; None when every string is valid Unicode.

    JSON lets a client send ``"\\ud800"`` (and :func:`json.loads` decodes invalid UTF-8
    ``ED A0 80`` to the same): a Python string UTF-8 cannot encode, which used to fail deep
    inside the server (a 500 from an error body echoing the ``model``) or pass into the
    engine (``stop``, ``tools``). Iterative, as :func:`_find_huge_int`.
    """
    stack: list[tuple[Loc, Any]] = [((), value)]
    while stack:
        loc, item = stack.pop()
        if isinstance(item, str):
            bad = _surrogate_at(item)
            if bad is not None:
                return loc, bad, item[bad]
        elif isinstance(item, dict):
            children: list[tuple[Loc, Any]] = []
            for k, v in item.items():
                bad = _surrogate_at(k)
                if bad is not None:
                    return loc, bad, k[bad]
                children.append((loc + (k,), v))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([(loc + (i,), v) for i, v in enumerate(item)]))
    return None


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _loads(text: str | bytes, what: str, param: str | None) -> Any:
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
