"""Per-request grammar state on llguidance: the :class:`LlgMatcher`, with the same interface
as the xgrammar :class:`~structspec.grammar.matcher.Matcher` (accept a committed run, roll
back, termination, the packed ``int32`` bitmask, the draft-tree walk).

Differences from xgrammar that this wrapper hides:

- ``llguidance.LLMatcher`` enters a permanent error state when it consumes a token the grammar
  forbids; xgrammar refuses the token and keeps its state. Every accept here is checked with
  ``validate_tokens`` first, so a refused token leaves the state unchanged, as with xgrammar.
- llguidance reports "stopped" as soon as the grammar cannot be extended (only EOS is allowed
  then); xgrammar's "terminated" means a stop token was accepted. :meth:`is_terminated` keeps
  xgrammar's meaning (the stop token is always the last accepted token, so any rollback
  undoes it).
- llguidance has no draft-tree traversal: :meth:`traverse_draft_tree` is a depth-first walk in
  Python (fill the node's row, consume an allowed child, recurse, roll back one token), or,
  for a chain, one call of llguidance's draft-token mask fill (``LLExecutor``). It
  runs in the engine process or, on a mirror matcher compiled there from the grammar text, in
  a mask worker process (docs/architecture.md, "Grammar backends").

The bitmask layout is xgrammar's (``int32 [rows, ceil(vocab_size / 32)]``, bit ``t % 32`` of
word ``t // 32``), so rows of both backends share one batch bitmask.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

BACKEND_NAME = "llguidance"


@dataclass(frozen=True, eq=False)
class LlgCompiled:
    """One compiled llguidance grammar, shared by every request that uses it.

    Attributes:
        template: a matcher at the grammar's start state, never advanced; each request's
            matcher is a ``deep_copy`` of it (the grammar's lexer and tables are built once).
        vocab_size: the logits width the masks cover (``ceil(vocab_size / 32)`` words a row).
        kind: the grammar kind (``json_schema``, ``regex``...).
        grammar: llguidance's grammar text of it (what a mask worker process compiles its
            own copy from: llguidance's objects cannot be pickled, and a compile takes
            milliseconds).
    """

    template: llguidance.LLMatcher
    vocab_size: int
    kind: str
    grammar: str = ""


class _WalkTimeout(Exception):
    """A draft-tree walk ran past its time limit (internal to :meth:`traverse_draft_tree`)."""


_EXECUTORS = threading.local()


def _chain_executor() -> llguidance.LLExecutor:
    """This thread's one-thread ``LLExecutor`` (for :meth:`LlgMatcher.traverse_draft_tree`'s
    chains). One per calling thread: the engine process walks trees on several threads at
    once, which one shared executor's single Rust thread would serialize."""
    ex = getattr(_EXECUTORS, "executor", None)
    if ex is None:
        ex = _EXECUTORS.executor = llguidance.LLExecutor(1)
    return ex


class LlgMatcher:
    """The grammar state of one request on llguidance (interface of
    :class:`~structspec.grammar.matcher.Matcher`).

    Args:
        compiled: the compiled grammar (:class:`LlgCompiled`).
        stop_token_ids: the ids that end the output (the llguidance tokenizer was built with
            them as its EOS tokens).
        max_rollback_tokens: the deepest :meth:`rollback` allowed (>= the deepest draft path).

    Attributes:
        backend: ``"llguidance"`` (reported per request).
        num_accepted: committed accepts minus rollbacks; a tree walk leaves it unchanged.
        stop_token_ids: the stop ids.
        compiled: the shared compiled grammar.
    """

    backend = BACKEND_NAME

    def __init__(self, compiled: LlgCompiled, *, stop_token_ids: Sequence[int],
                 max_rollback_tokens: int = 64) -> None:
        self.compiled = compiled
        self.stop_token_ids: tuple[int, ...] = tuple(int(t) for t in stop_token_ids)
        self.max_rollback_tokens = int(max_rollback_tokens)
        self.num_accepted = 0
        self._stop_set = frozenset(self.stop_token_ids)
        self._llg = compiled.template.deep_copy()
        self._terminated = False
        self._width = (compiled.vocab_size + 31) // 32

    @property
    def vocab_size(self) -> int:
        """The logits width the masks cover (the compiled grammar's vocabulary size)."""
        return int(self.compiled.vocab_size)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it or has
        ended."""
        return self.accept_run([token_id]) == 1

    def accept_run(self, token_ids: Sequence[int]) -> int:
        """Advance over a committed run; stops after a stop token or before the first
        forbidden token. Returns how many tokens were kept (``0 <= n <= len(token_ids)``)."""
        if self._terminated or not len(token_ids):
            return 0
        run = [int(t) for t in token_ids]
        llg = self._llg
        n = llg.validate_tokens(run)  # checked first: a bad consume is a dead matcher
        if n and not llg.consume_tokens(run[:n]):
            raise RuntimeError(f"llguidance refused tokens it had validated: "
                               f"{llg.get_error()}")
        # llguidance 1.9's validate_tokens refuses EOS once the grammar is stopped (it can
        # only end), although its mask allows EOS there and consuming it succeeds
        if n < len(run) and run[n] in self._stop_set and llg.is_stopped() \
                and not llg.is_error():
            if not llg.consume_token(run[n]):
                raise RuntimeError(f"llguidance refused EOS after a stop: {llg.get_error()}")
            n += 1
        # nothing is valid after a stop token, so a stop token can only be the last one kept
        self._terminated = n > 0 and run[n - 1] in self._stop_set
        self.num_accepted += n
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepts.

        Raises:
            ValueError: ``num_tokens`` negative, above ``num_accepted`` or
                ``max_rollback_tokens``.
        """
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens > self.max_rollback_tokens:
            raise ValueError(f"rollback({num_tokens}) exceeds max_rollback_tokens="
                             f"{self.max_rollback_tokens}")
        if num_tokens:
            self._llg.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self._terminated = False  # the stop token, if any, was the last accepted one

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted (the grammar has ended)."""
        return self._terminated

    def is_completed(self) -> bool:
        """Whether the text so far is a complete sentence (a stop token would be accepted)."""
        return self._terminated or self._llg.is_stopped() or any(
            self._llg.validate_tokens([t]) == 1 for t in self.stop_token_ids)

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from the current state (llguidance's fast-forward
        tokens; empty when the next token is a choice)."""
        return list(self._llg.compute_ff_tokens())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (``int32 [rows, W]`` on the
        CPU, ``W = ceil(vocab_size / 32)``, contiguous rows).

        Returns:
            False when every token is allowed (the row is all ones).
        """
        target = bitmask[int(row)]
        self._llg.unsafe_compute_mask_ptr(target.data_ptr(), self._width * 4)
        return bool((target != -1).any())

    def traverse_draft_tree(self, next_token: torch.Tensor, next_sibling: torch.Tensor,
                            draft_tokens: torch.Tensor, rows: torch.Tensor,
                            time_limit_s: float) -> bool:
        """Fill the bitmask row of every reachable node of one request's draft tree.

        Depth first from node 0 (the state before the tree): fill the node's row, then for
        each child whose token the row allows and that is not a stop token, consume it,
        recurse, roll back one token. Rows of nodes never expanded are left as they are (all
        ones when the caller allocated them so; the settle step resets them anyway). A chain
        goes to llguidance in one call, with the same rows (:meth:`_walk_chain`).

        Args:
            next_token, next_sibling, draft_tokens: ``int64 [N]`` host tensors of the tree.
            rows: ``int32 [N, W]`` host rows of this request (contiguous).
            time_limit_s: wall-clock limit for the walk.

        Returns:
            False when the walk ran past ``time_limit_s`` (the matcher is back at its state
            before the walk either way).
        """
        nxt, sib, toks = next_token.tolist(), next_sibling.tolist(), draft_tokens.tolist()
        chain_result = self._walk_chain(nxt, sib, toks, rows, time_limit_s)
        if chain_result is not None:
            return chain_result
        words = rows.numpy()
        width_bytes = self._width * 4
        base, stride_bytes = rows.data_ptr(), rows.stride(0) * rows.element_size()
        limit = 32 * words.shape[1]
        stop = self._stop_set
        llg = self._llg
        deadline = time.perf_counter() + time_limit_s
        depth = 0

        def expand(node: int) -> None:
            nonlocal depth
            llg.unsafe_compute_mask_ptr(base + node * stride_bytes, width_bytes)
            child = nxt[node]
            while child != -1:
                if time.perf_counter() > deadline:
                    raise _WalkTimeout
                tok = toks[child]
                if 0 <= tok < limit and tok not in stop \
                        and (int(words[node, tok >> 5]) >> (tok & 31)) & 1:
                    if not llg.consume_token(tok):
                        raise RuntimeError(f"llguidance refused a token its mask allowed: "
                                           f"{llg.get_error()}")
                    depth += 1
                    expand(child)
                    llg.rollback(1)
                    depth -= 1
                child = sib[child]

        try:
            expand(0)
        except _WalkTimeout:
            if depth:
                llg.rollback(depth)
            return False
        return True

    def _walk_chain(self, nxt: list[int], sib: list[int], toks: list[int],
                    rows: torch.Tensor, time_limit_s: float) -> bool | None:
        """:meth:`traverse_draft_tree` of a chain in one call into llguidance: the n-gram
        drafter's trees on repetitive outputs (nodes ``0 -> 1 -> ... -> k``, no siblings).

        ``LLExecutor.unsafe_compute_mask_ptr_with_draft_token`` fills row 0, then for each
        drafted token that the previous row allows consumes it and fills the next row; it
        stops at the first token refused, leaving the later rows untouched, and rolls the
        matcher back: the recursive walk's rows and end state, without its Python calls per
        node (a fifth of an 8-node chain's walk; ``benchmarks/tree_mask_cost.py``). The chain
        is cut before the first stop token (the walk never consumes one) and before an id
        outside ``[0, 32 * W)`` (llguidance would enter its error state on it), as the
        recursive walk skips them.

        The time limit is checked after the call (at most ``N`` masks): past it, the walk
        counts as timed out; the matcher is back at its state either way.

        Returns:
            None, with nothing done, when the tree is not such a chain or ``rows`` is not
            ``[N, W]`` contiguous (the caller walks it in Python); else False past the time
            limit, True otherwise.
        """
        width = self._width
        if not rows.is_contiguous() or rows.shape != (len(nxt), width):
            return None
        limit, stop = 32 * width, self._stop_set
        tokens: list[int] = []
        node = 0
        while (child := nxt[node]) != -1:
            if child != node + 1 or sib[child] != -1:
                return None
            tok = toks[child]
            if not 0 <= tok < limit or tok in stop:
                break  # never expanded: its row and those below it stay as they are
            tokens.append(tok)
            node = child
        t0 = time.perf_counter()
        if tokens:
            _chain_executor().unsafe_compute_mask_ptr_with_draft_token(
                [(self._llg, 0, tokens)], rows.data_ptr(), width * 4, rows.shape[0])
        else:  # the root alone (llguidance refuses an empty draft)
            self._llg.unsafe_compute_mask_ptr(rows.data_ptr(), width * 4)
        return time.perf_counter() - t0 <= time_limit_s


def decode_mask_row(row: torch.Tensor | np.ndarray, vocab_size: int) -> list[int]:
    """The allowed token ids of one packed ``int32 [W]`` row (tests and diagnostics)."""
    words = np.asarray(row, dtype=np.int32).view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return np.nonzero(bits)[0].tolist()
