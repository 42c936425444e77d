"""Draft-model drafter: EAGLE-2 expansion properties, draft KV catch-up, target-as-draft."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from structspec.config import CacheConfig, SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.verify import verify_tree
from structspec.kvcache.pool import KVPool
from structspec.models.loader import load_model
from structspec.runner.batch_builder import build_prefill_batch
from structspec.runner.model_runner import ModelRunner
from structspec.speculative.base import DraftRequest
from structspec.speculative.draft_model import DraftModelDrafter
from structspec.speculative.expansion import SMALL_TOP_K, expand_tree, top_k

CPU = torch.device("cpu")
VOCAB = 96
PAGE = 4


def tiny_llama(path: Path, seed: int, layers: int = 2) -> Path:
    """A tiny random Llama checkpoint (fp32 safetensors) with peaked next-token distributions."""
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.02)
        hf.lm_head.weight.mul_(4.0)
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_model")
    return {"target": tiny_llama(root / "target", 0), "draft": tiny_llama(root / "draft", 1, 1)}


def make_runner(path: Path, num_pages: int = 96) -> ModelRunner:
    model, cfg = load_model(str(path), device=CPU, dtype=torch.float32)
    return ModelRunner(model, cfg, CacheConfig(page_size=PAGE, num_pages=num_pages), device=CPU,
                       dtype=torch.float32)


def make_drafter(runner: ModelRunner, draft: Path | str, **spec_kw: Any) -> DraftModelDrafter:
    spec = SpecConfig(algorithm="draft_model", draft_model=str(draft), **spec_kw)
    return DraftModelDrafter(spec, target=runner, device=CPU, dtype=torch.float32, num_pages=96)


@torch.inference_mode()
def fresh_logp(model: torch.nn.Module, cfg: Any, tokens: list[int]) -> torch.Tensor:
    """``[V]`` log-probs after ``tokens`` from a full prefill in a fresh pool."""
    pool = KVPool(num_layers=cfg.num_hidden_layers, num_pages=1 + -(-len(tokens) // PAGE),
                  page_size=PAGE, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                  dtype=torch.float32, device=CPU)
    pages = list(range(1, pool.num_pages))
    fb = build_prefill_batch([tokens], [pages], page_size=PAGE, device=CPU)
    h = model(fb, pool).hidden_states.reshape(-1, cfg.hidden_size)
    return torch.log_softmax(model.compute_logits(h[fb.logits_indices]), -1)[0]


def greedy(model: torch.nn.Module, cfg: Any, tokens: list[int], steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        out.append(int(fresh_logp(model, cfg, tokens + out).argmax()))
    return out


# ----------------------------------------------------------------------------- expansion


def _fake_expand(
    bsz: int, vocab: int, topk: int, depth: int, n: int, *, uniform: bool = False, seed: int = 0
) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def logp(shape: tuple[int, ...]) -> torch.Tensor:
        x = torch.zeros(shape) if uniform else 3 * torch.randn(shape, generator=g)
        return torch.log_softmax(x, -1)

    def step_fn(step: int, tokens: torch.Tensor, parent: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        k = tokens.shape[1]
        assert mask.shape == (bsz, k, (depth - 1) * k)
        # each frontier node sees exactly its `step` path nodes, its own column included
        assert (mask.sum(-1) == step).all()
        own = (step - 1) * k + torch.arange(k)
        assert mask[:, torch.arange(k), own].all()
        calls.append((tokens, parent))
        return logp((bsz, k, vocab))

    tree = expand_tree(logp((bsz, vocab)), step_fn, topk=topk, depth=depth, num_nodes=n)
    return tree, calls


@pytest.mark.parametrize(
    ("topk", "depth", "n", "uniform"),
    [(3, 4, 12, False), (2, 5, 64, False), (1, 4, 6, False), (4, 3, 10, True), (2, 1, 5, False)],
)
def test_expansion_properties(topk: int, depth: int, n: int, uniform: bool) -> None:
    bsz = 3
    tree, calls = _fake_expand(bsz, 50, topk, depth, n, uniform=uniform)
    assert len(calls) == depth - 1
    assert tree.tokens.shape == tree.parents.shape == (bsz, n)
    num_cand = topk + (depth - 1) * topk * topk
    real = tree.tokens >= 0
    real[:, 0] = True
    assert (real.sum(1) == min(n, 1 + num_cand)).all()
    for b in range(bsz):
        par, sc = tree.parents[b].tolist(), tree.scores[b].tolist()
        for i in range(1, n):
            if not real[b, i]:
                assert par[i] == 0 and sc[i] == float("-inf")
                continue
            assert 0 <= par[i] < i and bool(real[b, par[i]])  # ancestor-closed, topological
            assert sc[i] <= sc[par[i]]  # cumulative scores never grow down a path
    vt = VerifyTree.from_parents(tree.tokens.clone(), tree.parents)
    assert int(vt.depth.max()) <= depth
    # deterministic (ties included)
    again, _ = _fake_expand(bsz, 50, topk, depth, n, uniform=uniform)
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)


def test_expansion_keeps_best_scores() -> None:
    """Selected nodes are the N-1 best of all candidates (brute force over the candidates)."""
    torch.manual_seed(3)
    topk, depth, n, vocab = 2, 4, 7, 20
    cands: list[float] = []
    root = torch.log_softmax(3 * torch.randn(1, vocab), -1)
    cands += root.topk(topk).values[0].tolist()
    fronts = [root.topk(topk).values]

    def step_fn(step: int, tokens: torch.Tensor, parent: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(3 * torch.randn(1, topk, vocab), -1)
        cum = fronts[-1].unsqueeze(2) + lp.topk(topk, -1).values  # frontier score + child
        cands.extend(cum.flatten().tolist())
        fronts.append(cum.flatten().unsqueeze(0).topk(topk).values)
        return lp

    tree = expand_tree(root, step_fn, topk=topk, depth=depth, num_nodes=n)
    best = sorted(cands, reverse=True)[: n - 1]
    assert sorted(tree.scores[0, 1:].tolist(), reverse=True) == pytest.approx(best, abs=1e-6)


@pytest.mark.parametrize("k", [1, 2, SMALL_TOP_K, SMALL_TOP_K + 1])
@pytest.mark.parametrize("shape,dim", [((3, 257), 1), ((2, 3, 64), 2), ((5, 2, 7), 0)])
def test_top_k_equals_torch_topk(k: int, shape: tuple[int, ...], dim: int) -> None:
    """Values and indices of torch.topk on tie-free input (the iterative maxima up to
    SMALL_TOP_K, torch.topk above); the input is left unchanged."""
    torch.manual_seed(k)
    x = torch.randn(shape)
    before = x.clone()
    values, indices = top_k(x, k, dim)
    ref = torch.topk(x, k, dim=dim)
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)
    assert torch.equal(x, before)


def test_top_k_ties_in_index_order() -> None:
    x = torch.tensor([[0.0, -1.0, 0.0, 0.0, -2.0], [-3.0, -3.0, -1.0, -3.0, -1.0]])
    values, indices = top_k(x, 3, dim=1)
    assert indices.tolist() == [[0, 2, 3], [2, 4, 0]]
    assert values.tolist() == [[0.0, 0.0, 0.0], [-1.0, -1.0, -3.0]]


# ----------------------------------------------------------------------------- with models


def test_target_as_own_draft_is_greedy(ckpts: dict[str, Path]) -> None:
    runner = make_runner(ckpts["target"])
    model, cfg = runner.model, runner.model_config
    prompts = [[5, 17, 3, 44, 9], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
    reqs = [DraftRequest(f"r{i}", p, len(p) - 1) for i, p in enumerate(prompts)]
    depth = 5
    # topk = 1: the tree is the greedy chain; topk = 3: the first-child chain is its prefix
    for topk, n in ((1, depth + 1), (3, 16)):
        drafter = make_drafter(runner, ckpts["target"], num_draft_tokens=n, depth=depth, topk=topk)
        tree = drafter.propose(reqs)
        assert tree.device == CPU and tree.num_nodes == n
        for b, p in enumerate(prompts):
            chain, node = [], 0
            while int(tree.next_token[b, node]) >= 0:
                node = int(tree.next_token[b, node])
                chain.append(int(tree.draft_tokens[b, node]))
            ref = greedy(model, cfg, p, depth)
            assert chain == ref[: len(chain)]
            assert len(chain) == depth if topk == 1 else len(chain) >= 1


def test_target_as_own_draft_fully_accepted(ckpts: dict[str, Path]) -> None:
    """End to end with the target's tree verify: a chain drafted by the target is accepted."""
    runner = make_runner(ckpts["target"])
    depth = 4
    drafter = make_drafter(runner, ckpts["target"], num_draft_tokens=depth + 1, depth=depth,
                           topk=1)
    prompts = [[5, 17, 3, 44, 9], [7, 8]]
    pages = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(prompts))]
    logits = runner.prefill(prompts, pages).logits
    hist = [p + [int(t)] for p, t in zip(prompts, logits.argmax(-1).tolist(), strict=True)]
    for _ in range(2):
        reqs = [DraftRequest(f"r{i}", h, len(h) - 1) for i, h in enumerate(hist)]
        tree = drafter.propose(reqs)
        fwd = runner.verify(tree, [r.seq_len for r in reqs], pages)
        res = verify_tree(tree, fwd.logits.argmax(-1).view(len(reqs), -1))
        runner.commit_accepted_kv(fwd, res)
        assert res.accept_len.tolist() == [depth + 1] * len(reqs)
        committed = [res.accept_tokens[b, : depth + 1].tolist() for b in range(len(reqs))]
        drafter.on_verified(reqs, committed)
        hist = [h + c for h, c in zip(hist, committed, strict=True)]


def test_catch_up_matches_fresh_prefill(ckpts: dict[str, Path]) -> None:
    runner = make_runner(ckpts["target"])
    drafter = make_drafter(runner, ckpts["draft"], num_draft_tokens=8, depth=3, topk=2)
    free0 = drafter.allocator.num_free_pages
    rng = random.Random(0)
    hist = {"a": [3, 9, 27, 81 % VOCAB, 50], "b": [11, 12]}
    late = [rng.randrange(VOCAB) for _ in range(23)]  # joins later: a long first catch-up
    for rnd in range(5):
        if rnd == 2:
            hist["c"] = list(late)
        reqs = [DraftRequest(rid, list(h), len(h) - 1) for rid, h in hist.items()]
        tree = drafter.propose(reqs)
        assert drafter.last_root_logp is not None
        for b, r in enumerate(reqs):
            ref = fresh_logp(drafter.model, drafter.model_config, r.token_ids)
            diff = (drafter.last_root_logp[b] - ref).abs().max().item()
            assert diff < 1e-4, (rnd, r.request_id, diff)
        committed = []
        for b in range(len(reqs)):
            # accept a random prefix of the first branch, then a random bonus token
            chain, node = [], 0
            while int(tree.next_token[b, node]) >= 0 and rng.random() < 0.7:
                node = int(tree.next_token[b, node])
                chain.append(int(tree.draft_tokens[b, node]))
            committed.append(chain + [rng.randrange(VOCAB)])
        drafter.on_verified(reqs, committed)
        for r, c in zip(reqs, committed, strict=True):
            hist[r.request_id].extend(c)
    for rid in list(hist):
        drafter.release(rid)
    assert drafter.allocator.num_free_pages == free0


def test_unready_requests_get_padding(ckpts: dict[str, Path]) -> None:
    """A request that does not fit the draft pool is proposed as root + padding."""
    runner = make_runner(ckpts["target"])
    spec = SpecConfig(algorithm="draft_model", draft_model=str(ckpts["draft"]),
                      num_draft_tokens=6, depth=3, topk=2)
    drafter = DraftModelDrafter(spec, target=runner, device=CPU, dtype=torch.float32,
                                num_pages=6)  # 5 usable pages of 4 slots
    reqs = [DraftRequest("small", [1, 2, 3], 2), DraftRequest("huge", list(range(40)), 39)]
    tree = drafter.propose(reqs)
    assert (tree.draft_tokens[1, 1:] == -1).all() and int(tree.draft_tokens[1, 0]) == 39
    assert (tree.draft_tokens[0, 1:] >= 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_propose_has_no_host_sync_and_matches_cpu(ckpts: dict[str, Path]) -> None:
    """On CUDA (fp32) a propose never syncs with the host and drafts the CPU tree."""
    reqs = [DraftRequest("a", [5, 17, 3, 44, 9, 1], 5), DraftRequest("b", [7, 8], 1)]
    trees = []
    for dev in (CPU, torch.device("cuda")):
        model, cfg = load_model(str(ckpts["target"]), device=dev, dtype=torch.float32)
        runner = ModelRunner(model, cfg, CacheConfig(page_size=PAGE, num_pages=96), device=dev,
                             dtype=torch.float32)
        spec = SpecConfig(algorithm="draft_model", draft_model=str(ckpts["draft"]),
                          num_draft_tokens=8, depth=3, topk=2)
        drafter = DraftModelDrafter(spec, target=runner, device=dev, dtype=torch.float32,
                                    num_pages=96)
        drafter.propose(reqs)  # first sight: catch-up of the whole history
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            tree = drafter.propose(reqs)  # steady state: re-feeds the last token
        finally:
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        assert tree.device.type == dev.type
        trees.append(tree)
    assert torch.equal(trees[0].draft_tokens, trees[1].draft_tokens.cpu())
    assert torch.equal(trees[0].parents, trees[1].parents.cpu())
