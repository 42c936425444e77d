"""Adaptive draft-tree sizing: the formula, the cost model, the sizer's plans, the tree fit."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from structspec.config import EngineConfig, SpecConfig, resolve_engine_config
from structspec.draft_tree.layout import VerifyTree
from structspec.scheduler.draft_guard import GuardedDrafter
from structspec.scheduler.tree_fit import fit_trees, real_nodes
from structspec.scheduler.tree_sizing import (
    AdaptiveTreeSizer,
    expected_tokens,
    host_tree_nodes,
    tree_size_choices,
)
from structspec.scheduler.verify_cost import VerifyCostModel, rows_bucket
from structspec.speculative.base import Drafter, DraftRequest


class FixedCost(VerifyCostModel):
    """A cost model with given verify times per rows (ms = base + per_row * rows) and draft
    time, which the steps' own timings do not move."""

    def __init__(self, base_ms: float, per_row_ms: float, draft_ms: float = 0.0) -> None:
        super().__init__()
        for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for _ in range(2):  # the first of a bucket is its warm-up
                super().observe(rows, base_ms + per_row_ms * rows)
        self.draft_ms_per_request = draft_ms

    def observe(self, rows: int, verify_ms: float, *, draft_ms: float = 0.0,
                num_drafted: int = 0, draft_nodes: int = 0) -> None:
        pass


def test_expected_tokens_formula() -> None:
    assert expected_tokens(1, 0.7) == 1.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(8, 1.0) == 8.0
    assert expected_tokens(8, 0.0) == 1.0
    a, n = 0.8, 5
    assert expected_tokens(n, a) == pytest.approx(sum(a ** i for i in range(n)))


def test_tree_size_choices() -> None:
    assert tree_size_choices(8) == (1, 2, 4, 8)
    assert tree_size_choices(6) == (1, 2, 4, 6)
    assert tree_size_choices(2) == (1, 2)
    assert tree_size_choices(1) == (1,)
    with pytest.raises(ValueError, match="max_nodes"):
        tree_size_choices(0)


def test_cost_model_drops_warmup_and_interpolates() -> None:
    cost = VerifyCostModel(alpha=0.5)
    assert rows_bucket(1) == 0 and rows_bucket(8) == 3 and rows_bucket(5) == 3
    assert cost.verify_ms(4) is None
    cost.observe(1, 500.0)  # warm-up: dropped
    assert cost.samples(1) == 0 and cost.verify_ms(1) is None
    cost.observe(1, 10.0)
    cost.observe(8, 999.0)
    cost.observe(8, 80.0)
    assert cost.verify_ms(1) == pytest.approx(10.0)
    assert cost.verify_ms(8) == pytest.approx(80.0)
    assert cost.verify_ms(4) == pytest.approx(40.0)  # linear between the buckets
    assert cost.verify_ms(16) == pytest.approx(160.0)  # the two nearest buckets' slope
    cost.observe(1, 20.0, draft_ms=6.0, num_drafted=3)
    assert cost.verify_ms(1) == pytest.approx(15.0)  # EWMA, alpha 0.5
    assert cost.draft_ms_per_request == pytest.approx(2.0)
    cost.observe(1, 10_000.0)  # an outlier counts as 4x the average at most
    assert cost.verify_ms(1) == pytest.approx(15.0 + 0.5 * (60.0 - 15.0))
    with pytest.raises(ValueError, match="alpha"):
        VerifyCostModel(alpha=0.0)


def test_first_propose_of_a_size_does_not_price_it_for_good() -> None:
    """Each size's first propose (one-time work) is dropped once any size has a kept
    sample; a size with only its first one borrows a measured size's price (optimistic, so
    it gets tried and measured) instead of its inflated first sample."""
    cost = VerifyCostModel(alpha=0.5)
    cost.observe(8, 30.0, draft_ms=400.0, num_drafted=1, draft_nodes=8)  # first: warm-up
    cost.observe(2, 30.0, draft_ms=9.0, num_drafted=1, draft_nodes=2)  # first: warm-up
    assert cost.draft_ms(8) == pytest.approx(400.0)  # nothing kept yet: the first samples
    cost.observe(2, 30.0, draft_ms=3.0, num_drafted=1, draft_nodes=2)
    assert cost.draft_ms(2) == pytest.approx(3.0)
    assert cost.draft_ms(8) == pytest.approx(3.0)  # 400 ms no longer prices 8 out
    cost.observe(8, 30.0, draft_ms=12.0, num_drafted=1, draft_nodes=8)
    assert cost.draft_ms(8) == pytest.approx(12.0)
    cost.observe(8, 30.0, draft_ms=1000.0, num_drafted=1, draft_nodes=8)  # an outlier: 4x
    assert cost.draft_ms(8) == pytest.approx(12.0 + 0.5 * (48.0 - 12.0))


def test_draft_cost_per_tree_size_prices_each_size() -> None:
    """A model drafter's propose costs more for deeper trees (one draft forward per depth):
    the cost model keeps it per planned size and the sizer prices each size with its own;
    an unmeasured size borrows the nearest larger measured one (never cheaper)."""
    cost = VerifyCostModel(alpha=0.5)
    assert cost.draft_ms(4) is None
    cost.observe(2, 30.0, draft_ms=2.0, num_drafted=1, draft_nodes=2)
    cost.observe(8, 30.0, draft_ms=12.0, num_drafted=1, draft_nodes=8)
    assert cost.draft_ms(2) == pytest.approx(2.0)
    assert cost.draft_ms(8) == pytest.approx(12.0)
    assert cost.draft_ms(4) == pytest.approx(12.0)  # the nearest larger measured size
    assert cost.draft_ms(16) == pytest.approx(12.0)
    assert cost.draft_ms_per_request == pytest.approx(7.0)  # all sizes, EWMA alpha 0.5
    # flat verify rows, a cheap 2-node probe and an expensive full tree: at a middling
    # acceptance the 2-node tree pays, the full one does not (one shared draft cost
    # would have priced them alike)
    fixed = FixedCost(20.0, 0.0)
    fixed._draft_ms_by_nodes = {2: 1.0, 4: 30.0, 8: 60.0}  # noqa: SLF001
    sizer = AdaptiveTreeSizer("on", 8, cost=fixed, prior_accept=0.3)
    assert sizer.plan(["a"]).num_nodes == 2


def test_sizer_calibrates_then_sizes_by_acceptance() -> None:
    sizer = AdaptiveTreeSizer("on", 8)
    # unmeasured: full trees, then plain decodes, two steps each (the first is a warm-up)
    sizes = []
    for _ in range(4):
        plan = sizer.plan(["a"])
        sizes.append(plan.num_nodes)
        sizer.observe_step(plan.num_nodes, 10.0 * plan.num_nodes, 0.0, 0)
    assert sizes == [8, 8, 1, 1]
    # CPU-like cost (a row costs 8 ms over a 20 ms step): a low acceptance does not pay
    # for a tree, a middling one for a small tree, a high one for the full tree
    sizer.cost = FixedCost(20.0, 8.0)
    for _ in range(20):
        sizer.observe_request("a", 7, 0)
    assert sizer.plan(["a"]).num_nodes == 1
    sizer.release("a")
    sizer.engine_accept = 0.5
    assert sizer.plan(["a"]).num_nodes == 2  # E(2) / 36 ms = 1.5 / 36 > 1 / 28
    for _ in range(20):
        sizer.observe_request("a", 7, 7)
    assert sizer.accept("a") > 0.9
    plan = sizer.plan(["a"])
    assert plan.num_nodes == 8 and plan.full


def test_sizer_flat_cost_keeps_full_trees_and_auto_stays_off() -> None:
    on = AdaptiveTreeSizer("on", 8, cost=FixedCost(20.0, 0.01))
    assert on.plan(["a", "b"]).full  # rows nearly free: every tree pays
    auto = AdaptiveTreeSizer("auto", 8, cost=FixedCost(20.0, 0.01))
    for _ in range(30):
        auto.observe_request("a", 7, 0)
    plan = auto.plan(["a"])
    assert plan.full and plan.num_nodes == 8 and not auto.counts.adaptive_active
    auto_cpu = AdaptiveTreeSizer("auto", 8, cost=FixedCost(0.0, 10.0))
    for _ in range(30):
        auto_cpu.observe_request("a", 7, 0)
    assert auto_cpu.plan(["a"]).num_nodes == 1 and auto_cpu.counts.adaptive_active
    off = AdaptiveTreeSizer("off", 8, cost=FixedCost(0.0, 10.0))
    assert off.plan(["a"]).full
    with pytest.raises(ValueError, match="speculative_adaptive"):
        AdaptiveTreeSizer("sometimes", 8)


def test_auto_keeps_full_trees_where_they_pay_on_average() -> None:
    """The GPU batch-1 regime: a full-tree step costs 2x a plain one in wall time, yet commits
    ~2.6 tokens on average. ``on`` demotes a request after a few unlucky steps; ``auto`` keeps
    full trees while the engine's acceptance says they pay, and sizes once it says not."""
    def sizer(mode: str) -> AdaptiveTreeSizer:
        return AdaptiveTreeSizer(mode, 8, cost=FixedCost(1.2, 0.15))  # T(8) / T(1) = 1.8
    auto, on = sizer("auto"), sizer("on")
    # runs of 0-4 accepted drafts and a full chain: ML acceptance ~0.68
    runs = [1, 2, 0, 3, 1, 0, 2, 1, 0, 4, 2, 7] * 4
    for s in (auto, on):
        for n in runs:
            s.observe_request("warm", 7, n)
    assert 0.6 < auto.engine_accept < 0.72
    # the mean of per-step ratios would say ~0.5, where full trees stop paying
    assert expected_tokens(8, auto.engine_accept) / 2.4 > 1 / 1.35 * 1.03
    for n in (0, 0, 1, 0):  # an unlucky stretch of one request
        auto.observe_request("a", 7, n)
        on.observe_request("a", 7, n)
    assert on.plan(["a"]).num_nodes < 8  # per-request sizing shrinks its tree
    plan = auto.plan(["a"])
    assert plan.full and plan.num_nodes == 8 and not auto.counts.adaptive_active
    # the workload turns unpredictable: the engine's acceptance falls, auto sizes
    for _ in range(80):
        auto.observe_request("b", 7, 0)
    assert auto.engine_accept < 0.2
    assert auto.plan(["a"]).num_nodes == 2 and auto.counts.adaptive_active  # a's own 0.31
    # rows dominate (a CPU: T(8) / T(1) ~ 3.4): sized per request even where full trees
    # pay at the engine's acceptance
    cpu = AdaptiveTreeSizer("auto", 8, cost=FixedCost(10.0, 30.0))  # T(1) 40, T(8) 250
    cpu.engine_accept = 0.95
    assert cpu._full_trees_pay(1)
    for n in (0, 0, 1, 0):
        cpu.observe_request("c", 7, n)
    assert cpu.plan(["c"]).num_nodes < 8 and cpu.counts.adaptive_active


def test_mixed_batch_plain_rows_and_probes_with_backoff() -> None:
    sizer = AdaptiveTreeSizer("on", 8, cost=FixedCost(1.0, 2.0), probe_every=4,
                              max_probe_every=16)
    for _ in range(30):
        sizer.observe_request("hot", 7, 7)
        sizer.observe_request("cold", 7, 0)
    plan = sizer.plan(["cold", "hot"])
    assert plan.drafted == (1,) and plan.num_nodes == 8 and not plan.full
    assert sizer.counts.drafting == 1 and sizer.counts.plain == 1
    # "cold" alone: plain decodes, one 2-node probe every 4 steps; failed probes back off
    probe_steps = []
    for step in range(40):
        plan = sizer.plan(["cold"])
        if plan.probes:
            assert plan.num_nodes == 2 and plan.drafted == (0,)
            probe_steps.append(step)
            sizer.observe_request("cold", 1, 0, probe=True)
        else:
            assert plan.num_nodes == 1 and plan.drafted == ()
    # the mixed step above was its first idle one: probes every 4, then 8, then 16 steps
    assert probe_steps[:3] == [2, 10, 26]
    # a probe that accepts resets the interval; acceptance recovers with repetitive text
    sizer.observe_request("cold", 1, 1, probe=True)
    for _ in range(20):
        sizer.observe_request("cold", 7, 7)
    assert sizer.plan(["cold"]).num_nodes == 8
    sizer.release("cold")
    sizer.release("hot")
    assert sizer.num_tracked() == 0


def _host_tree(rows: list[tuple[list[int], list[int]]], n: int) -> VerifyTree:
    toks = torch.full((len(rows), n), -1, dtype=torch.int64)
    pars = torch.zeros((len(rows), n), dtype=torch.int64)
    for b, (t, p) in enumerate(rows):
        toks[b, : len(t)] = torch.tensor(t)
        pars[b, : len(p)] = torch.tensor(p)
    return VerifyTree.from_parents(toks, pars)


def test_fit_trees_cuts_pads_and_keeps_structure() -> None:
    sub = _host_tree([([5, 6, 7, 8], [-1, 0, 1, 0]), ([9, 10], [-1, 0])], 8)
    assert real_nodes(sub) == [4, 2]
    assert host_tree_nodes(real_nodes(sub), (1, 2, 4, 8)) == 4
    assert host_tree_nodes([1, 1], (1, 2, 4, 8)) == 1
    tree = fit_trees([1, 5, 2, 9], [1, 3], sub, 4)
    want = _host_tree([([1], [-1]), ([5, 6, 7, 8], [-1, 0, 1, 0]), ([2], [-1]),
                       ([9, 10], [-1, 0])], 4)
    for name in ("draft_tokens", "parents", "depth", "next_token", "next_sibling",
                 "ancestor_mask"):
        assert torch.equal(getattr(tree, name), getattr(want, name)), name
    cut = fit_trees([5], [0], _host_tree([([5, 6, 7, 8], [-1, 0, 1, 2])], 8), 2)
    assert cut.draft_tokens.tolist() == [[5, 6]] and cut.depth.tolist() == [[0, 1]]
    plain = fit_trees([3, 4], [], None, 1)
    assert plain.num_nodes == 1 and plain.draft_tokens.tolist() == [[3], [4]]
    full = fit_trees([5, 9], [0, 1], sub, 8)
    assert full is sub
    with pytest.raises(ValueError, match="do not fit"):
        fit_trees([5], [0], sub, 4)


def test_config_names_speculative_adaptive() -> None:
    cfg = EngineConfig(device="cpu", spec=SpecConfig(algorithm="ngram", adaptive="maybe"))
    with pytest.raises(ValueError, match="speculative_adaptive='maybe'"):
        resolve_engine_config(cfg)
    ok = resolve_engine_config(EngineConfig(device="cpu", spec=SpecConfig(algorithm="ngram")))
    assert ok.spec.adaptive == "auto"


def test_cli_flag() -> None:
    import argparse

    from structspec.engine_args import add_engine_args, engine_kwargs, flag_error

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(["--speculative-algorithm", "ngram", "--speculative-adaptive", "on"])
    assert engine_kwargs(args)["speculative_adaptive"] == "on"
    assert ap.parse_args([]).speculative_adaptive == "auto"
    assert flag_error("speculative_adaptive='x': expected").startswith("--speculative-adaptive")
    assert math.isfinite(expected_tokens(4, 0.999999))


def test_prometheus_shows_drafting_and_plain_requests() -> None:
    pytest.importorskip("prometheus_client")
    from structspec.core import SpecMetrics
    from structspec.scheduler.step_record import StepRecord
    from structspec.server.ipc import EngineStats
    from structspec.server.metrics import ServerMetrics

    m = ServerMetrics()
    steps = (StepRecord(3, 8, 0, num_drafting=3), StepRecord(3, 4, 0, num_drafting=1,
                                                             num_plain=2))
    m.on_engine_stats(EngineStats(steps=steps))
    text = m.render().decode()
    assert "structspec_spec_requests_drafting 1.0" in text
    assert "structspec_spec_requests_plain 2.0" in text
    assert "structspec_verify_step_tree_nodes_sum 12.0" in text
    spec = SpecMetrics(verify_steps=4, committed_tokens=9, steps_without_draft=3,
                       tree_sizes={1: 3, 8: 1})
    assert spec.mean_tree_nodes == pytest.approx(2.75)
    d = spec.to_dict()
    assert d["steps_without_draft"] == 3 and d["tree_sizes"] == {"1": 3, "8": 1}
    total = SpecMetrics()
    total.add(spec)
    total.add(spec)
    assert total.tree_sizes == {1: 6, 8: 2} and total.steps_without_draft == 6


class RecordingStaging:
    """Stands in for the runner's pinned :class:`~structspec.staging.Staging` on the CPU:
    records every staged host tensor (shape, dtype) and returns a copy of it."""

    def __init__(self) -> None:
        self.staged: list[tuple[tuple[int, ...], torch.dtype]] = []

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        self.staged.append((tuple(host.shape), host.dtype))
        return host.clone()


class ChainDrafter(Drafter):
    """A device-tree drafter (``tree_on_host = False``) proposing ``root, root+1, ...``."""

    name = "chain"
    tree_on_host = False
    supports_grammar_overlap = True

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        toks = torch.tensor([[r.token_ids[-1] + i for i in range(self.num_nodes)]
                             for r in reqs], dtype=torch.int64)
        pars = torch.arange(-1, self.num_nodes - 1).expand(len(reqs), -1).contiguous()
        return VerifyTree.from_parents(toks, pars)


def test_mixed_trees_stage_host_values_through_the_pinned_ring() -> None:
    """docs/architecture.md, invariant 6: a mixed step of a device drafter (some rows drafted,
    some plain, or some stopped by a drafter failure) sends its host values (root tokens,
    padding, row index) to the device through the staging ring, one copy, never a pageable
    ``.to``. On CUDA the same steps run under the sync check (tests/engine/test_gpu_engine.py,
    ``test_mixed_tree_sizes_do_not_sync``)."""
    sub = _host_tree([([5, 6, 7, 8], [-1, 0, 1, 0]), ([9, 10], [-1, 0])], 8)
    staging = RecordingStaging()
    got = fit_trees([1, 5, 2, 9], [1, 3], sub, 4, staging)  # type: ignore[arg-type]
    want = fit_trees([1, 5, 2, 9], [1, 3], sub, 4)
    for name in ("draft_tokens", "parents", "depth", "next_token", "next_sibling",
                 "ancestor_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert staging.staged == [((4 * 4 + 2,), torch.int64)]  # roots + padding + index
    guard_staging = RecordingStaging()
    guard, reqs, tree = _propose_beside_a_stopped_request(ChainDrafter(4), torch.device("cpu"),
                                                          guard_staging)
    assert guard_staging.staged == [((2,), torch.int64)]  # the live rows' index
    assert guard.propose(reqs, max_nodes=2).draft_tokens.shape == (3, 4)  # propose_sized


def _propose_beside_a_stopped_request(
        drafter: Drafter, device: torch.device, staging: RecordingStaging | None,
) -> tuple[GuardedDrafter, list[DraftRequest], VerifyTree]:
    """Three requests, the middle one's drafting stopped, through a GuardedDrafter: the guard,
    the requests and the merged tree (checked: drafted rows chains, the stopped row root-only)."""
    guard = GuardedDrafter(drafter, device, staging)  # type: ignore[arg-type]
    guard.stopped.add("b")
    reqs = [DraftRequest(r, [3, t], 1) for r, t in (("a", 10), ("b", 20), ("c", 30))]
    tree = guard.propose(reqs)
    assert tree.draft_tokens.tolist() == [[10, 11, 12, 13], [20, -1, -1, -1], [30, 31, 32, 33]]
    return guard, reqs, tree


class HostChainDrafter(ChainDrafter):
    """:class:`ChainDrafter` as a host drafter (``tree_on_host = True``, like n-gram)."""

    name = "host_chain"
    tree_on_host = True


def test_stopped_request_beside_a_host_drafter_stages_nothing() -> None:
    """A host drafter's trees (n-gram) merged around a stopped request stay on the host: the
    row index too. Found on the H200 (``test_mixed_tree_sizes_do_not_sync[ngram]``): the index
    went through the staging ring to the GPU and indexing the host trees with it copied it
    back, a blocking sync every step."""
    staging = RecordingStaging()
    _, _, tree = _propose_beside_a_stopped_request(HostChainDrafter(4), torch.device("cuda"),
                                                   staging)
    assert tree.draft_tokens.device.type == "cpu"
    _, _, want = _propose_beside_a_stopped_request(HostChainDrafter(4), torch.device("cpu"),
                                                   None)
    for name in ("draft_tokens", "parents", "depth", "next_token", "next_sibling",
                 "ancestor_mask"):
        assert torch.equal(getattr(tree, name), getattr(want, name)), name
    assert staging.staged == []


def test_degenerate_observations_do_not_break_the_sizer() -> None:
    """A 0 ms bucket, counts outside 0..proposed and bad acceptance values (a tester's
    attack): no exception, no NaN, no bucket pinned at 0."""
    c = VerifyCostModel()
    for _ in range(3):
        c.observe(8, 0.0)
        c.observe(1, 1.0)
    assert AdaptiveTreeSizer("on", 8, cost=c).plan(["a"]).num_nodes in (1, 2, 4, 8)
    for _ in range(12):
        c.observe(8, 80.0)
    assert c.verify_ms(8) > 1.0  # recovers from the 0 ms samples
    sizer = AdaptiveTreeSizer("on", 8)
    sizer.observe_request("r", 3, -2)
    sizer.observe_request("r", 1, 100)
    assert 0.0 <= sizer.accept("r") <= 1.0 and 0.0 <= sizer.engine_accept <= 1.0
    for bad in (float("nan"), float("inf"), -1.0, 2.0):
        with pytest.raises(ValueError, match="engine_accept"):
            sizer.engine_accept = bad
