"""Regex syntax the grammar compiler would silently misread, refused before any compile.

xgrammar (0.2.8) compiles ``\\q`` as a literal ``q`` and ``[^]`` as "any character" where
Python's ``re`` refuses both and JavaScript reads ``[^]`` as any character but ``[]`` as
nothing: the client meant something the grammar would not enforce. Torch- and xgrammar-free,
so the request parsers (:mod:`structspec.constraint_parse`) check a ``regex`` field before it
reaches the engine, and the grammar backend checks a :class:`~structspec.constraints.RegexConstraint`
built by hand the same way.
"""

from __future__ import annotations

KNOWN_ESCAPE_LETTERS = frozenset("dDwWsSbBnrtvfxucpP")
"""Letters that may follow a backslash: classes (``\\d \\w \\s``, their negations, ``\\p{..}``),
word boundaries, control characters and ``\\xHH`` / ``\\uHHHH`` / ``\\cX`` codes. Digits
(``\\0``, back-references) and every non-alphanumeric character (``\\.``, ``\\/``) pass; the
compiler judges them."""


def find_regex_problem(pattern: str) -> str | None:
    """The first construct in ``pattern`` whose meaning differs between regex dialects (so the
    grammar would enforce something the client did not mean), or None.

    Refused: an escape of an unknown letter (``\\q``, ``\\z``, ``\\A``: a literal letter in
    xgrammar, an anchor or an error elsewhere) and an empty character class (``[]``, ``[^]``).

    Args:
        pattern: the regex text.

    Returns:
        ``"<what> at position <i>"`` (0-based character offset), or None.
    """
    i, n, in_class = 0, len(pattern), False
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            if i + 1 >= n:
                return f"a trailing backslash at position {i}"
            nxt = pattern[i + 1]
            if nxt.isalpha() and nxt not in KNOWN_ESCAPE_LETTERS:
                return (f"unknown escape '\\{nxt}' at position {i} (write '{nxt}' for the "
                        "letter itself)")
            i += 2
            continue
        if in_class:
            if ch == "]":
                in_class = False
        elif ch == "[":
            start = i
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                shown = pattern[start:i + 1]
                return (f"empty character class '{shown}' at position {start} (dialects "
                        "disagree on its meaning; write [\\s\\S] for any character or "
                        "escape the bracket as \\])")
            in_class = True
            continue
        i += 1
    return None
