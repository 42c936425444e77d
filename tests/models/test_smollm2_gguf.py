"""The converted SmolLM2 GGUF vs transformers' own GGUF loader (fp32 logits, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from structspec.models.loader import load_model
from structspec.models.tokenizer import Tokenizer

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a JSON object with a name and an age."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
]
LOGIT_TOL = 2e-3  # fp32, 30 layers, different matmul groupings (fused qkv / gate_up)


@pytest.fixture(scope="module")
def hf_reference(smollm2_gguf: Path, smollm2_dir: Path) -> HFLlama:
    """transformers' GGUF path: ``load_gguf_checkpoint`` is what ``from_pretrained(gguf_file=)``
    uses to read the config and dequantize/un-permute tensors (from_pretrained itself needs
    accelerate). The model is built from our config.json, checked against transformers' own."""
    cfg = LlamaConfig.from_pretrained(str(smollm2_dir))
    model = HFLlama(cfg).eval()
    parsed = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=model)
    theirs = parsed["config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "vocab_size", "tie_word_embeddings"):
        assert getattr(cfg, key) == theirs[key], key
    assert cfg.rope_parameters["rope_theta"] == theirs["rope_theta"]
    result = model.load_state_dict(parsed["tensors"], strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> tuple[Any, Any]:
    return load_model(str(smollm2_dir), device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def test_converted_files(smollm2_dir: Path, tok: Tokenizer) -> None:
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert tok.eos_token_ids == (2,)
    assert tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tok.has_chat_template and tok.vocab_size == 49152
    text = tok.render_chat(PROMPTS[0])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is" in text
    ids = tok.apply_chat_template(PROMPTS[0])
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=False) == text


@torch.no_grad()
def test_logits_match_transformers_gguf(
    ours: tuple[Any, Any], hf_reference: HFLlama, tok: Tokenizer, fbh: SimpleNamespace
) -> None:
    model, cfg = ours
    seqs = [tok.apply_chat_template(m) for m in PROMPTS]
    pool = fbh.make_pool(cfg, len(seqs))
    hidden = model(fbh.make_batch([fbh.extend_row(i, 0, s) for i, s in enumerate(seqs)]), pool).hidden_states
    worst = 0.0
    for i, s in enumerate(seqs):
        got = model.compute_logits(hidden[i, : len(s)])
        ref = hf_reference(torch.tensor([s])).logits[0].float()
        assert torch.equal(got[-1].argmax(), ref[-1].argmax())
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree > 0.95, f"prompt {i}: argmax agrees on only {agree:.0%} of positions"
        worst = max(worst, (got - ref).abs().max().item())
    print(f"SmolLM2 GGUF: max |ours - transformers| logit diff = {worst:.3g}")
    assert worst < LOGIT_TOL
    # Greedy continuation is coherent text ending the answer with <|im_end|>.
    seq = list(seqs[0])
    for _ in range(8):
        fb = fbh.make_batch([fbh.extend_row(0, len(seq) - 1, seq[-1:])])
        seq.append(int(model.compute_logits(model(fb, pool).hidden_states[:, -1]).argmax()))
    assert "Paris" in tok.decode(seq[len(seqs[0]) :])
