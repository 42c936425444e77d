"""The per-request matcher of either grammar backend (one type name for the scheduler and the
tree-mask build): :class:`~structspec.grammar.matcher.Matcher` (xgrammar) or
:class:`~structspec.grammar.llg_matcher.LlgMatcher` (llguidance). Both have ``backend``,
``vocab_size``, ``accept_run``, ``rollback``, ``is_terminated``, ``is_completed``,
``fill_bitmask`` and ``traverse_draft_tree`` with the same meanings and bitmask layout."""

from __future__ import annotations

from structspec.grammar.bitmask import allocate_bitmask
from structspec.grammar.llg_matcher import LlgMatcher
from structspec.grammar.matcher import Matcher

AnyMatcher = Matcher | LlgMatcher


def allows_no_token(matcher: AnyMatcher) -> bool:
    """Whether the matcher's current state allows no token at all: a dead end of the grammar
    (e.g. a property whose schema accepts no value, which the compiler let through), where a
    terminated matcher (its grammar ended at a stop token) is not one. One host mask fill;
    for error paths, not the step.
    """
    if matcher.is_terminated():
        return False
    bitmask = allocate_bitmask(1, matcher.vocab_size, pin=False)
    matcher.fill_bitmask(bitmask, 0)
    return not bool(bitmask.any())


__all__ = ["AnyMatcher", "LlgMatcher", "Matcher", "allows_no_token"]
