"""EAGLE drafter (EAGLE-1/2 and EAGLE-3 heads): loading, feature hook, catch-up, tree shape."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from structspec.config import CacheConfig, SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.verify import VerifyResult
from structspec.kvcache.pool import KVPool
from structspec.models.eagle_head import build_random_eagle_head, load_eagle_head
from structspec.models.loader import load_model
from structspec.runner.batch_builder import (
    build_prefill_batch,
    build_verify_batch,
    page_table_tensor,
)
from structspec.runner.model_runner import ModelRunner, VerifyForwardOutput
from structspec.speculative.base import DraftRequest
from structspec.speculative.eagle import EagleDrafter

CPU = torch.device("cpu")
VOCAB = 96
PAGE = 4
AUX = [0, 1, 3]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = tmp_path_factory.mktemp("eagle_target")
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    model, mcfg = load_model(str(path), device=CPU, dtype=torch.float32)
    return ModelRunner(model, mcfg, CacheConfig(page_size=PAGE, num_pages=80), device=CPU,
                       dtype=torch.float32)


def make_drafter(runner: ModelRunner, head_dir: Path, **kw: Any) -> EagleDrafter:
    spec = SpecConfig(algorithm="eagle", draft_model=str(head_dir), **kw)
    return EagleDrafter(spec, target=runner, device=CPU, dtype=torch.float32, num_pages=80)


@pytest.fixture(scope="module", params=[1, 3])
def head_dir(request: pytest.FixtureRequest, runner: ModelRunner,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_eagle_head(runner.model_config, tmp_path_factory.mktemp("head"), seed=1,
                                   version=request.param, draft_vocab_size=40,
                                   aux_hidden_layers=AUX)


class Sim:
    """A minimal scheduler: target prefill/verify with the EAGLE hook, random accepted paths."""

    def __init__(self, runner: ModelRunner, drafter: EagleDrafter, seed: int = 0,
                 early_store: bool = False) -> None:
        """``early_store``: verify features go through ``on_target_hidden(num_rows=None)``
        then ``commit_target_hidden`` (the scheduler's order), else in one call."""
        self.runner, self.drafter = runner, drafter
        self.early_store = early_store
        self.rng = random.Random(seed)
        self.hist: dict[str, list[int]] = {}
        self.seq: dict[str, int] = {}
        self.pages: dict[str, list[int]] = {}
        self.next_page = 1

    def forward(self, fb: Any) -> Any:
        return self.runner.model(fb, self.runner.kv_pool,
                                 aux_hidden_layers=self.drafter.aux_hidden_layers)

    def add(self, prompts: dict[str, list[int]]) -> None:
        for rid in prompts:
            self.pages[rid] = list(range(self.next_page, self.next_page + 12))
            self.next_page += 12
        ids = list(prompts)
        fb = build_prefill_batch([prompts[r] for r in ids], [self.pages[r] for r in ids],
                                 page_size=PAGE, device=CPU)
        out = self.forward(fb)
        h = out.hidden_states.reshape(-1, out.hidden_states.shape[-1])[fb.logits_indices]
        bonus = self.runner.model.compute_logits(h).argmax(-1).tolist()
        reqs = [DraftRequest(r, prompts[r], 0) for r in ids]
        self.drafter.on_target_hidden(reqs, out.hidden_states, None,
                                      [len(prompts[r]) for r in ids], out.aux_hidden_states)
        for r, t in zip(ids, bonus, strict=True):
            self.hist[r] = prompts[r] + [t]
            self.seq[r] = len(prompts[r])

    def step(self) -> tuple[list[DraftRequest], VerifyTree]:
        ids = list(self.hist)
        reqs = [DraftRequest(r, list(self.hist[r]), self.seq[r]) for r in ids]
        tree = self.drafter.propose(reqs)
        n = tree.num_nodes
        seq_t = torch.tensor([self.seq[r] for r in ids])
        table = page_table_tensor([self.pages[r] for r in ids], CPU)
        out = self.forward(build_verify_batch(tree, seq_t, table, page_size=PAGE))
        logits = self.runner.model.compute_logits(out.hidden_states.reshape(-1, 32))
        target = logits.argmax(-1).view(len(ids), n)
        # accept a random prefix of the first-child chain (exercises multi-token commits)
        nodes = torch.full((len(ids), n), -1)
        toks = torch.full((len(ids), n), -1)
        lens = []
        for b in range(len(ids)):
            path = [0]
            while int(tree.next_token[b, path[-1]]) >= 0 and self.rng.random() < 0.75:
                path.append(int(tree.next_token[b, path[-1]]))
            run = [int(tree.draft_tokens[b, i]) for i in path[1:]] + [int(target[b, path[-1]])]
            nodes[b, : len(path)] = torch.tensor(path)
            toks[b, : len(run)] = torch.tensor(run)
            lens.append(len(run))
        res = VerifyResult(accept_tokens=toks, accept_len=torch.tensor(lens), accept_nodes=nodes)
        self.runner.commit_accepted_kv(
            VerifyForwardOutput(logits, seq_t, table, out.hidden_states, []), res)
        if self.early_store:
            self.drafter.on_target_hidden(reqs, out.hidden_states, res.accept_nodes, None,
                                          out.aux_hidden_states)
            self.drafter.commit_target_hidden(reqs, lens)
        else:
            self.drafter.on_target_hidden(reqs, out.hidden_states, res.accept_nodes, lens,
                                          out.aux_hidden_states)
        committed = [toks[b, : lens[b]].tolist() for b in range(len(ids))]
        self.drafter.on_verified(reqs, committed)
        for r, c in zip(ids, committed, strict=True):
            self.hist[r] += c
            self.seq[r] += len(c)
        return reqs, tree

    @torch.inference_mode()
    def reference_logp(self, tokens: list[int]) -> torch.Tensor:
        """Fresh: target prefill of tokens[:-1] -> features -> head prefill over all entries."""
        return self.reference_chain(tokens, 0)[1]

    @torch.inference_mode()
    def reference_chain(self, tokens: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        """Greedy head rollout with fresh prefills: ``steps`` drafted tokens, each entry pairing
        the drafted token with the head's own previous output (EAGLE), and the root log-probs.
        """
        d = self.drafter
        m = len(tokens) - 1
        pool_t = KVPool(num_layers=4, num_pages=1 + -(-m // PAGE), page_size=PAGE,
                        num_kv_heads=2, head_dim=8, dtype=torch.float32, device=CPU)
        pages = [list(range(1, pool_t.num_pages))]
        fb = build_prefill_batch([tokens[:-1]], pages, page_size=PAGE, device=CPU)
        out = self.runner.model(fb, pool_t, aux_hidden_layers=d.aux_hidden_layers)
        feats = (torch.cat(out.aux_hidden_states, -1) if d.head.config.version == 3
                 else out.hidden_states)
        feats = d.head.project_target(feats)
        lc = d.head.config.layer
        pool_h = KVPool(num_layers=d.head.num_layers, num_pages=pool_t.num_pages + 2,
                        page_size=PAGE, num_kv_heads=lc.num_key_value_heads,
                        head_dim=lc.head_dim, dtype=torch.float32, device=CPU)
        entries, root_logp, chain = list(tokens[1:]), None, []
        for _ in range(steps + 1):
            pages_h = [list(range(1, 1 + -(-len(entries) // PAGE)))]
            fb = build_prefill_batch([entries], pages_h, page_size=PAGE, device=CPU)
            h = d.head(fb, pool_h, self.runner.model.embed_tokens(fb.input_ids), feats)
            logp = d._logp(h[0, -1])
            root_logp = logp if root_logp is None else root_logp
            tok = int(logp.argmax())
            tok = int(d.vocab_map[tok]) if d.vocab_map is not None else tok
            chain.append(tok)
            entries.append(tok)
            feats = torch.cat([feats, h[:, -1:]], dim=1)
        assert root_logp is not None
        return chain[:steps], root_logp


def test_load_and_aux_layers(runner: ModelRunner, head_dir: Path) -> None:
    drafter = make_drafter(runner, head_dir)
    v = drafter.head.config.version
    assert drafter.aux_hidden_layers == (tuple(AUX) if v == 3 else ())
    assert (drafter.vocab_map is not None) == (v == 3)
    assert drafter.tree_on_host is False and drafter.supports_grammar_overlap is True


def test_pytorch_bin_with_model_prefix(runner: ModelRunner, head_dir: Path,
                                       tmp_path: Path) -> None:
    """EAGLE-1 checkpoints often ship ``pytorch_model.bin`` (names may carry ``model.``)."""
    sd = {f"model.{k}": v for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    (tmp_path / "config.json").write_text((head_dir / "config.json").read_text())
    torch.save(sd, tmp_path / "pytorch_model.bin")
    a = load_eagle_head(head_dir, runner.model_config, device=CPU, dtype=torch.float32)
    b = load_eagle_head(tmp_path, runner.model_config, device=CPU, dtype=torch.float32)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_no_features_no_drafts(runner: ModelRunner, head_dir: Path) -> None:
    drafter = make_drafter(runner, head_dir, num_draft_tokens=6, depth=3, topk=2)
    tree = drafter.propose([DraftRequest("x", [1, 2, 3], 2)])
    assert tree.draft_tokens.tolist() == [[3, -1, -1, -1, -1, -1]]


@pytest.mark.parametrize("early_store", [False, True], ids=["store_after", "store_before"])
@pytest.mark.parametrize(("topk", "depth", "n"), [(2, 3, 8), (1, 4, 5)])
def test_catch_up_matches_fresh_and_tree_valid(
    runner: ModelRunner, head_dir: Path, topk: int, depth: int, n: int, early_store: bool
) -> None:
    """The head's root log-probs after each verify equal a fresh prefill's, with the
    verify's features stored after the run lengths are known or before (every tree row,
    the lengths committed after)."""
    drafter = make_drafter(runner, head_dir, num_draft_tokens=n, depth=depth, topk=topk)
    free0 = drafter.allocator.num_free_pages
    sim = Sim(runner, drafter, early_store=early_store)
    sim.add({"a": [5, 17, 3, 44, 9], "b": [7]})
    allowed = set(drafter.vocab_map.tolist()) if drafter.vocab_map is not None else None
    for rnd in range(4):
        if rnd == 2:
            sim.add({"c": list(range(20, 41))})  # a long first catch-up next to short ones
        reqs, tree = sim.step()
        assert drafter.last_root_logp is not None
        for b, r in enumerate(reqs):
            ref = sim.reference_logp(r.token_ids)
            diff = (drafter.last_root_logp[b] - ref).abs().max().item()
            assert diff < 1e-4, (rnd, r.request_id, diff)
            real = tree.draft_tokens[b, 1:]
            assert (real >= 0).all()  # enough candidates for n nodes
            assert (tree.parents[b, 1:] < torch.arange(1, n)).all()
            if allowed is not None:
                assert set(real.tolist()) <= allowed
    for rid in list(sim.hist):
        drafter.release(rid)
    assert drafter.allocator.num_free_pages == free0


def test_features_stored_early_count_only_once_committed(runner: ModelRunner,
                                                         head_dir: Path) -> None:
    """A verify's features stored before its run lengths are known do not count (the request
    is not drafted) until ``commit_target_hidden``; then exactly the committed run counts, and
    a release forgets the uncommitted store."""
    drafter = make_drafter(runner, head_dir, num_draft_tokens=5, depth=2, topk=2)
    sim = Sim(runner, drafter)
    sim.add({"a": [5, 17, 3, 44, 9]})
    reqs = [DraftRequest("a", list(sim.hist["a"]), sim.seq["a"])]
    tree = drafter.propose(reqs)
    n = tree.num_nodes
    out = sim.forward(build_verify_batch(tree, torch.tensor([sim.seq["a"]]),
                                         page_table_tensor([sim.pages["a"]], CPU),
                                         page_size=PAGE))
    nodes = torch.full((1, n), -1)
    nodes[0, :2] = torch.tensor([0, int(tree.next_token[0, 0])])  # node 0 + its first child
    drafter.on_target_hidden(reqs, out.hidden_states, nodes, None, out.aux_hidden_states)
    st = drafter.states["a"]
    assert st.feat_len == sim.seq["a"] and drafter._uncommitted == {"a": sim.seq["a"]}
    drafter.commit_target_hidden(reqs, [2])
    assert st.feat_len == sim.seq["a"] + 2 and not drafter._uncommitted
    drafter.on_target_hidden(reqs, out.hidden_states, nodes, None, out.aux_hidden_states)
    drafter.release("a")
    assert not drafter._uncommitted and "a" not in drafter.states
    with pytest.raises(ValueError, match="needs rows"):
        drafter.on_target_hidden(reqs, out.hidden_states, None, None, out.aux_hidden_states)


@pytest.mark.parametrize(("topk", "n"), [(1, 5), (3, 12)])
def test_first_branch_is_greedy_head_rollout(
    runner: ModelRunner, head_dir: Path, topk: int, n: int
) -> None:
    """The first-child chain is the head's greedy rollout (each step fed its own output);
    with topk = 1 it is the whole chain of ``depth`` drafts."""
    depth = 4
    drafter = make_drafter(runner, head_dir, num_draft_tokens=n, depth=depth, topk=topk)
    sim = Sim(runner, drafter, seed=1)
    sim.add({"a": [5, 17, 3, 44, 9], "b": [7, 8]})
    for _ in range(2):
        reqs, tree = sim.step()
        for b, r in enumerate(reqs):
            chain, node = [], 0
            while int(tree.next_token[b, node]) >= 0:
                node = int(tree.next_token[b, node])
                chain.append(int(tree.draft_tokens[b, node]))
            ref, _ = sim.reference_chain(r.token_ids, depth)
            assert chain == ref[: len(chain)] and len(chain) >= 1
            if topk == 1:
                assert len(chain) == depth


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_hook_and_propose_have_no_host_sync(runner: ModelRunner, head_dir: Path) -> None:
    """On CUDA the feature hook and propose never sync with the host; same tree as on CPU."""
    prompts = [[5, 17, 3, 44, 9], [7]]
    reqs = [DraftRequest("a", prompts[0] + [1], 5), DraftRequest("b", prompts[1] + [2], 1)]
    trees = []
    for dev in (CPU, torch.device("cuda")):
        model, cfg = runner.model.to(dev), runner.model_config
        target = ModelRunner(model, cfg, CacheConfig(page_size=PAGE, num_pages=80), device=dev,
                             dtype=torch.float32)
        spec = SpecConfig(algorithm="eagle", draft_model=str(head_dir), num_draft_tokens=8,
                          depth=3, topk=2)
        drafter = EagleDrafter(spec, target=target, device=dev, dtype=torch.float32,
                               num_pages=80)
        fb = build_prefill_batch(prompts, [[1, 2, 3], [4]], page_size=PAGE, device=dev)
        out = model(fb, target.kv_pool, aux_hidden_layers=drafter.aux_hidden_layers)
        drafter.propose(reqs)  # no features yet: padding only
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            drafter.on_target_hidden([DraftRequest(r.request_id, p, 0) for r, p in
                                      zip(reqs, prompts, strict=True)],
                                     out.hidden_states, None, [5, 1], out.aux_hidden_states)
            tree = drafter.propose(reqs)
        finally:
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        trees.append(tree)
    runner.model.to(CPU)
    assert (trees[0].draft_tokens[:, 1:] >= 0).all()
    assert torch.equal(trees[0].draft_tokens, trees[1].draft_tokens.cpu())
    assert torch.equal(trees[0].parents, trees[1].parents.cpu())


def test_sized_propose_runs_only_the_depths_its_tree_uses(runner: ModelRunner,
                                                          head_dir: Path) -> None:
    """``propose_sized(reqs, n)`` (the adaptive sizer's node budget): a 2-node tree is the
    catch-up alone (no expansion forward) and its draft is the root's most likely child; a
    4-node tree runs 2 expansion forwards; the full tree's first-child chain is unchanged and
    every tree keeps ``[B, N]`` with padding past the budget."""
    drafter = make_drafter(runner, head_dir, num_draft_tokens=8, depth=4, topk=2)
    sim = Sim(runner, drafter, seed=2)
    sim.add({"a": [5, 17, 3, 44, 9], "b": [7, 8]})
    sim.step()
    reqs = [DraftRequest(r, list(sim.hist[r]), sim.seq[r]) for r in sim.hist]
    calls: list[int] = []
    step_forward = drafter.step_forward

    def counting(fb: Any, parent: torch.Tensor, root_state: Any, step: int) -> torch.Tensor:
        calls.append(step)
        return step_forward(fb, parent, root_state, step)

    drafter.step_forward = counting  # type: ignore[method-assign]
    full = drafter.propose(reqs)
    assert calls == [1, 2, 3]
    root = drafter.last_root_logp
    assert root is not None
    calls.clear()
    two = drafter.propose_sized(reqs, 2)
    assert calls == [] and two.draft_tokens.shape == (2, 8)
    best = root.argmax(-1)
    if drafter.vocab_map is not None:
        best = drafter.vocab_map[best]
    assert two.draft_tokens[:, 1].tolist() == best.tolist()
    assert (two.draft_tokens[:, 2:] == -1).all()
    calls.clear()
    four = drafter.propose_sized(reqs, 4)
    assert calls == [1, 2] and (four.draft_tokens[:, 1:4] >= 0).all()
    assert (four.draft_tokens[:, 4:] == -1).all()
    assert (four.parents[:, 1:4] < torch.arange(1, 4)).all()
    for b in range(2):  # the first-child chain of the budgeted tree is the full tree's
        chain_full, chain_four, nf, n4 = [], [], 0, 0
        while int(full.next_token[b, nf]) >= 0:
            nf = int(full.next_token[b, nf])
            chain_full.append(int(full.draft_tokens[b, nf]))
        while int(four.next_token[b, n4]) >= 0:
            n4 = int(four.next_token[b, n4])
            chain_four.append(int(four.draft_tokens[b, n4]))
        assert chain_four == chain_full[: len(chain_four)] and chain_four
    for rid in list(sim.hist):
        drafter.release(rid)


def test_rotary_table_equals_recomputation(runner: ModelRunner, head_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused head's rotary table (built in blocks of positions) holds what
    ``RotaryEmbedding`` computes per position, across block boundaries; lookups past it read
    its last row."""
    import structspec.models.eagle_head as eagle_head

    head = make_drafter(runner, head_dir).head
    monkeypatch.setattr(eagle_head, "ROTARY_TABLE_BLOCK", 100)
    table = head._build_rotary_table(300)
    assert table.shape == (300 + eagle_head.ROTARY_TABLE_MARGIN, 2, head.rotary.inv_freq.shape[0] * 2)
    pos = torch.arange(table.shape[0]).unsqueeze(0)
    cos, sin = head.rotary(pos, table.dtype)
    torch.testing.assert_close(table[:, 0], cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(table[:, 1], sin[0], atol=1e-6, rtol=1e-6)
    head._rotary_table = table
    got_cos, _ = head.rotary_cos_sin(torch.tensor([[5, 10_000]]), table.dtype)
    torch.testing.assert_close(got_cos[0, 0], cos[0, 5])
    torch.testing.assert_close(got_cos[0, 1], cos[0, -1])
    head._rotary_table = None  # the torch path again for the other tests


@pytest.mark.parametrize(("text", "named"), [
    ('{"hidden_size": 32,', "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": "abc"}', "hidden_size='abc'"),
    ('{"architectures": "LlamaForCausalLMEagle3"}', "architectures="),
    ('{"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": [1]}', "eagle_config=[1]"),
    ('{"architectures": ["LlamaForCausalLMEagle3"], '
     '"eagle_config": {"eagle_aux_hidden_state_layer_ids": ["a", 1, 2]}}',
     "eagle_aux_hidden_state_layer_ids"),
    ('{"architectures": ["LlamaForCausalLMEagle3"], '
     '"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 99]}}',
     "the target has 4 decoder layers"),
])
def test_malformed_config_names_the_problem(runner: ModelRunner, head_dir: Path, tmp_path: Path,
                                            text: str, named: str) -> None:
    """A head folder whose config.json is not JSON, not an object, or holds a field of the
    wrong type is refused with a ValueError naming the file or the field (not a JSON decoder
    or ``int()`` message, nor an AttributeError)."""
    (tmp_path / "model.safetensors").write_bytes((head_dir / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")) as e:
        load_eagle_head(tmp_path, runner.model_config, device=CPU, dtype=torch.float32)
    assert str(e.value).startswith(str(tmp_path))  # which head folder


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_feature_store_graph_writes_what_the_eager_store_writes(runner: ModelRunner,
                                                               head_dir: Path) -> None:
    """Verify-time stores through the feature-store graphs (first sighting eager, second
    captured, later ones replayed without a host sync) leave the feature table bit-equal to
    the eager store's, with new features, rows, positions and pages every step."""
    dev = torch.device("cuda")
    model, cfg = runner.model.to(dev), runner.model_config
    target = ModelRunner(model, cfg, CacheConfig(page_size=PAGE, num_pages=80), device=dev,
                         dtype=torch.float32)
    spec = SpecConfig(algorithm="eagle", draft_model=str(head_dir), num_draft_tokens=4,
                      depth=2, topk=2)
    graphed, eager = (EagleDrafter(spec, target=target, device=dev, dtype=torch.float32,
                                   num_pages=80, use_cuda_graph=g) for g in (True, False))
    assert graphed.store_graphs is not None and eager.store_graphs is None
    try:
        gen = torch.Generator(device=dev).manual_seed(0)
        nsrc = len(graphed.aux_hidden_layers) or 1
        hidden = [torch.empty(2, 4, cfg.hidden_size, device=dev) for _ in range(nsrc)]
        rows = torch.empty(2, 4, dtype=torch.int64, device=dev)  # static, like accept_nodes
        prompts = {"a": 5, "b": 3}
        prefill = [torch.randn(2, 5, cfg.hidden_size, generator=gen, device=dev)
                   for _ in range(nsrc)]
        for d in (graphed, eager):
            d.on_target_hidden([DraftRequest(r, [1] * n, 0) for r, n in prompts.items()],
                               prefill[0], None, [5, 3], prefill if nsrc > 1 else ())
        seq = dict(prompts)
        rng = random.Random(0)
        for step in range(6):
            for h in hidden:
                h.normal_(generator=gen)
            rows.copy_(torch.randint(-1, 4, (2, 4), generator=gen, device=dev))
            reqs = [DraftRequest(r, [1] * seq[r], seq[r]) for r in prompts]
            runs = [rng.randint(1, 4) for _ in reqs]
            for d in (graphed, eager):
                check = d is graphed and step >= 2
                if check:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    d.on_target_hidden(reqs, hidden[0], rows, None, hidden if nsrc > 1 else ())
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                d.commit_target_hidden(reqs, runs)
            for r, n in zip(prompts, runs, strict=True):
                seq[r] += n
        assert graphed.store_graphs.replays == 5 and len(graphed.store_graphs) == 1
        torch.cuda.synchronize()
        # row 0 is the sink slot, never read: the prefill's padding columns all land there
        # and CUDA's index_copy_ keeps any one of duplicate writes (two eager stores of the
        # same prefill differed there on the H200)
        assert torch.equal(graphed.features[1:], eager.features[1:])
        assert {r: s.feat_len for r, s in graphed.states.items()} == seq
    finally:
        runner.model.to(CPU)
