"""StepTimer on the CPU: phases accumulate per step, summaries average, drain hands out once."""

from __future__ import annotations

import time

import torch

from structspec.scheduler.step_stats import StepTimer


def test_phases_summary_and_drain() -> None:
    timer = StepTimer(torch.device("cpu"))
    for _ in range(3):
        timer.begin(batch_size=2, num_nodes=8, constrained=1)
        time.sleep(0.002)
        timer.phase("draft")
        timer.event("fwd_start")  # no-op without CUDA
        timer.phase("launch")
        time.sleep(0.001)
        timer.phase("launch")  # a phase may be closed twice in a step: the times add up
        timer.end()
    recs = timer.drain()
    assert len(recs) == 3 and timer.drain() == []
    r = recs[0]
    assert (r.batch_size, r.num_nodes, r.constrained) == (2, 8, 1)
    assert r.cpu_ms["draft"] >= 1.5 and r.cpu_ms["launch"] >= 0.9
    assert r.wall_ms >= r.cpu_ms["draft"] + r.cpu_ms["launch"] - 1e-6
    assert r.gpu_forward_ms is None and r.gpu_busy_ms is None
    s = timer.summary()
    assert s["steps"] == 3 and s["cpu_draft_ms"] >= 1.5 and s["cpu_mask_ms"] == 0.0
    assert "gpu_busy_ms" not in s
    timer.phase("draft")  # outside a step: ignored
    timer.reset()
    assert timer.summary() == {"steps": 0.0}
