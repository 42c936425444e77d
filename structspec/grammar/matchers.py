"""The per-request matcher of either grammar backend (one type name for the scheduler and the
tree-mask build): :class:`~structspec.grammar.matcher.Matcher` (xgrammar) or
:class:`~structspec.grammar.llg_matcher.LlgMatcher` (llguidance). Both have ``backend``,
``accept_run``, ``rollback``, ``is_terminated``, ``is_completed``, ``fill_bitmask`` and
``traverse_draft_tree`` with the same meanings and bitmask layout."""

from __future__ import annotations

from structspec.grammar.llg_matcher import LlgMatcher
from structspec.grammar.matcher import Matcher

AnyMatcher = Matcher | LlgMatcher

__all__ = ["AnyMatcher", "LlgMatcher", "Matcher"]
