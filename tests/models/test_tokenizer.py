"""Tokenizer wrapper and IncrementalDetokenizer (streamed text == full decode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from structspec.core import ChatMessageError, PromptTooLongError
from structspec.models.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Grüße aus Köln — naïve café, ½ price.",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, math ∑∫√.",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी.",
    '{"name": "Zoë", "tags": ["🙂", "ß"], "n": 3}',
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE with few merges, so multi-byte characters span several tokens."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<eot>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(TEXTS[:2] * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    return path


def _check_stream(tok: Tokenizer, text: str, chunk: int, prompt: list[int]) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer(prompt_ids=prompt)
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert detok.text == text


def test_tiny_tokenizer_wrapper(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir)
    assert tok.eos_token_ids == (2, 1)  # generation_config first, then the tokenizer's eos
    assert tok.bos_token_id == 0 and tok.vocab_size == len(tok.hf)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode(TEXTS[3], add_special_tokens=False)
    assert len(ids) > len(TEXTS[3])  # emoji really are split into byte tokens
    with pytest.raises(FileNotFoundError):
        Tokenizer(tiny_dir / "missing")


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_tiny(tiny_dir: Path, chunk: int) -> None:
    tok = Tokenizer(tiny_dir)
    prompt = tok.encode("prompt: ", add_special_tokens=False)
    for text in TEXTS:
        _check_stream(tok, text, chunk, prompt)


def test_incremental_detokenizer_holds_back_partial_utf8(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir)
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) == 4  # four UTF-8 bytes, one token each
    detok = tok.detokenizer()
    assert [detok.add([i]) for i in ids] == ["", "", "", "🎉"]
    detok = tok.detokenizer()
    assert detok.add(ids[:2]) == ""
    assert detok.flush() == "\ufffd"  # a request cut off mid-character still reports it


def test_incremental_detokenizer_skips_special(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir)
    ids = tok.encode("Hello", add_special_tokens=False) + [1]
    detok = tok.detokenizer()
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "Hello"


@pytest.mark.parametrize("chunk", [1, 2])
def test_incremental_detokenizer_smollm2(smollm2_dir: Path, chunk: int) -> None:
    tok = Tokenizer(smollm2_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    for text in TEXTS:
        _check_stream(tok, text, chunk, prompt)


def test_backend_decode_equals_transformers_decode(smollm2_dir: Path) -> None:
    """decode() goes to the Rust backend directly; it must equal transformers' decode."""
    import random

    tok = Tokenizer(smollm2_dir)
    assert tok._backend is not None
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok.hf)) for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_lone_surrogate_is_a_value_error_naming_the_index(smollm2_dir: Path) -> None:
    """A JSON "\\ud800" escape decodes to a lone surrogate, which the Rust tokenizer refuses
    with a TypeError that does not say why."""
    tok = Tokenizer(smollm2_dir)
    with pytest.raises(ValueError, match=r"lone surrogate \(U\+D800\) at character 2"):
        tok.encode("ab\ud800cd")
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.apply_chat_template([{"role": "user", "content": "x\udc00"}])


@pytest.mark.parametrize("unit", ["a", " ", "ab ", "日本", "{\"k\": 1}, ", "\n\n\n"])
def test_max_tokens_refuses_only_prompts_that_cannot_fit(smollm2_dir: Path, unit: str) -> None:
    """The untokenized check is a true lower bound: a refused text really has more tokens
    than the limit (checked by tokenizing it), and a text at the limit is never refused."""
    tok = Tokenizer(smollm2_dir)
    limit = 50
    big = unit * (2 * tok.max_token_chars * (limit + 1) // len(unit) + 1)
    with pytest.raises(PromptTooLongError) as info:
        tok.encode(big, max_tokens=limit)
    assert info.value.min_tokens > limit
    assert len(tok.encode(big)) >= info.value.min_tokens
    fits = unit * max(1, limit // 4 // len(unit))
    assert tok.encode(fits, max_tokens=limit) == tok.encode(fits)


def test_surrogate_in_a_chat_message_names_the_message_and_its_index(smollm2_dir: Path) -> None:
    """The index is the one in the message's own text, not in the rendered template."""
    tok = Tokenizer(smollm2_dir)
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content is not valid Unicode: a "
                                         r"lone surrogate \(U\+D800\) at character 1$"):
        tok.apply_chat_template([{"role": "user", "content": "ok"},
                                 {"role": "user", "content": "a\ud800b"}])


def test_malformed_message_is_refused_before_the_template(smollm2_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """render_chat checks messages first: the error names the field, and the template is
    never called (its own error, "can only concatenate str (not "int") to str", did not)."""
    tok = Tokenizer(smollm2_dir)

    def no_render(*args: object, **kwargs: object) -> str:
        raise AssertionError("the template rendered malformed messages")

    with monkeypatch.context() as m:
        m.setattr(tok.hf, "apply_chat_template", no_render)
        with pytest.raises(ChatMessageError, match=r"^messages\[1\]\.content: expected a string "
                                                   r"or a list of text parts, got int$") as e:
            tok.apply_chat_template([{"role": "user", "content": "ok"},
                                     {"role": "user", "content": 5}])
    assert e.value.param == "messages[1].content"
    parts = [{"type": "text", "text": "o"}, {"type": "text", "text": "k"}]
    assert tok.render_chat([{"role": "user", "content": parts}]) == tok.render_chat(
        [{"role": "user", "content": "ok"}])


def test_chat_template_override_renders_chats(tiny_dir: Path) -> None:
    """``chat_template=`` (``--chat-template``) replaces the model's template: a tokenizer
    without one can render chats, and the text is the override's."""
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = Tokenizer(tiny_dir, chat_template=template)
    assert tok.has_chat_template
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
    assert not Tokenizer(tiny_dir).has_chat_template  # the directory's tokenizer is unchanged


# ------------------------------------------------------------------ vLLM's text options

WORDS = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "<x>": 5, "<y>": 6}


def _word_tokenizer(path: Path, *, bos: bool) -> Tokenizer:
    """A word-level tokenizer with no decoder (tokenizers joins decoded tokens with spaces);
    ``<x>``, ``<y>`` are added special tokens; ``bos``: its post-processor adds ``<s>``."""
    raw = RawTokenizer(models.WordLevel(WORDS, unk_token="a"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        raw.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    hf.add_special_tokens({"additional_special_tokens": ["<x>", "<y>"]})
    hf.save_pretrained(str(path))
    return Tokenizer(path)


def test_encode_tail_keeps_the_bos_the_tokenizer_adds(tmp_path: Path) -> None:
    """vLLM cuts a text prompt with Hugging Face's left truncation: the BOS stays."""
    tok = _word_tokenizer(tmp_path, bos=True)
    assert tok.encode("a b c a b") == [0, 2, 3, 4, 2, 3]
    assert tok.encode_tail("a b c a b", 3) == ([0, 2, 3], True)
    assert tok.encode_tail("a b c a b", 3, add_special_tokens=False) == ([4, 2, 3], True)
    assert tok.encode_tail("a b c a b", 6) == ([0, 2, 3, 4, 2, 3], False)
    assert tok.encode_tail("a b", 1) == ([0], True)  # Hugging Face keeps the BOS alone


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunk: int,
            spaces: bool) -> str:
    detok = tok.detokenizer(prompt, skip_special_tokens=False,
                            spaces_between_special_tokens=spaces)
    text = "".join(detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk))
    text += detok.flush()
    assert detok.text == text
    return text


@pytest.mark.parametrize("chunk", [1, 2, 9])
def test_spaces_between_special_tokens_follow_vllm(tmp_path: Path, chunk: int) -> None:
    """False drops the decoder's space in front of an added token that follows another added
    token of the output (vLLM's FastIncrementalDetokenizer); True is the tokenizer's decode.
    The first output token counts as following nothing, as in vLLM."""
    tok = _word_tokenizer(tmp_path, bos=False)
    ids = [5, 6, 2, 5, 6, 5, 1, 3]  # <x> <y> a <x> <y> <x> </s> b
    assert _stream(tok, [2, 5], ids, chunk, True) == tok.decode(
        [2, 5] + ids, skip_special_tokens=False)[len("a <x>"):] == (
        " <x> <y> a <x> <y> <x> </s> b")
    assert _stream(tok, [2, 5], ids, chunk, False) == " <x><y> a <x><y><x></s> b"
    detok = tok.detokenizer([2], skip_special_tokens=False,
                            spaces_between_special_tokens=False)
    detok.add([3, 5, 6, 6])
    assert detok.restart([5, 6]) == " <x><y>"
    # special tokens dropped: nothing left to space
    detok = tok.detokenizer([2], spaces_between_special_tokens=False)
    assert detok.add(ids) + detok.flush() == " a b"


def test_byte_level_decoders_put_nothing_between_special_tokens(tiny_dir: Path) -> None:
    """A byte-level BPE (SmolLM2's kind) decodes adjacent special tokens with nothing
    between them, so both values of spaces_between_special_tokens give its own decode."""
    tok = Tokenizer(tiny_dir)
    assert set(tok.added_token_texts.values()) >= {"<s>", "</s>", "<eot>"}
    ids = tok.encode("Hello", add_special_tokens=False) + [2, 1, 2] + tok.encode(
        " world", add_special_tokens=False) + [0]
    expected = tok.decode(ids, skip_special_tokens=False)
    assert "<eot></s><eot>" in expected
    for chunk in (1, 4):
        assert _stream(tok, [], ids, chunk, False) == _stream(tok, [], ids, chunk,
                                                              True) == expected
