"""Whole model: the Triton path (``set_kernels("triton")``) vs the torch reference path.

Tiny random Llama / Qwen2 / Qwen3 models: a causal prefill of several requests, then a tree
verify on top, comparing logits, aux hidden states and the K/V written to the pool. On CUDA,
also a SmolLM2-shaped bf16 forward captured in a CUDA graph with no host syncs.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from structspec.config import CacheConfig, ModelConfig  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.kernels.attention import TritonAttentionBackend  # noqa: E402
from structspec.kvcache.pool import KVPool  # noqa: E402
from structspec.layers.attention import TorchAttentionBackend  # noqa: E402
from structspec.layers.forward_batch import ForwardBatch  # noqa: E402
from structspec.models.llama import LlamaForCausalLM  # noqa: E402
from structspec.runner.model_runner import ModelRunner  # noqa: E402
from tests.graph_check import assert_no_sync_and_graph_replay
from tests.kernels.conftest import tol  # noqa: E402
from tests.models.conftest import (  # noqa: E402
    PAGE,
    SLOTS_PER_REQ,
    extend_row,
    make_batch,
    randomize,
    tree_row,
)

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
CONFIGS = {
    "llama": dict(architecture="LlamaForCausalLM"),
    "llama-tied-mha": dict(architecture="LlamaForCausalLM", num_key_value_heads=4,
                           tie_word_embeddings=True),
    "qwen2-bias": dict(architecture="Qwen2ForCausalLM", attention_bias=True),
    "qwen3-qknorm": dict(architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=32),
}


def _models(name: str, dev: torch.device) -> tuple[LlamaForCausalLM, LlamaForCausalLM, ModelConfig]:
    cfg = ModelConfig(**{**BASE, **CONFIGS[name]})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    randomize(ref, seed=1)
    ref = ref.to(dev)
    ref.rotary.reset_inv_freq()
    fused = copy.deepcopy(ref)
    fused.set_kernels("triton")
    assert isinstance(fused.attn_backend, TritonAttentionBackend)
    return ref, fused, cfg


def _pool(cfg: ModelConfig, num_reqs: int, dev: torch.device) -> KVPool:
    return KVPool(num_layers=cfg.num_hidden_layers, num_pages=1 + num_reqs * SLOTS_PER_REQ // PAGE,
                  page_size=PAGE, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                  dtype=torch.float32, device=dev)


def _step(model: LlamaForCausalLM, fb: ForwardBatch, pool: KVPool) -> SimpleNamespace:
    out = model(fb, pool, aux_hidden_layers=(0, 2))
    h = out.hidden_states
    return SimpleNamespace(logits=model.compute_logits(h.reshape(-1, h.shape[-1])),
                           aux=out.aux_hidden_states)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.no_grad()
def test_triton_path_matches_torch_path(dev: torch.device, name: str) -> None:
    ref, fused, cfg = _models(name, dev)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 4, 13)]
    pools = _pool(cfg, 3, dev), _pool(cfg, 3, dev)
    prefill = make_batch([extend_row(i, 0, s) for i, s in enumerate(seqs)], dev)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    tree = [torch.randint(3, VOCAB, (len(parents),), generator=g).tolist() for _ in seqs]
    verify = make_batch([tree_row(i, len(s), t, parents) for i, (s, t) in
                         enumerate(zip(seqs, tree, strict=True))], dev)
    for fb in (prefill, verify):
        a, b = _step(ref, fb, pools[0]), _step(fused, fb, pools[1])
        torch.testing.assert_close(b.logits, a.logits, atol=2e-4, rtol=2e-4)
        for x, y in zip(a.aux, b.aux, strict=True):
            torch.testing.assert_close(y, x, atol=2e-4, rtol=2e-4)
        # Page 0 is the sink: every padding token writes slot 0, in an unspecified order
        # (index_copy_ vs one Triton program per token), so only real pages are compared.
        for layer in range(cfg.num_hidden_layers):
            torch.testing.assert_close(pools[1].k_cache[layer][PAGE:],
                                       pools[0].k_cache[layer][PAGE:], **tol(torch.float32))
            torch.testing.assert_close(pools[1].v_cache[layer][PAGE:],
                                       pools[0].v_cache[layer][PAGE:], **tol(torch.float32))


@torch.no_grad()
def test_model_runner_kernels(dev: torch.device) -> None:
    """``ModelRunner(kernels="triton")`` switches the model; prefill and verify (a CUDA-graph
    replay on CUDA) agree with a torch-kernels runner."""
    ref_model, model, cfg = _models("llama", dev)
    model.set_kernels("torch")
    cache = CacheConfig(page_size=PAGE, num_pages=64)
    runners = [ModelRunner(m, cfg, cache, device=dev, dtype=torch.float32, kernels=k,
                           max_model_len=256)
               for m, k in ((ref_model, "torch"), (model, "triton"))]
    assert model.kernels == runners[1].kernels == "triton" and runners[0].kernels == "torch"
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    pages = [[1, 2, 3], [4, 5, 6]]
    outs = [r.prefill(prompts, pages).logits for r in runners]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    tree = VerifyTree.from_parents(torch.tensor([[9, 3, 4, 5], [12, 6, 7, 8]]), parents)
    outs = [r.verify(tree, [5, 3], pages).logits for r in runners]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)


def test_set_kernels_round_trip() -> None:
    cfg = ModelConfig(**{**BASE, **CONFIGS["llama"]})
    model = LlamaForCausalLM(cfg)
    model.set_kernels("triton")
    assert model.kernels == "triton"
    model.set_kernels("torch")
    assert model.kernels == "torch" and isinstance(model.attn_backend, TorchAttentionBackend)
    with pytest.raises(ValueError, match="kernels"):
        model.set_kernels("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,q", [(1, 1), (1, 8), (8, 8)])
@torch.no_grad()
def test_smollm2_shape_graph_no_sync_bf16(b: int, q: int) -> None:
    """SmolLM2 shape in bf16: Triton path agrees with the torch path, has no host syncs,
    and a CUDA-graph replay reproduces the eager result bit for bit."""
    from benchmarks.gpu_decode import smol_model  # the benchmark's random SmolLM2 shape

    dev = torch.device("cuda")
    model, cfg = smol_model(dev, torch.bfloat16)
    n = 520
    pool = KVPool(num_layers=30, num_pages=2 + b * n // 16, page_size=16, num_kv_heads=3,
                  head_dim=64, dtype=torch.bfloat16, device=dev)
    for c in pool.k_cache + pool.v_cache:
        c.normal_()
    g = torch.Generator().manual_seed(b * 100 + q)
    out = (16 + torch.arange(b * q)).view(b, q)
    kv = 16 + torch.randperm(b * n, generator=g).view(b, n)
    kv[:, -q:] = out
    mask = torch.ones(b, q, n, dtype=torch.bool)
    mask[:, :, -q:] = torch.ones(q, q, dtype=torch.bool).tril()
    pos = torch.arange(n - q, n).expand(b, q).contiguous()
    ids = torch.randint(0, 49152, (b, q), generator=g)
    fb = ForwardBatch(*(t.to(dev) for t in (ids, pos, out, kv, mask)))

    def step() -> torch.Tensor:
        o = model(fb, pool, aux_hidden_layers=(2, 15))
        return model.compute_logits(o.hidden_states.view(-1, cfg.hidden_size))

    ref = step()  # torch path
    model.set_kernels("triton")
    eager = step()
    rel = ((eager - ref).norm() / ref.norm()).item()  # bf16 roundings differ; stay close
    assert rel < 0.05, rel
    assert_no_sync_and_graph_replay(step, eager)
