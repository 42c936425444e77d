"""Token-budget batches of training sequences and their seeded order.

Each batch is a set of sequences padded on the right to one width (the longest, rounded up to
a multiple of :data:`WIDTH_MULTIPLE`), with ``rows * width <= batch_tokens``. An epoch's order
is a seeded shuffle; sequences are sorted by length inside windows of
:data:`SORT_WINDOW_BATCHES` batches' worth so that padding stays small, and the batches are
shuffled again. The plan depends only on ``(lengths, batch_tokens, seed, epoch)``, so a resumed
run rebuilds it exactly (the trainer also stores it in its checkpoint).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from structspec.training.sequences import TrainSequence

#: batch widths are rounded up to this (fewer distinct shapes; friendlier matmul sizes).
WIDTH_MULTIPLE = 16
#: sort-by-length window, in batches' worth of tokens.
SORT_WINDOW_BATCHES = 32


def padded_width(length: int, max_len: int) -> int:
    """``length`` rounded up to :data:`WIDTH_MULTIPLE`, at most ``max_len``."""
    return min(max_len, -(-length // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)


def plan_epoch(lengths: Sequence[int], *, batch_tokens: int, max_len: int, seed: int,
               epoch: int) -> list[list[int]]:
    """The batches (lists of sequence indices) of one epoch.

    Args:
        lengths: per sequence, its (already truncated) token count, each ``<= max_len``.
        batch_tokens: the budget ``rows * padded width`` of a batch (``>= max_len``).
        max_len: the longest row.
        seed, epoch: the order's seed.

    Raises:
        ValueError: ``batch_tokens < max_len``.
    """
    if batch_tokens < max_len:
        raise ValueError(f"batch_tokens={batch_tokens} is smaller than max_seq_len={max_len}")
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mean = max(1, sum(lengths) // max(1, len(lengths)))
    window = max(1, SORT_WINDOW_BATCHES * batch_tokens // mean)
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        part = sorted(order[start:start + window], key=lambda i: -lengths[i])
        cur: list[int] = []
        width = 0
        for i in part:
            w = max(width, padded_width(lengths[i], max_len))
            if cur and (len(cur) + 1) * w > batch_tokens:
                batches.append(cur)
                cur, w = [], padded_width(lengths[i], max_len)
            cur.append(i)
            width = w
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(seqs: Sequence[TrainSequence], max_len: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids [B, W]`` int64 (pad id 0), ``lengths [B]`` and prompt lengths
    ``[B]`` on ``device``; sequences longer than ``max_len`` keep their first ``max_len``
    tokens."""
    lens = [min(len(s.token_ids), max_len) for s in seqs]
    width = padded_width(max(lens), max_len)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    for r, (s, n) in enumerate(zip(seqs, lens, strict=True)):
        ids[r, :n] = torch.tensor(s.token_ids[:n], dtype=torch.int64)
    lengths = torch.tensor(lens, dtype=torch.int64)
    prompt = torch.tensor([min(s.num_prompt_tokens, n) for s, n in zip(seqs, lens, strict=True)],
                          dtype=torch.int64)
    return ids.to(device), lengths.to(device), prompt.to(device)


def trainable(seq: TrainSequence, max_len: int) -> bool:
    """Whether ``seq`` (truncated to ``max_len``) has a row the loss counts: at least one
    response token after the first (``n >= P + 1`` and ``n >= 3``)."""
    n = min(len(seq.token_ids), max_len)
    return n >= 3 and n >= seq.num_prompt_tokens + 1


def draft_vocabulary(seqs: Sequence[TrainSequence], size: int, vocab_size: int,
                     max_len: int) -> torch.Tensor:
    """The ``size`` most frequent response tokens of ``seqs`` (ties: lower id first), padded
    with the lowest unused ids when fewer distinct tokens occur; sorted ``[size]`` int64
    target ids (the reduced draft vocabulary's ``d2t`` targets).

    Raises:
        ValueError: ``size`` is not in ``[1, vocab_size]``.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size={size}: must be in [1, {vocab_size}] (0 = share "
                         f"the target's lm_head)")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        resp = s.token_ids[s.num_prompt_tokens:max_len]
        if resp:
            counts += torch.bincount(torch.tensor(resp, dtype=torch.int64), minlength=vocab_size)
    # stable descending sort on counts: equal counts keep ascending ids
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values
