"""``prompt_logprobs`` over HTTP (vLLM's format: top-level on chat, per choice on text
completions, ``null`` first), ``echo`` + ``logprobs`` listing the prompt's tokens first (the
first one ``null``), streamed in the first chunk; bad values are a 400 naming the field.
Over the fake engine (scores from ``fake_prompt_logprobs``) and the engine process's delta."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from structspec.core import RequestOutput, TokenLogprob
from structspec.server.engine_process import delta_from_output
from tests.server.server_fakes import FakeEngine
from tests.server.test_app import MSGS, sse_events


def _expected(prompt: str, k: int) -> list[Any]:
    """vLLM's prompt_logprobs for the fake's scores (token at rank 2 behind ``?``)."""
    out: list[Any] = [None]
    for ch in prompt[1:]:
        d = {str(ord(ch)): {"logprob": -0.5, "rank": 2, "decoded_token": ch}}
        if k >= 1:
            d.setdefault(str(ord("?")), {"logprob": -0.25, "rank": 1, "decoded_token": "?"})
        out.append(d)
    return out


def test_chat_top_level_prompt_logprobs(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2,
                                                 "prompt_logprobs": 1, "n": 2})
    assert r.status_code == 200, r.text
    prompt = "".join(chr(t) for t in engine.added[-1][1])
    assert [p.prompt_logprobs for _, _, p in engine.added[-2:]] == [1, 1]
    assert r.json()["prompt_logprobs"] == _expected(prompt, 1)
    plain = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()
    assert engine.added[-1][2].prompt_logprobs is None
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 3, "prompt_logprobs": 0, "stream": True}).text)
    carrying = [e for e in events[:-1] if "prompt_logprobs" in e]
    assert len(carrying) == 1 and carrying[0]["prompt_logprobs"] == _expected(prompt, 0)
    assert carrying[0]["choices"]  # rides a choice chunk, not a chunk of its own


def test_completions_prompt_logprobs_per_choice(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2,
                                            "prompt_logprobs": 0})
    choice = r.json()["choices"][0]
    assert choice["prompt_logprobs"] == _expected("abc", 0) and choice["logprobs"] is None
    events = sse_events(client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 3, "prompt_logprobs": 2, "stream": True}).text)
    carrying = [e["choices"][0] for e in events[:-1] if "prompt_logprobs" in e["choices"][0]]
    assert [c["prompt_logprobs"] for c in carrying] == [_expected("abc", 2)]
    assert carrying[0]["text"]  # the first text chunk


def test_echo_with_logprobs_lists_the_prompt_first(client: TestClient,
                                                  engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "echo": True,
                                            "logprobs": 1})
    choice = r.json()["choices"][0]
    assert engine.added[-1][2].prompt_logprobs == 1  # echo asks the engine for them
    assert "prompt_logprobs" not in choice  # not asked for as such
    lp = choice["logprobs"]
    assert choice["text"] == "abcHe"
    assert lp["tokens"] == ["a", "b", "c", "H", "e"]
    assert lp["token_logprobs"] == [None, -0.5, -0.5, -0.1, -0.1]
    # the top 1, and the prompt's own token beside it when it is not the top one (OpenAI's
    # legacy format: up to logprobs + 1 entries)
    assert lp["top_logprobs"] == [None, {"?": -0.25, "b": -0.5}, {"?": -0.25, "c": -0.5},
                                  {"H": -0.1}, {"e": -0.1}]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    # prompt_logprobs beside it: the engine scores with the larger k, each shows its own
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "echo": True,
                                            "logprobs": 0, "prompt_logprobs": 2})
    assert engine.added[-1][2].prompt_logprobs == 2
    choice = r.json()["choices"][0]
    assert choice["logprobs"]["top_logprobs"][:2] == [None, {"b": -0.5}]  # logprobs 0: itself
    assert choice["prompt_logprobs"] == _expected("abc", 2)
    events = sse_events(client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 3, "echo": True, "logprobs": 1, "stream": True}).text)
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["logprobs"]]
    assert chunks[0]["text"].startswith("abc")
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert tokens == ["a", "b", "c", "H", "e", "l"] and offsets == [0, 1, 2, 3, 4, 5]
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MSGS, "prompt_logprobs": 21}),
    ("/v1/chat/completions", {"messages": MSGS, "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "2"}),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": True}),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 30}),
])
def test_bad_values_are_400_naming_the_field(client: TestClient, path: str,
                                             body: dict[str, Any]) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"


def test_engine_sends_the_prompt_scores_once() -> None:
    scored = [None, TokenLogprob(token_id=7, logprob=-1.5, rank=3,
                                 top_logprobs=[(1, -0.5)])]

    def out(ids: list[int], new: list[int]) -> RequestOutput:
        return RequestOutput(request_id="r", prompt_token_ids=[5, 7], token_ids=ids, text="",
                             finished=False, new_token_ids=new, prompt_logprobs=scored)

    assert delta_from_output(out([9], [9])).prompt_logprobs == [None, (7, -1.5, 3, [(1, -0.5)])]
    assert delta_from_output(out([9, 4], [4])).prompt_logprobs is None


def test_completion_top_logprobs_always_hold_the_chosen_token() -> None:
    """OpenAI's legacy format: the sampled token is listed beside the top ``logprobs`` when
    it is not one of them (so up to ``logprobs + 1`` entries), never twice."""
    from structspec.server.serving import completion_logprobs

    class Codec:
        def token_str(self, t: int) -> str:
            return f"<{t}>"

    lp = completion_logprobs(Codec(), [(5, -2.0, [(1, -0.5)]), (1, -0.5, [(1, -0.5)]),
                                       (7, -3.0, [])], 0)  # type: ignore[arg-type]
    assert lp["top_logprobs"] == [{"<1>": -0.5, "<5>": -2.0}, {"<1>": -0.5}, {"<7>": -3.0}]


def test_echo_offsets_index_the_text_across_byte_tokens(smol_dir: str) -> None:
    """An emoji is several byte tokens, each shown as "\\ufffd": the echoed prompt's
    offsets still index its text (each is the length of the text before the token), rising
    to the prompt's length, where the generated tokens start."""
    from structspec.server.codec import TokenizerCodec
    from structspec.server.prompt_logprobs import echo_logprobs

    codec = TokenizerCodec(smol_dir)
    text = "I love 🍕 and 日本語 text."
    ids = codec.encode_text(text)
    entries = [None] + [(t, -1.0, 2, [(t, -1.0)]) for t in ids[1:]]
    lp = echo_logprobs(codec, ids, entries, 1)  # type: ignore[arg-type]
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    assert sum(len(codec.token_str(t)) for t in ids) > len(text)  # the pieces overcount
    for i, tok in enumerate(ids):  # a whole-character token sits where its text is
        piece = codec.token_str(tok)
        if "\ufffd" not in piece:
            assert text.startswith(piece, offsets[i]), (i, piece)


def test_generated_offsets_index_the_text_across_byte_tokens(smol_dir: str) -> None:
    """Generated tokens' text_offset, in one piece or over a stream's chunks, counted by a
    detokenizer: a character split over byte tokens counts once, so each whole-character
    token's offset is where its text is, and the offsets end inside the text."""
    from structspec.server.codec import TokenizerCodec
    from structspec.server.serving import TextOffsets, completion_logprobs

    codec = TokenizerCodec(smol_dir)
    prompt = codec.encode_text("北京是中国的首都。")
    text = "\n\n你可以 😀 done"
    ids = codec.encode_text(text)
    entries = [(t, -1.0, []) for t in ids]
    whole = completion_logprobs(codec, entries, TextOffsets(5, codec.detokenizer(prompt)))
    at = TextOffsets(5, codec.detokenizer(prompt))
    parts = [completion_logprobs(codec, entries[i:i + 2], at)["text_offset"]
             for i in range(0, len(entries), 2)]
    offsets = whole["text_offset"]
    assert [o for p in parts for o in p] == offsets
    assert offsets == sorted(offsets) and offsets[-1] < 5 + len(text)
    assert sum(len(codec.token_str(t)) for t in ids) > len(text)  # the pieces overcount
    for tok, off in zip(ids, offsets, strict=True):
        piece = codec.token_str(tok)
        if "\ufffd" not in piece:
            assert text.startswith(piece, off - 5), (piece, off)
