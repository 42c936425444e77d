"""``POST /tokenize`` and ``POST /detokenize`` (server/serving_tokenize.py), vLLM's shapes.

References: a prompt's ids are the codec's ``encode_text``; a chat's ids are the prompt the
chat endpoint hands the engine for the same body (``FakeEngine.added``); ``/detokenize``
inverts ``/tokenize``. Every bad input is a 400 naming its field (never a 500), and nothing
reaches the engine. A fake engine throughout; the codec is a character-level fake with a BOS
and a "template" that shows the tools, or a real (tiny, trained here) HF tokenizer.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from structspec.core import ChatTemplateOptions, PromptTooLongError
from structspec.server.app import create_app
from structspec.server.codec import TokenizerCodec
from structspec.server.field_policy import TOKENIZE, UNSUPPORTED
from structspec.server.limits import ServerLimits
from structspec.server.metrics import ServerMetrics
from structspec.server.serving import ServerState
from tests.server.fake_client import CHAT, MSGS
from tests.server.server_fakes import EOS, FakeCodec, FakeEngine

TOK, DETOK = "/tokenize", "/detokenize"
BOS = 2
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


class TemplateCodec(FakeCodec):
    """The fake codec with what the flags act on: a BOS (id 2, ``<s>``) added by
    ``add_special_tokens``, a template that shows the tools' names, and the real tokenizer's
    refusal of a text certainly over ``max_tokens`` (1 token per character here). Records the
    thread each call ran on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def _ids(self, text: str, max_tokens: int | None, add_special_tokens: bool) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if max_tokens is not None and len(text) // 2 > max_tokens:
            raise PromptTooLongError(len(text) // 2, max_tokens)
        return [BOS] * add_special_tokens + [ord(c) for c in text]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               options: ChatTemplateOptions | None = None) -> str:
        options = options or ChatTemplateOptions()
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if options.continue_final_message:
            text = text[:-1]
        if tools:
            text += "<tools>" + json.dumps([t["function"]["name"] for t in tools]) + "\n"
        if options.chat_template_kwargs:
            text += "<kwargs>" + json.dumps(options.chat_template_kwargs) + "\n"
        return text + ("<assistant>" if options.add_generation_prompt else "")

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    max_tokens: int | None = None,
                    options: ChatTemplateOptions | None = None, *,
                    add_special_tokens: bool = False) -> list[int]:
        return self._ids(self.render(messages, tools, options), max_tokens, add_special_tokens)

    def encode_text(self, text: str, max_tokens: int | None = None, *,
                    add_special_tokens: bool = True) -> list[int]:
        return self._ids(text, max_tokens, add_special_tokens)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.threads.append(threading.current_thread().name)
        specials = {BOS: "<s>", EOS: "</s>"}
        return "".join(("" if skip_special_tokens else specials[t]) if t in specials
                       else chr(t) for t in token_ids)

    def token_pieces(self, token_ids: Sequence[int]) -> list[str]:
        return ["<s>" if t == BOS else chr(t) for t in token_ids]


def make_state(engine: FakeEngine, codec: Any, **kw: Any) -> ServerState:
    return ServerState(engine=engine, codec=codec, metrics=ServerMetrics(), model_name="fake",
                       **kw)


@pytest.fixture
def codec() -> TemplateCodec:
    return TemplateCodec()


@pytest.fixture
def client(engine: FakeEngine, codec: TemplateCodec) -> Iterator[TestClient]:
    with TestClient(create_app(make_state(engine, codec))) as c:
        yield c


def ok(r: Any) -> dict[str, Any]:
    assert r.status_code == 200, r.text[:500]
    body: dict[str, Any] = r.json()
    return body


def error_of(r: Any, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err: dict[str, Any] = r.json()["error"]
    if status == 400:
        assert err["type"] == "invalid_request_error", err
    return err


def chat_prompt_ids(client: TestClient, engine: FakeEngine, **body: Any) -> list[int]:
    """The prompt ids the chat endpoint hands the engine for ``body``."""
    ok(client.post(CHAT, json={"max_tokens": 1, **body}))
    ids: list[int] = engine.added[-1][1]
    return ids


# ------------------------------------------------------------------ /tokenize, prompt


@pytest.mark.parametrize("text", ["hi", "Grüße 🎉 aus Köln", "", "a\nb\tc"])
def test_prompt_tokens_are_the_codecs_encode(client: TestClient, codec: TemplateCodec,
                                             engine: FakeEngine, text: str) -> None:
    body = ok(client.post(TOK, json={"prompt": text}))
    assert body == {"count": len(text) + 1, "max_model_len": 512,
                    "tokens": codec.encode_text(text), "token_strs": None}
    assert body["tokens"][0] == BOS  # vLLM's default for a prompt: special tokens added
    plain = ok(client.post(TOK, json={"model": "fake", "prompt": text,
                                      "add_special_tokens": False}))
    assert plain["tokens"] == codec.encode_text(text, add_special_tokens=False)
    assert engine.added == []  # counting never reaches the engine


def test_prompt_tokens_are_what_completions_sends_the_engine(client: TestClient,
                                                             engine: FakeEngine) -> None:
    ok(client.post("/v1/completions", json={"prompt": "count me", "max_tokens": 1}))
    assert ok(client.post(TOK, json={"prompt": "count me"}))["tokens"] == engine.added[-1][1]


def test_token_strs_are_the_vocabulary_entries(client: TestClient,
                                               codec: TemplateCodec) -> None:
    body = ok(client.post(TOK, json={"prompt": "héllo", "return_token_strs": True}))
    assert body["token_strs"] == codec.token_pieces(body["tokens"]) == ["<s>", *"héllo"]
    assert ok(client.post(TOK, json={"prompt": "x", "return_token_strs": False}))[
        "token_strs"] is None


# ------------------------------------------------------------------ /tokenize, messages


CHATS = {
    "plain": {"messages": MSGS},
    "system-and-parts": {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                     "text": "b"}]}]},
    "tools": {"messages": MSGS, "tools": TOOLS},
    "tools-auto": {"messages": MSGS, "tools": TOOLS, "tool_choice": "auto"},
    "tools-none": {"messages": MSGS, "tools": TOOLS, "tool_choice": "none"},
    "tools-required": {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"},
    "tool-call-turn": {"messages": [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": TOOLS},
}


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_tokens_are_the_chat_endpoints_prompt(client: TestClient, engine: FakeEngine,
                                                   name: str) -> None:
    body = CHATS[name]
    expected = chat_prompt_ids(client, engine, **body)
    got = ok(client.post(TOK, json=body))
    assert got["tokens"] == expected and got["count"] == len(expected)
    assert got["tokens"][0] != BOS  # vLLM's default for a chat: the template's tokens only


def test_a_chat_requests_whole_body_counts_as_its_prompt(
        client: TestClient, engine: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    """A client may send its chat request as is: the sampling fields are ignored (and
    named in a warning), the prompt is the one the chat endpoint would build."""
    body = {"model": "fake", "messages": MSGS, "tools": TOOLS, "temperature": 0.5,
            "max_tokens": 1, "stream": False}
    expected = chat_prompt_ids(client, engine, **body)
    with caplog.at_level(logging.WARNING, logger="structspec.server"):
        assert ok(client.post(TOK, json=body))["tokens"] == expected
    warned = [r.getMessage() for r in caplog.records if "ignored unknown" in r.getMessage()]
    assert warned and "'temperature'" in warned[0] and "'max_tokens'" in warned[0], warned


def test_chat_options(client: TestClient, codec: TemplateCodec) -> None:
    no_gen = ok(client.post(TOK, json={"messages": MSGS, "add_generation_prompt": False}))
    assert no_gen["tokens"] == codec.encode_chat(
        MSGS, options=ChatTemplateOptions(add_generation_prompt=False))
    with_gen = ok(client.post(TOK, json={"messages": MSGS, "add_generation_prompt": True}))
    assert with_gen["tokens"][:no_gen["count"]] == no_gen["tokens"]
    assert "".join(map(chr, with_gen["tokens"][no_gen["count"]:])) == "<assistant>"
    special = ok(client.post(TOK, json={"messages": MSGS, "add_special_tokens": True,
                                        "return_token_strs": True}))
    assert special["tokens"] == [BOS, *with_gen["tokens"]]
    assert special["token_strs"] == codec.token_pieces(special["tokens"])
    # the chat endpoint's template options: the final message left open, template variables
    answer = [*MSGS, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": answer, "add_generation_prompt": False,
            "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True,
                                  chat_template_kwargs={"enable_thinking": False})
    assert ok(client.post(TOK, json=body))["tokens"] == codec.encode_chat(answer,
                                                                         options=options)
    for field, value in (("continue_final_message", True), ("chat_template_kwargs", {"x": 1})):
        err = error_of(client.post(TOK, json={"prompt": "hi", field: value}))
        assert err["param"] == field  # a chat option beside a text prompt
    err = error_of(client.post(TOK, json={**body, "messages": MSGS}))  # last is not the answer
    assert err["param"] == "continue_final_message"
    err = error_of(client.post(TOK, json={"messages": MSGS,
                                          "chat_template_kwargs": {"tools": []}}))
    assert err["param"] == "chat_template_kwargs.tools"
    # a forced tool call is a new message, as the chat endpoint says
    err = error_of(client.post(TOK, json={**body, "tools": TOOLS, "tool_choice": "required"}))
    assert err["param"] == "continue_final_message"


# ------------------------------------------------------------------ /detokenize


@pytest.mark.parametrize("text", ["hi", "Grüße 🎉 aus Köln", "", "a\nb\tc"])
def test_detokenize_inverts_tokenize(client: TestClient, text: str) -> None:
    ids = ok(client.post(TOK, json={"prompt": text, "add_special_tokens": False}))["tokens"]
    assert ok(client.post(DETOK, json={"tokens": ids})) == {"prompt": text}
    # special tokens are kept, as vLLM decodes: the BOS shows
    ids = ok(client.post(TOK, json={"prompt": text}))["tokens"]
    assert ok(client.post(DETOK, json={"model": "fake", "tokens": ids})) == {
        "prompt": "<s>" + text}


def test_detokenize_of_a_chat_is_its_rendered_template(client: TestClient,
                                                       codec: TemplateCodec) -> None:
    ids = ok(client.post(TOK, json={"messages": MSGS, "tools": TOOLS}))["tokens"]
    assert ok(client.post(DETOK, json={"tokens": ids}))["prompt"] == codec.render(MSGS, TOOLS)


def test_tokenization_runs_on_the_tokenizer_thread(client: TestClient,
                                                   codec: TemplateCodec) -> None:
    """Not on the event loop: on the one thread that every endpoint tokenizes on."""
    ok(client.post(TOK, json={"prompt": "x"}))
    ok(client.post(TOK, json={"messages": MSGS}))
    ok(client.post(DETOK, json={"tokens": [104, 105]}))
    assert len(codec.threads) == 3
    assert all(name.startswith("structspec-tok") for name in codec.threads), codec.threads


# ------------------------------------------------------------------ refusals


def post_raw(client: TestClient, path: str, raw: str | bytes) -> Any:
    data = raw.encode() if isinstance(raw, str) else raw
    return client.post(path, content=data, headers={"content-type": "application/json"})


BAD = [
    # (path, JSON body or raw text, param, words in the message)
    (TOK, "{nope", None, "not valid JSON"),
    (TOK, "[1, 2]", None, "must be a JSON object"),
    (TOK, {"prompt": 5}, "prompt", "valid string"),
    (TOK, {"prompt": ["a", "b"]}, "prompt", "valid string"),
    (TOK, {"prompt": [1, 2]}, "prompt", "valid string"),
    (TOK, {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", "boolean"),
    (TOK, {"prompt": "x", "add_special_tokens": 1}, "add_special_tokens", "boolean"),
    (TOK, {"prompt": "x", "return_token_strs": 1}, "return_token_strs", "boolean"),
    (TOK, {"messages": MSGS, "add_generation_prompt": "no"}, "add_generation_prompt",
     "boolean"),
    (TOK, {"prompt": "x", "model": 3}, "model", "valid string"),
    (TOK, {"prompt": "x", "messages": MSGS}, "messages", "not both"),
    (TOK, {"prompt": "", "messages": MSGS}, "messages", "not both"),
    (TOK, {}, "prompt", "is required"),
    (TOK, {"model": "fake", "prompt": None, "messages": None}, "prompt", "is required"),
    (TOK, {"prompt": "x", "tools": TOOLS}, "tools", "messages only"),
    (TOK, {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt",
     "messages only"),
    (TOK, {"prompt": "x", "tool_choice": "none"}, "tool_choice", "messages only"),
    (TOK, {"messages": MSGS, "tools": {"type": "function"}}, "tools", "valid list"),
    (TOK, {"messages": MSGS, "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name", "non-empty string"),
    (TOK, {"messages": MSGS, "tool_choice": "required"}, "tool_choice", "non-empty 'tools'"),
    (TOK, '{"prompt": "ok \\ud800"}', "prompt", "lone surrogate"),
    (TOK, '{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages[0].content",
     "lone surrogate"),
    # nesting past the JSON parser's recursion limit: no field can be named (as on every
    # endpoint); within it, the message check names the field
    (TOK, '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "too deeply"),
    (TOK, {"messages": [{"role": "user", "content": [[[[["deep"]]]]]}]},
     "messages[0].content[0]", "expected"),
    (DETOK, "{nope", None, "not valid JSON"),
    (DETOK, '"tokens"', None, "must be a JSON object"),
    (DETOK, {}, "tokens", "required field"),
    (DETOK, {"tokens": "104 105"}, "tokens", "valid list"),
    (DETOK, {"tokens": [104, 1.5]}, "tokens[1]", "valid integer"),
    (DETOK, {"tokens": ["104"]}, "tokens[0]", "valid integer"),
    (DETOK, {"tokens": [True]}, "tokens[0]", "valid integer"),
    (DETOK, {"tokens": [104, -1]}, "tokens", "tokens[1] = -1 is outside the vocabulary"),
    (DETOK, {"tokens": [0x110000]}, "tokens", "outside the vocabulary [0, 1114112)"),
    (DETOK, {"tokens": [2 ** 70]}, "tokens", "outside the vocabulary"),
    (DETOK, '{"tokens": [1, ' + "2" * 5000 + "]}", "tokens[1]", "5000 digits"),
    (DETOK, {"tokens": [104] * 513}, "tokens", "at most 512"),
    (DETOK, {"tokens": [104], "model": ["fake"]}, "model", "valid string"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD,
                         ids=[f"{p[1:]}-{i}" for i, (p, *_rest) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(client: TestClient, engine: FakeEngine,
                                             path: str, body: Any, param: str | None,
                                             words: str) -> None:
    r = post_raw(client, path, body) if isinstance(body, str) else client.post(path, json=body)
    err = error_of(r)
    assert err["param"] == param and words in err["message"], err
    assert engine.added == []


@pytest.mark.parametrize("messages", [
    [],
    "hi",
    [{"content": "hi"}],
    [{"role": "user"}],
    [{"role": "robot", "content": "hi"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": "hi"}, "not a message"],
    [*MSGS, {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
    [*MSGS, {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
])
def test_bad_messages_are_refused_as_the_chat_endpoint_refuses_them(
        client: TestClient, messages: Any) -> None:
    chat = error_of(client.post(CHAT, json={"messages": messages, "max_tokens": 1}))
    tok = error_of(client.post(TOK, json={"messages": messages}))
    assert tok["param"] == chat["param"] and tok["param"].startswith("messages"), (tok, chat)
    assert tok["code"] == chat["code"] and tok["message"] == chat["message"]


@pytest.mark.parametrize("name", [e.name for e in UNSUPPORTED if TOKENIZE in e.endpoints])
def test_vllm_chat_options_the_server_cannot_honour_are_400(client: TestClient,
                                                            name: str) -> None:
    bad = {"chat_template": "{{ messages }}", "mm_processor_kwargs": {"size": 3}}[name]
    err = error_of(client.post(TOK, json={"messages": MSGS, name: bad}))
    assert err["param"] == name and err["code"] == "unsupported", err
    nothing = {"chat_template": None, "mm_processor_kwargs": {}}[name]
    ok(client.post(TOK, json={"messages": MSGS, name: nothing}))


def test_unknown_fields_are_ignored_with_a_warning(client: TestClient,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="structspec.server"):
        ok(client.post(TOK, json={"prompt": "x", "frobnicate": 1}))
        assert ok(client.post(DETOK, json={"tokens": [104], "zap": True}))["prompt"] == "h"
    warned = [r.getMessage() for r in caplog.records if "ignored unknown" in r.getMessage()]
    assert len(warned) == 2 and "'frobnicate'" in warned[0] and "'zap'" in warned[1], warned


def test_a_model_not_served_is_a_404_naming_model(client: TestClient) -> None:
    """As on the generation endpoints (vLLM's 404 ``NotFoundError``); none, null and ""
    mean the served model."""
    for path, body in ((TOK, {"prompt": "x"}), (DETOK, {"tokens": [104]})):
        err = error_of(client.post(path, json={**body, "model": "gpt-4"}), 404)
        assert err["param"] == "model" and "gpt-4" in err["message"], err
        for name in (None, ""):
            ok(client.post(path, json={**body, "model": name}))


def test_size_limits(engine: FakeEngine, codec: TemplateCodec) -> None:
    """The generation endpoints' bounds: body bytes (413), prompt characters, and the
    context (a prompt of more than max_model_len tokens, refused untokenized when it
    certainly is)."""
    limits = ServerLimits(max_prompt_chars=300, max_request_bytes=4096)
    with TestClient(create_app(make_state(engine, codec, limits=limits))) as c:
        err = error_of(c.post(TOK, json={"prompt": "x" * 301}))
        assert (err["param"], err["code"]) == ("prompt", "prompt_too_large"), err
        err = error_of(c.post(TOK, json={"messages": [{"role": "user", "content": "x" * 301}]}))
        assert (err["param"], err["code"]) == ("messages", "prompt_too_large"), err
        err = error_of(c.post(TOK, json={"prompt": "x" * 5000}), 413)
        assert err["code"] == "request_too_large", err
        err = error_of(c.post(DETOK, json={"tokens": [104] * 2000}), 413)
    small = FakeEngine(max_model_len=20)
    with TestClient(create_app(make_state(small, codec))) as c:
        assert ok(c.post(TOK, json={"prompt": "x" * 19}))["count"] == 20  # fits exactly
        err = error_of(c.post(TOK, json={"prompt": "x" * 20}))
        assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded"), err
        assert "maximum context length is 20 tokens" in err["message"]
        assert "your prompt has 21 tokens" in err["message"], err
        err = error_of(c.post(TOK, json={"messages": [{"role": "user", "content": "x" * 100}]}))
        assert (err["param"], err["code"]) == ("messages", "context_length_exceeded"), err
        assert "at least" in err["message"], err  # refused before it was tokenized
        assert ok(c.post(DETOK, json={"tokens": [104] * 20}))["prompt"] == "h" * 20
        err = error_of(c.post(DETOK, json={"tokens": [104] * 21}))
        assert (err["param"], err["code"]) == ("tokens", "context_length_exceeded"), err


def test_engine_not_ready_api_key_and_metrics(codec: TemplateCodec) -> None:
    with TestClient(create_app(make_state(FakeEngine(ready=False), codec))) as c:
        for path, body in ((TOK, {"prompt": "x"}), (DETOK, {"tokens": [104]})):
            assert error_of(c.post(path, json=body), 503)["code"] == "engine_unavailable"
    with TestClient(create_app(make_state(FakeEngine(), codec, api_key="sekrit"))) as c:
        for path, body in ((TOK, {"prompt": "x"}), (DETOK, {"tokens": [104]})):
            r = c.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            ok(c.post(path, json=body, headers={"Authorization": "Bearer sekrit"}))
    with TestClient(create_app(make_state(FakeEngine(), codec))) as c:
        error_of(c.post(TOK, json={"prompt": 5}))
        error_of(c.post(DETOK, json={"tokens": [-1]}))
        assert 'structspec_http_errors_total{status="400"} 2.0' in c.get("/metrics").text


def test_tokenization_requests_get_no_request_log_line(
        client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    """The request line is a generation's (tokens, TTFT, grammar): a count has none."""
    with caplog.at_level(logging.INFO, logger="structspec.server"):
        ok(client.post(TOK, json={"prompt": "x"}))
        error_of(client.post(DETOK, json={"tokens": [-1]}))
    assert not [r for r in caplog.records if r.getMessage().startswith("request ")]


# ------------------------------------------------------------------ a real tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE that adds a BOS and has a chat template (trained here, ~0.1 s)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<|im|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["Hello, world! How are you today?", "Grüße aus Köln"] * 4,
                            trainer=trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", raw.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    hf.chat_template = ("{% for m in messages %}<|im|>{{ m['role'] }}\n{{ m['content'] }}"
                        "</s>\n{% endfor %}{% if add_generation_prompt %}<|im|>assistant\n"
                        "{% endif %}")
    path = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(str(path))
    return path


def test_real_tokenizer(hf_dir: Path) -> None:
    codec = TokenizerCodec(str(hf_dir))
    tok = codec.tokenizer
    engine = FakeEngine()
    text = "Hello, Köln! 🎉"
    messages = [{"role": "user", "content": "How are you?"}]
    with TestClient(create_app(make_state(engine, codec))) as c:
        body = ok(c.post(TOK, json={"prompt": text, "return_token_strs": True}))
        assert body["tokens"] == tok.encode(text) and body["tokens"][0] == tok.bos_token_id
        assert body["token_strs"] == tok.hf.convert_ids_to_tokens(body["tokens"])
        assert "Ġ" in "".join(body["token_strs"])  # vocabulary entries, not text
        plain = ok(c.post(TOK, json={"prompt": text, "add_special_tokens": False}))["tokens"]
        assert plain == tok.encode(text, add_special_tokens=False) == body["tokens"][1:]
        assert ok(c.post(DETOK, json={"tokens": plain}))["prompt"] == text
        assert ok(c.post(DETOK, json={"tokens": body["tokens"]}))["prompt"] == "<s>" + text
        # a chat: the chat endpoint's prompt; back to text it is the rendered template
        chat = ok(c.post(TOK, json={"messages": messages}))["tokens"]
        assert chat == chat_prompt_ids(c, engine, messages=messages)
        assert ok(c.post(DETOK, json={"tokens": chat}))["prompt"] == tok.render_chat(messages)
        bare = ok(c.post(TOK, json={"messages": messages, "add_generation_prompt": False}))
        assert ok(c.post(DETOK, json={"tokens": bare["tokens"]}))["prompt"] == \
            "<|im|>user\nHow are you?</s>\n"
        with_bos = ok(c.post(TOK, json={"messages": messages, "add_special_tokens": True}))
        assert with_bos["tokens"] == [tok.bos_token_id, *chat]
