"""A structural tag end to end (CPU, fp32 SmolLM2): the model writes free text, calls the tool
in the tagged form, and the call's body follows its schema where the prompt's own example does
not; greedy output with n-gram speculation equals output without it."""

from __future__ import annotations

import json
import re

import jsonschema

from structspec import SamplingParams, StructuralTagConstraint

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}
TAG = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER,
                       "end": "</function>"}],
       "triggers": ["<function="]}
# a few-shot raw prompt whose example call quotes the number: copied as it is, the body would
# break the schema ("days" must be an integer)
PROMPT = ("Tool calls are written as <function=NAME>{JSON arguments}</function>.\n"
          "User: What's the weather in Paris for 3 days?\n"
          "Assistant: Let me check. <function=get_weather>{\"city\": \"Paris\", \"days\": \"3\"}"
          "</function>\n"
          "User: What's the weather in Oslo for 5 days?\n"
          "Assistant:")
CALL = re.compile(r"<function=get_weather>(.*?)</function>", re.DOTALL)
NGRAM = dict(speculative_algorithm="ngram", num_draft_tokens=8)


def test_tagged_call_follows_its_schema_and_speculation_is_lossless(make_llm) -> None:
    params = SamplingParams(max_tokens=48, grammar=StructuralTagConstraint(TAG))
    off = make_llm().generate(PROMPT, params, raw_prompt=True)[0]
    on = make_llm(**NGRAM).generate(PROMPT, params, raw_prompt=True)[0]
    assert off.error is None and on.error is None, (off.error, on.error)
    assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason
    assert on.spec.verify_steps > 0
    calls = CALL.findall(on.text)
    assert calls, on.text
    for body in calls:
        jsonschema.validate(json.loads(body), WEATHER)
    assert on.text.index("<function=") > 0  # free text came first
    # the verdict checks each tagged section's body against its schema (a stop finish)
    assert on.finish_reason == "stop" and on.schema_valid is True, on.finish_reason
    # without the grammar the model copies the example's quoted number: the tag did the work
    free = make_llm().generate(PROMPT, SamplingParams(max_tokens=48), raw_prompt=True)[0]
    bodies = [json.loads(b) for b in CALL.findall(free.text)]
    assert bodies and not all(jsonschema.Draft202012Validator(WEATHER).is_valid(b)
                              for b in bodies), free.text
