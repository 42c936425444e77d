"""structspec: structured generation with speculative decoding.

Public API: :class:`LLM`, :class:`SamplingParams`, the grammar constraints, :class:`RequestOutput`,
:class:`ChatMessageError` (malformed chat messages).
Heavy modules load lazily, so ``import structspec`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuralTagConstraint,
)
from structspec.core import (
    ChatMessageError,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SpecMetrics,
)

if TYPE_CHECKING:
    from structspec.llm import LLM

__all__ = [
    "LLM",
    "ChatMessageError",
    "ChoiceConstraint",
    "EbnfConstraint",
    "FinishReason",
    "GrammarConstraint",
    "JsonObjectConstraint",
    "JsonSchemaConstraint",
    "RegexConstraint",
    "RequestOutput",
    "SamplingParams",
    "SpecMetrics",
    "StructuralTagConstraint",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from structspec.llm import LLM

        return LLM
    from structspec.core import deprecated_constraint_name

    try:
        return deprecated_constraint_name(name)
    except AttributeError:
        pass
    raise AttributeError(f"module 'structspec' has no attribute {name!r}")
