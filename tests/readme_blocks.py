"""Fenced code blocks of a Markdown file, and how the README check runs each one.

Every fence must name its language. ``bash`` / ``sh`` / ``shell`` / ``console`` blocks are shell
commands, ``python`` blocks are Python programs, ``text`` blocks are not code (a layout
listing). A code block is run by default; an HTML comment on the line right before its fence
says otherwise, with the reason in the README where a reader sees it::

    <!-- readme-test: skip (needs CUDA) -->      not run here; the reason is required
    <!-- readme-test: serve -->                  starts the server the ``server`` blocks use
    <!-- readme-test: server -->                 runs while the ``serve`` block's server is up

The README's server port (:data:`README_PORT`) is the one thing the check substitutes: the
test's server listens on a free port, so several runs can share a machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

README_PORT = 8000
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
CODE_LANGS = SHELL_LANGS | {"python"}
TEXT_LANGS = frozenset({"text"})
MODES = ("run", "skip", "serve", "server")

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*readme-test:\s*(?P<mode>[a-z]+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
_PORT = re.compile(rf"(?<=localhost:){README_PORT}\b|(?<=127\.0\.0\.1:){README_PORT}\b"
                   rf"|(?<=--port ){README_PORT}\b")


class ReadmeFormatError(ValueError):
    """A fence or a ``readme-test`` marker the check cannot classify (names the line)."""


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block: where it starts, its language, its body and how the check treats it.

    Attributes:
        line: 1-based line number of the opening fence.
        lang: the fence's language (``bash``, ``python``, ``text``, ...).
        body: the text between the fences, newline-terminated.
        mode: ``run``, ``skip``, ``serve`` or ``server`` (``text`` blocks: ``skip``).
        reason: why a ``skip`` block is not run (the README's words); empty otherwise.
    """

    line: int
    lang: str
    body: str
    mode: str
    reason: str

    @property
    def is_code(self) -> bool:
        """True for shell and Python blocks; False for ``text`` listings."""
        return self.lang in CODE_LANGS

    def script(self, port: int = README_PORT) -> str:
        """The program the check runs: the body as written, the README port replaced by ``port``.

        A ``console`` block keeps only its ``$ `` command lines (the rest is shown output).
        """
        body = self.body
        if self.lang == "console":
            body = "".join(ln[2:] + "\n" for ln in body.splitlines() if ln.startswith("$ "))
        return _PORT.sub(str(port), body)


def extract_blocks(markdown: str) -> list[CodeBlock]:
    """Every fenced block of ``markdown`` in order, classified by language and marker.

    Raises:
        ReadmeFormatError: a fence without a language or with an unknown one, an unclosed
            fence, a malformed or unknown marker, a ``skip`` without a reason, a marker that is
            not directly followed by a fence or sits on a ``text`` block, or ``server`` blocks
            without exactly one ``serve`` block before them.
    """
    lines = markdown.splitlines()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            if lines[i].lstrip().startswith("<!--") and "readme-test" in lines[i]:
                _parse_marker(lines, i)  # validates; raises when no fence follows it
            i += 1
            continue
        fence, lang = m["fence"], m["info"].strip().split(" ")[0].lower()
        start = i
        if not lang:
            raise ReadmeFormatError(f"line {start + 1}: fence without a language "
                                    f"(use one of {sorted(CODE_LANGS | TEXT_LANGS)})")
        if lang not in CODE_LANGS | TEXT_LANGS:
            raise ReadmeFormatError(f"line {start + 1}: fence language {lang!r} is not one of "
                                    f"{sorted(CODE_LANGS | TEXT_LANGS)}")
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].lstrip().startswith(fence):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ReadmeFormatError(f"line {start + 1}: fence never closed")
        i += 1
        mode, reason = ("run", "")
        if start > 0 and lines[start - 1].lstrip().startswith("<!--") \
                and "readme-test" in lines[start - 1]:
            mode, reason = _parse_marker(lines, start - 1)
        if lang in TEXT_LANGS:
            if mode != "run":
                raise ReadmeFormatError(f"line {start}: readme-test marker on a text block")
            mode, reason = "skip", "not code"
        blocks.append(CodeBlock(start + 1, lang, "".join(b + "\n" for b in body), mode, reason))
    _check_server_blocks(blocks)
    return blocks


def _parse_marker(lines: list[str], i: int) -> tuple[str, str]:
    """The mode and reason of the marker on line ``i`` (0-based), which a fence must follow."""
    m = _MARKER.match(lines[i])
    if m is None or m["mode"] not in MODES:
        raise ReadmeFormatError(f"line {i + 1}: malformed readme-test marker {lines[i].strip()!r}"
                                f" (modes: {', '.join(MODES)})")
    if i + 1 >= len(lines) or _FENCE.match(lines[i + 1]) is None:
        raise ReadmeFormatError(f"line {i + 1}: readme-test marker not directly before a fence")
    reason = (m["reason"] or "").strip()
    if m["mode"] == "skip" and not reason:
        raise ReadmeFormatError(f"line {i + 1}: 'skip' needs a reason: skip (why)")
    return m["mode"], reason


def _check_server_blocks(blocks: list[CodeBlock]) -> None:
    serve = [b for b in blocks if b.mode == "serve"]
    server = [b for b in blocks if b.mode == "server"]
    if len(serve) > 1:
        raise ReadmeFormatError(f"lines {[b.line for b in serve]}: more than one 'serve' block")
    if serve and serve[0].lang not in SHELL_LANGS:
        raise ReadmeFormatError(f"line {serve[0].line}: the 'serve' block must be a shell block")
    if server and (not serve or server[0].line < serve[0].line):
        raise ReadmeFormatError(f"line {server[0].line}: a 'server' block needs a 'serve' block "
                                "before it")
