"""When a host tree's mask-worker build is sent: before or after the verify launch.

With a host tree (n-gram) whose walks go to the mask worker pool, the step can send the pool
its build before launching the verify forward, or launch first and send right after:

- launch first: the GPU starts ``S`` (the send, ~0.1 ms) earlier; the walks start only after
  the launch's host staging ``L`` (0.4-4 ms at batch 8-64 on the H200 host). The step ends at
  about ``L + max(F, S + W)`` (``F`` the GPU forward, ``W`` the workers' round trip).
- send first: the walks run during the launch; the GPU starts ``S`` later. The step ends at
  about ``S + max(L + F, W)``.

So the launch goes first while the walks hide under the forward (``S + W <= F``), and the build
goes first when they do not. Measured on the H200 (benchmarks/README.md, "Fourth and fifth
H200 runs: the pool build before or after the launch"): with the build always sent first, the
llguidance grammar overlap at batch 8 / 32 was 1.11 / 1.14 against 1.07 / 1.04 launching
first, and 300 distinct MaskBench schemas ran at 5.3-6.4k tok/s with the default workers
against 8.4k launching first.

``F`` is the forward's GPU time left once the launch returned: the step record's
``gpu_forward_ms`` (``fwd_start`` to ``fwd_end`` on the GPU) less ``host_fwd_launch_ms`` (the
host time between recording the two). A host tree has no draft kernels, so the GPU reaches
``fwd_start`` at once and waits there through ``L`` (and, sending first, through ``S``):
``gpu_forward_ms`` alone counts ``L + F`` and would keep the launch first while ``F < S + W <
L + F``, where sending first saves up to ``L`` per step.

A device tree (EAGLE, draft model) can go first too (with the mirrors' barrier), but the send
then waits for the draft kernels before the launch: ``auto`` launches first for it. Measured on
the H200 (benchmarks/README.md, "Fourteenth H200 run"): the build first at batch 8 / 32 / 64
gave step ratios of 1.250 / 1.227 / 1.196 against 1.280 / 1.090 / 1.149 launching first, the
host waiting 0.4-0.6 ms for the draft at batch 32-64 with the GPU idle meanwhile.

On the CPU the verify "launch" is the forward itself (the CPU ops run as they are called), so
the build always goes first there: walking after it would serialize the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from structspec.scheduler.step_record import StepRecord

BuildOrderMode = Literal["auto", "before", "after"]

#: weight of the newest step in the moving averages of the walk and forward times
EMA_WEIGHT = 0.1


@dataclass
class PoolBuildOrder:
    """Decides, per verify step, whether the pool build is sent before the launch.

    Args:
        mode: ``auto`` (from the measured times, see the module doc), ``before`` or
            ``after`` (fixed; for measurements and tests).
        forward_on_host: the forward runs inside the launch (CPU): ``auto`` sends first.

    Attributes:
        walk_ms: moving average over the pool's steps of the send time plus the busiest
            worker's round trip (ms), or None before the first such step was read.
        forward_ms: moving average of the GPU verify forward's time after its launch (ms;
            ``F`` of the module doc), or None before the first step's CUDA events were read.
    """

    mode: BuildOrderMode = "auto"
    forward_on_host: bool = False
    walk_ms: float | None = None
    forward_ms: float | None = None
    _last: StepRecord | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "before", "after"):
            raise ValueError(f"build order mode must be auto, before or after, not {self.mode!r}")

    def send_first(self, *, device_tree: bool = False) -> bool:
        """Whether this step's pool build goes out before the verify launch.

        Args:
            device_tree: the tree is drafted on the device (EAGLE, draft model): sending
                first waits for the draft kernels before the launch. ``auto`` launches first
                for such trees.
        """
        if self.mode != "auto":
            return self.mode == "before"
        if device_tree:
            return False
        if self.forward_on_host:
            return True
        if self.walk_ms is None or self.forward_ms is None:
            return False  # the measured default until both are known
        return self.walk_ms > self.forward_ms

    def observe(self, rec: StepRecord | None) -> None:
        """Fold in the newest finished step record (the step timer reads a step's CUDA
        events one step late; a record already seen is skipped)."""
        if rec is None or rec is self._last:
            return
        self._last = rec
        if rec.gpu_forward_ms is not None:
            # the GPU waited for the launch's host staging; the walks' window opens after it
            after_launch = rec.gpu_forward_ms - (rec.host_fwd_launch_ms or 0.0)
            self.forward_ms = _ema(self.forward_ms, max(after_launch, 0.0))
        if rec.pool_worker_max_ms is not None:
            walk = (rec.pool_send_ms or 0.0) + rec.pool_worker_max_ms
            self.walk_ms = _ema(self.walk_ms, walk)


def _ema(avg: float | None, value: float) -> float:
    """``avg`` moved :data:`EMA_WEIGHT` of the way to ``value`` (``value`` when None)."""
    return value if avg is None else avg + EMA_WEIGHT * (value - avg)
