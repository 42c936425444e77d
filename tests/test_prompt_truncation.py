"""``structspec.prompt_truncation``: vLLM's ``truncate_prompt_tokens`` rule (how many prompt
tokens are kept, and which)."""

from __future__ import annotations

import pytest

from structspec.prompt_truncation import keep_last, kept_prompt_tokens


@pytest.mark.parametrize(("value", "max_tokens", "kept"), [
    (None, None, None), (None, 50, None),
    (5, None, 5), (100, None, 100), (60, 40, 60),
    (-1, None, 100), (-1, 40, 60), (-1, 0, 100),
    (-1, 100, 1), (7, 150, 1),  # the completion alone fills the context: max_tokens is named
])
def test_kept_prompt_tokens(value: int | None, max_tokens: int | None, kept: int | None) -> None:
    assert kept_prompt_tokens(value, 100, max_tokens) == kept


@pytest.mark.parametrize(("value", "max_tokens", "match"), [
    (0, None, ">= 1"), (-2, None, ">= 1"), (True, None, "integer"),
    (101, None, "max_model_len = 100"), (61, 40, "100 - 40 = 60"),
])
def test_refused_values_name_the_field(value: int, max_tokens: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=f"^truncate_prompt_tokens.*{match}"):
        kept_prompt_tokens(value, 100, max_tokens)


def test_keep_last() -> None:
    assert keep_last([1, 2, 3, 4], 2) == [3, 4]
    assert keep_last([1, 2, 3, 4], 4) == keep_last([1, 2, 3, 4], 9) == [1, 2, 3, 4]
    assert keep_last((1, 2), None) == [1, 2]
