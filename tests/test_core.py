"""``SamplingParams.validate``: bad values are a ``ValueError`` whose message starts with the
field's name (the engine and the server take the field from there)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from structspec.core import SEED_MAX, SEED_MIN, SamplingParams, choice_seed
from structspec.engine.llm_engine import _param_of


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "seed", "logprobs"])
@pytest.mark.parametrize("value", [2.5, 2.0, "2", True, False])
def test_integer_fields_reject_non_integers_and_bools(field: str, value: Any) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"^{field} must be an integer") as e:
        params.validate()
    assert _param_of(str(e.value)) == field


@pytest.mark.parametrize("ids", [(2.5,), (True,), ("3",), (-1,)])
def test_stop_token_ids_must_be_non_negative_integers(ids: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError, match="^stop_token_ids"):
        SamplingParams(stop_token_ids=ids).validate()


def test_integer_fields_accept_ints_and_none() -> None:
    SamplingParams(max_tokens=3, top_k=2, seed=0, logprobs=0, stop_token_ids=(0, 7)).validate()
    SamplingParams(seed=None, logprobs=None).validate()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", ["0.5", True, None])
def test_float_fields_must_be_numbers(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be a number"):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("seed", [SEED_MAX + 1, 2**64, SEED_MIN - 1, -(2**63)])
def test_seed_outside_the_one_range_is_refused(seed: int) -> None:
    with pytest.raises(ValueError, match=r"^seed must be in \[0, 9223372036854775807\]"):
        SamplingParams(seed=seed).validate()
    SamplingParams(seed=SEED_MAX).validate()
    SamplingParams(seed=SEED_MIN).validate()


def test_choice_seeds_wrap_inside_the_range() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert [choice_seed(SEED_MAX - 1, i) for i in range(3)] == [SEED_MAX - 1, SEED_MAX, 0]


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_ignore_eos_takes_booleans_only(value: Any) -> None:
    """``ignore_eos="no"`` is truthy: it used to run past EOS."""
    with pytest.raises(ValueError, match="^ignore_eos must be True or False"):
        SamplingParams(ignore_eos=value).validate()


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "skip_special_tokens",
                                   "spaces_between_special_tokens"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_text_flags_take_booleans_only(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be True or False"):
        SamplingParams(**{field: value}).validate()
    SamplingParams(**{field: False}).validate()


@pytest.mark.parametrize("value", [0, -2, 2.0, "3", True])
def test_truncate_prompt_tokens_is_minus_one_or_positive(value: Any) -> None:
    with pytest.raises(ValueError, match="^truncate_prompt_tokens must be an integer") as e:
        SamplingParams(truncate_prompt_tokens=value).validate()
    assert _param_of(str(e.value)) == "truncate_prompt_tokens"
    for ok in (None, -1, 1, 10**6):
        SamplingParams(truncate_prompt_tokens=ok).validate()


def test_new_fields_come_last() -> None:
    """Fields are appended, so a positional construction keeps its meaning."""
    names = list(SamplingParams.__dataclass_fields__)
    assert names[-8:] == ["min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                          "allowed_token_ids", "prompt_logprobs", "truncate_prompt_tokens",
                          "spaces_between_special_tokens", "bad_words"]
    assert SamplingParams().spaces_between_special_tokens is True
    assert SamplingParams().bad_words is None
    # one string is one word; a list is stored as a tuple, an empty one as None
    assert SamplingParams(bad_words="x").bad_words == ("x",)
    assert SamplingParams(bad_words=["x", "y"]).bad_words == ("x", "y")
    assert SamplingParams(bad_words=[]).bad_words is None
    assert SamplingParams().truncate_prompt_tokens is None


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**20])
def test_top_k_past_int32_is_refused(top_k: int) -> None:
    """A top_k that would overflow the sampler's int64 column once crashed the engine loop
    (and with it the server); it is a ValueError naming the field."""
    with pytest.raises(ValueError, match=r"^top_k must be in \[0, 2\*\*31\)"):
        SamplingParams(temperature=1.0, top_k=top_k).validate()
    SamplingParams(temperature=1.0, top_k=2**31 - 1).validate()


@pytest.mark.parametrize("temperature", [1e39, 1e300])
def test_temperature_past_float32_is_refused(temperature: float) -> None:
    """Finite as a Python float, inf as float32: masked -inf logits / inf = NaN."""
    with pytest.raises(ValueError, match="^temperature must be a finite number >= 0 that fits"):
        SamplingParams(temperature=temperature).validate()
    SamplingParams(temperature=3.4e38).validate()


@pytest.mark.parametrize("choices,where", [("abc", "choices must be a list or tuple"),
                                           (None, "choices must be a list or tuple"),
                                           ({"x": 1}, "choices must be a list or tuple"),
                                           (("a", 1), "choices[1] must be a string"),
                                           (["a", None], "choices[1] must be a string")])
def test_choice_spec_refuses_a_bare_string_and_non_string_items(choices: Any,
                                                                where: str) -> None:
    """``ChoiceConstraint("abc")`` used to mean the choices a / b / c (a str is a sequence)."""
    from structspec.constraints import ChoiceConstraint

    with pytest.raises(ValueError, match=re.escape(where)):
        ChoiceConstraint(choices)


def test_choice_spec_keeps_valid_uses() -> None:
    from structspec.constraints import ChoiceConstraint

    assert ChoiceConstraint(("a", "b")).choices == ("a", "b")
    assert ChoiceConstraint(["a", "b"]) == ChoiceConstraint(("a", "b"))  # a list is stored as a tuple
    assert hash(ChoiceConstraint(["a"])) == hash(ChoiceConstraint(("a",)))
    assert ChoiceConstraint(()).choices == ()  # empty: refused by the grammar backend, as before
