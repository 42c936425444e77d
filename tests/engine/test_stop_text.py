"""vLLM's ``include_stop_str_in_output`` and ``skip_special_tokens`` on SmolLM2 (CPU, fp32),
streamed (``engine.step`` deltas) and whole: the text with the stop string kept is the text
without it plus the stop string; special tokens show only when asked for, and the EOS that
ended a request only with ``include_stop_str_in_output`` (as vLLM)."""

from __future__ import annotations

from typing import Any

from structspec import FinishReason, RequestOutput, SamplingParams
from tests.engine.conftest import PROMPTS


def run_streaming(llm: Any, prompts: list[str], params: list[SamplingParams]
                  ) -> tuple[list[RequestOutput], list[str]]:
    """One batch through ``engine.step``: the final outputs and, per request, its streamed
    ``new_text`` pieces joined."""
    engine = llm.engine
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done: dict[str, RequestOutput] = {}
    streamed = dict.fromkeys(rids, "")
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.new_text
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in rids], [streamed[r] for r in rids]


def test_include_stop_str_in_output_keeps_the_stop_string(make_llm) -> None:
    """A stop string that ends inside a token (the rest of the token's text goes either
    way): the text is cut before it, or right after it; the token ids are the same."""
    llm = make_llm()
    prompt = PROMPTS[17]  # "What day comes after Monday?"
    free = llm.generate(prompt, SamplingParams(max_tokens=12))[0]
    word = max(free.text.split()[:4], key=len)
    stop = word[:-1]  # its last character is in the same token: the stop ends mid-token
    assert len(stop) >= 3, free.text
    params = [SamplingParams(max_tokens=12, stop=[stop], include_stop_str_in_output=keep)
              for keep in (False, True)]
    (cut, kept), streamed = run_streaming(llm, [prompt, prompt], params)
    assert cut.finish_reason is kept.finish_reason is FinishReason.STOP
    assert cut.stop_reason == kept.stop_reason == stop
    assert cut.text == free.text[:free.text.index(stop)]
    assert kept.text == cut.text + stop
    assert kept.token_ids == cut.token_ids == free.token_ids[:len(cut.token_ids)]
    assert streamed == [cut.text, kept.text]


def test_skip_special_tokens_false_shows_special_tokens(make_llm) -> None:
    llm = make_llm()
    tok = llm.engine.tokenizer
    prompt = "Is the sky blue? Answer yes or no."  # "No." and EOS, then more with ignore_eos
    params = [
        SamplingParams(max_tokens=6),
        SamplingParams(max_tokens=6, skip_special_tokens=False),
        SamplingParams(max_tokens=6, skip_special_tokens=False, include_stop_str_in_output=True),
        SamplingParams(max_tokens=6, include_stop_str_in_output=True),
        SamplingParams(max_tokens=4, skip_special_tokens=False, ignore_eos=True),
        SamplingParams(max_tokens=4, ignore_eos=True),
    ]
    outs, streamed = run_streaming(llm, [prompt] * len(params), params)
    assert streamed == [o.text for o in outs]
    plain, special, special_kept, kept, raw, raw_skipped = outs
    # ended by the model's EOS, which is reported in the ids
    assert plain.finish_reason is FinishReason.STOP and plain.stop_reason is None, plain
    eos = plain.token_ids[-1]
    assert eos in tok.eos_token_ids
    eos_text = tok.decode([eos], skip_special_tokens=False)  # <|im_end|>
    assert eos_text and eos_text not in plain.text
    # the EOS that ended the request shows only with include_stop_str_in_output
    assert special.token_ids == special_kept.token_ids == kept.token_ids == plain.token_ids
    assert special.text == kept.text == plain.text
    assert special_kept.text == plain.text + eos_text
    # an EOS that did not end it (ignore_eos) is text like any other token, when kept
    assert raw.token_ids == raw_skipped.token_ids and eos in raw.token_ids[:-1], raw.token_ids
    assert raw.text == tok.decode(raw.token_ids, skip_special_tokens=False)
    assert eos_text in raw.text
    assert raw_skipped.text == tok.decode(raw_skipped.token_ids)
    assert eos_text not in raw_skipped.text
