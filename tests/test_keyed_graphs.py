"""KeyedGraphs (runner/keyed_graphs.py) on CUDA: a replay returns what the eager function
returns for the same inputs, reads the inputs' current contents, never syncs the host, and
fresh-address inputs run eagerly instead of capturing graph after graph. The ``ngram_eagle``
merge through it equals the eager merge. CUDA only (CI has no GPU: skipped there)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.speculative.ngram import NgramDrafter
from structspec.speculative.ngram_eagle import SCORE_SCALE, NgramEagleDrafter
from structspec.staging import PinnedRing
from tests.speculative.test_ngram_eagle import _random_tree

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")


def _fn(a: torch.Tensor, b: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = (a * 2 + b.float()).cumsum(1) - host.float()
    return x, x.argmax(1)


def test_replay_equals_eager_reads_current_inputs_and_never_syncs() -> None:
    from structspec.runner.keyed_graphs import KeyedGraphs

    graphs = KeyedGraphs(_fn, DEV, PinnedRing(DEV, torch.int64))
    a = torch.empty(3, 5, device=DEV)
    b = torch.empty(3, 5, dtype=torch.int64, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for step in range(6):
        a.normal_(generator=gen)
        b.random_(0, 9, generator=gen)
        host = np.random.default_rng(step).integers(-5, 5, (3, 5))
        want = _fn(a, b, torch.from_numpy(host).to(DEV))
        if step >= 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = graphs.run((a, b), host)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), step
    assert (graphs.eager_runs, graphs.replays, len(graphs)) == (1, 5, 1)
    # a view at another address (or shape) is another key: eager first, captured next time
    got = graphs.run((a[1:], b[1:]), np.zeros((2, 5), dtype=np.int64))
    assert torch.equal(got[0], _fn(a[1:], b[1:], torch.zeros(2, 5, device=DEV))[0])
    assert len(graphs) == 1 and graphs.eager_runs == 2


def test_fresh_inputs_stay_eager_past_the_graph_cap() -> None:
    from structspec.runner.keyed_graphs import KeyedGraphs

    graphs = KeyedGraphs(_fn, DEV, PinnedRing(DEV, torch.int64), max_graphs=1)
    keep = []
    for _ in range(4):  # distinct live tensors: distinct addresses, never seen twice
        a, b = torch.randn(2, 4, device=DEV), torch.ones(2, 4, dtype=torch.int64, device=DEV)
        keep.append((a, b))
        graphs.run((a, b), np.zeros((2, 4), dtype=np.int64))
    assert len(graphs) == 0 and graphs.eager_runs == 4
    a, b = keep[0]
    for _ in range(3):
        graphs.run((a, b), np.zeros((2, 4), dtype=np.int64))
    a2, b2 = keep[1]
    for _ in range(2):  # over the cap: eager
        got = graphs.run((a2, b2), np.ones((2, 4), dtype=np.int64))
    assert len(graphs) == 1 and graphs.replays == 3 and graphs.eager_runs == 6
    assert torch.equal(got[0], _fn(a2, b2, torch.ones(2, 4, device=DEV))[0])


class _GraphEagle:
    """What NgramEagleDrafter reads of EAGLE at construction, with graphs on."""

    def __init__(self, n: int, depth: int) -> None:
        self.num_nodes, self.depth, self.device = n, depth, DEV
        self.graphs = object()  # "proposes from CUDA graphs"
        from structspec.staging import Staging

        self.staging = Staging(DEV)
        self.aux_hidden_layers: tuple[int, ...] = ()


def test_ngram_eagle_merge_graph_equals_the_eager_merge() -> None:
    n, depth, bsz = 8, 4, 3
    spec = SpecConfig(algorithm="ngram_eagle", num_draft_tokens=n, depth=depth)
    drafter = NgramEagleDrafter(spec, ngram=NgramDrafter(spec),
                                eagle=_GraphEagle(n, depth))  # type: ignore[arg-type]
    assert drafter.merge_graphs is not None
    static = {k: torch.empty(bsz, n, dtype=dt, device=DEV) for k, dt in
              (("tok", torch.int64), ("par", torch.int64), ("dep", torch.int64),
               ("score", torch.float32))}
    rng = random.Random(0)
    for step in range(5):
        rows = [(_random_tree(rng, n, rng.randrange(0, n), 3, 6),
                 _random_tree(rng, n, rng.randrange(0, n), 3, depth)) for _ in range(bsz)]
        etree = VerifyTree.from_parents(torch.tensor([e[0] for _, e in rows], device=DEV),
                                        torch.tensor([e[1] for _, e in rows], device=DEV))
        static["tok"].copy_(etree.draft_tokens)
        static["par"].copy_(etree.parents)
        static["dep"].copy_(etree.depth)
        static["score"].copy_(torch.tensor([e[2] for _, e in rows], device=DEV))
        host = np.array([[g[0] for g, _ in rows], [g[1] for g, _ in rows],
                         [[round(max(x, -1e9) * SCORE_SCALE) for x in g[2]] for g, _ in rows]],
                        dtype=np.int64)
        inputs = (static["tok"], static["par"], static["dep"], static["score"])
        want = drafter._merge(*inputs, torch.from_numpy(host).to(DEV))
        got = drafter.merge_graphs.run(inputs, host)
        for field in ("draft_tokens", "parents", "depth", "next_token", "next_sibling"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (step, field)
    assert drafter.merge_graphs.replays == 4
