"""The committed Llama-3 benchmark assets (``benchmarks/assets``): the tokenizer converted from
llama.cpp's vocab GGUF reproduces llama.cpp's reference tokenizations, xgrammar compiles for
its 128,256-token vocabulary, and a tiny random model with this tokenizer, loaded with
``load_format="dummy"``, generates schema-valid JSON (CPU, greedy)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks.make_llama3_assets import CONFIG_1B, CONFIG_8B, parse_reference
from structspec.config import ModelConfig
from structspec.constraints import JsonSchemaConstraint
from structspec.core import FinishReason, SamplingParams
from structspec.models.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "benchmarks" / "assets"
TARGET_DIR = ASSETS / "llama3-8b-shape"
DRAFT_DIR = ASSETS / "llama3-1b-draft-shape"
REF = REPO / "tests" / "data" / "llama3-vocab" / "ggml-vocab-llama-bpe.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
BOS, EOS, EOT = 128000, 128001, 128009

SCHEMA = {  # bounded output, so a random model's greedy JSON must finish
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TARGET_DIR)


def test_reference_tokenizations(tok: Tokenizer) -> None:
    ref = parse_reference(Path(f"{REF}.inp").read_text(encoding="utf-8"),
                          Path(f"{REF}.out").read_text(encoding="utf-8"))
    assert len(ref) == 46
    for text, want in ref:
        assert tok.encode(text, add_special_tokens=False) == want, repr(text)
        assert tok.encode(text) == [BOS, *want], repr(text)  # BOS from the post-processor
        assert tok.decode(want) == text, repr(text)  # byte-level: lossless round trip


def test_tokenizer_specials_and_chat_template(tok: Tokenizer) -> None:
    assert tok.vocab_size == 128256 and tok.bos_token_id == BOS
    assert tok.eos_token_ids == (EOS, EOT)
    hf = tok.hf
    assert hf.convert_ids_to_tokens([BOS, EOS, 128006, 128007, EOT]) == [
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eot_id|>"]
    assert len(hf.all_special_ids) >= 2
    # special tokens in text are parsed as one token each
    assert tok.encode("<|eot_id|>", add_special_tokens=False) == [EOT]
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    # <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>
    # <|start_header_id|>assistant<|end_header_id|>\n\n  (Meta's Llama-3 Instruct format)
    assert ids == [BOS, 128006, 882, 128007, 271, 13347, 1070, EOT, 128006, 78191, 128007, 271]


def test_asset_configs() -> None:
    target = json.loads((TARGET_DIR / "config.json").read_text())
    draft = json.loads((DRAFT_DIR / "config.json").read_text())
    assert target == json.loads(json.dumps(CONFIG_8B))
    assert draft == json.loads(json.dumps(CONFIG_1B))
    t, d = ModelConfig.from_hf_config(target), ModelConfig.from_hf_config(draft)
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.head_dim, t.intermediate_size, t.vocab_size, t.tie_word_embeddings,
            t.rope_theta, t.max_position_embeddings, t.rms_norm_eps) == (
        4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 8192, 1e-5)
    assert (d.hidden_size, d.num_hidden_layers, d.num_attention_heads, d.num_key_value_heads,
            d.head_dim, d.intermediate_size, d.vocab_size, d.tie_word_embeddings) == (
        2048, 16, 32, 8, 64, 8192, 128256, True)
    assert d.rope_scaling_dict is not None and d.rope_scaling_dict["rope_type"] == "llama3"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the draft uses the target's
        assert (TARGET_DIR / name).exists() and not (DRAFT_DIR / name).exists(), name
    assert not list(ASSETS.rglob("*.safetensors"))  # shapes only, no weights


def _params(cfg: ModelConfig) -> int:
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_hidden_layers * layer + embed + h


def test_asset_parameter_counts() -> None:
    t = ModelConfig.from_hf_config(json.loads((TARGET_DIR / "config.json").read_text()))
    d = ModelConfig.from_hf_config(json.loads((DRAFT_DIR / "config.json").read_text()))
    assert _params(t) == 8_030_261_248  # Meta-Llama-3-8B
    assert _params(d) == 1_235_814_400  # Llama-3.2-1B


def test_hbm_floor_byte_accounting() -> None:
    """benchmarks/hbm_floor.py counts the built model's bytes (meta device, no memory): all
    parameters, minus the untied input embedding a decode step only gathers rows of."""
    import torch

    from benchmarks.hbm_floor import (
        copy_bandwidth,
        kv_read_bytes,
        meta_model,
        param_bytes,
        step_read_bytes,
    )

    for path, tied in ((TARGET_DIR, False), (DRAFT_DIR, True)):
        model, cfg = meta_model(str(path), torch.bfloat16)
        assert param_bytes(model) == 2 * _params(cfg)  # tied embeddings counted once
        embed = 2 * cfg.vocab_size * cfg.hidden_size
        assert step_read_bytes(model, cfg, 4) == param_bytes(model) - (
            0 if tied else embed - 4 * 2 * cfg.hidden_size)
    model, cfg = meta_model(str(TARGET_DIR), torch.bfloat16)
    assert round(step_read_bytes(model, cfg) / 1e9, 2) == 15.01  # /4.2 TB/s = 3.6 ms
    assert kv_read_bytes(cfg, 2, 512, torch.bfloat16) == 2 * 512 * 2 * 32 * 1024 * 2
    with pytest.raises(ValueError, match="CUDA"):
        copy_bandwidth(1 << 20, device="cpu")


def test_xgrammar_json_schema_on_llama3_vocab(tok: Tokenizer) -> None:
    from structspec.grammar.backend import GrammarBackend

    backend = GrammarBackend(tok.hf, vocab_size=128256, stop_token_ids=list(tok.eos_token_ids))
    try:
        assert backend.tokenizer_info.vocab_size == 128256
        compiled = backend.compile(JsonSchemaConstraint(SCHEMA), timeout=120)
        good = {"name": "Zoë Việt", "age": 42, "ok": True, "tag": "green"}
        text = json.dumps(good, ensure_ascii=False)  # ", " and ": ": xgrammar's compact form
        ids = tok.encode(text, add_special_tokens=False)
        m = backend.create_matcher(compiled)
        for t in ids:
            assert m.accept_token(t), tok.decode([t])
        assert not m.is_terminated()
        assert m.accept_token(EOT) and m.is_terminated()
        # a token that breaks the schema is refused, the state stays usable
        m2 = backend.create_matcher(compiled)
        assert not m2.accept_token(tok.encode("[", add_special_tokens=False)[0])
        assert m2.accept_token(tok.encode("{", add_special_tokens=False)[0])
    finally:
        backend.shutdown()


TINY_OPTS: dict[str, Any] = dict(device="cpu", dtype="float32", load_format="dummy",
                                 kv_capacity_tokens=2048, max_batch_size=4)


@pytest.fixture(scope="module")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8B asset's config scaled down to 2 layers / hidden 64, with the real tokenizer."""
    out = tmp_path_factory.mktemp("tiny-llama3")
    cfg = dict(CONFIG_8B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=128)
    (out / "config.json").write_text(json.dumps(cfg))
    for name in TOKENIZER_FILES:
        shutil.copyfile(TARGET_DIR / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama3_dir: Path) -> Any:
    """A ``structspec.LLM`` over :func:`tiny_llama3_dir` with seeded random weights (CPU)."""
    from structspec import LLM

    return LLM(str(tiny_llama3_dir), **TINY_OPTS)


def test_dummy_engine_generates_schema_valid_json(tiny_llm: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")  # not on the GPU host
    assert tiny_llm.engine.model_config.vocab_size == 128256
    prompts = ["Make up a person as JSON.", "Another one, please."]
    outs = tiny_llm.generate(prompts, SamplingParams(max_tokens=64,
                                                     grammar=JsonSchemaConstraint(SCHEMA)))
    for out in outs:
        assert out.error is None and out.finish_reason is FinishReason.STOP, out
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.slow  # ~6 s on 2 cores; the Llama-3 vocabulary's grammar and engine tests stay
def test_dummy_draft_model_with_llama3_tokenizer(tiny_llama3_dir: Path, tiny_llm: Any) -> None:
    """``speculative_algorithm="draft_model"`` loads its draft with ``load_format="dummy"`` too;
    a draft from the target's own directory and seed is the target (same seed, same random
    weights, also across the two engines), so greedy output equals plain decoding and drafts
    are accepted."""
    from structspec import LLM

    spec = LLM(str(tiny_llama3_dir), speculative_algorithm="draft_model",
               draft_model=str(tiny_llama3_dir), num_draft_tokens=6, **TINY_OPTS)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    want = tiny_llm.generate("Say something.", sp)[0]
    got = spec.generate("Say something.", sp)[0]
    assert got.token_ids == want.token_ids
    assert got.spec.draft_tokens_accepted > 0
    draft = spec.engine.drafter.model  # type: ignore[attr-defined]
    target = tiny_llm.engine.runner.model
    for (name, p), (_, q) in zip(draft.named_parameters(), target.named_parameters(),
                                 strict=True):
        assert p.equal(q), name
