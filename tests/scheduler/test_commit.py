"""Committing accepted runs: cuts at EOS / stop ids / max_tokens / stop strings / grammar end,
and the matcher is advanced exactly once per committed token."""

from __future__ import annotations

from structspec.core import FinishReason, SamplingParams
from structspec.scheduler.commit import commit_run
from structspec.scheduler.request import Req

EOS = 2


class FakeMatcher:
    """Accepts any token; terminates after accepting EOS; counts net accepts."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.terminated = False

    def accept_run(self, tokens: list[int]) -> int:
        for i, t in enumerate(tokens):
            if self.terminated:
                return i
            self.accepted.append(t)
            self.terminated = t == EOS
        return len(tokens)

    def rollback(self, k: int) -> None:
        del self.accepted[len(self.accepted) - k:]
        self.terminated = bool(self.accepted) and self.accepted[-1] == EOS

    def is_terminated(self) -> bool:
        return self.terminated


class CharDetok:
    """Token t decodes to chr(ord('a') + t % 26); EOS decodes to nothing."""

    def add(self, ids: list[int]) -> str:
        return "".join("" if t == EOS else chr(ord("a") + t % 26) for t in ids)


def make_req(**params: object) -> Req:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    return Req(request_id="r", prompt_ids=[1], params=p, arrival_time=0.0,
               max_new_tokens=p.max_tokens, eos_token_ids=frozenset({EOS}),
               detokenizer=CharDetok(), matcher=FakeMatcher())  # type: ignore[arg-type]


def test_eos_inside_run_cuts_after_it() -> None:
    req = make_req(max_tokens=50)
    n = commit_run(req, [5, 6, EOS, 7, 8], 0.0)
    assert n == 3 and req.output_ids == [5, 6, EOS]
    assert req.finish_reason is FinishReason.STOP and req.text == "fg"
    assert req.matcher.accepted == [5, 6, EOS]  # type: ignore[union-attr]


def test_max_tokens_inside_run() -> None:
    req = make_req(max_tokens=4)
    commit_run(req, [5, 6], 0.0)
    n = commit_run(req, [7, 8, 9, 10], 0.0)
    assert n == 2 and req.output_ids == [5, 6, 7, 8]
    assert req.finish_reason is FinishReason.LENGTH
    assert req.matcher.accepted == [5, 6, 7, 8]  # type: ignore[union-attr]


def test_stop_string_across_tokens_rolls_back_matcher() -> None:
    req = make_req(max_tokens=50, stop=("hij",))
    commit_run(req, [5, 6], 0.0)  # "fg"
    n = commit_run(req, [7, 8, 9, 10, 11], 0.0)  # "hijkl": stop completes at token 9
    assert n == 3 and req.output_ids == [5, 6, 7, 8, 9]
    assert req.text == "fg" and req.finish_reason is FinishReason.STOP
    assert req.stop_reason == "hij"
    assert req.matcher.accepted == req.output_ids  # type: ignore[union-attr]


def test_stop_token_id_and_finished_request_takes_nothing() -> None:
    req = make_req(max_tokens=50, stop_token_ids=(9,))
    commit_run(req, [5, 9, 6], 0.0)
    assert req.output_ids == [5, 9] and req.stop_reason == 9
    assert commit_run(req, [7], 0.0) == 0 and req.output_ids == [5, 9]


def test_grammar_rejection_aborts() -> None:
    class Rejecting(FakeMatcher):
        def accept_run(self, tokens: list[int]) -> int:
            self.accepted.extend(tokens[:1])
            return 1

    req = make_req(max_tokens=50)
    req.matcher = Rejecting()  # type: ignore[assignment]
    commit_run(req, [5, 6, 7], 0.0)
    assert req.finish_reason is FinishReason.ABORT and "grammar rejected token 6" in (req.error or "")
    assert req.output_ids == [5]
