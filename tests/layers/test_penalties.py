"""Penalties and logit bias on verify-tree logits: each row against Hugging Face's repetition
processor and the OpenAI formula applied to that row's own path, counts kept on the device."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from structspec.draft_tree.layout import VerifyTree
from structspec.layers.penalties import (
    PenaltyInputs,
    PenaltyTable,
    apply_penalties_,
    count_accepted_,
    penalize,
    penalize_,
)

VOCAB = 40


def reference_row(logits: torch.Tensor, prompt: list[int], output: list[int], *,
                  presence: float, frequency: float, repetition: float,
                  bias: dict[int, float]) -> torch.Tensor:
    """One row penalised the way vLLM orders it: logit bias, Hugging Face's repetition
    processor over prompt + output, then OpenAI's ``mu - c * f - (c > 0) * p`` over the
    output's counts."""
    row = logits.clone()
    for t, b in bias.items():
        row[t] += b
    if repetition != 1.0:
        ids = torch.tensor([prompt + output], dtype=torch.int64)
        row = RepetitionPenaltyLogitsProcessor(repetition)(ids, row.view(1, -1)).view(-1)
    counts = Counter(output)
    for t, c in counts.items():
        row[t] = row[t] - frequency * c - presence * 1.0
    return row


def build(slots_params: dict[int, dict], prompts: dict[int, list[int]],
          outputs: dict[int, list[int]]) -> PenaltyTable:
    table = PenaltyTable.allocate(4, VOCAB, torch.device("cpu"))
    for slot, p in slots_params.items():
        table.presence[slot] = p["presence"]
        table.frequency[slot] = p["frequency"]
        table.repetition[slot] = p["repetition"]
        for t, b in p["bias"].items():
            table.logit_bias[slot, t] = b
        table.prompt_mask[slot, prompts[slot]] = True
        for t in outputs[slot]:
            table.counts[slot, t] += 1
    return table


def path_drafts(tree: VerifyTree, b: int, i: int) -> list[int]:
    """Drafted tokens on node i's path (node 0 and padding excluded), root to i."""
    nodes = [k for k in range(1, tree.num_nodes)
             if tree.ancestor_mask[b, i, k] and tree.draft_tokens[b, k] >= 0]
    return [int(tree.draft_tokens[b, k]) for k in nodes]


PARAMS = {
    "presence": dict(presence=1.5, frequency=0.0, repetition=1.0, bias={}),
    "frequency": dict(presence=0.0, frequency=0.7, repetition=1.0, bias={}),
    "repetition": dict(presence=0.0, frequency=0.0, repetition=1.3, bias={}),
    "repetition_below_1": dict(presence=0.0, frequency=0.0, repetition=0.8, bias={}),
    "all": dict(presence=-0.5, frequency=1.1, repetition=1.7, bias={3: 5.0, 7: -100.0}),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_rows_match_reference_on_their_paths(name: str) -> None:
    g = torch.Generator().manual_seed(1)
    # Two requests with a tree each (duplicate tokens among the drafts, a padding node, and
    # drafted tokens that also occur in the committed output), one request without penalties.
    tokens = torch.tensor([[5, 3, 3, 9, 3, 5, 7, -1],
                           [2, 8, 8, 8, 1, 2, 4, 6],
                           [1, 1, 2, 3, 4, 5, 6, 7]])
    parents = torch.tensor([[0, 0, 1, 1, 2, 4, 0, 0],
                            [0, 0, 1, 2, 0, 4, 5, 1],
                            [0, 0, 1, 2, 3, 4, 5, 6]])
    tree = VerifyTree.from_parents(tokens, parents)
    bsz, n = tokens.shape
    prompts = {1: [11, 12, 3, 30], 2: [8, 13, 13]}
    outputs = {1: [3, 20, 5], 2: [9, 8, 8, 2]}  # the last committed token is node 0
    table = build({1: PARAMS[name], 2: PARAMS[name]}, prompts, outputs)
    slots = torch.tensor([1, 2, 0])
    logits = torch.randn(bsz * n, VOCAB, generator=g) * 4
    got = logits.clone()
    apply_penalties_(got, PenaltyInputs(table, slots), tree.draft_tokens, tree.ancestor_mask)
    for b in range(bsz):
        for i in range(n):
            row = logits[b * n + i]
            if b == 2:  # slot 0: untouched, bit for bit
                assert torch.equal(got[b * n + i], row)
                continue
            slot = int(slots[b])
            want = reference_row(row, prompts[slot], outputs[slot] + path_drafts(tree, b, i),
                                 **PARAMS[name])
            torch.testing.assert_close(got[b * n + i], want, rtol=1e-6, atol=1e-5)


def test_root_only_rows_and_counts_on_device() -> None:
    """A prefill-shaped (root-only) step, then the committed runs counted into the slots:
    slot 0 and padding (-1) never count, nor tokens past ``accept_len``."""
    table = build({1: PARAMS["all"], 2: PARAMS["frequency"]}, {1: [1], 2: [2]},
                  {1: [], 2: [4]})
    slots = torch.tensor([1, 0, 2])
    logits = torch.randn(3, VOCAB)
    got = logits.clone()
    apply_penalties_(got, PenaltyInputs(table, slots), torch.tensor([[1], [5], [4]]),
                     torch.ones(3, 1, 1, dtype=torch.bool))
    torch.testing.assert_close(got[0], reference_row(logits[0], [1], [], **PARAMS["all"]))
    assert torch.equal(got[1], logits[1])
    torch.testing.assert_close(got[2], reference_row(logits[2], [2], [4],
                                                     **PARAMS["frequency"]))
    accept = torch.tensor([[7, 7, 3, -1], [9, 9, -1, -1], [4, 6, 6, 6]])
    count_accepted_(PenaltyInputs(table, slots), accept, torch.tensor([3, 2, 2]))
    assert table.counts[1, 7] == 2 and table.counts[1, 3] == 1
    assert table.counts[0].sum() == 0  # slot 0 stays neutral
    assert table.counts[2, 4] == 2 and table.counts[2, 6] == 1  # one 6 within accept_len
    assert table.counts.sum() == 3 + 1 + 2


def test_in_place_formula_is_bit_identical() -> None:
    """The in-place pass and the reference formula agree bit for bit (the path fix-up uses
    the latter, the broadcast pass the former: a token's value must not depend on which)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 500, generator=g) * 20
    logits[0, 0, :10] = 0.0
    counts = torch.randint(0, 3, (3, 1, 500), generator=g).float()
    seen = (torch.rand(3, 1, 500, generator=g) < 0.3) | (counts > 0)
    pen = [torch.tensor([0.3, -1.0, 0.0]).view(3, 1, 1), torch.tensor([1.7, 0.0, -0.4]).view(
        3, 1, 1), torch.tensor([1.3, 0.77, 1.0]).view(3, 1, 1)]
    bias = torch.randn(3, 1, 500, generator=g)
    want = penalize(logits, counts, seen, *pen, bias)
    got = logits.clone()
    penalize_(got, counts, seen, *pen, bias)
    assert torch.equal(got, want)
