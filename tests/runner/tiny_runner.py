"""A float32 two-layer random Llama on the CPU behind a ModelRunner (runner tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from structspec.config import CacheConfig
from structspec.models.loader import load_model
from structspec.runner.model_runner import ModelRunner


def tiny_runner(path: Path, *, max_position_embeddings: int, num_pages: int,
                page_size: int = 4) -> ModelRunner:
    """Save a random tiny Llama (vocabulary 64, hidden 32, GQA 4/2 heads, seed 0) to ``path``
    and load it behind a runner with ``num_pages`` pages of ``page_size`` tokens."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_position_embeddings)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    model, mcfg = load_model(str(path), device=torch.device("cpu"), dtype=torch.float32)
    return ModelRunner(model, mcfg, CacheConfig(page_size=page_size, num_pages=num_pages),
                       device=torch.device("cpu"), dtype=torch.float32)
