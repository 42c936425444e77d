"""The converted SmolLM2 GGUF vs transformers' own GGUF loader (fp32 logits, tokenizer).

Loading the reference through transformers' GGUF reader takes ~30 s on a 2-core CPU, so the
default suite compares with its logits stored in ``tests/data/smollm2-hf-logits.safetensors``
(per prompt and position: the reference's top-64 logits and 64 fixed other vocabulary rows,
and its argmax); the live comparison, which also checks the stored file against
transformers, runs under ``-m slow``. To rewrite the file (another pinned model or
transformers): ``STRUCTSPEC_WRITE_HF_REFERENCE=1 python -m pytest -m slow -k stored_reference
tests/models/test_smollm2_gguf.py``.
"""

from __future__ import annotations

import json
import os
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
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "smollm2-hf-logits.safetensors"
TOP_ROWS = 64  # stored per position: the reference's best rows, then as many fixed others


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


def _our_logits(ours: tuple[Any, Any], tok: Tokenizer, fbh: SimpleNamespace
                ) -> tuple[list[list[int]], list[torch.Tensor], Any]:
    """Our fp32 logits ``[T_i, V]`` of each prompt (one batched prefill), and the pool."""
    model, cfg = ours
    seqs = [tok.apply_chat_template(m) for m in PROMPTS]
    pool = fbh.make_pool(cfg, len(seqs))
    hidden = model(fbh.make_batch([fbh.extend_row(i, 0, s) for i, s in enumerate(seqs)]),
                   pool).hidden_states
    return seqs, [model.compute_logits(hidden[i, : len(s)]) for i, s in enumerate(seqs)], pool


def _reference_entries(seqs: list[list[int]], full: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the stored reference keeps of the reference's full logits ``[T_i, V]``."""
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    for i, (s, ref) in enumerate(zip(seqs, full, strict=True)):
        top = ref.topk(TOP_ROWS, dim=-1).indices
        others = torch.randint(0, ref.shape[-1], (ref.shape[0], TOP_ROWS), generator=gen)
        index = torch.cat([top, others], dim=-1)
        out[f"ids_{i}"] = torch.tensor(s, dtype=torch.int64)
        out[f"index_{i}"] = index
        out[f"value_{i}"] = ref.gather(-1, index).contiguous()
        out[f"argmax_{i}"] = ref.argmax(-1)
    return out


def _check_against(seqs: list[list[int]], got: list[torch.Tensor],
                   ref: dict[str, torch.Tensor]) -> float:
    """Our logits against reference entries; returns the largest difference."""
    worst = 0.0
    for i, (s, g) in enumerate(zip(seqs, got, strict=True)):
        assert ref[f"ids_{i}"].tolist() == s, f"prompt {i}: the chat template's ids changed"
        want = ref[f"argmax_{i}"]
        assert g[-1].argmax().item() == want[-1].item()
        agree = (g.argmax(-1) == want).float().mean().item()
        assert agree > 0.95, f"prompt {i}: argmax agrees on only {agree:.0%} of positions"
        worst = max(worst, (g.gather(-1, ref[f"index_{i}"]) - ref[f"value_{i}"]).abs().max()
                    .item())
    return worst


@torch.no_grad()
def test_logits_match_stored_transformers_reference(
    ours: tuple[Any, Any], tok: Tokenizer, fbh: SimpleNamespace
) -> None:
    """Our logits at the stored reference rows (its best 64 and 64 fixed others per position,
    every position of three chat prompts) within ``LOGIT_TOL``, and its argmax; then a greedy
    continuation that answers."""
    from safetensors.torch import load_file

    model, _ = ours
    seqs, got, pool = _our_logits(ours, tok, fbh)
    worst = _check_against(seqs, got, load_file(str(REFERENCE)))
    print(f"SmolLM2 GGUF: max |ours - stored transformers| logit diff = {worst:.3g}")
    assert worst < LOGIT_TOL
    # Greedy continuation is coherent text ending the answer with <|im_end|>.
    seq = list(seqs[0])
    for _ in range(8):
        fb = fbh.make_batch([fbh.extend_row(0, len(seq) - 1, seq[-1:])])
        seq.append(int(model.compute_logits(model(fb, pool).hidden_states[:, -1]).argmax()))
    assert "Paris" in tok.decode(seq[len(seqs[0]) :])


@pytest.mark.slow  # transformers' GGUF reader: ~30 s on 2 cores
@torch.no_grad()
def test_logits_match_transformers_gguf_and_the_stored_reference(
    ours: tuple[Any, Any], hf_reference: HFLlama, tok: Tokenizer, fbh: SimpleNamespace
) -> None:
    """Every logit of ours against transformers' own (full vocabulary); the stored reference
    is what transformers computes here (``STRUCTSPEC_WRITE_HF_REFERENCE=1`` rewrites it)."""
    from safetensors.torch import load_file, save_file

    seqs, got, _ = _our_logits(ours, tok, fbh)
    full = [hf_reference(torch.tensor([s])).logits[0].float() for s in seqs]
    worst = 0.0
    for g, ref in zip(got, full, strict=True):
        assert torch.equal(g[-1].argmax(), ref[-1].argmax())
        worst = max(worst, (g - ref).abs().max().item())
    print(f"SmolLM2 GGUF: max |ours - transformers| logit diff = {worst:.3g}")
    assert worst < LOGIT_TOL
    entries = _reference_entries(seqs, full)
    if os.environ.get("STRUCTSPEC_WRITE_HF_REFERENCE") == "1":
        save_file(entries, str(REFERENCE))
    stored = load_file(str(REFERENCE))
    assert stored.keys() == entries.keys()
    for i, (s, ref) in enumerate(zip(seqs, full, strict=True)):
        assert stored[f"ids_{i}"].tolist() == s
        assert torch.equal(stored[f"argmax_{i}"], ref.argmax(-1))
        # (this machine's fp32 sums may group differently from the one that wrote the file)
        torch.testing.assert_close(stored[f"value_{i}"], ref.gather(-1, stored[f"index_{i}"]),
                                   rtol=0, atol=1e-4)
