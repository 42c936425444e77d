"""Self-distillation (``structspec.training.distill``) returns what ``LLM.generate`` makes."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from structspec import ChoiceConstraint, FinishReason, JsonSchemaConstraint, SamplingParams
from structspec.training.distill import distill
from structspec.training.prompts import TrainPrompt
from structspec.training.workloads import EXTRACTION_SCHEMA


def test_distill_matches_generate_and_skips_failures(make_llm: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    llm = make_llm()
    good = [
        TrainPrompt.user("List three colors.", None, "sharegpt"),
        TrainPrompt.user("Ana Silva, 30, lives in Lisbon, nurse, ana@example.org; likes chess. "
                         "Extract her as JSON.", JsonSchemaConstraint(EXTRACTION_SCHEMA),
                         "extraction"),
        TrainPrompt([{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": "Name a planet."}], None, "sharegpt"),
        # ends inside max_tokens with stop: its EOS is part of the sequence
        TrainPrompt.user("Is the sky blue?", ChoiceConstraint(("yes", "no")), "schema"),
    ]
    bad = [
        TrainPrompt.user("", None, "sharegpt"),  # refused when added: the prompt is empty
        # refused by the grammar (strict: 'not' cannot be enforced): finishes as abort
        TrainPrompt.user("Any JSON.", JsonSchemaConstraint({"type": "object", "not": {}}),
                         "schema"),
    ]
    prompts = [bad[0], good[0], bad[1], good[1], good[2], good[3]]
    with caplog.at_level(logging.INFO, logger="structspec.training.distill"):
        seqs = distill(llm, prompts, max_tokens=4, batch_size=2, progress=False)
    inputs = [list(p.messages) if len(p.messages) > 1 else p.messages[0]["content"]
              for p in good]
    expected = llm.generate(inputs, [SamplingParams(max_tokens=4, grammar=p.grammar)
                                     for p in good])
    assert [s.source for s in seqs] == [p.source for p in good]
    for seq, out in zip(seqs, expected, strict=True):
        assert list(seq.token_ids) == out.prompt_token_ids + out.token_ids
        assert seq.num_prompt_tokens == len(out.prompt_token_ids)
        assert seq.num_response_tokens == len(out.token_ids)
    assert [len(o.token_ids) for o in expected[:3]] == [4, 4, 4]
    assert expected[3].finish_reason is FinishReason.STOP
    assert seqs[3].token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "skipped 2 of 6 prompts" in caplog.text and "prompt is empty" in caplog.text
    assert llm.engine.detokenize is True  # restored
    with pytest.raises(ValueError, match="prompts is empty"):
        distill(llm, [], max_tokens=4, batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        distill(llm, good, max_tokens=4, batch_size=0)


def test_distill_limits_requests_waiting_for_a_compile(make_llm: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema prompts enter the engine a few at a time (their compiles' timeouts count from
    submission), and the free-text prompts behind them go in meanwhile; the output is the
    same."""
    import structspec.training.distill as d

    llm = make_llm()
    prompts = [TrainPrompt.user(f"Give a JSON object with key k{i}.",
                                JsonSchemaConstraint({"type": "object", "properties": {
                                    f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}),
                                "schema") for i in range(4)]
    prompts += [TrainPrompt.user(f"Say {w}.", None, "sharegpt") for w in ("yes", "no")]
    waiting: list[int] = []
    added: list[str] = []
    add_request = llm.engine.add_request

    def spy_add(prompt: Any, params: Any, request_id: str) -> Any:
        added.append(request_id.rsplit("-", 1)[1])
        return add_request(prompt, params, request_id=request_id)

    stats = llm.engine.stats

    def spy() -> dict[str, Any]:
        out = stats()
        waiting.append(out["num_waiting_grammar"])
        return out

    monkeypatch.setattr(d, "MAX_WAITING_FOR_GRAMMAR", 2)
    monkeypatch.setattr(llm.engine, "stats", spy)
    monkeypatch.setattr(llm.engine, "add_request", spy_add)
    seqs = distill(llm, prompts, max_tokens=3, batch_size=8, progress=False)
    assert max(waiting) <= 2 and len(seqs) == 6
    # schemas 2 and 3 are held back (two compiles waiting): the chat prompts go first
    assert added[:4] == ["0", "1", "4", "5"] and sorted(added) == [str(i) for i in range(6)]
    monkeypatch.undo()
    expected = llm.generate([p.messages[0]["content"] for p in prompts],
                            [SamplingParams(max_tokens=3, grammar=p.grammar) for p in prompts])
    assert [list(s.token_ids) for s in seqs] == [o.prompt_token_ids + o.token_ids
                                                for o in expected]
