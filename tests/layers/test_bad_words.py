"""ban_bad_words_ against a plain per-row loop of vLLM's rule (``vllm/v1/sample/ops/bad_words.py``
``_apply_bad_words_single_batch``): on random trees, each row's past tokens are the committed
output followed by the draft tokens on its path below the root; a word's last token is -inf
where they end with its prefix, except in a row the ban would leave with no finite logit."""

from __future__ import annotations

import random

import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.layers.bad_words import WordBan, ban_bad_words_


def _path_tokens(tree: VerifyTree, b: int, i: int) -> list[int]:
    """The draft tokens of the nodes root..i below the root (a plain parent walk)."""
    out = []
    while i > 0:
        out.append(int(tree.draft_tokens[b, i]))
        i = int(tree.parents[b, i])
    return out[::-1]


def _reference(logits: torch.Tensor, tree: VerifyTree, outputs: list[list[int]],
               words: dict[int, list[list[int]]]) -> torch.Tensor:
    out = logits.clone()
    n = tree.num_nodes
    for b, ws in words.items():
        for i in range(n):
            past = outputs[b] + _path_tokens(tree, b, i)
            row = out[b * n + i].clone()
            for w in ws:  # vLLM's loop, verbatim in meaning
                if len(w) > len(past) + 1:
                    continue
                if past[len(past) - (len(w) - 1):] == w[:-1]:
                    row[w[-1]] = float("-inf")
            if torch.isfinite(row.max()):
                out[b * n + i] = row
    return out


def _random_tree(rng: random.Random, bsz: int, n: int, vocab: int) -> VerifyTree:
    tokens, parents = [], []
    for _ in range(bsz):
        par = [-1] + [rng.randrange(i) for i in range(1, n)]
        tokens.append([rng.randrange(vocab) for _ in range(n)])
        parents.append(par)
    return VerifyTree.from_parents(torch.tensor(tokens), torch.tensor(parents))


def test_ban_matches_the_row_loop_on_random_trees() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    bsz, n, vocab = 5, 9, 6  # a small vocabulary: paths often end with a word's prefix
    hits = 0
    for _ in range(20):
        tree = _random_tree(rng, bsz, n, vocab)
        outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(4))] for _ in range(bsz)]
        for b in range(bsz):  # the root is the last committed token
            if outputs[b]:
                tree.draft_tokens[b, 0] = outputs[b][-1]
        words = {b: [[rng.randrange(vocab) for _ in range(rng.randrange(2, 5))]
                     for _ in range(rng.randrange(1, 4))]
                 for b in rng.sample(range(bsz), 3)}
        logits = torch.randn(bsz * n, vocab, generator=gen)
        # a row whose only finite logit is a banned one (a grammar allowing nothing else),
        # and a NaN row
        logits[rng.randrange(bsz * n)] = float("-inf")
        logits[rng.randrange(bsz * n), 0] = float("nan")
        for b, ws in words.items():
            r = b * n + rng.randrange(n)
            logits[r] = float("-inf")
            logits[r, ws[0][-1]] = 1.0
        want = _reference(logits, tree, outputs, words)
        got = logits.clone()
        ban = WordBan.build([(b, outputs[b], ws) for b, ws in words.items()], lambda t: t)
        ban_bad_words_(got, tree.draft_tokens, tree.parents, tree.depth, ban)
        torch.testing.assert_close(got, want, equal_nan=True)
        hits += int((torch.isneginf(got) & ~torch.isneginf(logits)).sum())
    assert hits > 50  # the rule banned something, often


def test_the_ban_follows_the_path_not_the_committed_tokens() -> None:
    """Word [3, 4]: token 4 is banned only at rows whose path ends with 3 (a draft token),
    not at its siblings, and at the root only when the committed output ends with 3."""
    for output, banned_rows in (([1], {1}), ([3, 1], {1}), ([1, 3], {0, 1})):
        tree = VerifyTree.from_parents(torch.tensor([[output[-1], 3, 5, 4]]),
                                       torch.tensor([[-1, 0, 0, 1]]))
        logits = torch.zeros(4, 8)
        ban = WordBan.build([(0, output, [[3, 4]])], lambda t: t)
        ban_bad_words_(logits, tree.draft_tokens, tree.parents, tree.depth, ban)
        assert {i for i in range(4) if torch.isneginf(logits[i, 4])} == banned_rows, output
        assert torch.isneginf(logits).sum() == len(banned_rows)
