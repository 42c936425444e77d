"""The TTT attention's ``split`` form (causal SDPA + diagonal keys through a sink key) equals
the ``dense`` reference: outputs and gradients, alone and inside the whole TTT forward (padded
rows, K = 1); ``auto`` resolves to ``split`` and falls back to ``dense`` when its self-check
fails; the option's config / CLI plumbing."""

from __future__ import annotations

import argparse

import pytest
import torch

from structspec.config import ModelConfig
from structspec.models.eagle_head import EagleHead
from structspec.training import ttt as ttt_module
from structspec.training.cli_train import add_train_eagle_parser, config_from_args
from structspec.training.export import eagle3_head_config
from structspec.training.train_config import TrainEagleConfig
from structspec.training.ttt import TTTForward, soft_targets
from structspec.training.ttt_attention import (
    dense_ttt_attention,
    split_ttt_attention,
    ttt_mask,
)

HIDDEN, VOCAB = 32, 64


@pytest.mark.parametrize(("width", "steps", "heads", "kv_heads", "head_dim"), [
    (1, 1, 2, 2, 8), (7, 1, 4, 2, 8), (16, 3, 4, 2, 8), (33, 4, 4, 1, 16), (20, 7, 3, 3, 8),
])
def test_split_equals_dense(width: int, steps: int, heads: int, kv_heads: int,
                            head_dim: int) -> None:
    """Every step k of a K-step unroll: same output and same gradients of q, keys, values."""
    g = torch.Generator().manual_seed(width * 100 + steps)
    batch, scale = 2, 3.0 * head_dim**-0.5  # a large scale: peaked softmaxes

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(True)

    mask = ttt_mask(width, steps, torch.device("cpu"))
    keys = [rand(batch, width, kv_heads, head_dim) for _ in range(steps)]
    values = [rand(batch, width, kv_heads, head_dim) for _ in range(steps)]
    for k in range(steps):
        q = rand(batch, width, heads, head_dim)
        dense = dense_ttt_attention(q, keys[:k + 1], values[:k + 1], mask, scale)
        split = split_ttt_attention(q, keys[:k + 1], values[:k + 1], scale)
        torch.testing.assert_close(split, dense, atol=1e-5, rtol=1e-5)
        probe = torch.randn(dense.shape, generator=g)
        inputs = [q, *keys[:k + 1], *values[:k + 1]]
        grads_dense = torch.autograd.grad((dense * probe).sum(), inputs)
        grads_split = torch.autograd.grad((split * probe).sum(), inputs)
        for a, b in zip(grads_split, grads_dense, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _head(seed: int = 0) -> EagleHead:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                      intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(seed)
    head = EagleHead(eagle3_head_config(cfg, (1, 3, 4), 0))
    head.rotary.reset_inv_freq()
    return head.train()


def _batch(width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three rows; the last two shorter than ``width`` (padding rows at the end)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([width, max(3, width - 5), 3])
    return {"input_ids": torch.randint(0, VOCAB, (3, width), generator=g),
            "aux_hidden": torch.randn(3, width, 3 * HIDDEN, generator=g),
            "lengths": lengths, "num_prompt": torch.tensor([2, 1, 1]),
            "logits": 3.0 * torch.randn(3, width, VOCAB, generator=g)}


@pytest.mark.parametrize(("width", "steps"), [(9, 1), (20, 3), (24, 7)])
def test_ttt_forward_split_equals_dense(width: int, steps: int) -> None:
    """The whole TTT forward: per-step losses, agreement counts and the head's gradients."""
    head = _head()
    embed = torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
    lm_w = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(5))
    b = _batch(width)
    targets = soft_targets(b["logits"], None)
    results = {}
    for form in ("dense", "split"):
        ttt = TTTForward(head, embed, lm_w, steps, form)
        head.zero_grad(set_to_none=True)
        stats = ttt(b["input_ids"], b["aux_hidden"], b["lengths"], b["num_prompt"], targets)
        sum(s.loss for s in stats).backward()
        assert ttt.attention_used == form
        results[form] = (stats, {n: p.grad.clone() for n, p in head.named_parameters()
                                 if p.grad is not None})
    (dense, grads_dense), (split, grads_split) = results["dense"], results["split"]
    assert len(split) == steps and any(s.count for s in split)
    for s, d in zip(split, dense, strict=True):
        assert s.count == d.count and int(s.correct) == int(d.correct)
        torch.testing.assert_close(s.loss.detach(), d.loss.detach(), atol=1e-5, rtol=1e-5)
    assert grads_split.keys() == grads_dense.keys() and grads_dense
    for name, g in grads_dense.items():
        torch.testing.assert_close(grads_split[name], g, atol=1e-5, rtol=1e-5, msg=name)


def test_auto_self_check_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` is ``split`` (the check passes in float32 and under bf16 autocast); a split
    form that is wrong or raises makes it ``dense`` with a warning naming the problem."""
    head = _head(1)
    embed = torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
    ttt = TTTForward(head, embed, torch.randn(VOCAB, HIDDEN), 3)
    b = _batch(16, seed=2)
    ids, aux = b["input_ids"], b["aux_hidden"]
    assert ttt.attention == "auto" and ttt.attention_used is None
    assert ttt.resolve_attention(ids, aux, check=False) == "split"
    assert ttt.check_split(ids, aux) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ttt.check_split(ids, aux) is None
    assert ttt.resolve_attention(ids, aux, check=True) == "split"
    assert all(p.grad is None for p in head.parameters())  # the check leaves no .grad

    def causal_only(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    scale: float) -> torch.Tensor:
        return split_ttt_attention(q, keys[:1], values[:1], scale)

    monkeypatch.setattr(ttt_module, "split_ttt_attention", causal_only)
    with pytest.warns(RuntimeWarning, match="outputs: relative difference"):
        assert ttt.resolve_attention(ids, aux, check=True) == "dense"

    def raising(*args: object) -> torch.Tensor:
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(ttt_module, "split_ttt_attention", raising)
    with pytest.warns(RuntimeWarning, match="RuntimeError: no kernel for this GPU"):
        assert ttt.resolve_attention(ids, aux, check=True) == "dense"
    for form in ("dense", "split"):  # an explicit form is never checked
        assert TTTForward(head, embed, torch.randn(1), 3, form).resolve_attention(
            ids, aux, check=True) == form


def test_option_plumbing() -> None:
    assert TrainEagleConfig(out="x").ttt_attention == "auto"
    with pytest.raises(ValueError, match="ttt_attention='flash': expected one of auto, dense"):
        TrainEagleConfig(out="x", ttt_attention="flash").validate()
    with pytest.raises(ValueError, match="ttt_attention='x'"):
        TTTForward(_head(), torch.nn.Embedding(VOCAB, HIDDEN), torch.randn(1), 2, "x")
    p = argparse.ArgumentParser()
    add_train_eagle_parser(p.add_subparsers(dest="cmd"), argparse.HelpFormatter)
    args = p.parse_args(["train-eagle", "--out", "o", "--ttt-attention", "dense"])
    assert config_from_args(args).ttt_attention == "dense"
    assert config_from_args(p.parse_args(["train-eagle", "--out", "o"])).ttt_attention == "auto"
