"""Our Llama/Qwen2/Qwen3 forward vs transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from structspec.models.loader import load_model

TOL = 1e-4
VOCAB = 512
SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
CASES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama-tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama-untied-llama3": (LlamaConfig, LlamaForCausalLM, dict(
        tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
    )),
    "llama-yarn": (LlamaConfig, LlamaForCausalLM, dict(
        tie_word_embeddings=True,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    )),
    "llama-linear": (LlamaConfig, LlamaForCausalLM, dict(
        rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama-dynamic": (LlamaConfig, LlamaForCausalLM, dict(
        rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "qwen2-bias-tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3-qknorm-headdim": (Qwen3Config, Qwen3ForCausalLM, dict(
        tie_word_embeddings=False, head_dim=32)),
}


def _build(case: str, tmp: Path, fbh: SimpleNamespace) -> tuple[PreTrainedModel, Path]:
    cfg_cls, model_cls, extra = CASES[case]
    cfg = cfg_cls(**SHAPE, **extra)
    torch.manual_seed(0)
    hf = model_cls(cfg).eval()
    fbh.randomize(hf, seed=1)
    hf.save_pretrained(tmp, safe_serialization=True)
    return hf, tmp


@torch.no_grad()
def _hf_logits(hf: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path: Path, fbh: SimpleNamespace) -> tuple[Any, Any, Any]:
    hf, path = _build(request.param, tmp_path, fbh)
    ours, cfg = load_model(str(path), device=torch.device("cpu"), dtype=torch.float32)
    return hf, ours, cfg


@torch.no_grad()
def test_prefill_then_decode_matches_hf(pair: tuple[Any, Any, Any], fbh: SimpleNamespace) -> None:
    hf, ours, cfg = pair
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 5)]
    pool = fbh.make_pool(cfg, len(seqs))
    fb = fbh.make_batch([fbh.extend_row(i, 0, s) for i, s in enumerate(seqs)])
    hidden = ours(fb, pool).hidden_states
    worst = 0.0
    for i, s in enumerate(seqs):
        got = ours.compute_logits(hidden[i, : len(s)])
        ref = _hf_logits(hf, s)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        worst = max(worst, (got - ref).abs().max().item())
    last = [int(ours.compute_logits(hidden[i, len(s) - 1 : len(s)]).argmax()) for i, s in enumerate(seqs)]
    for _ in range(3):
        rows = [fbh.extend_row(i, len(s), [t]) for i, (s, t) in enumerate(zip(seqs, last, strict=True))]
        for s, t in zip(seqs, last, strict=True):
            s.append(t)
        hidden = ours(fbh.make_batch(rows), pool).hidden_states
        logits = ours.compute_logits(hidden[:, 0])
        for i, s in enumerate(seqs):
            ref = _hf_logits(hf, s)[-1]
            assert int(logits[i].argmax()) == int(ref.argmax())
            worst = max(worst, (logits[i] - ref).abs().max().item())
        last = logits.argmax(-1).tolist()
    assert ref.abs().max() > 1.0, "logits too small for the tolerance to mean anything"
    assert worst < TOL, f"max |ours - hf| = {worst:.3g}"


@torch.no_grad()
def test_tree_mask_matches_sequential_paths(pair: tuple[Any, Any, Any], fbh: SimpleNamespace) -> None:
    hf, ours, cfg = pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 4)]
    trees = [[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 0]]
    tokens = [torch.randint(3, VOCAB, (len(p),), generator=g).tolist() for p in trees]
    pool = fbh.make_pool(cfg, len(prompts))
    ours(fbh.make_batch([fbh.extend_row(i, 0, p) for i, p in enumerate(prompts)]), pool)
    rows = [fbh.tree_row(i, len(p), tokens[i], trees[i]) for i, p in enumerate(prompts)]
    hidden = ours(fbh.make_batch(rows), pool).hidden_states
    worst = 0.0
    for i, prompt in enumerate(prompts):
        logits = ours.compute_logits(hidden[i, : len(trees[i])])
        for node in range(len(trees[i])):
            path = [tokens[i][j] for j in fbh.tree_path(trees[i], node)]
            ref = _hf_logits(hf, prompt + path)[-1]
            assert int(logits[node].argmax()) == int(ref.argmax())
            worst = max(worst, (logits[node] - ref).abs().max().item())
    assert worst < TOL, f"max |tree - sequential| = {worst:.3g}"


@torch.no_grad()
def test_aux_hidden_states_are_layer_outputs(pair: tuple[Any, Any, Any], fbh: SimpleNamespace) -> None:
    hf, ours, cfg = pair
    seq = list(range(5, 12))
    pool = fbh.make_pool(cfg, 1)
    out = ours(fbh.make_batch([fbh.extend_row(0, 0, seq)]), pool, aux_hidden_layers=(1, 0))
    ref = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    # HF hidden_states[i + 1] is layer i's output, except the last which is after the final norm.
    assert torch.allclose(out.aux_hidden_states[1][0], ref[1][0], atol=TOL)
    assert out.aux_hidden_states[0].shape == (1, len(seq), cfg.hidden_size)
    assert torch.allclose(out.hidden_states[0], ref[-1][0], atol=TOL)
    with pytest.raises(ValueError, match="out of range"):
        ours(fbh.make_batch([fbh.extend_row(0, 0, seq)]), pool, aux_hidden_layers=(2,))
