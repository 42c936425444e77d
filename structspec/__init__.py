"""structspec: structured generation with speculative decoding.

Public API: :class:`LLM`, :class:`SamplingParams`, the grammar specs, :class:`RequestOutput`,
:class:`ChatMessageError` (malformed chat messages).
Heavy modules load lazily, so ``import structspec`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from structspec.core import (
    ChatMessageError,
    ChoiceSpec,
    EbnfSpec,
    FinishReason,
    GrammarSpec,
    JsonObjectSpec,
    JsonSchemaSpec,
    RegexSpec,
    RequestOutput,
    SamplingParams,
    SpecMetrics,
)

if TYPE_CHECKING:
    from structspec.llm import LLM

__all__ = [
    "LLM",
    "ChatMessageError",
    "ChoiceSpec",
    "EbnfSpec",
    "FinishReason",
    "GrammarSpec",
    "JsonObjectSpec",
    "JsonSchemaSpec",
    "RegexSpec",
    "RequestOutput",
    "SamplingParams",
    "SpecMetrics",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from structspec.llm import LLM

        return LLM
    raise AttributeError(f"module 'structspec' has no attribute {name!r}")
