"""Tokenizer wrapper (encode, decode, chat template, stop ids) and incremental detokenizer."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from structspec.core import (
    ChatMessageError,
    ChatTemplateOptions,
    PromptTooLongError,
    check_chat_messages,
)

# Tokens before the first new one that are re-decoded so that spacing/merges come out right.
_PREFIX_WINDOW = 5


class Tokenizer:
    """A model directory's HF fast tokenizer plus the generation stop ids.

    Args:
        model_dir: HF model directory (tokenizer.json / tokenizer_config.json, optional
            generation_config.json).
        chat_template: Jinja text used instead of the directory's chat template (vLLM's
            ``--chat-template``); None keeps the model's own.

    Raises:
        FileNotFoundError: ``model_dir`` does not exist.
        ValueError: the directory has no loadable fast tokenizer.
    """

    def __init__(self, model_dir: str | os.PathLike[str], *,
                 chat_template: str | None = None) -> None:
        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                 "tokenizer.model", "vocab.json")):
            raise ValueError(f"{path}: no tokenizer files (tokenizer.json / "
                             "tokenizer_config.json); a directory without one can serve only "
                             "as a --draft-model of a target that has it")
        try:
            hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot load a tokenizer: {e}") from e
        if not isinstance(hf, PreTrainedTokenizerFast):
            raise ValueError(f"{path}: expected a fast (tokenizers) tokenizer, got {type(hf).__name__}")
        if chat_template is not None:
            hf.chat_template = chat_template  # what apply_chat_template renders with
        # The only truncation structspec asks of it is truncate_prompt_tokens, which keeps a
        # prompt's last tokens (vLLM sets this side for generation too)
        hf.truncation_side = "left"
        self.hf: PreTrainedTokenizerFast = hf
        backend = getattr(hf, "backend_tokenizer", None)
        # The Rust tokenizer, used directly by decode() (same text as hf.decode without
        # clean-up; tests/models compare the two).
        self._backend: Any = backend if hasattr(backend, "decode") else None
        self.eos_token_ids: tuple[int, ...] = _eos_ids(path, hf)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template."""
        return bool(self.hf.chat_template)

    @property
    def bos_token_id(self) -> int | None:
        """The BOS id, or None."""
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones (``len(hf)``); may be < the model's rows."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True, *,
               max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds e.g. BOS where the model wants it.

        Args:
            max_tokens: when given, a text that cannot encode to fewer tokens (longer than
                ``max_tokens`` times the longest token's characters, with a margin of 2) is
                refused before it is tokenized: tokenizing a 10 MB prompt takes ~20 s of a
                server's tokenizer thread, which other requests queue behind.

        Raises:
            ValueError: ``text`` is not valid Unicode (a lone surrogate, e.g. from a JSON
                ``"\ud800"`` escape), naming the character index.
            PromptTooLongError: ``text`` is certainly longer than ``max_tokens`` tokens.
        """
        check_unicode(text, "text")  # the Rust tokenizer's TypeError would not say why
        if max_tokens is not None:
            at_least = len(text) // (2 * self.max_token_chars)
            if at_least > max_tokens:
                raise PromptTooLongError(at_least, max_tokens)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_tail(self, text: str, keep: int,
                    add_special_tokens: bool = True) -> tuple[list[int], bool]:
        """Token ids of ``text`` cut from the left to at most ``keep`` tokens (vLLM's
        ``truncate_prompt_tokens`` of a text prompt), and whether any token was dropped.

        As Hugging Face's left truncation, which vLLM tokenizes with, the special tokens the
        tokenizer adds (a BOS) stay and the text's first tokens go; where they alone are more
        than ``keep``, the last ``keep`` ids are kept. No length guard: a text of any length
        is tokenized (its tail is what is kept).

        Raises:
            ValueError: ``text`` is not valid Unicode.
        """
        ids = self.encode(text, add_special_tokens)
        if len(ids) <= keep:
            return ids, False
        if add_special_tokens:  # tokenized again only when cut: the common no-op costs one
            ids = list(self.hf.encode(text, add_special_tokens=True, truncation=True,
                                      max_length=keep))
        return ids[-keep:], True

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry, added tokens included (an upper bound
        on the characters one token covers for byte-level BPE and SentencePiece vocabularies,
        whose entries spell one character per byte or character)."""
        return max(1, max(map(len, self.hf.get_vocab())))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (no clean-up of tokenization spaces, so streaming agrees with it).

        Calls the Rust ``tokenizers`` backend directly when the HF tokenizer has one: the
        transformers wrapper adds ~8 us of Python per call, and the engine decodes twice per
        committed token (measured: 5 ms per step at batch 32 on the H200 host)."""
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def render_chat(self, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None = None,
                    options: ChatTemplateOptions | None = None) -> str:
        """The prompt text for ``messages`` rendered through the chat template, by default
        with the assistant generation prompt appended.

        ``messages`` are checked first (:func:`structspec.core.check_chat_messages`: text
        content parts are joined), so the template only ever sees string contents.

        Args:
            tools: passed to the template (left out when None or empty).
            options: ``add_generation_prompt``, ``continue_final_message`` and the template
                variables of ``chat_template_kwargs`` (:class:`ChatTemplateOptions`; None: the
                defaults, a generation prompt and no variables).

        Raises:
            ChatMessageError: malformed messages (a ValueError naming the field, e.g.
                ``messages[1].content``); with ``continue_final_message``, a final message
                that is not the assistant's, or a template that does not render the final
                message's content as sent (it cannot be left open), naming
                ``continue_final_message``.
            ValueError: the model has no chat template, the template fails to render, or a
                message's text is not valid Unicode (named by message, with its index there).
        """
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain-text prompt instead")
        options = options if options is not None else ChatTemplateOptions()
        messages = check_chat_messages(messages)
        options.check_messages(messages)
        for i, message in enumerate(messages):  # here: the rendered text's index means nothing
            check_unicode(message["content"], f"messages[{i}].content")
        kwargs: dict[str, Any] = options.template_args()
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja errors (e.g. raise_exception in the template)
            if options.continue_final_message and str(e).startswith("continue_final_message"):
                # transformers' own check: the final message's content must come out of the
                # template as sent (its message then quotes the whole rendered chat)
                raise ChatMessageError(
                    "continue_final_message", "the chat template does not render the final "
                    "message's content as sent (it drops or changes it, or reads another "
                    "field), so the message cannot be left open to continue") from None
            raise ValueError(f"chat template failed to render: {e}") from e
        return str(text)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None, options: ChatTemplateOptions | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of the rendered chat prompt (:meth:`render_chat`; by default with the
        generation prompt); the template already contains the special tokens, so by default
        none are added (``add_special_tokens``: add them on top, e.g. a BOS, as vLLM's
        ``/tokenize`` option does).

        Raises:
            ValueError: see :meth:`render_chat` and :meth:`encode` (``max_tokens`` too).
        """
        return self.encode(self.render_chat(messages, tools=tools, options=options),
                           add_special_tokens=add_special_tokens, max_tokens=max_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of ``ids`` as the tokenizer spells them (HF
        ``convert_ids_to_tokens``: ``"Ġworld"`` for a byte-level BPE); ``""`` for an id the
        tokenizer does not know (a padding row of the model's embedding)."""
        return [t if isinstance(t, str) else "" for t in self.hf.convert_ids_to_tokens(list(ids))]

    @functools.cached_property
    def added_token_texts(self) -> dict[int, str]:
        """The added tokens (special or not: ``<|im_end|>``, control tokens) by id, each
        with its text."""
        return {int(i): str(t.content) for i, t in self.hf.added_tokens_decoder.items()}

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` for one request."""
        return IncrementalDetokenizer(
            self, prompt_ids, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens)


def _eos_ids(path: Path, hf: PreTrainedTokenizerFast) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{gen}: not a valid JSON object: {e}") from e
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in value)
    if hf.eos_token_id is not None and hf.eos_token_id not in ids:
        ids.append(int(hf.eos_token_id))
    return tuple(ids)


def check_unicode(text: str, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` and the character index when ``text`` holds a lone
    surrogate (e.g. from a JSON ``"\ud800"`` escape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate "
                         f"(U+{ord(text[e.start]):04X}) at character {e.start}") from None


class IncrementalDetokenizer:
    """Streams text for one request, token by token, consistent with a full decode.

    The prefix-offset / read-offset algorithm (as in vLLM): each step decodes the window
    ``ids[prefix_offset:]`` and emits what extends beyond the decode of
    ``ids[prefix_offset:read_offset]``. Text ending in U+FFFD (an incomplete UTF-8 sequence
    split across tokens) is held back until later tokens complete it.

    ``spaces_between_special_tokens`` False (with special tokens kept) is vLLM's rule for a
    fast tokenizer (``FastIncrementalDetokenizer.decode_next``): an added token that follows
    another added token of the output contributes its own text only, without what the
    decoder puts before it (decoders that join tokens with spaces, such as WordPiece's or
    none, put a space there; byte-level BPE decoders put nothing, so for them both values
    give the same text). True, vLLM's default, is the tokenizer's own decode: this class's
    output before the option existed. The first output token is never such a follower (vLLM
    starts counting at the output, not the prompt).

    Args:
        tokenizer: the :class:`Tokenizer`.
        prompt_ids: the prompt, used as left context only (its text is never emitted).
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: see above; only read when ``skip_special_tokens`` is
            False (dropped tokens leave nothing to space).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
        skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # the added tokens whose decoder prefix is dropped after another one; None: the
        # tokenizer's own decode
        self._added: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = tokenizer.added_token_texts or None
        self._last_added = False
        self._ids: list[int] = list(prompt_ids)
        self._prompt_len = len(self._ids)
        self._read = len(self._ids)
        self._prefix = max(self._read - _PREFIX_WINDOW, 0)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, token_ids: Iterable[int]) -> str:
        """Append ``token_ids`` and return the text they completed (the window step)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def _advance_unspaced(self, token_ids: Iterable[int], added: dict[int, str]) -> str:
        """:meth:`_advance` one token at a time, an added token (of ``added``) after another
        one giving its own text (``spaces_between_special_tokens`` False)."""
        out = []
        for t in token_ids:
            delta = self._advance([t])
            text = added.get(t)
            if text is not None and self._last_added:
                delta = text
                # its window text is not emitted again by the next token's window (when the
                # step above held it back, the read offset did not move)
                self._read = len(self._ids)
            self._last_added = text is not None
            out.append(delta)
        return "".join(out)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated ``token_ids``; return the newly completed text (may be "")."""
        delta = (self._advance(token_ids) if self._added is None
                 else self._advance_unspaced(token_ids, self._added))
        self.text += delta
        return delta

    def restart(self, token_ids: Sequence[int]) -> str:
        """Forget every generated id, then :meth:`add` ``token_ids``; returns the whole text
        (for an output whose tail was cut after it was detokenized)."""
        del self._ids[self._prompt_len :]
        self._read = self._prompt_len
        self._prefix = max(self._read - _PREFIX_WINDOW, 0)
        self._last_added = False
        self.text = ""
        self.add(token_ids)
        return self.text

    def flush(self) -> str:
        """At the end of the request: return held-back text (e.g. a dangling U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.text += delta
        return delta
