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


class FakeEvent:
    """A CUDA event on a fake GPU that reaches each event :attr:`lag_ms` after the host
    records it (the lag set before the forward's ``fwd_end``: the forward runs after it)."""

    lag_ms = 0.0

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.t_ms = 0.0

    def record(self, stream: object = None) -> None:
        self.t_ms = self.clock.now * 1e3 + FakeEvent.lag_ms

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t_ms - self.t_ms

    def synchronize(self) -> None:
        pass


def test_cuda_records_one_step_late_feed_the_build_order(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """On CUDA a step's record is read at the next step's end (or a flush): ``latest()``
    after ``end()`` is the previous step's, with the forward's GPU time and the host's launch
    time, and the build order (fed as VerifyStep.run feeds it) folds each record in once."""
    from structspec.scheduler.build_order import PoolBuildOrder

    clock = FakeClock()
    monkeypatch.setattr(step_stats.time, "perf_counter", clock)
    monkeypatch.setattr(step_stats.torch.cuda, "Event",
                        lambda enable_timing=False: FakeEvent(clock))
    monkeypatch.setattr(step_stats.torch.cuda, "current_stream", lambda: None)
    timer = StepTimer(torch.device("cuda"))
    order = PoolBuildOrder()
    seen = []

    def step(launch_ms: float, forward_ms: float) -> None:
        FakeEvent.lag_ms = 0.0
        timer.begin(batch_size=8, num_nodes=8, constrained=8)
        timer.event("fwd_start")
        clock.advance_ms(launch_ms)  # the GPU waits for the launch at fwd_start
        FakeEvent.lag_ms = forward_ms
        for name in ("fwd_end", "post", "end"):
            timer.event(name)
        clock.advance_ms(forward_ms + 0.5)  # the wait and the commit
        timer.end()
        order.observe(timer.latest())
        seen.append(order.forward_ms)

    step(2.0, 1.0)
    assert timer.latest() is None and seen == [None]  # nothing read yet
    step(1.0, 3.0)
    rec = timer.latest()
    assert rec is not None and rec.gpu_forward_ms == pytest.approx(3.0)
    assert rec.host_fwd_launch_ms == pytest.approx(2.0) and seen[-1] == pytest.approx(1.0)
    timer.break_chain()  # a prefill: the second step's record is read now
    step(0.5, 2.0)
    assert timer.latest().gpu_forward_ms == pytest.approx(4.0)  # type: ignore[union-attr]
    assert seen[-1] == pytest.approx(1.0 + 0.1 * (3.0 - 1.0))
    order.observe(timer.latest())  # read again: not folded in twice
    assert order.forward_ms == pytest.approx(seen[-1])
    assert timer.summary()["host_fwd_launch_ms"] == pytest.approx((2.0 + 1.0 + 0.5) / 3)
    timer.reset()
    assert timer.latest() is None
    step(1.0, 1.0)
    assert timer.latest() is None and order.forward_ms == pytest.approx(seen[-2])
