"""How likely the target is to accept each node of an n-gram trie, per step: the ``ngram_eagle``
drafter's score for the n-gram branch (:mod:`structspec.speculative.ngram_eagle`).

A trie node was added by a continuation of an earlier occurrence of the history's suffix. Two
things say how far to trust it (:class:`~structspec.speculative.ngram.AnnotatedTrie`):

* the **match length** of that continuation: a trie found by a long suffix match copies a span
  of the prompt and is usually right to its end; one from a 1-2 token match (``"``, ``: ``) is a
  guess at which of the many earlier occurrences this one continues like;
* its **support**: how many of the looked-up continuations pass through the node (several
  earlier occurrences that agree on the next token make it likelier).

Each node's probability, given its parent was accepted, is the acceptance rate of its bucket
``(effective match length, support level)`` (the effective length counts the drafts before the
node too: :meth:`TrieConfidence.effective_match`):
a Beta estimate started from a prior that rises with both (:func:`prior_accept`) and updated
after every step from the target's committed run: every trie node whose parent the run reached
was tested (accepted when its token is the run's next one), whether the node was in the merged
tree or not, since the run is the target's own greedy continuation; a bucket's counts are halved
once they pass ``max_trials``, so it follows its recent tests. The estimates are engine-wide
(all requests' steps feed them); a request's confidence is per step, from the trie it has now.
A node's score is the sum of the log-probabilities along its path, comparable with EAGLE-2's
cumulative draft log-probabilities (:func:`~structspec.speculative.tree_union.union_trees` ranks
both together).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from structspec.speculative.ngram import AnnotatedTrie

#: support levels: 1 continuation, 2-3, 4 or more
SUPPORT_LEVELS = (1, 2, 4)


def support_level(support: int) -> int:
    """Bucket index of a node's support (:data:`SUPPORT_LEVELS`)."""
    return 2 if support >= SUPPORT_LEVELS[2] else (1 if support >= SUPPORT_LEVELS[1] else 0)


def prior_accept(match: int, level: int) -> float:
    """Prior acceptance probability of a trie node from a ``match``-token suffix match at
    support ``level``: 0.3 for a lone 1-token match, +0.1 per further matched token, +0.1 per
    support level, at most 0.9."""
    return min(0.9, 0.3 + 0.1 * (max(match, 1) - 1) + 0.1 * level)


class TrieConfidence:
    """Per-bucket acceptance estimates of trie nodes (see the module doc).

    Args:
        max_match: match lengths above this share its bucket (the n-gram drafter's
            ``max_window`` caps them anyway).
        prior_strength: pseudo-trials of each bucket's prior.
        max_trials: a bucket's counts are halved once its trials pass this (the estimates
            follow the last ~``max_trials`` tests of each bucket, not the whole history).

    Raises:
        ValueError: ``max_match < 1``, ``prior_strength <= 0`` or ``max_trials <=
            prior_strength``.
    """

    def __init__(self, *, max_match: int = 8, prior_strength: float = 8.0,
                 max_trials: float = 2000.0) -> None:
        if max_match < 1:
            raise ValueError(f"max_match={max_match}: expected >= 1")
        if prior_strength <= 0:
            raise ValueError(f"prior_strength={prior_strength}: expected > 0")
        if not max_trials > prior_strength:
            raise ValueError(f"max_trials={max_trials}: expected > prior_strength "
                             f"({prior_strength})")
        self.max_match = max_match
        #: a bucket's pseudo-trials are scaled back to half this once they pass it (hits with
        #: them, so the estimate is unchanged at that moment): its estimate keeps following a
        #: workload that changes over a long-running server, from its last ~max_trials tests
        self.max_trials = max_trials
        shape = (max_match + 1, len(SUPPORT_LEVELS))
        prior = np.array([[prior_accept(m, s) for s in range(shape[1])]
                          for m in range(shape[0])])
        #: accepted and tested pseudo-counts per (match length, support level) (updated by
        #: :meth:`observe` only: it invalidates the log table below)
        self.hits = prior * prior_strength
        self.trials = np.full(shape, prior_strength)
        #: ``log(hits / trials)`` as nested lists, rebuilt after an :meth:`observe`: the
        #: per-node loop of :meth:`path_logp` reads plain floats (numpy scalar indexing and
        #: division per node made it ~3 ms per step at batch 64, N=64, on this 2-core CPU)
        self._log_table: list[list[float]] | None = None

    def _bucket(self, match: int, support: int) -> tuple[int, int]:
        return min(max(match, 1), self.max_match), support_level(support)

    def accept_prob(self, match: int, support: int) -> float:
        """Current acceptance estimate of a node (in ``(0, 1)``)."""
        m, s = self._bucket(match, support)
        return float(self.hits[m, s] / self.trials[m, s])

    def path_logp(self, trie: AnnotatedTrie) -> list[float]:
        """Cumulative log-probability of each node's path (0.0 for node 0), never above the
        parent's. A node at depth ``d`` is scored by its effective match length
        (:meth:`effective_match`)."""
        if self._log_table is None:
            self._log_table = np.log(self.hits / self.trials).tolist()
        table = self._log_table
        parents, match, support = trie.parents, trie.match, trie.support
        out = [0.0]
        depth = [0]
        for i in range(1, len(trie.tokens)):
            p = parents[i]
            d = depth[p] + 1
            depth.append(d)
            m, s = self._bucket(self.effective_match(match[i], d), support[i])
            out.append(out[p] + table[m][s])
        return out

    @staticmethod
    def effective_match(match: int, depth: int) -> int:
        """The suffix match length behind a node at ``depth`` once its parent is accepted:
        the continuation's ``match`` plus the ``depth - 1`` drafts before it, which the
        history then repeats too (the probability of a node is conditional on its parent's
        acceptance, so a copy that has held for a few tokens is trusted more)."""
        return match + depth - 1

    def observe(self, trie: AnnotatedTrie, run: Sequence[int]) -> None:
        """Update the estimates from one step: ``run`` is the committed tokens (accepted drafts,
        then the target's bonus token), the target's greedy continuation of the trie's root.

        A node at depth ``d <= len(run)`` whose parent's path equals ``run[:d - 1]`` was tested
        (accepted iff its token is ``run[d - 1]``); deeper nodes and nodes off the run's path
        were not."""
        on_run = [True] + [False] * (len(trie.tokens) - 1)  # node's path is a prefix of run
        depth = [0] * len(trie.tokens)
        for i in range(1, len(trie.tokens)):
            p = trie.parents[i]
            depth[i] = depth[p] + 1
            if not on_run[p] or depth[i] > len(run):
                continue
            hit = trie.tokens[i] == run[depth[i] - 1]
            on_run[i] = hit
            m, s = self._bucket(self.effective_match(trie.match[i], depth[i]), trie.support[i])
            self.trials[m, s] += 1.0
            self.hits[m, s] += float(hit)
            if self.trials[m, s] > self.max_trials:
                scale = 0.5 * self.max_trials / self.trials[m, s]
                self.trials[m, s] *= scale
                self.hits[m, s] *= scale
            self._log_table = None

