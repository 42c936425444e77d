"""vLLM's ``truncate_prompt_tokens``, ``return_tokens_as_token_ids`` and
``spaces_between_special_tokens`` on both endpoints (they were 400 ``unsupported``). Fake
engine (one character = one token); ``spaces_between_special_tokens`` through the real
:class:`~structspec.server.codec.TokenizerCodec` over a small tokenizer whose decoder joins
tokens with spaces (byte-level BPE decoders, SmolLM2's, put nothing between tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from structspec.server.app import create_app
from structspec.server.codec import TokenizerCodec
from structspec.server.metrics import ServerMetrics
from structspec.server.serving import ServerState
from tests.server.fake_client import CHAT, COMPLETIONS, post
from tests.server.server_fakes import FakeEngine

PROMPT = "abcdefghij"


def ok(r: Any) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def error_of(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text)
    err: dict[str, Any] = r.json()["error"]
    return err


def sse(r: Any) -> list[dict[str, Any]]:
    """The JSON events of a streamed response (``[DONE]`` left out)."""
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def sent_prompt(engine: FakeEngine) -> list[int]:
    return engine.added[-1][1]


# ------------------------------------------------------------------ truncate_prompt_tokens


def test_completion_keeps_the_last_tokens_and_counts_them(client: TestClient,
                                                          engine: FakeEngine) -> None:
    whole = ok(post(client, COMPLETIONS, prompt=PROMPT))
    assert sent_prompt(engine) == [ord(c) for c in PROMPT]
    cut = ok(post(client, COMPLETIONS, prompt=PROMPT, truncate_prompt_tokens=4))
    assert sent_prompt(engine) == [ord(c) for c in "ghij"]
    assert (whole["usage"]["prompt_tokens"], cut["usage"]["prompt_tokens"]) == (10, 4)
    # the front end cut it: the engine gets no truncation of its own to apply
    assert engine.added[-1][2].truncate_prompt_tokens is None


def test_truncation_larger_than_the_prompt_changes_nothing(client: TestClient,
                                                           engine: FakeEngine) -> None:
    body = ok(post(client, COMPLETIONS, prompt=PROMPT, truncate_prompt_tokens=10, echo=True))
    assert sent_prompt(engine) == [ord(c) for c in PROMPT]
    assert body["usage"]["prompt_tokens"] == 10
    assert body["choices"][0]["text"].startswith(PROMPT)
    ok(post(client, COMPLETIONS, prompt=PROMPT, truncate_prompt_tokens=400))
    assert sent_prompt(engine) == [ord(c) for c in PROMPT]


@pytest.mark.parametrize("prompt", [PROMPT, [ord(c) for c in PROMPT]],
                         ids=["text", "token-ids"])
def test_echo_is_the_kept_prompt(client: TestClient, prompt: Any) -> None:
    body = ok(post(client, COMPLETIONS, prompt=prompt, truncate_prompt_tokens=3, echo=True,
                   max_tokens=2))
    assert body["choices"][0]["text"] == "hij" + "He"  # the fake's script starts "He"
    events = sse(post(client, COMPLETIONS, prompt=prompt, truncate_prompt_tokens=3, echo=True,
                      max_tokens=2, stream=True))
    assert "".join(c["text"] for e in events for c in e["choices"]) == "hijHe"


def test_batch_prompts_are_cut_each(client: TestClient, engine: FakeEngine) -> None:
    body = ok(post(client, COMPLETIONS, prompt=["abc", "defgh"], truncate_prompt_tokens=2))
    assert [p for _, p, _ in engine.added[-2:]] == [[ord("b"), ord("c")], [ord("g"), ord("h")]]
    assert body["usage"]["prompt_tokens"] == 4


def test_chat_keeps_the_rendered_prompts_tail(client: TestClient, engine: FakeEngine) -> None:
    whole = ok(post(client, CHAT))
    ids = sent_prompt(engine)
    cut = ok(post(client, CHAT, truncate_prompt_tokens=5))
    assert sent_prompt(engine) == ids[-5:] and len(ids) > 5
    assert (whole["usage"]["prompt_tokens"], cut["usage"]["prompt_tokens"]) == (len(ids), 5)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_minus_one_keeps_what_the_context_holds_beside_the_completion(
        client: TestClient, engine: FakeEngine, path: str) -> None:
    """-1 is max_model_len - max_tokens (vLLM's server); the context check counts the kept
    prompt: a prompt over the context is served once cut."""
    long = "x" * 600 + "END"  # the fake's context is 512
    body = ({"messages": [{"role": "user", "content": long}]} if path == CHAT
            else {"prompt": long})
    err = error_of(client.post(path, json={**body, "max_tokens": 12}))
    assert err["code"] == "context_length_exceeded"
    r = ok(client.post(path, json={**body, "max_tokens": 12, "truncate_prompt_tokens": -1}))
    assert len(sent_prompt(engine)) == 500 == r["usage"]["prompt_tokens"]
    assert "".join(map(chr, sent_prompt(engine))).endswith("END" + (
        "\n<assistant>" if path == CHAT else ""))
    ok(client.post(path, json={**body, "max_tokens": 12, "truncate_prompt_tokens": 500}))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("extra", [
    {"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2},
    {"truncate_prompt_tokens": 501, "max_tokens": 12},  # 512 - 12 = 500 fit
    {"truncate_prompt_tokens": 513},
], ids=["zero", "below-minus-one", "over-the-room", "over-the-context"])
def test_bad_truncation_is_400_naming_it(client: TestClient, engine: FakeEngine, path: str,
                                         extra: dict[str, Any]) -> None:
    err = error_of(post(client, path, **{"max_tokens": 2, **extra}))
    assert err["param"] == "truncate_prompt_tokens", err
    assert "truncate_prompt_tokens" in err["message"]
    assert not engine.added


def test_chat_room_counts_max_completion_tokens(client: TestClient) -> None:
    err = error_of(post(client, CHAT, max_completion_tokens=100, truncate_prompt_tokens=450))
    assert err["param"] == "truncate_prompt_tokens" and "412" in err["message"], err


# ------------------------------------------------------------------ return_tokens_as_token_ids


def test_chat_logprob_tokens_as_ids(client: TestClient) -> None:
    plain = ok(post(client, CHAT, logprobs=True, top_logprobs=2))
    body = ok(post(client, CHAT, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True))
    text = body["choices"][0]["message"]["content"]
    assert text == plain["choices"][0]["message"]["content"] == "He"
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["token_id:72", "token_id:101"]
    # vLLM: a chosen token's bytes are its text's, a top entry's its "token_id:N" string's
    assert [c["bytes"] for c in content] == [[72], [101]]
    assert content[0]["top_logprobs"] == [
        {"token": "token_id:72", "logprob": -0.1, "bytes": list(b"token_id:72")},
        {"token": "token_id:63", "logprob": -2.5, "bytes": list(b"token_id:63")}]
    assert [c["token"] for c in plain["choices"][0]["logprobs"]["content"]] == ["H", "e"]
    assert [c["logprob"] for c in content] == [
        c["logprob"] for c in plain["choices"][0]["logprobs"]["content"]]


def test_chat_stream_logprob_tokens_as_ids(client: TestClient) -> None:
    events = sse(post(client, CHAT, logprobs=True, top_logprobs=1, stream=True,
                      return_tokens_as_token_ids=True))
    tokens = [item["token"] for e in events for c in e["choices"]
              for item in (c.get("logprobs") or {}).get("content", [])]
    assert tokens == ["token_id:72", "token_id:101"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprob_tokens_as_ids(client: TestClient, stream: bool) -> None:
    def logprobs(**extra: Any) -> dict[str, Any]:
        r = post(client, COMPLETIONS, logprobs=2, echo=True, stream=stream, **extra)
        parts = ([c["logprobs"] for e in sse(r) for c in e["choices"] if c["logprobs"]]
                 if stream else [ok(r)["choices"][0]["logprobs"]])
        return {k: sum((p[k] for p in parts), []) for k in parts[0]}

    plain, as_ids = logprobs(), logprobs(return_tokens_as_token_ids=True)
    # the echoed prompt "hi" leads (its first token unscored), then the generated "He"
    assert as_ids["tokens"] == ["token_id:104", "token_id:105", "token_id:72", "token_id:101"]
    assert plain["tokens"] == ["h", "i", "H", "e"]
    assert as_ids["top_logprobs"][0] is None
    assert all(k.startswith("token_id:") for k in as_ids["top_logprobs"][1])
    assert as_ids["top_logprobs"][2] == {"token_id:72": -0.1, "token_id:63": -2.5}
    # offsets still index the text, not the "token_id:N" strings
    assert as_ids["text_offset"] == plain["text_offset"] == [0, 1, 2, 3]
    assert as_ids["token_logprobs"] == plain["token_logprobs"]


# ------------------------------------------------------------------ spaces_between_special_tokens

VOCAB = {"</s>": 0, "a": 1, "b": 2, "<x>": 3, "<y>": 4}
SPECIALS = ["<x>", "<y>"]


@pytest.fixture(scope="module")
def spaced_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A word-level tokenizer with no decoder: tokenizers joins decoded tokens with spaces
    (as WordPiece-style decoders do); ``<x>``, ``<y>`` and ``</s>`` are added special
    tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    hf.add_special_tokens({"additional_special_tokens": SPECIALS})
    out = tmp_path_factory.mktemp("spaced_tok")
    hf.save_pretrained(out)
    return str(Path(out))


@pytest.fixture
def spaced_client(spaced_tokenizer_dir: str) -> Iterator[tuple[TestClient, FakeEngine]]:
    """The app over the fake engine scripted to write the ids a, <x>, <y>, <x>, b (then its
    EOS, id 0), detokenized by the real codec over :func:`spaced_tokenizer_dir` (with a chat
    template of its own: the message contents)."""
    engine = FakeEngine()
    engine.script = "".join(map(chr, [1, 3, 4, 3, 2]))
    codec = TokenizerCodec(spaced_tokenizer_dir,
                           chat_template="{% for m in messages %}{{ m.content }} {% endfor %}")
    state = ServerState(engine=engine, codec=codec, metrics=ServerMetrics(),
                        model_name="fake")
    with TestClient(create_app(state)) as c:
        yield c, engine


def _text(c: TestClient, path: str, stream: bool, **extra: Any) -> str:
    """The choice's whole text, or its streamed pieces joined."""
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": "a"}]} if path == CHAT
                            else {"prompt": "a"})
    r = c.post(path, json={**body, "max_tokens": 16, "stream": stream, **extra})
    if path == CHAT:
        return (str(ok(r)["choices"][0]["message"]["content"]) if not stream else
                "".join(ch["delta"].get("content") or "" for e in sse(r)
                        for ch in e["choices"]))
    return (str(ok(r)["choices"][0]["text"]) if not stream else
            "".join(ch["text"] for e in sse(r) for ch in e["choices"]))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_spaces_between_special_tokens(spaced_client: tuple[TestClient, FakeEngine],
                                       path: str, stream: bool) -> None:
    """vLLM's rule (fast tokenizer): false drops the decoder's space in front of an added
    token that follows another added token; true (the default) is the tokenizer's decode,
    what structspec always served."""
    c, engine = spaced_client
    kept = {"skip_special_tokens": False}
    assert _text(c, path, stream, **kept) == " a <x> <y> <x> b"
    assert _text(c, path, stream, spaces_between_special_tokens=True,
                 **kept) == " a <x> <y> <x> b"
    assert _text(c, path, stream, spaces_between_special_tokens=False,
                 **kept) == " a <x><y><x> b"
    assert engine.added[-1][2].spaces_between_special_tokens is False
    # with special tokens dropped there is nothing to space
    assert _text(c, path, stream, spaces_between_special_tokens=False) == " a b"
