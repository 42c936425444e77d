"""``usage`` in streamed responses: OpenAI's ``stream_options.include_usage`` and vLLM's
``stream_options.continuous_usage_stats``.

With ``include_usage`` every chunk has a ``usage`` key: ``null``, and the request's totals in
one last chunk with no choices (OpenAI). With ``continuous_usage_stats`` too (vLLM; ignored
without ``include_usage``, as vLLM ignores it), each chunk that carries a choice has that
choice's usage so far instead of ``null``: its prompt's tokens, the tokens it has generated
up to that chunk, and their sum (vLLM's ``UsageInfo`` per chunk, counted per choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from structspec.server.generation import GenerationRun
from structspec.server.protocol import StreamOptions


@dataclass(frozen=True)
class StreamUsage:
    """What a stream's chunks say about usage (module doc).

    Attributes:
        include: ``include_usage``: a ``usage`` key in every chunk and a last usage chunk.
        continuous: ``continuous_usage_stats`` (only with ``include``): a choice chunk's
            ``usage`` is its choice's so far.
    """

    include: bool = False
    continuous: bool = False

    @classmethod
    def of(cls, options: StreamOptions | None) -> StreamUsage:
        """The request's ``stream_options`` (None: no usage in the stream)."""
        if options is None or not options.include_usage:
            return cls()
        return cls(include=True, continuous=bool(options.continuous_usage_stats))

    def add_to(self, body: dict[str, Any], run: GenerationRun, usage: Any = None) -> None:
        """Put the chunk's ``usage`` into ``body`` (a chunk whose ``choices`` hold at most one
        choice, by ``index``): ``usage`` when given (the last chunk's totals), else the
        choice's usage so far when continuous, else null; nothing without ``include``."""
        if not self.include:
            return
        if usage is None and self.continuous and body.get("choices"):
            c = run.choices[body["choices"][0]["index"]]
            prompt, completion = len(c.prompt_ids), len(c.token_ids)
            usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion}
        body["usage"] = usage
