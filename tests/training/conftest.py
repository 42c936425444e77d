"""Fixtures of the train-eagle tests: tiny random targets and a sequence file over one."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from structspec.training.sequences import TrainSequence, save_sequences

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 8-layer, hidden-32 Llama with SmolLM2's tokenizer (vocab 49152, tied)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from structspec.models.default_model import resolve_model_path

    try:
        smol = Path(resolve_model_path(None))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("tiny_target")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      initializer_range=0.3, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smol / name).is_file():
            shutil.copy(smol / name, out / name)
    return out


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 8-layer, hidden-32, vocab-96 Llama with peaked logits (no tokenizer: the
    training stage needs none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("small_target")
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=1.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def small_seqs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sequences over the small vocabulary: a prompt, then a noisy repeating pattern."""
    rng = random.Random(0)
    seqs = []
    for i in range(32):
        prompt = [rng.randrange(96) for _ in range(rng.randint(3, 10))]
        period = [rng.randrange(96) for _ in range(rng.randint(2, 5))]
        resp = [period[j % len(period)] if rng.random() < 0.8 else rng.randrange(96)
                for j in range(rng.randint(10, 40))]
        seqs.append(TrainSequence(tuple(prompt + resp), len(prompt), f"s{i % 3}"))
    path = tmp_path_factory.mktemp("small_seqs") / "sequences.npz"
    save_sequences(path, seqs)
    return path


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir: Path) -> Any:
    """The tiny target's engine on the CPU (float32), shared by the session."""
    from structspec import LLM

    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_capacity_tokens=4096,
              max_batch_size=16)
    yield llm
    llm.close()
