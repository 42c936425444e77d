"""Tokenization and detokenization in the front-end process.

:class:`Codec` is what the HTTP layer needs from a tokenizer; :class:`TokenizerCodec`
implements it over :class:`structspec.models.tokenizer.Tokenizer` (the same class, and so the
same chat template and incremental detokenizer, as the engine). Tests use a fake codec.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any, Protocol

from structspec.core import ChatTemplateOptions


class Detokenizer(Protocol):
    """Incremental decoder of one output stream."""

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the text they completed."""
        ...

    def flush(self) -> str:
        """Return held-back text at the end of the stream."""
        ...


class Codec(Protocol):
    """Prompt encoding and output decoding for the HTTP layer."""

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    max_tokens: int | None = None,
                    options: ChatTemplateOptions | None = None, *,
                    add_special_tokens: bool = False) -> list[int]:
        """Token ids of a chat rendered through the chat template (``tools`` are passed to
        the template; ``options``: the request's ``add_generation_prompt``,
        ``continue_final_message`` and ``chat_template_kwargs``, None for the defaults: a
        generation prompt added, no template variables; the template holds the special
        tokens, so none are added unless ``add_special_tokens``).

        Raises:
            PromptTooLongError: the rendered prompt certainly has more than ``max_tokens``
                tokens (checked before tokenizing it).
            ChatMessageError: ``options`` cannot render this chat (a final message that is
                not the assistant's, or that the template cannot leave open), naming the
                option.
            ValueError: the model has no chat template or it fails to render, or the text is
                not valid Unicode.
        """
        ...

    def encode_text(self, text: str, max_tokens: int | None = None, *,
                    add_special_tokens: bool = True) -> list[int]:
        """Token ids of a raw prompt (special tokens such as BOS added as the model wants,
        unless ``add_special_tokens`` is false).

        Raises:
            PromptTooLongError / ValueError: as :meth:`encode_chat`.
        """
        ...

    def encode_text_tail(self, text: str, keep: int, *,
                         add_special_tokens: bool = True) -> tuple[list[int], bool]:
        """Token ids of a raw prompt cut from the left to at most ``keep`` tokens (vLLM's
        ``truncate_prompt_tokens``: the special tokens the tokenizer adds stay), and whether
        any was dropped; no length guard (the text's tail is what is kept).

        Raises:
            ValueError: the text is not valid Unicode.
        """
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (special tokens dropped unless ``skip_special_tokens`` is
        false)."""
        ...

    def token_pieces(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of ``token_ids`` as the tokenizer spells them (HF
        ``convert_ids_to_tokens``, what vLLM's ``/tokenize`` returns as ``token_strs``)."""
        ...

    def detokenizer(self, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> Detokenizer:
        """A fresh incremental detokenizer with ``prompt_ids`` as left context; special
        tokens are dropped from its text unless ``skip_special_tokens`` is False, and then
        ``spaces_between_special_tokens`` False drops what the decoder puts between two added
        tokens of the output (vLLM's rule:
        :class:`~structspec.models.tokenizer.IncrementalDetokenizer`)."""
        ...

    def token_str(self, token_id: int) -> str:
        """Text of one token on its own (for logprobs)."""
        ...


class TokenizerCodec:
    """:class:`Codec` over :class:`structspec.models.tokenizer.Tokenizer`.

    Args:
        model_dir: the engine's resolved model directory (``EngineInfo.model_path``).
        chat_template: the engine config's ``chat_template`` (``--chat-template``), or None
            for the model's own.

    Raises:
        FileNotFoundError / ValueError: from ``Tokenizer``.
    """

    def __init__(self, model_dir: str, chat_template: str | None = None) -> None:
        from structspec.models.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(model_dir, chat_template=chat_template)
        self._token_str = lru_cache(maxsize=65536)(self._token_str_uncached)

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    max_tokens: int | None = None,
                    options: ChatTemplateOptions | None = None, *,
                    add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, tools=tools, max_tokens=max_tokens,
                                                  options=options,
                                                  add_special_tokens=add_special_tokens)

    def encode_text(self, text: str, max_tokens: int | None = None, *,
                    add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens, max_tokens=max_tokens)

    def encode_text_tail(self, text: str, keep: int, *,
                         add_special_tokens: bool = True) -> tuple[list[int], bool]:
        return self.tokenizer.encode_tail(text, keep, add_special_tokens)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_pieces(self, token_ids: Sequence[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    def detokenizer(self, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> Detokenizer:
        return self.tokenizer.detokenizer(
            prompt_ids, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens)

    def token_str(self, token_id: int) -> str:
        return self._token_str(int(token_id))

    def _token_str_uncached(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
