"""Grammar-constrained decoding on xgrammar (killable compiles: worker processes under a
time limit, :mod:`~structspec.grammar.compile_pool`) or llguidance
(:mod:`~structspec.grammar.llg_backend`; per grammar with ``auto``:
:mod:`~structspec.grammar.select_backend`): compile cache, matchers, tree bitmasks.

Public API: :class:`GrammarBackend` (compile specs, make matchers), :class:`Matcher`,
:func:`allocate_bitmask` / :func:`apply_bitmask_`, :class:`GrammarTree` and
:func:`build_grammar_vocab_mask`, :func:`find_unenforceable`, :class:`GrammarError`.
"""

from __future__ import annotations

from structspec.grammar.backend import GrammarBackend, GrammarFuture
from structspec.grammar.bitmask import allocate_bitmask, apply_bitmask_, bitmask_width
from structspec.grammar.errors import GrammarError
from structspec.grammar.matcher import Matcher
from structspec.grammar.schema_check import find_unenforceable
from structspec.grammar.tree_mask import GrammarMaskResult, GrammarTree, build_grammar_vocab_mask

__all__ = [
    "GrammarBackend",
    "GrammarError",
    "GrammarFuture",
    "GrammarMaskResult",
    "GrammarTree",
    "Matcher",
    "allocate_bitmask",
    "apply_bitmask_",
    "bitmask_width",
    "build_grammar_vocab_mask",
    "find_unenforceable",
]
