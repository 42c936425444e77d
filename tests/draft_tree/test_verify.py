"""Tree verification against a plain-Python reference walk."""

from __future__ import annotations

import random

import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.verify import verify_tree


def reference_walk(tokens: list[int], parents: list[int], target: list[int]) -> list[int]:
    """Every child whose token equals its parent's target may be taken; the accepted path is
    the deepest such path (ties: lowest last-node index). Run = accepted drafts + bonus."""
    best = (0, 0)  # (depth, -node)
    path_of = {0: [0]}
    stack = [0]
    while stack:
        node = stack.pop()
        for k in range(1, len(tokens)):
            if parents[k] == node and tokens[k] >= 0 and tokens[k] == target[node]:
                path_of[k] = path_of[node] + [k]
                best = max(best, (len(path_of[k]) - 1, -k))
                stack.append(k)
    nodes = path_of[-best[1]]
    return [tokens[k] for k in nodes[1:]] + [target[nodes[-1]]]


def random_tree(n: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    tokens, parents = [rng.randrange(vocab)], [-1]
    for i in range(1, n):
        if rng.random() < 0.15:
            tokens.append(-1)
            parents.append(0)
            continue
        real = [j for j in range(i) if tokens[j] >= 0]
        parents.append(rng.choice(real))
        tokens.append(rng.randrange(vocab))
    return tokens, parents


def test_verify_matches_reference_on_random_trees() -> None:
    rng = random.Random(0)
    for _ in range(200):
        bsz, n, vocab = 3, rng.choice([1, 2, 5, 8, 16]), 4  # tiny vocab: many matches
        trees = [random_tree(n, vocab, rng) for _ in range(bsz)]
        targets = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bsz)]
        tree = VerifyTree.from_parents(torch.tensor([t for t, _ in trees]),
                                       torch.tensor([p for _, p in trees]))
        res = verify_tree(tree, torch.tensor(targets))
        for b in range(bsz):
            expect = reference_walk(*trees[b], targets[b])
            got_len = int(res.accept_len[b])
            got = res.accept_tokens[b, :got_len].tolist()
            assert got == expect
            nodes = res.accept_nodes[b, :got_len].tolist()
            assert nodes[0] == 0
            for d in range(1, got_len):
                assert trees[b][1][nodes[d]] == nodes[d - 1]
                assert trees[b][0][nodes[d]] == targets[b][nodes[d - 1]]
            assert got[-1] == targets[b][nodes[-1]]


def test_unique_siblings_give_exact_reference() -> None:
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    tree = VerifyTree.from_parents(tokens, parents)
    # target: after node0 -> 2 (node1), after node1 -> 4 (node3), after node3 -> 9 (no child 9)
    res = verify_tree(tree, torch.tensor([[2, 4, 0, 9, 0]]))
    assert res.accept_len.tolist() == [3]
    assert res.accept_tokens[0, :3].tolist() == [2, 4, 9]
    assert res.accept_nodes[0, :3].tolist() == [0, 1, 3]
    capped = verify_tree(tree, torch.tensor([[2, 4, 0, 9, 0]]), torch.tensor([1]))
    assert capped.accept_tokens[0, :2].tolist() == [2, 4]
