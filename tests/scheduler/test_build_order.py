"""When a host tree's mask-worker build is sent (structspec/scheduler/build_order.py)."""

from __future__ import annotations

import pytest

from structspec.scheduler.build_order import PoolBuildOrder
from structspec.scheduler.step_record import StepRecord


def record(forward_ms: float | None, walk_ms: float | None = None,
           launch_ms: float | None = None) -> StepRecord:
    """A step record: GPU ``fwd_start`` to ``fwd_end`` ``forward_ms``, of which ``launch_ms``
    the host spent launching; the pool's send plus busiest worker ``walk_ms``."""
    rec = StepRecord(batch_size=8, num_nodes=8, constrained=8, gpu_forward_ms=forward_ms,
                     host_fwd_launch_ms=launch_ms)
    if walk_ms is not None:
        rec.pool_workers, rec.pool_send_ms, rec.pool_worker_max_ms = 8, 0.1, walk_ms - 0.1
    return rec


def test_auto_launches_first_until_walks_outlast_the_forward() -> None:
    order = PoolBuildOrder()
    assert not order.send_first()  # nothing measured yet: the launch goes first
    order.observe(record(2.0, walk_ms=0.6))
    assert not order.send_first()  # the walks hide under the forward
    for _ in range(40):  # the walks grow past the forward: the moving average follows
        order.observe(record(2.0, walk_ms=3.0))
    assert order.walk_ms == pytest.approx(3.0, abs=0.05) and order.send_first()
    for _ in range(40):  # steps without the pool move only the forward's average
        order.observe(record(4.0))
    assert order.walk_ms == pytest.approx(3.0, abs=0.05) and not order.send_first()


def test_the_launch_is_not_counted_as_forward() -> None:
    """The GPU waits at ``fwd_start`` through the launch's host staging; the walks can hide
    only under the forward left after it (module doc: ``F``, not ``L + F``)."""
    order = PoolBuildOrder()
    order.observe(record(3.0, walk_ms=1.5, launch_ms=2.0))  # 1.0 ms of forward after the launch
    assert order.forward_ms == pytest.approx(1.0) and order.send_first()
    order = PoolBuildOrder()
    order.observe(record(3.0, walk_ms=1.5, launch_ms=1.0))
    assert order.forward_ms == pytest.approx(2.0) and not order.send_first()
    order.observe(record(1.0, launch_ms=1.5))  # the clocks disagree: no negative forward
    assert order.forward_ms == pytest.approx(1.8)


def test_a_record_is_folded_in_once() -> None:
    order = PoolBuildOrder()
    rec = record(2.0, walk_ms=1.0)
    order.observe(rec)
    order.observe(record(4.0, walk_ms=3.0))
    order.observe(rec)  # not the newest any more, but not the last seen either: counted
    seen = (order.forward_ms, order.walk_ms)
    order.observe(rec)  # the same record again: skipped
    order.observe(None)
    assert (order.forward_ms, order.walk_ms) == seen


def test_device_trees_launch_first_unless_fixed() -> None:
    """A device tree's build would wait for the draft kernels before the launch: ``auto``
    launches first for it even when the walks outlast the forward (and on the CPU)."""
    for order in (PoolBuildOrder(), PoolBuildOrder(forward_on_host=True)):
        order.observe(record(1.0, walk_ms=3.0))
        assert order.send_first() and not order.send_first(device_tree=True)
    assert PoolBuildOrder("before").send_first(device_tree=True)
    assert not PoolBuildOrder("after").send_first(device_tree=True)


def test_fixed_modes_and_the_host_forward() -> None:
    assert PoolBuildOrder("before").send_first()
    assert not PoolBuildOrder("after", forward_on_host=True).send_first()
    # on the CPU the launch is the forward: the workers walk during it
    assert PoolBuildOrder(forward_on_host=True).send_first()
    with pytest.raises(ValueError, match="build order mode"):
        PoolBuildOrder("sometimes")  # type: ignore[arg-type]
