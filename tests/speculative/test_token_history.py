"""``TokenHistory``: the drafters' view of prompt + output ids reads exactly like the
concatenated list it replaces, and keeps its length when the output grows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from structspec.speculative.base import TokenHistory


@pytest.mark.parametrize(("num_prompt", "num_output"), [(0, 5), (5, 0), (1, 1), (7, 12)])
def test_reads_like_the_concatenated_list(num_prompt: int, num_output: int) -> None:
    prompt = list(range(100, 100 + num_prompt))
    output = list(range(500, 500 + num_output))
    ref = prompt + output
    view = TokenHistory(prompt, output)
    n = len(ref)
    assert len(view) == n and list(view) == ref and view == ref and ref == view
    for i in range(-n, n):
        assert view[i] == ref[i]
    for bad in (n, -n - 1):
        with pytest.raises(IndexError):
            view[bad]
    rng = random.Random(num_prompt * 31 + num_output)
    for _ in range(300):
        a, b = rng.randint(-n - 3, n + 3), rng.randint(-n - 3, n + 3)
        step = rng.choice([None, None, None, 2, -1])
        assert view[a:b:step] == ref[a:b:step], (a, b, step)
        assert view[a:] == ref[a:] and view[:b] == ref[:b]
    arr = np.asarray(view)
    assert arr.dtype == np.int64 and arr.tolist() == ref


def test_length_is_fixed_at_construction() -> None:
    """Tokens the scheduler commits after the view was made are not part of it."""
    output = [1, 2, 3]
    view = TokenHistory([9], output)
    output += [4, 5]
    assert len(view) == 4 and list(view) == [9, 1, 2, 3] and view[-1] == 3
    assert view[2:] == [2, 3] and np.asarray(view).tolist() == [9, 1, 2, 3]
