"""Per-request grammar state: a thin wrapper around ``xgrammar.GrammarMatcher``.

The scheduler owns one :class:`Matcher` per constrained request. :meth:`Matcher.accept_run` is
*the* single place a committed run of tokens advances it (docs/architecture.md, invariant 3:
one matcher advance per committed token); the tree traversal in
:mod:`structspec.grammar.tree_mask` advances and rolls back the underlying matcher inside C++
and leaves it as it found it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class Matcher:
    """The grammar state of one request.

    Args:
        compiled: the compiled grammar (shared between requests; compile once, match many).
        stop_token_ids: token ids that end the output (they override the tokenizer's).
        max_rollback_tokens: the deepest :meth:`rollback` allowed (>= the deepest draft path).
            xgrammar 0.2.8 keeps unlimited history, so this bound is checked here.

    Attributes:
        num_accepted: committed accepts minus rollbacks (tests of "exactly-once advance" read
            it); the traversal of a draft tree leaves it unchanged.
        stop_token_ids: the stop ids the matcher terminates on.
        backend: ``"xgrammar"`` (the llguidance matcher,
            :class:`~structspec.grammar.llg_matcher.LlgMatcher`, has the same interface).
    """

    backend = "xgrammar"

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        *,
        stop_token_ids: Sequence[int],
        max_rollback_tokens: int = 64,
    ) -> None:
        self.stop_token_ids: tuple[int, ...] = tuple(int(t) for t in stop_token_ids)
        self.max_rollback_tokens = int(max_rollback_tokens)
        self.num_accepted = 0
        self._stop_set = frozenset(self.stop_token_ids)
        #: the compiled grammar (the mask worker pool ships it to its mirror matcher)
        self.compiled = compiled
        self._xgr = xgr.GrammarMatcher(compiled, override_stop_tokens=list(self.stop_token_ids))

    @property
    def vocab_size(self) -> int:
        """The logits width the masks cover (the compiled tokenizer's vocabulary size)."""
        return int(self.compiled.tokenizer_info.vocab_size)

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        """The wrapped ``xgrammar.GrammarMatcher`` (for ``traverse_draft_tree``)."""
        return self._xgr

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token.

        Returns:
            True when the grammar allows ``token_id`` (the state advanced); False otherwise
            (state unchanged), including after termination.
        """
        if self._xgr.is_terminated():
            return False
        ok = bool(self._xgr.accept_token(int(token_id)))
        self.num_accepted += ok
        return ok

    def accept_run(self, token_ids: Sequence[int]) -> int:
        """Advance over a committed run, one token at a time.

        Stops after the token that terminates the grammar (e.g. the stop token) or before the
        first rejected token. The caller keeps (emits, commits to KV) only the first ``n``
        tokens of the run.

        Args:
            token_ids: the accepted run of one verify step (bonus included), host ints.

        Returns:
            ``n``, the number of tokens retained (``0 <= n <= len(token_ids)``).
        """
        xm = self._xgr
        if xm.is_terminated():
            return 0
        # Hot path of the grammar barrier (every committed token of every request, each step):
        # one C++ call per token; the matcher can only terminate on a stop token.
        n = 0
        for tok in token_ids:
            tok = int(tok)
            if not xm.accept_token(tok):
                break
            n += 1
            if tok in self._stop_set and xm.is_terminated():
                break
        self.num_accepted += n
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepts.

        Raises:
            ValueError: when ``num_tokens`` is negative, exceeds ``num_accepted`` or
                ``max_rollback_tokens``.
        """
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens > self.max_rollback_tokens:
            raise ValueError(f"rollback({num_tokens}) exceeds max_rollback_tokens="
                             f"{self.max_rollback_tokens}")
        if num_tokens:
            self._xgr.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        """Whether the grammar has ended (a stop token was accepted)."""
        return bool(self._xgr.is_terminated())

    def is_completed(self) -> bool:
        """Whether the text so far is a complete sentence (a stop token would be accepted)."""
        return bool(self._xgr.is_completed())

    def traverse_draft_tree(self, next_token: torch.Tensor, next_sibling: torch.Tensor,
                            draft_tokens: torch.Tensor, rows: torch.Tensor,
                            time_limit_s: float) -> bool:
        """Fill the rows of one request's draft tree (xgrammar ``traverse_draft_tree``, in
        C++: accept, fill row, recurse, roll back; the state is left as it was).

        Args:
            next_token, next_sibling, draft_tokens: ``int64 [N]`` host tensors of the tree.
            rows: ``int32 [N, W]`` host rows of this request.
            time_limit_s: wall-clock limit for the walk.

        Returns:
            False when the walk timed out.
        """
        return bool(self._xgr.traverse_draft_tree(next_token, next_sibling, draft_tokens, rows,
                                                  time_limit_s))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens of the current state into ``bitmask[row]``.

        Args:
            bitmask: ``int32 [rows, ceil(vocab_size / 32)]`` on the CPU (bit ``t % 32`` of word
                ``t // 32`` = token ``t`` allowed); see :func:`~.bitmask.allocate_bitmask`.
            row: the row to fill (a Python int).

        Returns:
            False when every token is allowed (the row is all ones).
        """
        return bool(self._xgr.fill_next_token_bitmask(bitmask, int(row)))
