"""Committing accepted runs: cuts at EOS / stop ids / max_tokens / stop strings / grammar end,
and the matcher is advanced exactly once per committed token."""

from __future__ import annotations

from structspec.core import FinishReason, SamplingParams
from structspec.scheduler.commit import (
    commit_run,
    commit_tokens,
    process_text,
    settle_grammar_advance,
)
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

    def restart(self, ids: list[int]) -> str:
        return self.add(ids)


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
    assert req.stop_reason is None  # the model's EOS: no stop_reason (vLLM's convention)
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


def test_grammar_cut_after_the_text_work_rebuilds_the_text() -> None:
    """With overlap the text work of a step can run before the grammar verdict on its ids
    (predicted verdicts, or the host replay after a mask worker died): ids the verdict
    removes take their text with them, so the text never shows a removed id."""
    req = make_req(max_tokens=50)
    commit_tokens(req, [5, 6, 7, 8], 0.0)
    req.spec.committed_tokens = 4
    process_text(req)
    assert req.text == "fghi" and req.num_detokenized == 4
    settle_grammar_advance(req, 2, False)  # the grammar refused 7 and 8
    assert req.output_ids == [5, 6] and req.text == "fg" and req.num_detokenized == 2
    assert req.spec.committed_tokens == 2
    assert req.finish_reason is FinishReason.ABORT and "grammar rejected token 7" in req.error


def test_mismatch_after_a_stop_string_cut_keeps_the_stop() -> None:
    """A mirror refuses the last id of a run whose earlier id completed a stop string: the
    outcome is the stop string's (STOP, no error) whichever of the text work and the
    mismatch check runs first (the order depends on how fast the mask workers reply)."""
    from structspec.scheduler.grammar_service import GrammarService

    outcomes = []
    for text_first in (True, False):
        req = make_req(max_tokens=50, stop=("g",))
        commit_tokens(req, [5, 6, 7], 0.0)  # "fgh": the stop string ends at 6; 7 is refused
        if text_first:
            process_text(req)
        GrammarService._settle_mismatches([req], {0: (3, 1, False)})
        if not text_first:
            process_text(req)
        outcomes.append((req.output_ids, req.text, req.finish_reason, req.error))
    # the id that completed the stop string stays (as in process_text), its text does not
    assert outcomes[0] == outcomes[1] == ([5, 6], "f", FinishReason.STOP, None), outcomes


class SpecialDetok(CharDetok):
    """:class:`CharDetok` that keeps special tokens (EOS decodes to ``<eos>``) and has one
    three-character token, 100 (``xyz``)."""

    def add(self, ids: list[int]) -> str:
        return "".join("<eos>" if t == EOS else "xyz" if t == 100 else CharDetok.add(self, [t])
                       for t in ids)


def test_include_stop_str_in_output_cuts_after_the_stop_string() -> None:
    """The text ends right after the stop string (vLLM), also where it ends inside a token
    (the rest of that token's text goes); the ids are the same either way."""
    for include, want in ((False, "fg"), (True, "fghi")):
        req = make_req(max_tokens=50, stop=("hi",), include_stop_str_in_output=include)
        commit_run(req, [5, 6, 7, 8, 9], 0.0)  # "fghij": the stop completes at token 8
        assert req.output_ids == [5, 6, 7, 8] and req.text == want, include
        assert req.finish_reason is FinishReason.STOP and req.stop_reason == "hi"
    for include, want in ((False, "f"), (True, "fxy")):
        req = make_req(max_tokens=50, stop=("xy",), include_stop_str_in_output=include)
        req.detokenizer = SpecialDetok()  # type: ignore[assignment]
        commit_run(req, [5, 100, 6], 0.0)  # "fxyzg": "xy" ends inside token 100
        assert req.output_ids == [5, 100] and req.text == want, include


def test_streamed_text_holds_back_a_stop_prefix_unless_it_stays() -> None:
    """``take_output`` holds back ``len(longest stop) - 1`` characters while running; with
    include_stop_str_in_output nothing (the final text keeps them), and the streamed
    pieces add up to the final text either way."""
    for include, first, final in ((False, "f", "fg"), (True, "fgh", "fghij")):
        req = make_req(max_tokens=50, stop=("hij",), include_stop_str_in_output=include)
        commit_run(req, [5, 6, 7], 0.0)  # "fgh": could be the start of "hij"
        out = req.take_output(0.0)
        assert out.new_text == first and not out.finished, include
        commit_run(req, [8, 9, 10], 0.0)  # "ijk": the stop completes at token 9
        last = req.take_output(0.0)
        assert last.finished and last.text == final and first + last.new_text == final
        assert last.token_ids == [5, 6, 7, 8, 9]


def test_token_level_stop_text_shows_only_with_include_stop_str_in_output() -> None:
    """The token that ended a request at token level (EOS, a stop_token_ids id) is reported
    but stays out of the text unless include_stop_str_in_output (vLLM's rule); a special
    token that did not stop the request (ignore_eos) is text like any other when the
    detokenizer keeps special tokens."""
    cases = [
        (dict(), [5, EOS, 6], [5, EOS], "f"),
        (dict(include_stop_str_in_output=True), [5, EOS, 6], [5, EOS], "f<eos>"),
        (dict(stop_token_ids=(9,)), [5, 9, 6], [5, 9], "f"),
        (dict(stop_token_ids=(9,), include_stop_str_in_output=True), [5, 9, 6], [5, 9], "fj"),
        (dict(ignore_eos=True), [5, EOS, 6], [5, EOS, 6], "f<eos>g"),
        # with stop strings (token by token) too
        (dict(stop=("zz",)), [5, EOS], [5, EOS], "f"),
        (dict(stop=("zz",), include_stop_str_in_output=True), [5, EOS], [5, EOS], "f<eos>"),
    ]
    for kw, run, ids, text in cases:
        req = make_req(max_tokens=50, **kw)
        req.detokenizer = SpecialDetok()  # type: ignore[assignment]
        req.matcher = None  # no grammar (the fake one ends at EOS)
        commit_run(req, run, 0.0)
        out = req.take_output(0.0)
        assert (out.token_ids, out.text) == (ids, text), kw
        assert req.num_detokenized == len(ids), kw
