"""Verify-forward CUDA graphs: bucket logic and padding on CPU; capture/replay on GPU.

CPU tests check that a padded bucket (dummy rows, wider page table) gives the real rows the
same logits as the eager verify. GPU tests (marker ``gpu``) check graph replay against eager
(bit for bit on the same static inputs; close against the unpadded eager forward) and that a
replayed verify makes no host sync (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import pytest
import torch

from structspec.config import CacheConfig, ModelConfig
from structspec.engine.cuda_graph import VerifyGraph, kv_len_buckets, pick_bucket
from structspec.engine.model_runner import ModelRunner, VerifyForwardOutput
from structspec.models.llama import LlamaForCausalLM
from structspec.spec.tree import VerifyTree


def smol_config(num_layers: int = 30) -> ModelConfig:
    """SmolLM2-135M's shape (random weights are built by the caller)."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=num_layers, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )


def random_tree(bsz: int, n: int, seed: int) -> VerifyTree:
    """``[bsz, n]`` host tree: random parents (< own index), some padding nodes."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (bsz, n), generator=g)
    parents = torch.zeros((bsz, n), dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bsz,), generator=g)
    if n > 2:
        tokens[0, -1] = -1  # a padding node
    return VerifyTree.from_parents(tokens, parents)


def batch_pages(seq_lens: list[int], n: int, page_size: int, start: int = 1) -> list[list[int]]:
    """Disjoint page lists covering ``seq_len + n`` (+1 spare page each, as the scheduler may)."""
    out, nxt = [], start
    for s in seq_lens:
        k = -(-(s + n) // page_size) + 1
        out.append(list(range(nxt, nxt + k)))
        nxt += k
    return out


def build_runner(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, *,
                 num_pages: int, use_cuda_graph: bool, seed: int = 0,
                 model: LlamaForCausalLM | None = None) -> ModelRunner:
    """Runner over a random-weight model (shared when ``model`` is given); KV pool random."""
    if model is None:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.ones_(p)
        model = model.to(device, dtype)
        model.rotary.reset_inv_freq()
    runner = ModelRunner(model, cfg, CacheConfig(page_size=16, num_pages=num_pages),
                         device=device, dtype=dtype, use_cuda_graph=use_cuda_graph)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    for k, v in zip(runner.kv_pool.k_cache, runner.kv_pool.v_cache, strict=True):
        k.copy_(torch.randn(k.shape, generator=g).to(dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(dtype))
    return runner


class _HostRing:
    """CPU stand-in for :class:`~structspec.engine.staging.PinnedRing` (plain copies)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def acquire(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype)

    def copy_to(self, host: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(host.view(dst.shape))


class _HostStaging:
    def ring(self, dtype: torch.dtype) -> _HostRing:
        return _HostRing(dtype)


def test_buckets() -> None:
    assert kv_len_buckets(2048) == (256, 512, 1024, 2048)
    assert kv_len_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert kv_len_buckets(100) == (100,)
    assert pick_bucket(3, (1, 2, 4, 8)) == 4
    assert pick_bucket(8, (1, 2, 4, 8)) == 8
    assert pick_bucket(9, (1, 2, 4, 8)) is None


@pytest.mark.parametrize("n", [1, 4])
@torch.inference_mode()
def test_padded_bucket_matches_eager_cpu(n: int) -> None:
    """Dummy rows and a wider page table leave the real rows' logits unchanged (CPU, fp32)."""
    cfg = smol_config(num_layers=2)
    dev = torch.device("cpu")
    runner = build_runner(cfg, dev, torch.float32, num_pages=64, use_cuda_graph=False)
    seq_lens = [37, 5, 60]
    pages = batch_pages(seq_lens, n, runner.page_size)
    tree = random_tree(len(seq_lens), n, seed=n)
    ref = runner.verify(tree, seq_lens, pages)
    need = -(-(max(seq_lens) + n) // runner.page_size)
    g = VerifyGraph(4, n, 16, (), dev)  # bucket B=4, kv_len 256
    runner.staging = _HostStaging()  # type: ignore[assignment]
    runner._stage_graph_inputs(g, tree, seq_lens, pages, need)
    logits, hidden, _ = g.forward(runner.model, runner.kv_pool, runner.page_size)
    rows = len(seq_lens) * n
    torch.testing.assert_close(logits[:rows], ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden[: len(seq_lens)], ref.hidden_states, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logits).all()  # dummy rows too


def _compare(runner: ModelRunner, eager: ModelRunner, bsz: int, n: int, seed: int,
             host_tree: bool) -> tuple[VerifyForwardOutput, torch.Tensor, float]:
    """Graph verify vs the bucket's static forward run eagerly (returned) and the eager runner:
    returns the largest ref-logit gap between the eager argmax and the graph's argmax."""
    seq_lens = [300 + 17 * i for i in range(bsz)]
    pages = batch_pages(seq_lens, n, runner.page_size)
    tree = random_tree(bsz, n, seed)
    if not host_tree:
        tree = tree.to(runner.device)
    out = runner.verify(tree, seq_lens, pages)
    logits = out.logits.clone()
    need = -(-(max(seq_lens) + n) // runner.page_size)
    assert runner.graphs is not None
    g = runner.graphs.lookup(bsz, n, need, runner.aux_hidden_layers)
    assert g is not None and g.captured
    static_eager, _, _ = g.forward(runner.model, runner.kv_pool, runner.page_size)
    ref = eager.verify(tree, seq_lens, pages).logits
    picked = ref.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    gap = (ref.max(-1).values - picked).max().item()
    return out, static_eager[: bsz * n], gap


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bsz", "n"), [(1, 1), (3, 8), (8, 1), (8, 8)])
@pytest.mark.parametrize("host_tree", [True, False])
@torch.inference_mode()
def test_graph_matches_eager_gpu(dtype: torch.dtype, bsz: int, n: int, host_tree: bool) -> None:
    dev = torch.device("cuda")
    cfg = smol_config(num_layers=4)
    runner = build_runner(cfg, dev, dtype, num_pages=512, use_cuda_graph=True)
    eager = build_runner(cfg, dev, dtype, num_pages=512, use_cuda_graph=False,
                         model=runner.model)  # same weights, same random KV (same seed)
    out, static_eager, gap = _compare(runner, eager, bsz, n, seed=bsz * 10 + n,
                                      host_tree=host_tree)
    # Same kernels on the same static inputs: bit for bit.
    assert torch.equal(out.logits, static_eager)
    # Against the unpadded eager forward: argmax may only flip near-ties.
    assert gap <= (1e-3 if dtype == torch.float32 else 0.1), gap
    assert out.logits.shape == (bsz * n, cfg.vocab_size)
    assert out.hidden_states.shape == (bsz, n, cfg.hidden_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_replay_has_no_host_sync() -> None:
    """After capture, a verify (host tree or device tree) + greedy argmax never syncs."""
    dev = torch.device("cuda")
    cfg = smol_config(num_layers=4)
    runner = build_runner(cfg, dev, torch.bfloat16, num_pages=512, use_cuda_graph=True)
    assert runner.warmup_cuda_graphs(8, batch_sizes=[4], kv_lens=[512]) == 1
    seq_lens = [400, 401, 402]
    pages = batch_pages(seq_lens, 8, runner.page_size)
    host = random_tree(3, 8, seed=1)
    dev_tree = host.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for tree in (host, dev_tree, host, dev_tree, host, dev_tree):
            out = runner.verify(tree, seq_lens, pages)
            out.logits.argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert len(runner.graphs.graphs) == 1  # type: ignore[union-attr]
