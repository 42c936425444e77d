"""``ModelRunner(kernels="triton", batch_invariant=True)``: the logits of a verify tree's
first-chain nodes equal, bit for bit, the logits of decoding the same tokens one at a time
(speculation off) in a different batch."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from structspec.config import CacheConfig, ModelConfig  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.kernels.attention import TritonAttentionBackend  # noqa: E402
from structspec.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP  # noqa: E402
from structspec.runner.model_runner import ModelRunner  # noqa: E402
from tests.models.conftest import PAGE, randomize  # noqa: E402

CFG = ModelConfig(architecture="Qwen2ForCausalLM", attention_bias=True, vocab_size=128,
                  hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)


def _model(dev: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    randomize(model, seed=1)
    model = model.to(dev)
    model.rotary.reset_inv_freq()
    return model


def test_set_kernels_batch_invariant() -> None:
    model = LlamaForCausalLM(CFG)
    model.set_kernels("triton", batch_invariant=True)
    assert model.batch_invariant and model.attn_backend.batch_invariant
    flags = [m.batch_invariant for m in model.modules() if isinstance(m, LlamaAttention | LlamaMLP)]
    assert len(flags) == 4 and all(flags)
    model.set_kernels("triton")
    assert not model.batch_invariant and not model.attn_backend.batch_invariant
    assert isinstance(model.attn_backend, TritonAttentionBackend)
    assert not any(m.batch_invariant for m in model.modules()
                   if isinstance(m, LlamaAttention | LlamaMLP))
    with pytest.raises(ValueError, match="batch_invariant"):
        model.set_kernels("torch", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant"):
        ModelRunner(model, CFG, CacheConfig(page_size=PAGE, num_pages=8),
                    device=torch.device("cpu"), dtype=torch.float32, kernels="torch",
                    batch_invariant=True)


@torch.no_grad()
def test_verify_chain_equals_decode_bitwise(dev: torch.device) -> None:
    model = _model(dev)
    cache = CacheConfig(page_size=PAGE, num_pages=16)
    spec_on = ModelRunner(model, CFG, cache, device=dev, dtype=torch.float32,
                          kernels="triton", batch_invariant=True, max_model_len=128)
    spec_off = ModelRunner(copy.deepcopy(model), CFG, cache, device=dev, dtype=torch.float32,
                           kernels="triton", batch_invariant=True, max_model_len=128)
    prompt, other = [5, 6, 7, 8, 9, 10, 11], [20, 21, 22]
    # Spec on: both requests prefilled together, then one verify of both trees; request 0's
    # tree is the chain 40-41-42-43 (nodes 0..3) plus a branch (node 4 under node 1).
    pre_on = spec_on.prefill([prompt, other], [[1, 2], [3, 4]]).logits
    tree = VerifyTree.from_parents(torch.tensor([[40, 41, 42, 43, 50], [60, 61, 62, 63, 64]]),
                                   torch.tensor([[-1, 0, 1, 2, 1], [-1, 0, 0, 1, 2]]))
    ver = spec_on.verify(tree, [len(prompt), len(other)], [[1, 2], [3, 4]]).logits
    assert ver.shape == (2 * 5, CFG.vocab_size)  # row b * N + i = node i of request b
    # Spec off: request 0 alone, prefilled then decoded one token per forward.
    pre_off = spec_off.prefill([prompt], [[5, 6]]).logits
    assert torch.equal(pre_off[0], pre_on[0])
    for depth, token in enumerate([40, 41, 42, 43]):
        step = VerifyTree.from_parents(torch.tensor([[token]]), torch.tensor([[-1]]))
        dec = spec_off.verify(step, [len(prompt) + depth], [[5, 6]]).logits
        assert dec.shape == (1, CFG.vocab_size)
        assert torch.equal(dec[0], ver[depth]), f"depth {depth}"
