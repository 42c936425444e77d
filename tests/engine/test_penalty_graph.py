"""Sampling penalties in the post-forward CUDA graph (issue 20).

CPU: the post graph's body with penalties (static slot input, slot 0 on the dummy rows)
equals the scheduler's eager path on the real rows, and counts the same committed runs.
GPU (marker ``gpu``): the penalised post graph's replay equals its eager first run bit for bit
and makes no host sync; whole penalised engine steps make no host sync; with batch-invariant
kernels, penalised greedy output with speculation equals the output without it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from structspec.grammar.bitmask import bitmask_width
from structspec.layers.penalties import PenaltyInputs, PenaltyTable
from structspec.runner.cuda_graph import VerifyGraph
from structspec.scheduler.select_verify import select_verify
from tests.engine.conftest import PERSON_SCHEMA, PROMPTS, step_under_sync_check
from tests.engine.test_cuda_graph import (
    _accepting_tree,
    _HostStaging,
    batch_pages,
    build_runner,
    smol_config,
)


def penalty_table(vocab: int, device: torch.device) -> PenaltyTable:
    """Slots 1 and 2 penalised (counts, prompt tokens, a bias), slot 3 unused, slot 0
    neutral."""
    table = PenaltyTable.allocate(4, vocab, device)
    gen = torch.Generator().manual_seed(0)
    for slot, (p, f, r) in {1: (0.5, 0.4, 1.3), 2: (-1.0, 1.5, 0.8)}.items():
        ids = torch.randint(0, vocab, (60,), generator=gen)
        table.counts[slot].index_add_(0, ids[:30].to(device), torch.ones(30, device=device))
        table.prompt_mask[slot, ids[30:].to(device)] = True
        table.logit_bias[slot, ids[:5].to(device)] = torch.tensor([5.0, -100, 3, -2, 1],
                                                                  device=device)
        table.presence[slot], table.frequency[slot], table.repetition[slot] = p, f, r
    return table


def clone_table(table: PenaltyTable) -> PenaltyTable:
    return PenaltyTable(**{f.name: getattr(table, f.name).clone()
                           for f in dataclasses.fields(table)})


@pytest.mark.parametrize("masked", [False, True])
@torch.inference_mode()
def test_penalised_post_forward_matches_eager_cpu(masked: bool) -> None:
    cfg = smol_config(num_layers=2)
    dev = torch.device("cpu")
    runner = build_runner(cfg, dev, torch.float32, num_pages=64, use_cuda_graph=False)
    seq_lens, n = [37, 5, 60], 6
    bsz = len(seq_lens)
    pages = batch_pages(seq_lens, n, runner.page_size)
    tree = _accepting_tree(runner, seq_lens, pages, n, seed=11)
    ref = runner.verify(tree, seq_lens, pages)
    need = -(-(max(seq_lens) + n) // runner.page_size)
    g = VerifyGraph(4, n, 16, (), dev)  # bucket B=4: one dummy row
    runner.staging = _HostStaging()  # type: ignore[assignment]
    runner._stage_graph_inputs(g, tree, seq_lens, pages, need)
    logits, _, _ = g.forward(runner.model, runner.kv_pool, runner.page_size)
    logits[: bsz * n] = ref.logits
    g.logits = logits
    gen = torch.Generator().manual_seed(3)
    g.bitmask = torch.randint(-2**31, 2**31 - 1, (4 * n, bitmask_width(cfg.vocab_size)),
                              generator=gen, dtype=torch.int32)
    g.bitmask[::2] = -1
    g.cap = torch.full((4,), n, dtype=torch.int64)
    table = penalty_table(cfg.vocab_size, dev)
    want_table = clone_table(table)
    want, want_real = select_verify(
        ref.logits.clone(), g.bitmask[: bsz * n] if masked else None, tree.draft_tokens,
        tree.parents, tree.depth, tree.ancestor_mask, g.cap[:bsz] if masked else None,
        PenaltyInputs(want_table, torch.tensor([1, 0, 2])))
    got, got_real = g.post_forward(runner.kv_pool, runner.page_size, masked, select_verify,
                                   PenaltyInputs(table, torch.tensor([1, 0, 2, 0])))
    assert torch.equal(got.accept_len[:bsz], want.accept_len)
    assert torch.equal(got.accept_tokens[:bsz], want.accept_tokens)
    assert torch.equal(got_real[:bsz], want_real)
    assert torch.equal(table.counts, want_table.counts)  # the dummy row counted nothing
    assert int(want.accept_len.sum()) > bsz  # drafts were accepted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("masked", [False, True])
@torch.inference_mode()
def test_penalised_post_graph_replay_matches_eager_and_never_syncs(masked: bool) -> None:
    dev = torch.device("cuda")
    cfg = smol_config(num_layers=4)
    runner = build_runner(cfg, dev, torch.bfloat16, num_pages=512, use_cuda_graph=True)
    seq_lens, n = [300, 317, 350], 8
    pages = batch_pages(seq_lens, n, runner.page_size)
    tree = _accepting_tree(runner, seq_lens, pages, n, seed=3)
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
    table = penalty_table(cfg.vocab_size, dev)
    counts_before = table.counts.clone()
    kv_before = runner.kv_pool.kv_buffer.clone()
    logits_before = g.logits.clone()
    slots = [1, 0, 2]
    first = runner.greedy_verify(fwd, masked=masked, penalties=(table, slots))  # eager+capture
    first_out = [t.clone() for t in (first[0].accept_tokens, first[0].accept_len, first[1])]
    counts_first = table.counts.clone()
    assert (masked, True) in g.post_graphs
    runner.kv_pool.kv_buffer.copy_(kv_before)
    g.logits.copy_(logits_before)
    table.counts.copy_(counts_before)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = runner.greedy_verify(fwd, masked=masked, penalties=(table, slots))  # replay
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for a, b in zip(first_out, (again[0].accept_tokens, again[0].accept_len, again[1]),
                    strict=True):
        assert torch.equal(a, b)
    assert torch.equal(table.counts, counts_first)
    assert torch.equal(table.counts[0], torch.zeros_like(table.counts[0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_penalised_engine_steps_do_not_sync_and_spec_matches_plain() -> None:
    """Whole verify steps of a penalised batch (ngram, graphs, a grammar on half of it) make
    no host sync once the penalised post graph is captured; with batch-invariant kernels the
    penalised greedy outputs with and without speculation are equal."""
    from structspec import LLM, JsonSchemaConstraint, SamplingParams

    def params(i: int) -> SamplingParams:
        pen = [dict(frequency_penalty=0.8), dict(repetition_penalty=1.3),
               dict(presence_penalty=1.0, logit_bias={28: -100.0}), {}][i % 4]
        grammar = JsonSchemaConstraint(PERSON_SCHEMA) if i % 2 else None
        return SamplingParams(max_tokens=40, grammar=grammar, **pen)

    llms = {algo: LLM(device="cuda", speculative_algorithm=algo, num_draft_tokens=8,
                      max_batch_size=16, batch_invariant=True) for algo in ("none", "ngram")}
    try:
        engine = llms["ngram"].engine
        for i, p in enumerate(PROMPTS[:8]):
            engine.add_request(p, params(i))
        # every bucket the shrinking batch will use, with its penalised post graphs: no
        # capture (a device sync) inside the checked window
        table = engine.scheduler.penalties.table
        assert table is not None  # reserved when the first penalised request was added
        assert engine.runner.warmup_cuda_graphs(engine.drafter.num_nodes,
                                                batch_sizes=[1, 2, 4, 8], kv_lens=[256],
                                                penalty_table=table) == 4
        assert all(len(g.post_graphs) == 4 for g in engine.runner.graphs.graphs.values())
        while engine.scheduler.waiting or engine.scheduler.grammar_queue:
            engine.step()
        steps = step_under_sync_check(engine, 20)
        while engine.has_unfinished_requests():
            engine.step()
        assert steps > 3
        batch = [params(i) for i in range(len(PROMPTS))]
        plain = llms["none"].generate(PROMPTS, batch)
        spec = llms["ngram"].generate(PROMPTS, batch)
        diverged = [i for i, (a, b) in enumerate(zip(plain, spec, strict=True))
                    if a.token_ids != b.token_ids]
        print(f"penalised batch-invariant spec-vs-plain divergences: {len(diverged)}/"
              f"{len(PROMPTS)}")
        assert not diverged, diverged
    finally:
        for llm in llms.values():
            llm.close()
