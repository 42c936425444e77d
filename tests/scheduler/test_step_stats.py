"""StepTimer on the CPU: phases accumulate per step, summaries average, drain hands out once.

The host clock is replaced by a fake one, so every duration is exact."""

from __future__ import annotations

import pytest
import torch

from structspec.scheduler import step_stats
from structspec.scheduler.step_stats import StepTimer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1e3


def test_phases_summary_and_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(step_stats.time, "perf_counter", clock)
    timer = StepTimer(torch.device("cpu"))
    for i in range(3):
        timer.begin(batch_size=2, num_nodes=8, constrained=1)
        clock.advance_ms(2.0 + i)
        timer.phase("draft")
        timer.event("fwd_start")  # no-op without CUDA
        clock.advance_ms(1.0)
        timer.phase("launch")
        clock.advance_ms(0.5)
        timer.phase("launch")  # a phase may be closed twice in a step: the times add up
        clock.advance_ms(0.25)  # not in any phase, but in the wall time
        timer.end()
    recs = timer.drain()
    assert len(recs) == 3 and timer.drain() == []
    r = recs[1]
    assert (r.batch_size, r.num_nodes, r.constrained) == (2, 8, 1)
    assert r.cpu_ms == pytest.approx({"draft": 3.0, "launch": 1.5})
    assert r.wall_ms == pytest.approx(4.75)
    assert r.gpu_forward_ms is None and r.gpu_busy_ms is None
    s = timer.summary()
    assert s["steps"] == 3
    assert s["cpu_draft_ms"] == pytest.approx(3.0)  # mean of 2, 3, 4
    assert s["wall_ms"] == pytest.approx(4.75) and s["cpu_mask_ms"] == 0.0
    assert "gpu_busy_ms" not in s
    timer.phase("draft")  # outside a step: ignored
    timer.reset()
    assert timer.summary() == {"steps": 0.0}
