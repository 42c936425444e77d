"""``check_chat_messages``: the one check of chat messages that the Python API, the CLI and
the HTTP server share; a malformed message is refused naming its field, before any chat
template renders it."""

from __future__ import annotations

from typing import Any

import pytest

from structspec.core import ChatMessageError, ChatTemplateOptions, check_chat_messages

USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("messages", "param", "reason"), [
    ("hi", "messages", "expected a list of messages, got str"),
    ({"role": "user", "content": "hi"}, "messages", "expected a list of messages, got dict"),
    (None, "messages", "expected a list of messages, got null"),
    ([], "messages", "expected at least one message, got an empty list"),
    ([USER, "hi"], "messages[1]", "expected a message object with 'role' and 'content', "
                                  "got str"),
    ([{"content": "hi"}], "messages[0].role", "missing"),
    ([{"role": 1, "content": "hi"}], "messages[0].role", "expected a string, got int"),
    ([{"role": "", "content": "hi"}], "messages[0].role", "expected a non-empty string"),
    ([USER, {"role": "user"}], "messages[1].content", "missing"),
    ([USER, {"role": "user", "content": 5}], "messages[1].content",
     "expected a string or a list of text parts, got int"),
    ([{"role": "user", "content": None}], "messages[0].content",
     "expected a string or a list of text parts, got null"),
    ([{"role": "assistant", "content": None}], "messages[0].content", "got null"),
    ([{"role": "user", "content": [1, 2]}], "messages[0].content[0]",
     "expected a content part object"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}],
     "messages[0].content[0].text", "expected a string, got int"),
    ([{"role": "user", "content": "hi", "name": 7}], "messages[0].name",
     "expected a string, got int"),
])
def test_malformed_messages_name_the_field(messages: Any, param: str, reason: str) -> None:
    with pytest.raises(ChatMessageError) as e:
        check_chat_messages(messages)
    assert e.value.param == param
    assert str(e.value).startswith(f"{param}: ") and reason in str(e.value), str(e.value)
    assert e.value.code is None
    assert isinstance(e.value, ValueError)  # callers that catch ValueError still do


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "messages[1].content[0].type"),
    ({"role": "assistant", "content": None, "tool_calls": [CALL]}, "messages[1].content"),
    ({"role": "assistant", "tool_calls": [CALL]}, "messages[1].content"),
])
def test_valid_openai_messages_structspec_cannot_serve_are_unsupported(
        message: dict[str, Any], param: str) -> None:
    """An image part, and an assistant turn that only carries tool calls (content null or
    left out, as OpenAI allows), are refused as ``unsupported``, naming the field."""
    with pytest.raises(ChatMessageError, match="not supported") as e:
        check_chat_messages([USER, message])
    assert e.value.param == param and e.value.code == "unsupported"
    assert str(e.value).startswith(f"{param}: ")


def test_text_parts_are_joined_and_the_input_is_left_alone() -> None:
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    messages = [{"role": "system", "content": "Be brief.", "name": "sys"},
                {"role": "user", "content": parts, "extra": 1}]
    out = check_chat_messages(messages)
    assert out == [{"role": "system", "content": "Be brief.", "name": "sys"},
                   {"role": "user", "content": "Say hi.", "extra": 1}]
    assert messages[1]["content"] is parts  # copies, not the caller's dicts
    assert check_chat_messages(tuple(out)) == out  # idempotent; a tuple is a list too


# ------------------------------------------------------------------ chat template options


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize(("kwargs", "param", "reason"), [
    ({"add_generation_prompt": 1}, "add_generation_prompt", "expected true or false, got int"),
    ({"continue_final_message": "yes"}, "continue_final_message",
     "expected true or false, got str"),
    ({"continue_final_message": True}, "continue_final_message",
     "cannot be true while add_generation_prompt is true"),
    ({"chat_template_kwargs": [("a", 1)]}, "chat_template_kwargs",
     "expected an object of template variables, got list"),
    ({"chat_template_kwargs": {1: "x"}}, "chat_template_kwargs",
     "keys must be strings, got int 1"),
    ({"chat_template_kwargs": {"ok": 1, "tools": []}}, "chat_template_kwargs.tools",
     "'tools' is reserved"),
    ({"chat_template_kwargs": {"when": object()}}, "chat_template_kwargs.when",
     "expected a JSON value"),
    ({"chat_template_kwargs": {"x": float("nan")}}, "chat_template_kwargs.x",
     "expected a JSON value"),
    ({"chat_template_kwargs": {"deep": _nested(200)}}, "chat_template_kwargs.deep",
     "nests deeper than 128 levels"),  # the template's rendering recursed past its limit
])
def test_bad_chat_template_options_name_the_field(kwargs: dict[str, Any], param: str,
                                                  reason: str) -> None:
    with pytest.raises(ChatMessageError) as e:
        ChatTemplateOptions(**kwargs)
    assert e.value.param == param and reason in str(e.value), str(e.value)
    assert str(e.value).startswith(f"{param}: ")


def test_chat_template_options_render_arguments() -> None:
    assert ChatTemplateOptions().template_args() == {"add_generation_prompt": True,
                                                     "continue_final_message": False}
    given = {"enable_thinking": False, "notes": ["ü", 1.5, None]}
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True,
                                  chat_template_kwargs=given)
    given["enable_thinking"] = True  # the options keep their own copy
    assert options.template_args() == {"enable_thinking": False, "notes": ["ü", 1.5, None],
                                       "add_generation_prompt": False,
                                       "continue_final_message": True}
    assert options.kwargs_chars() == len('{"enable_thinking": false, "notes": ["ü", 1.5, null]}')
    assert ChatTemplateOptions().kwargs_chars() == 0


def test_only_an_assistant_message_is_continued() -> None:
    cont = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    cont.check_messages([USER, {"role": "assistant", "content": "Sure"}])
    with pytest.raises(ChatMessageError, match=r"^continue_final_message: the final message "
                                               r"must be the assistant's.*messages\[0\]\.role "
                                               r"is 'user'"):
        cont.check_messages([USER])
    ChatTemplateOptions(add_generation_prompt=False).check_messages([USER])  # not continued
