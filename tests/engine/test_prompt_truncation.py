"""``truncate_prompt_tokens`` in the Python API (vLLM's ``SamplingParams`` field): the engine
keeps the prompt's last tokens after tokenizing it, reports the kept prompt, and generates as
for that prompt given as token ids; bad values fail the request naming the field. Tiny random
model with SmolLM2's tokenizer (CPU)."""

from __future__ import annotations

from typing import Any

from structspec import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog, again and again"


def test_the_kept_tail_is_the_prompt(make_llm: Any, tiny_model_dir: str) -> None:
    llm = make_llm(model=tiny_model_dir)
    full = llm.engine.tokenize_prompt(PROMPT, raw=True)
    assert len(full) > 6
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    cut, not_cut, tail = llm.generate(
        [PROMPT, PROMPT, full[-6:]],
        [SamplingParams(max_tokens=3, ignore_eos=True, truncate_prompt_tokens=6),
         SamplingParams(max_tokens=3, ignore_eos=True, truncate_prompt_tokens=len(full) + 5),
         params], raw_prompt=True)
    assert cut.error is None and cut.prompt_token_ids == full[-6:]
    assert cut.token_ids == tail.token_ids and cut.text == tail.text
    assert not_cut.prompt_token_ids == full  # more than the prompt: nothing cut
    chat = [{"role": "user", "content": PROMPT}]
    rendered = llm.engine.tokenize_prompt(chat)
    out = llm.generate(chat, SamplingParams(max_tokens=2, truncate_prompt_tokens=4))[0]
    assert out.prompt_token_ids == rendered[-4:]


def test_bad_values_fail_the_request_naming_the_field(make_llm: Any,
                                                      tiny_model_dir: str) -> None:
    llm = make_llm(model=tiny_model_dir)
    too_many = llm.engine.max_model_len + 1
    outs = llm.generate([PROMPT] * 3, [SamplingParams(max_tokens=2, truncate_prompt_tokens=v)
                                       for v in (0, -2, too_many)], raw_prompt=True)
    for out in outs:
        assert out.finish_reason == "abort" and out.error_param == "truncate_prompt_tokens", out
    assert str(too_many) in outs[2].error
