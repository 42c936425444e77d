"""KeyedGraphs (runner/keyed_graphs.py) on CUDA: a replay returns what the eager function
returns for the same inputs, reads the inputs' current contents, never syncs the host, and
fresh-address inputs run eagerly instead of capturing graph after graph. CUDA only (CI has no
GPU: skipped there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structspec.staging import PinnedRing

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
