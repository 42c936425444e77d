"""``score_prompt_rows``: the LM head over bounded slices gives what one whole-prompt
log-softmax gives (logprob, rank, top-k), and no slice is larger than ``max_rows``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from structspec.runner.prompt_logprobs import score_prompt_rows


def _head(weight: torch.Tensor, seen: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def compute_logits(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return rows @ weight.T

    return compute_logits


def test_slices_equal_the_whole_prompt() -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(11, 8), torch.randn(50, 8) * 3
    targets = torch.randint(0, 50, (11,))
    seen: list[int] = []
    got = score_prompt_rows(_head(weight, seen), hidden, targets, 5, max_rows=4)
    assert seen == [4, 4, 3]
    full = (hidden @ weight.T).log_softmax(dim=-1)
    want = full.gather(1, targets.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(got.logprobs, want)
    assert got.ranks.tolist() == [int((r > r[t]).sum()) + 1 for r, t in zip(full, targets,
                                                                            strict=True)]
    top = full.topk(5, dim=1)
    assert torch.equal(got.top_ids, top.indices)
    torch.testing.assert_close(got.top_logprobs, top.values)


def test_no_alternatives_and_no_rows() -> None:
    weight = torch.randn(50, 8)
    got = score_prompt_rows(_head(weight, []), torch.randn(3, 8), torch.tensor([1, 2, 3]), 0)
    assert got.top_ids.shape == (3, 0) and got.top_logprobs.shape == (3, 0)
    empty = score_prompt_rows(_head(weight, []), torch.randn(0, 8),
                              torch.zeros(0, dtype=torch.int64), 2)
    assert empty.logprobs.shape == (0,) and empty.top_ids.shape == (0, 2)


def test_mismatched_targets_are_refused() -> None:
    with pytest.raises(ValueError, match="target_ids"):
        score_prompt_rows(_head(torch.randn(5, 4), []), torch.randn(3, 4),
                          torch.tensor([1, 2]), 1)
