"""The timing record of one verify step (torch-free: the server's front end imports it)."""

from __future__ import annotations

from dataclasses import dataclass, field

CPU_PHASES = ("draft", "launch", "barrier", "mask", "text", "wait", "commit")
GPU_INTERVALS = ("gpu_draft", "gpu_forward", "gpu_grammar_stall", "gpu_post", "gpu_idle_before")


@dataclass
class StepRecord:
    """Timings of one verify step, milliseconds (GPU fields stay None on the CPU).

    Attributes:
        batch_size: requests in the step.
        num_nodes: tree size ``N``.
        constrained: requests with a grammar.
        wall_ms: host time from the step's start to the end of its commit.
        cpu_ms: host time per phase (keys :data:`CPU_PHASES`): ``draft`` (propose),
            ``launch`` (tree upload + verify launch), ``barrier`` (matchers advanced over the
            previous step), ``mask`` (tree bitmask build + upload), ``text`` (previous step's
            detokenization / stop strings), ``wait`` (host blocked on the step's results),
            ``commit`` (results committed, drafter updated).
        gpu_draft_ms, gpu_forward_ms, gpu_grammar_stall_ms, gpu_post_ms, gpu_idle_before_ms:
            see :mod:`structspec.scheduler.step_stats`.
        num_drafting: requests the drafter proposed a tree for (adaptive sizing may leave
            some out; all of them with a drafter and fixed trees, none without a drafter).
        num_plain: requests verified as a plain decode row (the root alone).
        pool_workers, pool_send_ms, pool_worker_max_ms: when the mask worker pool built the
            step's tree bitmask, the workers messaged, the host time spent sending to them,
            and the busiest worker's time from message to reply (None otherwise).
        pool_first_start_ms, pool_last_reply_ms, pool_read_ms: the same build's round trip
            from its first message: the first worker starting, the last reply sent, the last
            reply read by the engine (:class:`~structspec.grammar.pool_types.PoolBuildResult`).
        pool_sent_first: when the pool built the step's bitmask, whether its build went out
            before the verify launch (:mod:`~structspec.scheduler.build_order`; the
            summary's mean is the share of such steps).
        host_fwd_launch_ms: on CUDA, the host time from recording ``fwd_start`` to recording
            ``fwd_end``: staging the tree and launching the verify forward (and, when the pool
            build goes first, sending it). Without device draft kernels the GPU reaches
            ``fwd_start`` at once and waits through it, so ``gpu_forward_ms`` includes it.
    """

    batch_size: int
    num_nodes: int
    constrained: int
    wall_ms: float = 0.0
    cpu_ms: dict[str, float] = field(default_factory=dict)
    gpu_draft_ms: float | None = None
    gpu_forward_ms: float | None = None
    gpu_grammar_stall_ms: float | None = None
    gpu_post_ms: float | None = None
    gpu_idle_before_ms: float | None = None
    num_drafting: int = 0
    num_plain: int = 0
    pool_workers: int | None = None
    pool_send_ms: float | None = None
    pool_worker_max_ms: float | None = None
    pool_first_start_ms: float | None = None
    pool_last_reply_ms: float | None = None
    pool_read_ms: float | None = None
    pool_sent_first: bool | None = None
    host_fwd_launch_ms: float | None = None

    @property
    def gpu_busy_ms(self) -> float | None:
        """GPU time from ``start`` to ``end`` minus the grammar stall inside it."""
        if self.gpu_forward_ms is None:
            return None
        return ((self.gpu_draft_ms or 0.0) + self.gpu_forward_ms + (self.gpu_post_ms or 0.0)
                - (self.gpu_grammar_stall_ms or 0.0))
