"""The repetition stop: which tails are loops, and a multi-token run is cut at the token where
committing one token at a time stops (what keeps speculation lossless)."""

from __future__ import annotations

import random

import pytest

from structspec.core import FinishReason, SamplingParams
from structspec.penalty_params import REPETITION_STOP_REASON, RepetitionStop
from structspec.scheduler.commit import commit_tokens
from structspec.scheduler.repeat_stop import RepeatDetector
from tests.scheduler.test_commit import make_req


def first_hit(tokens: list[int], config: RepetitionStop) -> int | None:
    """Index of the token at which the detector fires, or None."""
    det = RepeatDetector(config)
    return next((i for i, t in enumerate(tokens) if det.push(t)), None)


@pytest.mark.parametrize(("tokens", "config", "want"), [
    # one token repeated: min_tokens 6 stops at the 6th equal token
    ([9, 1, 1, 1, 1, 1, 1, 1], RepetitionStop(min_tokens=6, max_period=4), 6),
    # a 3-token unit: 4 repeats (12 tokens) once min_tokens <= 12
    ([5, 6, 7] * 5, RepetitionStop(min_tokens=8, max_period=4, min_repeats=4), 11),
    # min_repeats dominates a long unit: 2 x 5 = 10 tokens
    ([1, 2, 3, 4, 5] * 3, RepetitionStop(min_tokens=4, max_period=8, min_repeats=2), 9),
    # a unit longer than max_period is not a loop
    ([1, 2, 3, 4, 5] * 4, RepetitionStop(min_tokens=4, max_period=4, min_repeats=2), None),
    # counting up is not periodic
    (list(range(40)), RepetitionStop(min_tokens=4, max_period=8, min_repeats=2), None),
    # a broken loop starts over
    ([1, 1, 1, 2, 1, 1, 1], RepetitionStop(min_tokens=5, max_period=1), None),
])
def test_which_tails_are_loops(tokens: list[int], config: RepetitionStop,
                               want: int | None) -> None:
    assert first_hit(tokens, config) == want


def test_runs_are_cut_where_one_token_at_a_time_stops() -> None:
    """The same output committed in runs of random lengths (a speculative step commits
    several tokens) stops at the same token, with finish reason length and stop_reason
    repetition, as when it is committed one token at a time."""
    rng = random.Random(0)
    config = RepetitionStop(min_tokens=10, max_period=6, min_repeats=3)
    for trial in range(50):
        unit = [rng.randrange(3, 40) for _ in range(rng.randrange(1, 7))]
        head = [rng.randrange(3, 40) for _ in range(rng.randrange(0, 8))]
        tokens = head + unit * 12
        plain = make_req(max_tokens=200, repetition_stop=config)
        for t in tokens:
            commit_tokens(plain, [t], 0.0)
        spec = make_req(max_tokens=200, repetition_stop=config)
        i = 0
        while i < len(tokens) and not spec.finished:
            k = rng.randrange(1, 9)
            commit_tokens(spec, tokens[i:i + k], 0.0)
            i += k
        assert spec.output_ids == plain.output_ids, trial
        assert plain.finish_reason is FinishReason.LENGTH
        assert spec.stop_reason == plain.stop_reason == REPETITION_STOP_REASON


def test_eos_and_max_tokens_still_win_in_order() -> None:
    config = RepetitionStop(min_tokens=4, max_period=2)
    req = make_req(max_tokens=50, repetition_stop=config)
    commit_tokens(req, [7, 7, 2, 7], 0.0)  # EOS (2) before the loop is long enough
    assert req.finish_reason is FinishReason.STOP and req.output_ids == [7, 7, 2]
    req = make_req(max_tokens=3, repetition_stop=config)
    commit_tokens(req, [7, 7, 7, 7], 0.0)
    assert req.finish_reason is FinishReason.LENGTH and req.stop_reason is None
    assert make_req(max_tokens=3).repeat_detector is None
    assert SamplingParams(repetition_stop=True).repetition_stop == RepetitionStop()
