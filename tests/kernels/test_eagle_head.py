"""The EAGLE-3 head's fused Triton layer (``EagleHead.set_kernels("triton")``) vs its torch
reference: a causal catch-up of several requests, then a draft-tree frontier forward over it,
comparing the head outputs (the fed-back features), the final norm and the K/V written to the
head's pool. The input features are not modified (the fused layer's residual is a copy)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from structspec.config import ModelConfig  # noqa: E402
from structspec.kernels.attention import TritonAttentionBackend  # noqa: E402
from structspec.kvcache.pool import KVPool  # noqa: E402
from structspec.layers.attention import TorchAttentionBackend  # noqa: E402
from structspec.models.eagle_head import build_random_eagle_head, load_eagle_head  # noqa: E402
from tests.kernels.conftest import tol  # noqa: E402
from tests.models.conftest import PAGE, SLOTS_PER_REQ, extend_row, make_batch, tree_row  # noqa: E402

TARGET = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64,
                     intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=512, tie_word_embeddings=False)


def _pool(num_reqs: int, dev: torch.device) -> KVPool:
    return KVPool(num_layers=1, num_pages=1 + num_reqs * SLOTS_PER_REQ // PAGE, page_size=PAGE,
                  num_kv_heads=TARGET.num_key_value_heads, head_dim=TARGET.head_dim,
                  dtype=torch.float32, device=dev)


@torch.no_grad()
def test_fused_eagle3_layer_matches_torch(dev: torch.device, tmp_path) -> None:
    path = build_random_eagle_head(TARGET, tmp_path / "head", seed=3, version=3,
                                   aux_hidden_layers=(0, 1, 2))
    ref = load_eagle_head(path, TARGET, device=dev, dtype=torch.float32)
    fused = copy.deepcopy(ref)
    fused.set_kernels("triton")
    assert fused.kernels == "triton" and isinstance(fused.backend, TritonAttentionBackend)
    g = torch.Generator().manual_seed(4)
    hidden = TARGET.hidden_size
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 4, 13)]
    parents = [-1, 0, 0, 1, 1, 2, 3]
    trees = [torch.randint(3, 128, (len(parents),), generator=g).tolist() for _ in seqs]
    batches = [make_batch([extend_row(i, 0, s) for i, s in enumerate(seqs)], dev),
               make_batch([tree_row(i, len(s), t, parents)
                           for i, (s, t) in enumerate(zip(seqs, trees, strict=True))], dev)]
    pools = _pool(3, dev), _pool(3, dev)
    pos = torch.tensor([[0, 5, 511], [700, 3, 2000]], device=dev)  # 2000: past the table
    want_cs = ref.rotary(pos.clamp(max=fused._rotary_table.shape[0] - 1), torch.float32)
    for got_t, want_t in zip(fused.rotary_cos_sin(pos, torch.float32), want_cs, strict=True):
        torch.testing.assert_close(got_t, want_t, atol=1e-6, rtol=1e-6)
    for fb in batches:
        shape = (*fb.input_ids.shape, hidden)
        embeds = torch.randn(shape, generator=g).to(dev)
        feats = torch.randn(shape, generator=g).to(dev)
        kept = feats.clone()
        want = ref(fb, pools[0], embeds, feats)
        got = fused(fb, pools[1], embeds, feats)
        assert torch.equal(feats, kept)  # the fused residual is a copy
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(fused.final_norm(got), ref.final_norm(want),
                                   atol=2e-4, rtol=2e-4)
        # page 0 is the sink that padding rows write in any order: real pages only
        torch.testing.assert_close(pools[1].k_cache[0][PAGE:], pools[0].k_cache[0][PAGE:],
                                   **tol(torch.float32))
        torch.testing.assert_close(pools[1].v_cache[0][PAGE:], pools[0].v_cache[0][PAGE:],
                                   **tol(torch.float32))


def test_head_set_kernels_round_trip(tmp_path) -> None:
    path = build_random_eagle_head(TARGET, tmp_path / "head", seed=0, version=3,
                                   aux_hidden_layers=(0, 1, 2))
    head = load_eagle_head(path, TARGET, device=torch.device("cpu"), dtype=torch.float32)
    assert head.kernels == "torch"
    head.set_kernels("triton")
    head.set_kernels("torch")
    assert head.kernels == "torch" and isinstance(head.backend, TorchAttentionBackend)
    with pytest.raises(ValueError, match="kernels='cuda'"):
        head.set_kernels("cuda")
