"""End-to-end generation on SmolLM2 (CPU, fp32): batching, stops, bad input."""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import pytest

from structspec import (
    ChatMessageError,
    ChoiceConstraint,
    FinishReason,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
)
from structspec.core import ChatTemplateOptions
from structspec.engine.llm_engine import RequestError
from tests.engine.conftest import PERSON_SCHEMA, PROMPTS


@pytest.mark.parametrize("alone", [(1, 2, 5), pytest.param(range(6), marks=pytest.mark.slow)],
                         ids=["three", "all"])
def test_greedy_same_alone_and_in_mixed_batch(make_llm, alone) -> None:
    """Six requests of three lengths, one with a JSON Schema, in one batch; each of ``alone``
    (the longest free one, the JSON one, a shorter free one; all six in the slow variant)
    again on its own: the same tokens."""
    llm = make_llm()
    params = [SamplingParams(max_tokens=16 + 4 * (i % 3)) for i in range(6)]
    params[2] = SamplingParams(max_tokens=20, grammar=JsonSchemaConstraint(PERSON_SCHEMA))
    batch = llm.generate(PROMPTS[:6], params)
    assert all(got.finish_reason is not None for got in batch)
    for i in alone:
        got = llm.generate(PROMPTS[i], params[i])[0]
        assert got.token_ids == batch[i].token_ids, PROMPTS[i]


def test_result_fields_and_json_schema(make_llm) -> None:
    llm = make_llm()
    out = llm.generate("Make up a person: name, age and city as JSON.",
                       SamplingParams(max_tokens=64, grammar=JsonSchemaConstraint(PERSON_SCHEMA)))[0]
    assert out.finish_reason is FinishReason.STOP, out
    jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)
    assert out.schema_valid is True
    assert out.num_prompt_tokens > 0 and out.num_completion_tokens == len(out.token_ids)
    assert out.ttft_s is not None and out.latency_s is not None and out.latency_s >= out.ttft_s


def test_regex_and_choice(make_llm) -> None:
    import re

    llm = make_llm()
    outs = llm.generate(
        ["Give a date in ISO format.", "Is the sky blue? Answer yes or no."],
        [SamplingParams(max_tokens=20, grammar=RegexConstraint(r"\d{4}-\d{2}-\d{2}")),
         SamplingParams(max_tokens=8, grammar=ChoiceConstraint(("yes", "no")))],
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", outs[0].text), outs[0].text
    assert outs[1].text in ("yes", "no")
    assert all(o.finish_reason is FinishReason.STOP for o in outs)


def test_stop_string_and_max_tokens(make_llm) -> None:
    llm = make_llm()
    free = llm.generate(PROMPTS[6], SamplingParams(max_tokens=24))[0]
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 24
    word = free.text.split()[2]
    stopped = llm.generate(PROMPTS[6], SamplingParams(max_tokens=24, stop=[word]))[0]
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == word
    assert word not in stopped.text and free.text.startswith(stopped.text)


def test_seeded_sampling_is_reproducible_in_any_batch(make_llm) -> None:
    llm = make_llm()
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate(PROMPTS[2], sp)[0]
    mixed = llm.generate([PROMPTS[0], PROMPTS[2]], [SamplingParams(max_tokens=12), sp])[1]
    assert alone.token_ids == mixed.token_ids


BAD_INPUTS: list[tuple[object, SamplingParams, str]] = [
    ("", SamplingParams(max_tokens=8), "prompt is empty"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(max_tokens=-3), "max_tokens"),
    ("hi", SamplingParams(max_tokens=8, temperature=-1), "temperature"),
    ("hi", SamplingParams(max_tokens=8, grammar=JsonSchemaConstraint("{not json")), "JSON"),
    ("hi", SamplingParams(max_tokens=8, grammar=RegexConstraint("([a-z")), "regex"),
    ([17] * 9000, SamplingParams(max_tokens=8), "context"),
    ("hi", SamplingParams(max_tokens=8, temperature=1.0, seed=2**63), "seed must be in [0, "),
    ("hi", SamplingParams(max_tokens=8, temperature=1.0, seed=-1), "seed must be in [0, "),
    ("hi", SamplingParams(max_tokens=8, ignore_eos="no"), "ignore_eos must be True or False"),
    ([True, 17], SamplingParams(max_tokens=8), "prompt[0] must be an integer token id"),
    ("hi", SamplingParams(max_tokens=8, temperature=1.0, top_k=2**63), "top_k"),
    ("hi", SamplingParams(max_tokens=8, temperature=1e39), "temperature"),
    ("a\ud800b", SamplingParams(max_tokens=8), "prompt is not valid Unicode: a lone "
     "surrogate (U+D800) at character 1"),
    ([{"role": "user", "content": "\udc00"}], SamplingParams(max_tokens=8),
     "lone surrogate"),
    # refused untokenized (a 4 MB prompt would take seconds to tokenize)
    ("word " * 800_000, SamplingParams(max_tokens=8), "prompt has at least"),
]
BAD_INPUT_IDS = ["empty", "max_tokens_0", "max_tokens_neg", "temperature", "schema_json", "regex",
                 "too_long", "seed_over_max", "seed_negative", "ignore_eos_str",
                 "bool_token_id", "top_k_int64", "temperature_float32", "surrogate",
                 "surrogate_chat", "too_long_untokenized"]


def between_good_requests(bad: list[object], bad_params: list[SamplingParams],
                          good: SamplingParams) -> tuple[list[object], list[SamplingParams]]:
    """``[good, bad[0], good, bad[1], ..., good]``: every bad request sits between two good
    ones (PROMPTS[0] and PROMPTS[1]), so one generate checks every case for locality
    (the good outputs of case ``i`` are at ``2i`` and ``2i + 2``, the bad one at ``2i + 1``)."""
    prompts: list[object] = [PROMPTS[0]]
    params = [good]
    for i, (prompt, sp) in enumerate(zip(bad, bad_params, strict=True)):
        prompts += [prompt, PROMPTS[(i + 1) % 2]]
        params += [sp, good]
    return prompts, params


@pytest.fixture(scope="module")
def bad_input_outputs(make_llm) -> list:
    """Every BAD_INPUTS case in one batch (see :func:`between_good_requests`): a decode run per
    case cost seconds each on CPU."""
    prompts, params = between_good_requests([b[0] for b in BAD_INPUTS],
                                            [b[1] for b in BAD_INPUTS], SamplingParams(max_tokens=6))
    return make_llm().generate(prompts, params)


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)), ids=BAD_INPUT_IDS)
def test_bad_input_is_local(bad_input_outputs: list, case: int) -> None:
    needle = BAD_INPUTS[case][2]
    outs = bad_input_outputs[2 * case:2 * case + 3]
    assert outs[1].finish_reason is FinishReason.ABORT
    assert needle.lower() in (outs[1].error or "").lower(), outs[1].error
    for ok in (outs[0], outs[2]):
        assert ok.error is None and ok.finish_reason is FinishReason.LENGTH


#: each BAD_INPUTS case's ``error_code`` (the Python API's, the same rule as the server's 400s)
BAD_INPUT_CODES = {"too_long": "context_length_exceeded",
                   "too_long_untokenized": "context_length_exceeded",
                   "empty": None, "bool_token_id": None, "surrogate": None}


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)), ids=BAD_INPUT_IDS)
def test_bad_input_has_the_servers_error_code(bad_input_outputs: list, case: int) -> None:
    """A refused request's ``error_code`` in the Python API: the context's own code for a
    prompt that cannot fit, the generic ``invalid_request_parameter`` for any other field
    (an invalid JSON Schema or regex too, found at compile time), none for an unusable
    prompt, as the server's HTTP 400 gives them."""
    out = bad_input_outputs[2 * case + 1]
    want = BAD_INPUT_CODES.get(BAD_INPUT_IDS[case], "invalid_request_parameter")
    assert out.error_code == want, (out.error_param, out.error)


#: the ``error_param`` of the grammar BAD_INPUTS cases: the key a ``--batch`` line gives the
#: grammar by (the server names its own request field instead; see ``error_for``)
BAD_GRAMMAR_PARAMS = {"schema_json": "json_schema", "regex": "regex"}


@pytest.mark.parametrize("case_id", sorted(BAD_GRAMMAR_PARAMS))
def test_bad_grammar_names_the_kinds_key(bad_input_outputs: list, case_id: str) -> None:
    """An invalid JSON Schema used to be named ``response_format.json_schema`` (the OpenAI
    server's field) in the Python API, while a bad regex was ``regex``; both are now the
    grammar kind's own key."""
    out = bad_input_outputs[2 * BAD_INPUT_IDS.index(case_id) + 1]
    assert out.error_param == BAD_GRAMMAR_PARAMS[case_id], (out.error_param, out.error)


MALFORMED_CHATS: list[tuple[list, str, str]] = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user"}], "messages[1].content",
     "messages[1].content: missing"),
    ([{"role": "user", "content": 5}], "messages[0].content",
     "messages[0].content: expected a string or a list of text parts, got int"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0].type", "not supported"),
    ([{"role": 1, "content": "hi"}], "messages[0].role",
     "messages[0].role: expected a string, got int"),
    ([{"content": "hi"}], "messages[0].role", "messages[0].role: missing"),
    ([{"role": "user", "content": "hi"}, "and more"], "messages[1]",
     "messages[1]: expected a message object"),
]


@pytest.fixture(scope="module")
def malformed_chat_outputs(make_llm) -> list:
    """Every MALFORMED_CHATS case in one batch, each between two good prompts."""
    good = SamplingParams(max_tokens=2)
    prompts, params = between_good_requests([m[0] for m in MALFORMED_CHATS],
                                            [good] * len(MALFORMED_CHATS), good)
    return make_llm().generate(prompts, params)


@pytest.mark.parametrize("case", range(len(MALFORMED_CHATS)))
def test_malformed_chat_messages_fail_alone_naming_the_field(malformed_chat_outputs: list,
                                                             case: int) -> None:
    """Refused before the chat template renders (its own error named no field and came
    prefixed twice), with ``error_param`` set; the neighbours run."""
    _, param, needle = MALFORMED_CHATS[case]
    outs = malformed_chat_outputs[2 * case:2 * case + 3]
    assert outs[1].finish_reason is FinishReason.ABORT and outs[1].error_param == param
    error = outs[1].error or ""
    assert error.startswith(f"{param}: ") and needle in error, error
    assert "chat template" not in (outs[1].error or "")
    assert [o.error for o in (outs[0], outs[2])] == [None, None]


def test_chat_takes_text_parts_and_refuses_what_is_not_a_conversation(make_llm) -> None:
    llm = make_llm()
    sp = SamplingParams(max_tokens=3)
    text = llm.chat([{"role": "user", "content": "Say hi."}], sp)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Say "},
                                                   {"type": "text", "text": "hi."}]}], sp)[0]
    assert parts.error is None and parts.prompt_token_ids == text.prompt_token_ids
    assert parts.token_ids == text.token_ids
    two = llm.chat([[{"role": "user", "content": "Say hi."}], [{"role": "user"}]], sp)
    assert two[0].token_ids == text.token_ids
    assert two[1].error_param == "messages[0].content"
    for bad, reason in [({"role": "user", "content": "hi"}, "got dict"), ("hi", "got str"),
                        ([], "at least one message")]:
        with pytest.raises(ChatMessageError, match=f"^messages: .*{reason}"):
            llm.chat(bad, sp)


@pytest.mark.parametrize("prompts", [5, 2.5, None, b"hi", {"role": "user", "content": "hi"},
                                     {"a", "b"}])
def test_generate_names_prompts_of_another_type(make_llm, prompts: object) -> None:
    """``generate(5)`` used to fail deep inside as ``'int' object is not iterable`` (and a dict
    ran its keys as prompts); it is a TypeError naming ``prompts`` and what it takes."""
    with pytest.raises(TypeError, match=r"^prompts must be a string, a list of token ids, a "
                                        r"chat \(a list of \{role, content\} dicts\) or a "
                                        r"list/tuple of those, got ") as e:
        make_llm().generate(prompts, SamplingParams(max_tokens=2))
    if prompts is None:
        assert str(e.value).endswith("got None")  # was "got null None"


def test_generate_names_sampling_params_of_another_type(make_llm) -> None:
    llm = make_llm()
    with pytest.raises(TypeError, match=r"^sampling_params must be a SamplingParams, a "
                                        r"list/tuple of them or None, got int 5"):
        llm.generate("hi", 5)
    with pytest.raises(TypeError, match=r"^sampling_params\[1\] must be a SamplingParams, "
                                        r"got dict"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), {"max_tokens": 2}])
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2)])
    # a tuple of token ids is one prompt, as a list is
    assert len(llm.generate((17, 18, 19), SamplingParams(max_tokens=1))) == 1


def test_chat_template_error_is_prefixed_once(make_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """A template's own failure (here raise_exception) keeps one "chat template failed"."""
    llm = make_llm()
    monkeypatch.setattr(llm.engine.tokenizer.hf, "chat_template",
                        "{{ raise_exception('only user turns, please') }}")
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))[0]
    assert out.error == "chat template failed to render: only user turns, please"
    assert out.error_param == "messages"


def test_chat_template_options(make_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM.chat`` takes vLLM's chat template options: each prompt is transformers'
    ``apply_chat_template`` of the chat with the same options, and the output only the
    continuation; a conversation the options cannot render fails alone, naming the option; a
    bad option raises; a ``chat_template_kwargs`` variable reaches the template."""
    llm = make_llm()
    hf = llm.engine.tokenizer.hf
    answer = [{"role": "user", "content": "Name a colour."},
              {"role": "assistant", "content": "My favourite colour is"}]
    sp = SamplingParams(max_tokens=1, temperature=0)

    def reference(messages: list[dict[str, str]], **options: Any) -> list[int]:
        return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                           **options))

    cont, refused = llm.chat([answer, answer[:1]], sp, add_generation_prompt=False,
                             continue_final_message=True)
    assert cont.prompt_token_ids == reference(answer, continue_final_message=True)
    assert cont.error is None and len(cont.token_ids) == 1
    assert hf.decode(cont.prompt_token_ids).endswith("My favourite colour is")
    assert refused.finish_reason == "abort"
    assert refused.error_param == "continue_final_message", refused.error
    closed = ChatTemplateOptions(add_generation_prompt=False,
                                 chat_template_kwargs={"enable_thinking": False})
    assert llm.engine.tokenize_prompt(answer, chat_options=closed) == reference(
        answer, add_generation_prompt=False)
    assert llm.engine.tokenize_prompt(answer[:1]) == reference(answer[:1],
                                                               add_generation_prompt=True)
    # a string prompt is one user message: not continued, naming the option
    with pytest.raises(RequestError) as e:
        llm.engine.tokenize_prompt("hi", chat_options=ChatTemplateOptions(
            add_generation_prompt=False, continue_final_message=True))
    assert e.value.param == "continue_final_message"
    with pytest.raises(ChatMessageError, match="^continue_final_message: cannot be true"):
        llm.chat(answer, sp, continue_final_message=True)
    with pytest.raises(ChatMessageError, match=r"^chat_template_kwargs\.chat_template: "):
        llm.chat(answer, sp, chat_template_kwargs={"chat_template": "{{ 1 }}"})
    monkeypatch.setattr(hf, "chat_template",
                        "{{ greeting }}:{% for m in messages %}{{ m.content }}{% endfor %}")
    (greeted,) = llm.chat(answer[:1], sp, chat_template_kwargs={"greeting": "hola"})
    assert hf.decode(greeted.prompt_token_ids) == "hola:Name a colour."


def test_generate_from_two_threads_at_once(make_llm) -> None:
    """Two threads calling ``generate`` on one LLM at once (one constrained, one not) each get
    their own outputs, the ones a call alone gives; before the lock each call collected the
    other's finished outputs and failed with ``KeyError('gen-5-0')``."""
    llm = make_llm()
    jobs = [(PROMPTS[:2], SamplingParams(max_tokens=8)),
            (PROMPTS[5], SamplingParams(max_tokens=12,
                                        grammar=JsonSchemaConstraint(PERSON_SCHEMA)))]
    alone = [[o.token_ids for o in llm.generate(p, sp)] for p, sp in jobs]
    start = threading.Barrier(len(jobs))
    got: list[object] = [None] * len(jobs)

    def call(i: int) -> None:
        start.wait()
        try:
            got[i] = [o.token_ids for o in llm.generate(*jobs[i])]
        except Exception as e:  # reported by the assert below, not lost in the thread
            got[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == alone
    assert not llm.engine.has_unfinished_requests()


def test_generate_keeps_outputs_of_requests_added_before_it(make_llm) -> None:
    """A request added with ``engine.add_request`` keeps running through a ``generate`` call
    and its final output is not lost: ``generate`` returns its own, the next ``step`` returns
    the other's, equal to its run alone."""
    llm = make_llm()
    engine = llm.engine
    longer = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], [longer])[0].token_ids
    other = engine.add_request(PROMPTS[3], longer)
    got = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0.0,
                                                   ignore_eos=True))
    assert [len(o.token_ids) for o in got] == [16, 16]
    assert engine.has_unfinished_requests()
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == [other]
    assert finals[0].token_ids == alone


def test_failed_add_leaves_no_trace(make_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose add fails after validation (here the grammar submit raises) is not
    left registered: its id can be used again, and the engine serves it."""
    engine = make_llm().engine
    params = SamplingParams(max_tokens=2, grammar=RegexConstraint("[0-9]+"))

    def broken_submit(spec: object) -> None:
        raise RuntimeError("compile pool is down")

    monkeypatch.setattr(engine.grammar, "submit", broken_submit)
    with pytest.raises(RuntimeError, match="compile pool"):
        engine.add_request("hi", params, request_id="again")
    monkeypatch.undo()
    assert engine.add_request("hi", params, request_id="again") == "again"
    outs: list = []
    with pytest.raises(RequestError, match="duplicate request_id") as e:
        engine.add_request("hi", params, request_id="again")  # still running
    assert e.value.param == "request_id"
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["again"]
    assert outs[-1].error is None and outs[-1].text.isdigit()


def test_unknown_model_path() -> None:
    from structspec import LLM

    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        LLM("/tmp/no-such-model", device="cpu")


def test_prefill_waits_for_min_prefill_batch_under_a_backlog(make_llm) -> None:
    """With more requests waiting than free slots, a prefill runs once it admits
    ``min_prefill_batch`` of them (or every waiting one); until then the batch keeps
    decoding. Driven through ``_admit`` alone: nothing runs a forward."""
    eng = make_llm().engine
    s = eng.scheduler
    cfg = s.config.scheduler
    assert cfg.min_prefill_batch == max(1, cfg.max_batch_size // 8) == 4
    sp = SamplingParams(max_tokens=2)
    try:
        for _ in range(cfg.max_batch_size - 2):
            eng.add_request([1, 2, 3], sp)
        first = s._admit()  # nothing runs: the whole backlog goes in
        assert len(first) == cfg.max_batch_size - 2 and not s.waiting
        s.running.extend(first)
        late = [eng.add_request([1, 2, 3], sp) for _ in range(3)]
        assert s._admit() == []  # 2 free slots, 3 waiting: keep decoding
        eng.abort_request(first[0].request_id)  # 3 free slots: every waiting one fits
        assert [r.request_id for r in s._admit()] == late
    finally:
        for rid in list(s.requests):
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
    assert not s.running and s.page_table.num_free_rows >= cfg.max_batch_size


def test_final_outputs_only_when_not_reporting_unfinished(make_llm) -> None:
    """``report_unfinished = False`` (generate_all, distill): a step reports finished requests
    only, each once, with its whole output."""
    llm = make_llm()
    eng = llm.engine
    params = [SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True) for i in range(3)]
    streamed = llm.generate(PROMPTS[:3], params)
    assert eng.report_unfinished  # restored by generate
    eng.report_unfinished = False
    try:
        ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params, strict=True)]
        got = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                assert out.finished and out.request_id not in got
                got[out.request_id] = out
    finally:
        eng.report_unfinished = True
    for rid, ref in zip(ids, streamed, strict=True):
        assert got[rid].token_ids == ref.token_ids and got[rid].text == ref.text


def test_speculative_algorithm_none_value_means_no_drafter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``speculative_algorithm=None`` (how vLLM users switch speculation off) is ``"none"``:
    the engine gets the same config as with the default, so the same engine and output (the
    engine itself is not built: the config it would be built from is compared)."""
    import structspec.llm as llm_mod
    from structspec import LLM

    seen: list[Any] = []

    class RecordingEngine:
        def __init__(self, config: Any) -> None:
            seen.append(config)

    monkeypatch.setattr(llm_mod, "LLMEngine", RecordingEngine)
    LLM(device="cpu", dtype="float32")
    LLM(device="cpu", dtype="float32", speculative_algorithm=None)
    assert seen[1].spec.algorithm == "none" and seen[1] == seen[0]
