"""What a verify step costs on this device, learned from the engine's own steps.

A verify forward scores ``rows = batch x nodes`` query rows. On a GPU at small batch it is
bound by reading the weights, so its time barely moves with the tree size; on a 2-core CPU
(or a GPU at large batch) it is bound by the rows' arithmetic, and an 8-node verify costs
close to 8 decodes. :class:`VerifyCostModel` measures that curve online: every verify step
reports its rows and its time (host clock, from the step's start to its commit, minus the
drafter's propose time, which is learned apart, per drafted request and per tree size), and the
model keeps an exponentially weighted moving average (EWMA) of both per power-of-two bucket of
rows.

The propose time is kept per planned tree size because a model drafter's cost grows with the
tree: EAGLE and the draft model run one draft forward (and one vocabulary projection) per
expansion depth, and a tree of ``n`` nodes needs at most ``n - 1`` of them
(:meth:`~structspec.speculative.base.Drafter.propose_sized`): a 2-node probe is the catch-up
alone, a full tree every depth. The tree sizer prices each size with its own propose cost. The
first sample of each bucket, and each tree size's first propose, is dropped: it pays one-time
work (CUDA-graph capture, allocator growth, a new shape's kernels) that later steps do not;
later ones are clamped to 1/4..4x the average, so a single outlier cannot swing a decision.

Between measured buckets the cost is interpolated linearly in rows (the forward's time is
close to affine in rows on both devices); outside the measured range it is extended with the
slope of the two nearest buckets (flat when only one is measured).
"""

from __future__ import annotations

from dataclasses import dataclass

#: EWMA weight of a new sample (about the last 1 / alpha steps matter)
COST_EWMA_ALPHA = 0.25


def rows_bucket(rows: int) -> int:
    """The bucket of a step's ``rows`` (``>= 1``): ``ceil(log2(rows))``, so 1 -> 0, 2 -> 1,
    3..4 -> 2, 5..8 -> 3, ...

    Raises:
        ValueError: ``rows < 1``.
    """
    if rows < 1:
        raise ValueError(f"rows={rows}: a verify step has at least one row")
    return (rows - 1).bit_length()


@dataclass
class _Bucket:
    """EWMA of the rows and of the verify time (ms) of the steps in one bucket."""

    seen: int = 0  # samples offered, the dropped warm-up one included
    rows: float = 0.0
    ms: float = 0.0

    @property
    def samples(self) -> int:
        return max(0, self.seen - 1)


class VerifyCostModel:
    """Verify step time as a function of its rows, plus the drafter's time per drafted
    request, both measured online (see the module doc). One per engine (so per device).

    Args:
        alpha: EWMA weight of a new sample, in (0, 1].

    Raises:
        ValueError: ``alpha`` outside (0, 1].
    """

    def __init__(self, alpha: float = COST_EWMA_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha}: expected 0 < alpha <= 1")
        self.alpha = alpha
        self._buckets: dict[int, _Bucket] = {}
        #: EWMA of the propose time per drafted request (ms), all tree sizes together; None
        #: before a drafted step (the fallback of :meth:`draft_ms` for an unmeasured size)
        self.draft_ms_per_request: float | None = None
        #: EWMA of the propose time per drafted request (ms) by planned tree size (nodes),
        #: from each size's second propose on
        self._draft_ms_by_nodes: dict[int, float] = {}
        #: each size's first propose time (ms per request): one-time work included (a new
        #: shape's kernels and buffers), so it prices a size only while no size has a kept
        #: sample. Kept as the estimate, an inflated first sample priced its size out for
        #: good: a size the sizer stops choosing is never measured again (EAGLE at batch 1 on
        #: the CPU settled on 2- or on 8-node trees from run to run, benchmarks/README.md)
        self._draft_first_ms: dict[int, float] = {}
        #: the measured buckets' ``(rows, ms)`` in rows order, built on the first
        #: :meth:`verify_ms` after an :meth:`observe` (the sizer asks ~10 times per step)
        self._points: list[tuple[float, float]] | None = None

    def observe(self, rows: int, verify_ms: float, *, draft_ms: float = 0.0,
                num_drafted: int = 0, draft_nodes: int = 0) -> None:
        """Record one verify step.

        Args:
            rows: ``batch x nodes`` rows of its forward (>= 1).
            verify_ms: the step's time without the propose (ms).
            draft_ms: the propose's time (ms).
            num_drafted: requests the drafter proposed for (0: no propose ran).
            draft_nodes: the planned tree size of the propose (0: unknown; only the
                all-sizes average learns from it).
        """
        b = self._buckets.setdefault(rows_bucket(rows), _Bucket())
        self._points = None
        # a time of 0 (or NaN) is no sample: kept, it would pin the bucket at 0 (the clamp
        # below would be [0, 0]) and price every tree of that size as free
        valid = verify_ms > 0.0
        b.seen += 1 if valid else 0
        if not valid:
            pass
        elif b.seen == 2:  # the first kept sample starts the average
            b.rows, b.ms = float(rows), float(verify_ms)
        elif b.seen > 2:
            # One outlier (a CUDA graph captured for a new page bucket, a burst of load on
            # the host) moves the average by at most a factor: the sample is clamped to
            # [1/4, 4] x the current estimate.
            ms = min(max(float(verify_ms), 0.25 * b.ms), 4.0 * b.ms)
            b.rows += self.alpha * (rows - b.rows)
            b.ms += self.alpha * (ms - b.ms)
        if num_drafted > 0:
            per = draft_ms / num_drafted
            d = self.draft_ms_per_request
            self.draft_ms_per_request = per if d is None else d + self.alpha * (per - d)
            if draft_nodes > 1 and draft_nodes not in self._draft_first_ms:
                self._draft_first_ms[draft_nodes] = per
            elif draft_nodes > 1:
                d = self._draft_ms_by_nodes.get(draft_nodes)
                if d is None:
                    self._draft_ms_by_nodes[draft_nodes] = per
                else:  # clamped like the verify samples: one outlier moves it by a factor
                    per = min(max(per, 0.25 * d), 4.0 * d)
                    self._draft_ms_by_nodes[draft_nodes] = d + self.alpha * (per - d)

    def draft_ms(self, num_nodes: int) -> float | None:
        """Estimated propose time (ms) per drafted request for trees of ``num_nodes`` nodes:
        that size's own EWMA when measured (its first propose dropped), else the nearest
        measured larger size's (a larger tree never costs a model drafter less), else the
        nearest smaller one's - an optimistic price that gets the size tried and measured -
        the same over the first proposes while no size has a kept sample, else the
        all-sizes average; None before any drafted step."""
        by = self._draft_ms_by_nodes or self._draft_first_ms
        if num_nodes in by:
            return by[num_nodes]
        larger = [n for n in by if n > num_nodes]
        if larger:
            return by[min(larger)]
        if by:
            return by[max(by)]
        return self.draft_ms_per_request

    def samples(self, rows: int) -> int:
        """Kept samples of the bucket of ``rows`` (0: not measured yet)."""
        b = self._buckets.get(rows_bucket(rows))
        return 0 if b is None else b.samples

    def verify_ms(self, rows: int) -> float | None:
        """Estimated verify time (ms) of a step of ``rows`` rows; None before any bucket has a
        kept sample. Interpolated between measured buckets, extended past them with the slope
        of the two nearest (flat with one); never below 1% of the smallest measurement."""
        pts = self._points
        if pts is None:
            pts = self._points = sorted((b.rows, b.ms) for b in self._buckets.values()
                                        if b.samples)
        if not pts:
            return None
        if len(pts) == 1:
            return pts[0][1]
        x = float(rows)
        if x <= pts[0][0]:
            (x0, y0), (x1, y1) = pts[0], pts[1]
        elif x >= pts[-1][0]:
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
        else:
            i = next(i for i in range(1, len(pts)) if pts[i][0] >= x)
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        y = y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return max(y, 0.01 * min(ms for _, ms in pts))
