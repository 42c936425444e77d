"""Sampling penalties and the repetition stop under speculation (issue 20): greedy output with
speculation equals greedy output without it, with each penalty, with and without a grammar,
for the n-gram drafter and a branching draft-model tree; the repetition stop cuts a
multi-token run where plain decoding stops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from structspec import FinishReason, JsonSchemaConstraint, SamplingParams
from structspec.penalty_params import REPETITION_STOP_REASON, RepetitionStop
from tests.engine.conftest import PERSON_SCHEMA, PROMPTS

# prompts that repeat themselves, so that the drafters propose and the penalties bite
LOOPY = [PROMPTS[3], PROMPTS[20], PROMPTS[6], PROMPTS[10]]

PENALTIES: list[dict[str, Any]] = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.8),
    dict(repetition_penalty=1.3),
    dict(logit_bias={28: -100.0, 30: 4.0}),  # "," gone, "." favoured (SmolLM2 ids)
]


def penalised_params() -> tuple[list[str], list[SamplingParams]]:
    """Each penalty without and with a JSON Schema, and one request without penalties in
    the same batch (a penalised batch must leave it alone)."""
    prompts, params = [], []
    for i, pen in enumerate(PENALTIES):
        for grammar in (None, JsonSchemaConstraint(PERSON_SCHEMA)):
            prompts.append(LOOPY[i])
            params.append(SamplingParams(max_tokens=12, grammar=grammar, **pen))
    prompts.append(LOOPY[0])
    params.append(SamplingParams(max_tokens=12))
    return prompts, params


SPEC = {
    "ngram": lambda d: dict(speculative_algorithm="ngram", num_draft_tokens=8),
    # the same options as test_spec.py's draft_model_first_layers (one engine in the LRU)
    "draft_model_tree": lambda d: dict(speculative_algorithm="draft_model", draft_model=d,
                                       num_draft_tokens=6, speculative_depth=3,
                                       speculative_topk=2),
}


@pytest.fixture(scope="module")
def plain_outputs(make_llm: Callable[..., Any]) -> list[Any]:
    prompts, params = penalised_params()
    return make_llm().generate(prompts, params)


# the draft-model tree under -m slow (~13 s on a 2-core AVX2 VM): the n-gram run covers the
# penalised verify in the default suite
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n == "draft_model_tree" else n for n in SPEC])
def test_penalised_greedy_is_lossless(make_llm: Callable[..., Any], smol_first_layers_dir: str,
                                      plain_outputs: list[Any], name: str) -> None:
    prompts, params = penalised_params()
    got = make_llm(**SPEC[name](smol_first_layers_dir)).generate(prompts, params)
    for want, out in zip(plain_outputs, got, strict=True):
        assert out.token_ids == want.token_ids, (name, out.request_id, out.text, want.text)
        assert out.finish_reason == want.finish_reason
    assert sum(o.spec.draft_tokens_accepted for o in got) > 0  # drafts were really verified


def test_penalties_change_the_output(make_llm: Callable[..., Any],
                                     plain_outputs: list[Any]) -> None:
    """The penalties bite: most penalised requests differ from their unpenalised run, and
    the logit bias really removes its token."""
    prompts, params = penalised_params()
    free = make_llm().generate(prompts, [SamplingParams(max_tokens=12, grammar=p.grammar)
                                         for p in params])
    changed = sum(a.token_ids != b.token_ids for a, b in zip(plain_outputs, free, strict=True))
    assert changed >= 5, changed
    assert plain_outputs[-1].token_ids == free[-1].token_ids  # no penalties: untouched
    assert all(28 not in o.token_ids for o in plain_outputs[6:8])


def test_repetition_stop_cuts_where_plain_decoding_stops(
        make_llm: Callable[..., Any]) -> None:
    """The n-gram drafter commits several tokens of a loop per step; the repetition stop
    still ends the request at the very token where the plain run ends it."""
    params = SamplingParams(max_tokens=64, ignore_eos=True,
                            repetition_stop=RepetitionStop(min_tokens=12, max_period=8))
    prompt = "1, 1, 1, 1, 1, 1, 1, 1,"  # SmolLM2 continues it for good
    plain = make_llm().generate(prompt, params, raw_prompt=True)[0]
    spec = make_llm(**SPEC["ngram"](None)).generate(prompt, params, raw_prompt=True)[0]
    assert plain.finish_reason is FinishReason.LENGTH
    assert plain.stop_reason == REPETITION_STOP_REASON
    assert len(plain.token_ids) == 12  # one token of ", 1" repeated: 12 tokens stop
    assert spec.token_ids == plain.token_ids and spec.stop_reason == REPETITION_STOP_REASON
    assert spec.spec.accept_length > 1.5  # multi-token runs were cut


def test_logit_bias_outside_the_vocabulary_is_refused(make_llm: Callable[..., Any]) -> None:
    from structspec.core import RequestError

    llm = make_llm()
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("hi", SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias" and str(vocab) in str(e.value)
    with pytest.raises(RequestError) as e:  # a stop id the model never generates
        llm.engine.add_request("hi", SamplingParams(max_tokens=2, stop_token_ids=[5, vocab]))
    assert e.value.param == "stop_token_ids" and str(vocab) in str(e.value)
    out = llm.generate("hi", SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1]))[0]
    assert out.error is None
    out = llm.generate("hi", SamplingParams(max_tokens=2, presence_penalty=9.0))[0]
    assert out.error is not None and out.error_param == "presence_penalty"


def test_steps_yield_the_core_while_only_grammars_compile(make_llm: Callable[..., Any],
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A step with nothing to run but grammar compiles sleeps briefly instead of spinning (it
    held the core the compile worker needed); a step with work to do never sleeps."""
    import structspec.scheduler.scheduler as sched_mod

    llm = make_llm()
    naps: list[float] = []
    monkeypatch.setattr(sched_mod.time, "sleep", lambda s: naps.append(s))
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 7}},
              "required": ["q"]}  # new to the engine's compile cache: compiled fresh
    out = llm.generate("hi", SamplingParams(max_tokens=12,
                                            grammar=JsonSchemaConstraint(schema)))[0]
    assert out.error is None and out.finish_reason is not None
    assert naps and all(s == sched_mod.COMPILE_WAIT_S for s in naps)
    naps.clear()
    llm.generate("hi", SamplingParams(max_tokens=4))  # no grammar: nothing to wait for
    assert naps == []
