"""The scheduler's select/verify function (the one the runner's post-forward graph records)
against its parts: mask application, argmax or sampling, tree verification."""

from __future__ import annotations

import pytest
import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.verify import verify_tree
from structspec.grammar.bitmask import apply_bitmask_, bitmask_width
from structspec.layers.sampler import SamplingBatch, sample_rows
from structspec.scheduler.select_verify import select_verify

VOCAB = 100


def _tree(bsz: int, n: int, seed: int) -> VerifyTree:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (bsz, n), generator=g)
    parents = torch.zeros((bsz, n), dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bsz,), generator=g)
    if n > 2:
        tokens[0, -1] = -1  # a padding node
    return VerifyTree.from_parents(tokens, parents)


def _greedy_batch(rows_per_request: int) -> SamplingBatch:
    empty = torch.empty(0)
    return SamplingBatch(temperature=empty, top_k=empty.long(), top_p=empty, min_p=empty,
                         rows_per_request=rows_per_request, all_greedy=True,
                         use_top_k=False, use_top_p=False, use_min_p=False,
                         seeds=empty.long(), starts=empty.long())


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_select_verify_equals_its_parts(n: int, masked: bool) -> None:
    bsz = 3
    tree = _tree(bsz, n, seed=n)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(bsz * n, VOCAB, generator=gen)
    # Make some drafts the target's choice, so paths get accepted.
    for b in range(bsz):
        for i in range(1, n):
            tok = int(tree.draft_tokens[b, i])
            if tok >= 0 and i % 2:
                logits[b * n + int(tree.parents[b, i]), tok] = 10.0
    bitmask = None
    if masked:
        bitmask = torch.randint(-2**31, 2**31 - 1, (bsz * n, bitmask_width(VOCAB)),
                                generator=gen, dtype=torch.int32)
        bitmask[::2] = -1
    cap = torch.tensor([n, 0, 1])

    ref_logits = logits.clone()
    if bitmask is not None:
        apply_bitmask_(ref_logits, bitmask)
    ref = verify_tree(tree, ref_logits.argmax(-1).view(bsz, n), cap)
    ref_real = (tree.draft_tokens[:, 1:] >= 0).sum(1)

    for select in (None, lambda rows: sample_rows(rows, _greedy_batch(n))):
        got_logits = logits.clone()
        result, num_real = select_verify(got_logits, bitmask, tree.draft_tokens, tree.parents,
                                         tree.depth, tree.ancestor_mask, cap, select=select)
        assert torch.equal(got_logits, ref_logits)  # masked in place
        assert torch.equal(result.accept_tokens, ref.accept_tokens)
        assert torch.equal(result.accept_len, ref.accept_len)
        assert torch.equal(result.accept_nodes, ref.accept_nodes)
        assert torch.equal(num_real, ref_real)
