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
from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.verify import verify_tree
from structspec.grammar.bitmask import apply_bitmask_, bitmask_width
from structspec.models.llama import LlamaForCausalLM
from structspec.runner.cuda_graph import VerifyGraph, kv_len_buckets, pick_bucket
from structspec.runner.model_runner import ModelRunner, VerifyForwardOutput
from structspec.scheduler.select_verify import select_verify


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
    """Runner over a random-weight model (shared when ``model`` is given); KV pool random;
    the scheduler's select/verify function installed (post graphs)."""
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
    runner.set_select_verify(select_verify, bitmask_width=bitmask_width(cfg.vocab_size))
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    for k, v in zip(runner.kv_pool.k_cache, runner.kv_pool.v_cache, strict=True):
        k.copy_(torch.randn(k.shape, generator=g).to(dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(dtype))
    return runner


class _HostRing:
    """CPU stand-in for :class:`~structspec.staging.PinnedRing` (plain copies)."""

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


def _accepting_tree(runner: ModelRunner, seq_lens: list[int], pages: list[list[int]], n: int,
                    seed: int) -> VerifyTree:
    """A random tree whose nodes (each with probability 0.7) carry their parent's argmax
    token, so verification accepts multi-token paths."""
    tree = random_tree(len(seq_lens), n, seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = tree.draft_tokens.clone()
    for i in range(1, n):
        logits = runner.verify(VerifyTree.from_parents(tokens, tree.parents), seq_lens, pages)
        target = logits.logits.view(len(seq_lens), n, -1).argmax(-1).cpu()
        take = torch.rand(len(seq_lens), generator=gen) < 0.7
        parent_target = target.gather(1, tree.parents[:, i : i + 1].clamp(min=0)).squeeze(1)
        tokens[:, i] = torch.where(take & (tokens[:, i] >= 0), parent_target, tokens[:, i])
    return VerifyTree.from_parents(tokens, tree.parents)


@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize("masked", [False, True])
@torch.inference_mode()
def test_post_forward_matches_eager_cpu(n: int, masked: bool) -> None:
    """The post graph's body (mask, argmax, verify, KV compaction on the bucket's static
    buffers, dummy rows included) equals the scheduler's eager path for the real rows: same
    accepted runs, same real-draft counts, same KV cache outside the sink page."""
    cfg = smol_config(num_layers=2)
    dev = torch.device("cpu")
    runner = build_runner(cfg, dev, torch.float32, num_pages=64, use_cuda_graph=False)
    seq_lens = [37, 5, 60]
    bsz = len(seq_lens)
    pages = batch_pages(seq_lens, n, runner.page_size)
    tree = _accepting_tree(runner, seq_lens, pages, n, seed=n + 7)
    ref = runner.verify(tree, seq_lens, pages)
    need = -(-(max(seq_lens) + n) // runner.page_size)
    g = VerifyGraph(4, n, 16, (), dev)  # bucket B=4: one dummy row
    runner.staging = _HostStaging()  # type: ignore[assignment]
    runner._stage_graph_inputs(g, tree, seq_lens, pages, need)
    logits, _, _ = g.forward(runner.model, runner.kv_pool, runner.page_size)
    logits[: bsz * n] = ref.logits  # the same rows on both sides (argmax ties aside)
    g.logits = logits
    gen = torch.Generator().manual_seed(n)
    width = bitmask_width(cfg.vocab_size)
    g.bitmask = torch.randint(-2**31, 2**31 - 1, (4 * n, width), generator=gen,
                              dtype=torch.int32)
    g.bitmask[::2] = -1  # every other row unconstrained, so drafts still get accepted
    g.cap = torch.tensor([n, 0, 1, n], dtype=torch.int64)
    kv_before = runner.kv_pool.kv_buffer.clone()
    result, num_real = g.post_forward(runner.kv_pool, runner.page_size, masked, select_verify)
    kv_graph = runner.kv_pool.kv_buffer.clone()
    runner.kv_pool.kv_buffer.copy_(kv_before)

    ref_logits = ref.logits.clone()
    cap = None
    if masked:
        apply_bitmask_(ref_logits, g.bitmask[: bsz * n])
        cap = g.cap[:bsz]
    ref_result = verify_tree(tree, ref_logits.argmax(-1).view(bsz, n), cap)
    runner.commit_accepted_kv(ref, ref_result)

    assert torch.equal(result.accept_tokens[:bsz], ref_result.accept_tokens)
    assert torch.equal(result.accept_len[:bsz], ref_result.accept_len)
    assert torch.equal(result.accept_nodes[:bsz], ref_result.accept_nodes)
    assert num_real[:bsz].tolist() == (tree.draft_tokens[:, 1:] >= 0).sum(1).tolist()
    if n > 1 and not masked:
        assert ref_result.accept_len.max() > 1  # the comparison covers real compaction
    sink = runner.page_size  # slots of page 0, where dummy rows may write
    assert torch.equal(kv_graph[:, :, sink:], runner.kv_pool.kv_buffer[:, :, sink:])
    if n > 1:
        assert not torch.equal(kv_graph[:, :, sink:], kv_before[:, :, sink:])


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
        for i, tree in enumerate((host, dev_tree, host, dev_tree, host, dev_tree)):
            out = runner.verify(tree, seq_lens, pages)
            out.logits.argmax(-1)
            # the post graphs were captured by the warm-up: replays only
            runner.greedy_verify(out, masked=i % 2 == 0,
                                 max_accept_cpu=torch.tensor([7, 0, 7]) if i == 2 else None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert len(runner.graphs.graphs) == 1  # type: ignore[union-attr]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("host_tree", [True, False])
@torch.inference_mode()
def test_post_graph_replay_matches_eager_gpu(masked: bool, host_tree: bool) -> None:
    """The post graph's replay equals its eager first run bit for bit (accepted runs and the
    compacted KV), from the same logits and KV state."""
    dev = torch.device("cuda")
    cfg = smol_config(num_layers=4)
    runner = build_runner(cfg, dev, torch.bfloat16, num_pages=512, use_cuda_graph=True)
    seq_lens = [300, 317, 350]
    n = 8
    pages = batch_pages(seq_lens, n, runner.page_size)
    tree = _accepting_tree(runner, seq_lens, pages, n, seed=3)
    if not host_tree:
        tree = tree.to(dev)
    fwd = runner.verify(tree, seq_lens, pages)
    g = fwd.graph
    assert g is not None and g.logits is not None
    if masked:
        bitmask = runner.graph_bitmask(fwd)
        assert bitmask is not None
        gen = torch.Generator(device="cpu").manual_seed(0)
        rand = torch.randint(-2**31, 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int32)
        rand[::2] = -1
        bitmask.copy_(rand.to(dev))
    kv_before = runner.kv_pool.kv_buffer.clone()
    logits_before = g.logits.clone()
    cap = torch.tensor([7, 0, 7])
    first, nr1 = runner.greedy_verify(fwd, masked=masked, max_accept_cpu=cap)  # eager + capture
    first = [t.clone() for t in (first.accept_tokens, first.accept_len, first.accept_nodes)]
    nr1 = nr1.clone()
    kv_first = runner.kv_pool.kv_buffer.clone()
    runner.kv_pool.kv_buffer.copy_(kv_before)
    g.logits.copy_(logits_before)
    again, nr2 = runner.greedy_verify(fwd, masked=masked, max_accept_cpu=cap)  # replay
    torch.cuda.synchronize()
    assert (masked, False) in g.post_graphs
    for a, b in zip(first, (again.accept_tokens, again.accept_len, again.accept_nodes),
                    strict=True):
        assert torch.equal(a, b)
    assert torch.equal(nr1, nr2)
    assert torch.equal(kv_first, runner.kv_pool.kv_buffer)
    if masked:
        assert again.accept_len[1].item() == 1  # capped at 0 drafts
