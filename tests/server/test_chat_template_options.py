"""vLLM's chat template options on ``/v1/chat/completions`` (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``): the prompt ids the engine receives
through the real codec equal transformers' ``apply_chat_template`` of the same chat and
options, with SmolLM2's tokenizer (its own template, and a small template that renders tools
and a variable); every bad combination is a 400 naming its field."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from structspec.server.app import create_app
from structspec.server.limits import ServerLimits
from structspec.server.metrics import ServerMetrics
from structspec.server.serving import ServerState
from tests.server.fake_client import CHAT, MSGS, post
from tests.server.server_fakes import FakeEngine
from tests.server.test_tool_calls import NAMED, TOOLS

ANSWER = [{"role": "user", "content": "Name a colour."},
          {"role": "assistant", "content": "My favourite colour is"}]

#: renders ``tools`` and a ``greeting`` variable, so that a test sees them reach the prompt
TEMPLATE = (
    "{%- if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif -%}"
    "{%- if greeting is defined %}GREETING {{ greeting }}\n{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}")


@pytest.fixture(scope="module")
def hf(smol_dir: str) -> Any:
    """The reference: transformers' own tokenizer of the directory."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def codec(smol_dir: str) -> Any:
    """SmolLM2's real codec (a test may swap its template with monkeypatch)."""
    from structspec.server.codec import TokenizerCodec

    return TokenizerCodec(smol_dir)


@pytest.fixture(scope="module")
def smol(codec: Any) -> Iterator[tuple[TestClient, FakeEngine]]:
    """A server over the fake engine with SmolLM2's real codec."""
    engine = FakeEngine()
    state = ServerState(engine=engine, codec=codec, metrics=ServerMetrics(),
                        model_name="fake")
    with TestClient(create_app(state)) as c:
        yield c, engine


@pytest.fixture
def custom(smol: tuple[TestClient, FakeEngine], codec: Any,
           monkeypatch: pytest.MonkeyPatch) -> tuple[TestClient, FakeEngine]:
    """The same server with :data:`TEMPLATE` as its template (as ``--chat-template``
    sets it)."""
    monkeypatch.setattr(codec.tokenizer.hf, "chat_template", TEMPLATE)
    return smol


def _prompt_ids(pair: tuple[TestClient, FakeEngine], **body: Any) -> list[int]:
    client, engine = pair
    r = client.post(CHAT, json={"max_tokens": 2, **body})
    assert r.status_code == 200, r.text
    return engine.added[-1][1]


def _reference(hf: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
               continue_final_message: bool = False, **kwargs: Any) -> list[int]:
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                 add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, **kwargs)
    return list(ids)


@pytest.mark.parametrize(("messages", "fields", "agp", "cont"), [
    (MSGS, {}, True, False),
    (MSGS, {"add_generation_prompt": None, "continue_final_message": None,
            "chat_template_kwargs": None}, True, False),  # null: the defaults
    (MSGS, {"add_generation_prompt": False}, False, False),
    (ANSWER, {"add_generation_prompt": False}, False, False),
    (ANSWER, {"add_generation_prompt": False, "continue_final_message": True}, False, True),
    (ANSWER, {"add_generation_prompt": False, "continue_final_message": True,
              "chat_template_kwargs": {"enable_thinking": False}}, False, True),
], ids=["default", "nulls", "no-generation-prompt", "answer-closed", "continue",
        "continue-kwargs"])
def test_prompt_ids_are_transformers_apply_chat_template(
        smol: tuple[TestClient, FakeEngine], hf: Any, messages: list[dict[str, Any]],
        fields: dict[str, Any], agp: bool, cont: bool) -> None:
    kwargs = fields.get("chat_template_kwargs") or {}
    got = _prompt_ids(smol, messages=messages, **fields)
    assert got == _reference(hf, messages, add_generation_prompt=agp,
                             continue_final_message=cont, **kwargs)
    text = hf.decode(got)
    if cont:  # the answer is left open: no end of turn after it, no new header
        assert text.endswith("My favourite colour is")
    elif not agp:
        assert text.endswith("<|im_end|>\n")


def test_kwargs_and_tools_reach_the_template(custom: tuple[TestClient, FakeEngine],
                                             hf: Any) -> None:
    """Through a template that renders them: a ``chat_template_kwargs`` variable and the
    tools (``tool_choice`` auto) both reach the prompt, with the final message continued."""
    got = _prompt_ids(custom, messages=ANSWER, tools=TOOLS, add_generation_prompt=False,
                      continue_final_message=True, chat_template_kwargs={"greeting": "hola"})
    assert got == _reference(hf, ANSWER, add_generation_prompt=False,
                             continue_final_message=True, chat_template=TEMPLATE,
                             tools=TOOLS, greeting="hola")
    text = hf.decode(got)
    assert text.startswith("TOOLS get_weather,get_time\nGREETING hola\n")
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")
    # without the variable (and tool_choice none) neither line is rendered
    text = hf.decode(_prompt_ids(custom, messages=MSGS, tools=TOOLS, tool_choice="none"))
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_changes_the_final_message_cannot_continue_it(
        custom: tuple[TestClient, FakeEngine], codec: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers refuses to leave open a message its template does not render as sent;
    that is a 400 naming ``continue_final_message`` (without the whole rendered chat that
    transformers' message quotes)."""
    client, engine = custom
    upper = TEMPLATE.replace("{{ m.content }}", "{{ m.content | upper }}")
    monkeypatch.setattr(codec.tokenizer.hf, "chat_template", upper)
    added = len(engine.added)
    err = _error(client.post(CHAT, json={"messages": ANSWER, "add_generation_prompt": False,
                                         "continue_final_message": True}))
    assert err["param"] == "continue_final_message", err
    assert "cannot be left open" in err["message"] and "<|im_start|>" not in err["message"]
    assert len(engine.added) == added
    # closed, the same chat renders
    text = codec.tokenizer.hf.decode(_prompt_ids(custom, messages=ANSWER,
                                                 add_generation_prompt=False))
    assert text.endswith("MY FAVOURITE COLOUR IS<|im_end|>\n")


def _error(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"continue_final_message": True, "add_generation_prompt": None},
     "continue_final_message", "add_generation_prompt"),
    ({"continue_final_message": True, "add_generation_prompt": False, "messages": MSGS},
     "continue_final_message", "messages[0].role is 'user'"),
    ({"continue_final_message": True, "add_generation_prompt": False, "tools": TOOLS,
      "tool_choice": "required"}, "continue_final_message", "forced tool call"),
    ({"continue_final_message": True, "add_generation_prompt": False, "tools": TOOLS,
      "tool_choice": NAMED}, "continue_final_message", "forced tool call"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt", "valid boolean"),
    ({"continue_final_message": 1}, "continue_final_message", "valid boolean"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs",
     "valid dictionary"),
    *[({"chat_template_kwargs": {"ok": 1, key: "x"}}, f"chat_template_kwargs.{key}",
       "reserved") for key in ("messages", "tools", "documents", "chat_template",
                               "add_generation_prompt", "continue_final_message",
                               "tokenize")],
])
def test_bad_combinations_are_400s_naming_the_field(client: TestClient, engine: FakeEngine,
                                                    fields: dict[str, Any], param: str,
                                                    words: str) -> None:
    body = {"messages": ANSWER, **fields}
    err = _error(post(client, CHAT, **body))
    assert err["param"] == param and words in err["message"], err
    assert engine.added == []


def test_continue_with_auto_tools_and_a_grammar_is_served(client: TestClient,
                                                          engine: FakeEngine) -> None:
    """Only a forced call conflicts with a continued message: tools offered (``auto``) are
    rendered, and a grammar constrains the continuation."""
    r = post(client, CHAT, messages=ANSWER, tools=TOOLS, tool_choice="auto",
             add_generation_prompt=False, continue_final_message=True,
             response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    # the fake codec's rendering: the final message open, no generation prompt
    prompt = "".join(map(chr, engine.added[-1][1]))
    assert prompt.endswith("<assistant>My favourite colour is")


def test_kwargs_count_as_prompt_text() -> None:
    """``chat_template_kwargs`` values a template may render are bounded with the messages
    (``--max-prompt-chars``)."""
    from tests.server.server_fakes import FakeCodec

    engine = FakeEngine()
    state = ServerState(engine=engine, codec=FakeCodec(), metrics=ServerMetrics(),
                        model_name="fake", limits=ServerLimits(max_prompt_chars=100))
    with TestClient(create_app(state)) as c:
        assert post(c, CHAT, chat_template_kwargs={"notes": "x" * 80}).status_code == 200
        err = _error(post(c, CHAT, chat_template_kwargs={"notes": "x" * 100}))
        assert err["code"] == "prompt_too_large" and err["param"] == "chat_template_kwargs"
        # within the bound alone, over it with the messages: the whole prompt is named
        err = _error(post(c, CHAT, chat_template_kwargs={"notes": "x" * 87}))
        assert err["code"] == "prompt_too_large" and err["param"] == "messages"
    assert len(engine.added) == 1


def test_options_are_not_unknown_fields(client: TestClient,
                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="structspec.server"):
        r = post(client, CHAT, add_generation_prompt=True, continue_final_message=False,
                 chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    assert not [rec for rec in caplog.records if "ignored unknown" in rec.getMessage()]


def test_reserved_keys_cover_apply_chat_templates_arguments() -> None:
    """Every named argument of the installed transformers' ``apply_chat_template`` is
    reserved: passed in ``chat_template_kwargs`` it would change the rendering itself (a
    ``chat_template`` would run the client's Jinja)."""
    import inspect

    import transformers

    from structspec.core import RESERVED_CHAT_TEMPLATE_KWARGS

    sig = inspect.signature(transformers.PreTrainedTokenizerBase.apply_chat_template)
    named = {name for name, p in sig.parameters.items()
             if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert named <= RESERVED_CHAT_TEMPLATE_KWARGS, named - RESERVED_CHAT_TEMPLATE_KWARGS
    assert "messages" in RESERVED_CHAT_TEMPLATE_KWARGS
