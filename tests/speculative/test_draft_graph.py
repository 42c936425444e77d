"""Propose graphs of the model-based drafters (:mod:`structspec.speculative.draft_graph`).

CPU: the graph path (bucket lookup, one staged int buffer, eager prefixes of long catch-ups,
dummy rows, the static forward) runs with :meth:`DraftGraph.forward` executed eagerly instead of
a replay, and must draft the same trees as the eager propose, round after round, for batches
mixing short and long catch-ups, undrafted requests, several batch/page buckets and fallbacks
to the eager path. GPU (marker ``gpu``): real capture/replay against the eager propose, and no
host sync in replayed proposes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from structspec.config import CacheConfig, SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.kvcache.allocator import slots_for_positions
from structspec.models.eagle_head import build_random_eagle_head
from structspec.models.loader import load_model
from structspec.runner.model_runner import ModelRunner
from structspec.speculative.base import DraftRequest
from structspec.speculative.draft_batches import (
    build_catch_up_batch,
    build_extend_batch,
    build_frontier_batch,
    frontier_layout,
)
from structspec.speculative.draft_graph import DraftGraph, DraftGraphCache, draft_page_buckets
from structspec.speculative.draft_model import DraftModelDrafter
from structspec.speculative.eagle import EagleDrafter
from structspec.speculative.tree_drafter import TreeDrafter
from tests.speculative.test_draft_model import PAGE, VOCAB, tiny_llama

CPU = torch.device("cpu")
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TREE_FIELDS = ("draft_tokens", "parents", "depth", "next_token", "next_sibling",
               "ancestor_mask")
SPEC = dict(num_draft_tokens=8, depth=3, topk=2)  # scratch 4, catch-up width Q = 5
HUGE = list(range(1, 90)) * 4  # 356 tokens: 90 draft pages, more than any pool here


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_graph")
    return {"target": tiny_llama(root / "target", 0), "draft": tiny_llama(root / "draft", 1, 2)}


def make_target(path: Path, dev: torch.device, kernels: str | None = None) -> ModelRunner:
    model, cfg = load_model(str(path), device=dev, dtype=torch.float32)
    return ModelRunner(model, cfg, CacheConfig(page_size=PAGE, num_pages=96), device=dev,
                       dtype=torch.float32, kernels=kernels)


def use_graphs(d: TreeDrafter, batch_sizes: tuple[int, ...], page_buckets: tuple[int, ...],
               dev: torch.device) -> DraftGraphCache:
    """Give ``d`` a graph cache with small buckets (on CPU: the eager static forward)."""
    d.graphs = DraftGraphCache(batch_sizes=batch_sizes, page_buckets=page_buckets,
                               query_len=d.short_catch_up, device=dev)
    return d.graphs


def draft_model_pair(ckpts: dict[str, Path], dev: torch.device, num_pages: int,
                     kernels: str | None = None) -> tuple[DraftModelDrafter, DraftModelDrafter]:
    """(eager, graph) drafters sharing one draft model, each with its own KV pool."""
    target = make_target(ckpts["target"], dev, kernels)
    model = load_model(str(ckpts["draft"]), device=dev, dtype=torch.float32)
    spec = SpecConfig(algorithm="draft_model", draft_model=str(ckpts["draft"]), **SPEC)
    return tuple(  # type: ignore[return-value]
        DraftModelDrafter(spec, target=target, device=dev, dtype=torch.float32,
                          num_pages=num_pages, model=model, use_cuda_graph=graph)
        for graph in (False, True))


class Twin:
    """Drives an eager and a graph-path drafter through identical rounds and compares them.

    Each round: both propose for every request; the trees must be equal field by field (and
    the root log-probs of drafted rows close); then every request commits a random prefix of
    the eager tree's first branch plus a random bonus token. ``feed`` (EAGLE) hands both
    drafters the same random target features for committed positions.
    """

    def __init__(self, eager: TreeDrafter, graph: TreeDrafter, seed: int,
                 feed: Callable[[TreeDrafter, DraftRequest, int], None] | None = None) -> None:
        self.eager, self.graph, self.feed = eager, graph, feed
        self.rng = random.Random(seed)
        self.hist: dict[str, list[int]] = {}
        self.unfed: set[str] = set()
        #: per round, whether the graph path's tree carried packed host links
        self.packed: list[bool] = []

    def add(self, rid: str, prompt: list[int], fed: bool = True) -> None:
        """A new request: ``prompt`` prefilled by the target, plus its first token."""
        if self.feed is not None and fed:
            for d in (self.eager, self.graph):
                self.feed(d, DraftRequest(rid, list(prompt), 0), len(prompt))
        if not fed:
            self.unfed.add(rid)
        self.hist[rid] = list(prompt) + [self.rng.randrange(VOCAB)]

    def round(self, sync_check: bool = False) -> list[DraftRequest]:
        reqs = [DraftRequest(r, list(h), len(h) - 1) for r, h in self.hist.items()]
        ref = self.eager.propose(reqs)
        if sync_check:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = self.graph.propose(reqs)
        finally:
            if sync_check:
                torch.cuda.set_sync_debug_mode(0)
        for f in TREE_FIELDS:
            a, b = getattr(ref, f).cpu(), getattr(got, f).cpu()
            assert torch.equal(a, b), (f, a, b)
        # a graph's packed links (the grammar's one host copy) hold this batch's fields; an
        # eager propose has none (its fields are staged one by one)
        self.packed.append(got.host_links is not None)
        if got.host_links is not None:
            links = got.host_links[:, : len(reqs)].cpu()
            for i, f in enumerate(("next_token", "next_sibling", "draft_tokens", "parents")):
                assert torch.equal(links[i], getattr(ref, f).cpu()), f
        if self.graph.last_root_logp is not None:
            assert self.eager.last_root_logp is not None
            drafted = (ref.draft_tokens[:, 1] >= 0).cpu()
            torch.testing.assert_close(self.graph.last_root_logp.cpu()[drafted],
                                       self.eager.last_root_logp.cpu()[drafted],
                                       rtol=1e-4, atol=1e-4)
        tree = VerifyTree(**{f: getattr(ref, f).cpu() for f in TREE_FIELDS})
        for b, r in enumerate(reqs):
            chain, node = [], 0
            while int(tree.next_token[b, node]) >= 0 and self.rng.random() < 0.7:
                node = int(tree.next_token[b, node])
                chain.append(int(tree.draft_tokens[b, node]))
            run = chain + [self.rng.randrange(VOCAB)]
            if self.feed is not None and r.request_id not in self.unfed:
                for d in (self.eager, self.graph):
                    self.feed(d, r, len(run))
            self.hist[r.request_id] += run
        for d in (self.eager, self.graph):
            d.on_verified(reqs, [])
        return reqs

    def assert_same_kv(self) -> None:
        """Both pools hold the same draft KV outside the sink page (dummy rows only ever
        write page 0; the two allocators hand out the same pages)."""
        a, b = self.eager.kv_pool.kv_buffer, self.graph.kv_pool.kv_buffer
        torch.testing.assert_close(b[:, :, PAGE:].cpu(), a[:, :, PAGE:].cpu(),
                                   rtol=1e-4, atol=1e-4)


def draft_model_rounds(twin: Twin, cache: DraftGraphCache, rounds: int = 9) -> list[bool]:
    """Requests join over the rounds (long first catch-ups next to short ones); returns, per
    round, whether the graph path served the propose."""
    twin.add("a", [5, 17, 3, 44, 9])
    twin.add("b", [7])
    twin.add("huge", HUGE)  # never fits the draft pool: padded tree
    path = []
    for rnd in range(rounds):
        if rnd == 2:  # batch 4; a long first catch-up (> Q entries)
            twin.add("c", [(7 * i) % VOCAB for i in range(23)])
        if rnd == 3:  # batch 5
            twin.add("d", [11, 12, 13, 14, 15, 16, 17, 18, 19])
        if rnd == 6:  # 45 entries + scratch: wider than the largest page bucket (12 pages)
            twin.add("e", [(3 * i + 2) % VOCAB for i in range(44)])
        runs = cache.runs
        twin.round()
        path.append(cache.runs > runs)
    return path


# ----------------------------------------------------------------------------- CPU


def test_draft_page_buckets() -> None:
    assert draft_page_buckets(1024, 28, 16) == (16, 32, 66)
    assert draft_page_buckets(256, 4, 4) == (66,)
    assert draft_page_buckets(300, 4, 4) == (64, 77)


@torch.inference_mode()
def test_catch_up_batch_matches_extend_batch() -> None:
    """Real rows of the fixed-shape device batch equal :func:`build_extend_batch`'s (the same
    causal rule, no mask built); padding and dummy rows write the sink slot 0 and see only
    sink columns past their request's entries."""
    q, width = 5, 6
    tokens = [[4, 5, 6], [9], [1, 2, 3, 4, 5]]
    starts = [2, 7, 0]
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(40, generator=g)[: 3 * width].view(3, width) + 1
    ref = build_extend_batch(tokens, starts, table, page_size=PAGE, device=CPU)
    bsz = 5  # two dummy rows
    tok = torch.zeros(bsz, q, dtype=torch.int64)
    for i, t in enumerate(tokens):
        tok[i, : len(t)] = torch.tensor(t)
    start = torch.tensor(starts + [0, 0])
    qlen = torch.tensor([len(t) for t in tokens] + [0, 0])
    full_table = torch.cat([table, torch.zeros(2, width, dtype=torch.int64)])
    fb = build_catch_up_batch(tok, start, qlen, full_table, page_size=PAGE)
    qr = ref.input_ids.shape[1]
    assert fb.attn_mask is None and ref.attn_mask is None  # the causal rule, no mask built
    for i, t in enumerate(tokens):
        n = len(t)
        assert torch.equal(fb.input_ids[i, :n], ref.input_ids[i, :n])
        assert torch.equal(fb.positions[i, :n], ref.positions[i, :n])
        assert torch.equal(fb.out_slots[i, :n], ref.out_slots[i, :n])
        assert torch.equal(fb.kv_slots[i], ref.kv_slots[i])
        assert torch.equal(fb.mask()[i, :n], ref.mask()[i, :n])
        assert (fb.out_slots[i, n:] == 0).all()  # padding rows: the sink
        # what a padding row sees past its request's entries is the sink
        seen = fb.mask()[i, n:]
        assert (fb.kv_slots[i].expand_as(seen)[seen & (torch.arange(seen.shape[1])
                                                         >= starts[i] + n)] == 0).all()
        assert int(fb.logits_indices[i]) == i * q + n - 1
        assert int(ref.logits_indices[i]) == i * qr + n - 1
    assert (fb.out_slots[3:] == 0).all() and (fb.kv_slots[3:] == 0).all()
    assert (fb.causal_start[3:] == 0).all()


@torch.inference_mode()
def test_frontier_batches_follow_the_layout_rule() -> None:
    """Each expansion step's batch, built from the propose's shared layout, is the rule of the
    module doc computed from scratch: node j of step s writes position base + (s-1) k + j,
    sits at rotary position base + s - 1, and sees the committed entries plus the scratch
    columns its mask row sets; columns past the scratch are never seen."""
    k, depth, width = 2, 4, 6
    scratch = (depth - 1) * k
    base = torch.tensor([3, 9, 1])
    g = torch.Generator().manual_seed(1)
    table = torch.randperm(40, generator=g)[: 3 * width].view(3, width) + 1
    layout = frontier_layout(base, scratch, table, page_size=PAGE)
    cols = width * PAGE
    for step in range(1, depth):
        tokens = torch.randint(0, VOCAB, (3, k), generator=g)
        smask = torch.rand(3, k, scratch, generator=g) < 0.5
        fb = build_frontier_batch(tokens, step, smask, layout)
        pos = base.unsqueeze(1) + (step - 1) * k + torch.arange(k)
        assert torch.equal(fb.out_slots, slots_for_positions(table, pos, PAGE))
        assert torch.equal(fb.positions, (base + step - 1).unsqueeze(1).expand(3, k))
        assert torch.equal(fb.input_ids, tokens)
        want = torch.zeros(3, k, cols, dtype=torch.bool)
        for b in range(3):
            want[b, :, : int(base[b])] = True
            want[b, :, int(base[b]) : int(base[b]) + scratch] = smask[b]
            lens = torch.tensor([int(base[b]) + scratch])
            assert torch.equal(fb.kv_slots[b, : int(lens)],
                               slots_for_positions(table[b : b + 1],
                                                   torch.arange(int(lens)).unsqueeze(0),
                                                   PAGE)[0])
        assert torch.equal(fb.attn_mask, want)


@torch.inference_mode()
def test_dummy_rows_write_only_the_sink(ckpts: dict[str, Path]) -> None:
    """An all-dummy bucket (what warm-up captures) leaves every real page untouched and
    yields root + padding trees."""
    _, d = draft_model_pair(ckpts, CPU, num_pages=40)
    pool = d.kv_pool.kv_buffer
    pool.normal_()
    before = pool.clone()
    g = DraftGraph(4, 6, d.short_catch_up, CPU)
    g.reset_dummy()
    g.roots.copy_(torch.tensor([3, 4, 5, 6]))
    root_logp, tree = g.forward(d)
    assert torch.equal(pool[:, :, PAGE:], before[:, :, PAGE:])
    assert not torch.equal(pool[:, :, :PAGE], before[:, :, :PAGE])  # the sink was written
    assert torch.isfinite(root_logp).all()
    assert tree.draft_tokens[:, 0].tolist() == [3, 4, 5, 6]
    assert (tree.draft_tokens[:, 1:] == -1).all() and (tree.next_token == -1).all()


@pytest.mark.parametrize("batch_sizes", [(2, 4, 8), (2, 4)])
def test_graph_path_matches_eager_draft_model(ckpts: dict[str, Path],
                                              batch_sizes: tuple[int, ...]) -> None:
    """Rounds of proposes: padded batch buckets (3 -> 4, 5 -> 8), page buckets 4/6/8/12
    crossed as histories grow, then page tables wider than the largest bucket (eager
    fallback); with ``(2, 4)`` batches of 5 fall back too. A request that never fits the
    draft pool gets a padded tree on both paths."""
    eager, graph = draft_model_pair(ckpts, CPU, num_pages=64)
    cache = use_graphs(graph, batch_sizes, (4, 6, 8, 12), CPU)
    twin = Twin(eager, graph, seed=0)
    path = draft_model_rounds(twin, cache)
    twin.assert_same_kv()
    assert twin.packed == path  # every graph propose packs its links, no eager one does
    used = {key for key, g in cache.graphs.items() if g.tree is not None}
    if batch_sizes[-1] == 8:
        assert path == [True] * 6 + [False] * 3
        assert {b for b, _ in used} == {4, 8}
        assert {p for _, p in used} == {4, 8, 12}, used
    else:  # batches of 5 are above the largest bucket
        assert path == [True] * 3 + [False] * 6
        assert {b for b, _ in used} == {4}
        assert {p for _, p in used} == {4, 8}, used


@pytest.fixture(scope="module")
def eagle_target(ckpts: dict[str, Path]) -> ModelRunner:
    return make_target(ckpts["target"], CPU)


def eagle_feed(seed: int) -> Callable[[TreeDrafter, DraftRequest, int], None]:
    """``feed(drafter, req, m)``: random target features of positions ``req.seq_len ..
    + m - 1``; the same tensors for every drafter (seeded per call position)."""
    calls: dict[int, int] = {}

    def feed(d: TreeDrafter, req: DraftRequest, m: int) -> None:
        assert isinstance(d, EagleDrafter)
        k = calls[id(d)] = calls.get(id(d), 0) + 1
        g = torch.Generator().manual_seed(seed * 100003 + k)
        hidden = d.features.shape[1]
        h = torch.randn(1, m, hidden, generator=g).to(d.device)
        aux = [torch.randn(1, m, hidden, generator=g).to(d.device)
               for _ in d.aux_hidden_layers]
        d.on_target_hidden([req], h, None, [m], aux)

    return feed


def eagle_pair(target: ModelRunner, head_dir: Path, dev: torch.device,
               num_pages: int) -> tuple[EagleDrafter, EagleDrafter]:
    spec = SpecConfig(algorithm="eagle", draft_model=str(head_dir), **SPEC)
    return tuple(  # type: ignore[return-value]
        EagleDrafter(spec, target=target, device=dev, dtype=torch.float32, num_pages=num_pages,
                     use_cuda_graph=graph)
        for graph in (False, True))


def eagle_rounds(twin: Twin, rounds: int) -> None:
    twin.add("a", [5, 17, 3, 44, 9])
    twin.add("b", [7, 8])
    twin.add("nofeat", [1, 2, 3], fed=False)  # its features never arrive: padded tree
    for rnd in range(rounds):
        if rnd == 1:
            twin.add("c", [(5 * i + 1) % VOCAB for i in range(21)])
        twin.round()


@pytest.mark.parametrize("version", [1, 3])
def test_graph_path_matches_eager_eagle(eagle_target: ModelRunner, version: int,
                                        tmp_path: Path) -> None:
    head = build_random_eagle_head(eagle_target.model_config, tmp_path, seed=1,
                                   version=version, draft_vocab_size=40,
                                   aux_hidden_layers=[0, 1, 1])
    eager, graph = eagle_pair(eagle_target, head, CPU, num_pages=80)
    cache = use_graphs(graph, (2, 4, 8), (4, 8, 16), CPU)
    twin = Twin(eager, graph, seed=version, feed=eagle_feed(version))
    eagle_rounds(twin, rounds=5)
    twin.assert_same_kv()
    assert cache.runs == 5


def test_graphs_only_on_cuda(ckpts: dict[str, Path]) -> None:
    eager, graph = draft_model_pair(ckpts, CPU, num_pages=40)
    assert eager.graphs is None and graph.graphs is None  # CPU: always eager
    assert graph.warmup_cuda_graphs() == 0


# ----------------------------------------------------------------------------- GPU


def _kernels_or_skip(kernels: str) -> None:
    if kernels == "triton":
        pytest.importorskip("triton")


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_graph_replay_matches_eager_draft_model_gpu(ckpts: dict[str, Path],
                                                    kernels: str) -> None:
    """Captured/replayed proposes draft the eager trees (fp32), round after round."""
    _kernels_or_skip(kernels)
    dev = torch.device("cuda")
    eager, graph = draft_model_pair(ckpts, dev, num_pages=64, kernels=kernels)
    assert eager.graphs is None and graph.graphs is not None  # default: on
    graph.graph_keeps_root_logp = True
    cache = use_graphs(graph, (2, 4, 8), (4, 6, 8, 12), dev)
    twin = Twin(eager, graph, seed=0)
    assert draft_model_rounds(twin, cache) == [True] * 6 + [False] * 3
    twin.assert_same_kv()
    assert all(g.captured for g in cache.graphs.values() if g.tree is not None)


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("version", [1, 3])
def test_graph_replay_matches_eager_eagle_gpu(ckpts: dict[str, Path], version: int,
                                              tmp_path: Path) -> None:
    dev = torch.device("cuda")
    target = make_target(ckpts["target"], dev)
    head = build_random_eagle_head(target.model_config, tmp_path, seed=1, version=version,
                                   draft_vocab_size=40, aux_hidden_layers=[0, 1, 1])
    eager, graph = eagle_pair(target, head, dev, num_pages=80)
    graph.graph_keeps_root_logp = True
    cache = use_graphs(graph, (2, 4, 8), (4, 8, 16), dev)
    twin = Twin(eager, graph, seed=version, feed=eagle_feed(version))
    eagle_rounds(twin, rounds=5)
    twin.assert_same_kv()
    assert cache.runs == 5 and all(g.captured for g in cache.graphs.values())


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_replayed_propose_has_no_host_sync(ckpts: dict[str, Path], kernels: str) -> None:
    """After warm-up, proposes (short catch-ups, a long one split into an eager prefix, an
    undrafted request, dummy rows) replay without any host sync and match eager."""
    _kernels_or_skip(kernels)
    dev = torch.device("cuda")
    eager, graph = draft_model_pair(ckpts, dev, num_pages=48, kernels=kernels)
    cache = use_graphs(graph, (4, 8), (8, 12), dev)
    assert graph.warmup_cuda_graphs(batch_sizes=[3, 4]) == 2  # (4, 8) and (4, 12)
    assert graph.warmup_cuda_graphs(batch_sizes=[4], kv_lens=[4]) == 0  # already captured
    twin = Twin(eager, graph, seed=3)
    twin.add("a", [5, 17, 3, 44, 9])
    twin.add("b", [7])
    twin.add("huge", HUGE)
    twin.round()  # outside the check: the first sight of a and b
    for rnd in range(5):
        if rnd == 2:
            twin.add("c", [(7 * i) % VOCAB for i in range(13)])  # batch of 4, long catch-up
        twin.round(sync_check=True)
    assert cache.runs == 6
    assert sum(g.captured for g in cache.graphs.values()) == 2  # nothing captured lazily


@pytest.mark.gpu
@CUDA_ONLY
def test_drafter_follows_target_graph_setting(ckpts: dict[str, Path]) -> None:
    dev = torch.device("cuda")
    model, cfg = load_model(str(ckpts["target"]), device=dev, dtype=torch.float32)
    spec = SpecConfig(algorithm="draft_model", draft_model=str(ckpts["draft"]), **SPEC)
    for target_graphs in (True, False):
        target = ModelRunner(model, cfg, CacheConfig(page_size=PAGE, num_pages=96), device=dev,
                             dtype=torch.float32, use_cuda_graph=target_graphs,
                             cuda_graph_batch_sizes=(1, 2, 3), max_model_len=200)
        d = DraftModelDrafter(spec, target=target, device=dev, dtype=torch.float32,
                              num_pages=48)
        assert (d.graphs is not None) == target_graphs
        if d.graphs is not None:
            assert d.graphs.batch_sizes == (1, 2, 3)
            assert d.graphs.page_buckets[-1] * PAGE >= 200 + d.scratch + 1
