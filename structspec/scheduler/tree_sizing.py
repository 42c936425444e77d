"""Speculation that pays for itself: each request's draft tree sized from its acceptance and
the device's measured verify cost (``SpecConfig.adaptive``, ``--speculative-adaptive``).

A draft token costs a verify row whether it is accepted or not. Where rows are nearly free (a
GPU at small batch) a full tree always pays; where they are not (a CPU, where an 8-node verify
costs close to 8 decodes, or a GPU at large batch) a request whose drafts are rarely accepted
is faster as a plain decode. :class:`AdaptiveTreeSizer` decides, before each verify step, how
many nodes each request's tree gets, from two estimates:

* **acceptance** ``a`` per request: the per-draft-token acceptance of a chain. A step that
  proposed ``k`` real drafts and accepted ``L`` of them is ``L`` successes in ``L + 1``
  Bernoulli trials (the first rejection ends the run), or in ``L`` trials when all ``k`` were
  accepted; ``a`` = EWMA(successes) / EWMA(trials), which is the maximum-likelihood
  geometric estimate over the recent steps. A new request starts from the engine's running
  average (:attr:`AdaptiveTreeSizer.engine_accept`).
* **cost** ``T(rows)``: the verify time of ``rows = batch x nodes`` rows and the drafter's time
  per drafted request ``d(n)`` for a tree of ``n`` nodes (a model drafter runs one draft
  forward per expansion depth, and a tree of ``n`` nodes needs at most ``n - 1``), measured
  online
  (:class:`~structspec.scheduler.verify_cost.VerifyCostModel`).

**The formula.** With per-token acceptance ``a``, a chain of ``n - 1`` drafts (a tree of ``n``
nodes) commits on average ``E(n) = 1 + a + ... + a^(n-1) = (1 - a^n) / (1 - a)`` tokens (the
accepted drafts plus the target's bonus token; ``E(n) = n`` when ``a = 1``, ``E(1) = 1``). The
request's share of a step in which every request of the batch ``B`` verifies ``n`` nodes costs
``C(n) = T(B n) / B + d(n) [n > 1]``. Each request gets the size ``n`` (from
:func:`tree_size_choices`: 1, 2, 4, ... up to ``num_draft_tokens``) that maximises committed
tokens per unit of time ``E(n) / C(n)``; a size above 1 must beat plain decoding
``E(1) / C(1)`` by ``margin`` (noise in the estimates must not buy a slower step). Trees are
branchy where the drafter proposes branches, so ``E`` is a lower bound of what a tree commits
and the choice leans small.

The batch verifies ``N = max n`` nodes per request (smaller trees are padded with -1 nodes,
which no draft can match), so a drafting request gets all ``N`` nodes (those rows are computed
anyway) and a request with ``n = 1`` is not drafted at all: its row is the root alone, a plain
decode, and it costs no propose time.

**Re-probing.** A request that stopped drafting learns nothing more about its acceptance, so
every ``probe_every`` steps it is drafted with the smallest tree (2 nodes) to re-measure; a
probe that accepts nothing doubles its interval (up to ``max_probe_every``), one that accepts
resets it, so a request recovers within a few steps once its text turns repetitive and an
unpredictable one pays a vanishing probe cost.

**Modes.** ``off``: every request gets ``num_draft_tokens`` nodes every step (no sizing).
``on``: the sizing above. ``auto``: the sizing only where it can win, else ``off``'s full
trees: where the measured cost says rows are not free (``T(B N_max) >= auto_min_ratio x
T(B)`` at the batch's size), except where the ratio stays below ``auto_full_max_ratio`` (2.5)
and full trees at the engine's average acceptance already beat plain decoding
(``E(N_max, a_engine) / C(N_max) > (1 + margin) B / T(B)``): there full trees are kept. That
exception is the GPU at small batch: an EAGLE step at batch 1 on the H200 costs ~1.8x a plain
one (host work per node, not the rows) yet commits ~2.5 tokens, and sizing each request from a
noisy few-step EWMA demoted requests to plain decoding on their unlucky steps (ShareGPT + JSON
Schema: 0.81x no drafter with sizing, 1.39x with this rule, benchmarks/README.md). On a CPU an
8-row verify plus its propose costs ~3x a decode, and there the per-request sizing (2-node trees
for EAGLE on chat) is what wins (1.22x against 0.92x with full trees, measured while deciding
this bound). ``a_engine`` is the ratio of slow EWMAs
of successes and trials over every drafted request (the same maximum-likelihood estimate as
the per-request one; a mean of per-step ratios would undercount long runs). To know the cost,
the first steps at a new batch size run calibration sizes (full trees, then plain decodes, two
of each: the first of each bucket is its warm-up).

Adaptive sizing only changes which drafts are proposed: the verify commits the target's
tokens either way (docs/architecture.md, invariant 2), and a 1-node tree is the root-only tree
the grammar mask and the verify already handle (prefill uses it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from structspec.scheduler.verify_cost import VerifyCostModel

#: the ``SpecConfig.adaptive`` values
ADAPTIVE_MODES = ("auto", "on", "off")

#: EWMA weight of a step's acceptance observation
ACCEPT_EWMA_ALPHA = 0.3

#: EWMA weight of a step's observation in the engine-wide acceptance (about the last 20
#: drafted request-steps matter)
ENGINE_ACCEPT_EWMA_ALPHA = 0.05


def tree_size_choices(max_nodes: int) -> tuple[int, ...]:
    """Tree sizes the sizer picks from: 1 and the powers of two below ``max_nodes``, then
    ``max_nodes`` (8 -> ``(1, 2, 4, 8)``, 6 -> ``(1, 2, 4, 6)``). Few sizes keep the number of
    verify CUDA graphs (one per size and batch bucket) small.

    Raises:
        ValueError: ``max_nodes < 1``.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes={max_nodes}: expected >= 1")
    sizes = [1]
    while sizes[-1] * 2 < max_nodes:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_nodes:
        sizes.append(max_nodes)
    return tuple(sizes)


def expected_tokens(num_nodes: int, accept: float) -> float:
    """``E(n) = (1 - a^n) / (1 - a)``: expected committed tokens (accepted drafts + the bonus)
    of a chain of ``num_nodes - 1`` drafts, each accepted with probability ``accept`` given its
    parent was (see the module doc). ``accept`` is clamped to [0, 1]."""
    a = min(max(accept, 0.0), 1.0)
    if a >= 1.0 - 1e-9:
        return float(num_nodes)
    return (1.0 - a ** num_nodes) / (1.0 - a)


@dataclass
class _Acceptance:
    """One request's acceptance estimate and probe schedule."""

    successes: float
    trials: float
    idle_steps: int = 0  # consecutive steps without a draft
    probe_every: int = 0

    @property
    def accept(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0


@dataclass(frozen=True)
class TreePlan:
    """The sizer's choice for one verify step.

    Attributes:
        num_nodes: ``N`` of the batch's trees (the largest size chosen; the drafter's own
            ``num_draft_tokens`` when the plan is :attr:`full`).
        drafted: batch indices of the requests the drafter proposes for, ascending.
        full: every request is drafted with the drafter's full tree (today's step: the
            drafter's trees go to the verify untouched).
        probes: batch indices drafted only to re-measure their acceptance.
    """

    num_nodes: int
    drafted: tuple[int, ...]
    full: bool
    probes: tuple[int, ...] = ()


@dataclass
class SizerCounts:
    """The last plan's split, for the engine metrics: requests drafting vs plain decoding."""

    drafting: int = 0
    plain: int = 0
    adaptive_active: bool = False
    calibrating: bool = False


#: :meth:`AdaptiveTreeSizer._size_costs` of one step: the plain decode's tokens per ms per
#: request, and ``(tree size, ms per request)`` of each measured size
SizeCosts = tuple[float, list[tuple[int, float]]]


class AdaptiveTreeSizer:
    """Sizes each request's draft tree per step (see the module doc for the formula).

    Args:
        mode: ``auto``, ``on`` or ``off`` (``SpecConfig.adaptive``).
        max_nodes: the drafter's ``num_draft_tokens`` (node 0 included); 1 = no drafter (the
            sizer then always plans 1-node trees).
        cost: the engine's cost model (a fresh one by default).
        prior_accept: the acceptance a request starts from before any engine-wide average.
        probe_every: steps between re-probes of a request that stopped drafting.
        max_probe_every: the interval's cap after failed probes (doubling).
        margin: relative gain over plain decoding a tree must promise.
        auto_min_ratio: ``auto`` sizes only where ``T(B N_max) / T(B)`` reaches this.
        auto_full_max_ratio: below this ratio ``auto`` keeps full trees while they pay at
            the engine's average acceptance (above it, rows dominate the step and each
            request is sized).

    Raises:
        ValueError: an unknown ``mode``.
    """

    def __init__(self, mode: str, max_nodes: int, *, cost: VerifyCostModel | None = None,
                 prior_accept: float = 0.5, probe_every: int = 8, max_probe_every: int = 64,
                 margin: float = 0.03, auto_min_ratio: float = 1.25,
                 auto_full_max_ratio: float = 2.5) -> None:
        if mode not in ADAPTIVE_MODES:
            raise ValueError(f"speculative_adaptive={mode!r}: expected auto, on or off")
        self.mode = mode
        self.max_nodes = max_nodes
        self.sizes = tree_size_choices(max_nodes)
        self.cost = cost if cost is not None else VerifyCostModel()
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.margin = margin
        self.auto_min_ratio = auto_min_ratio
        self.auto_full_max_ratio = auto_full_max_ratio
        # engine-wide EWMAs of successes and trials (see engine_accept)
        self._engine = _Acceptance(successes=prior_accept, trials=1.0)
        self._reqs: dict[str, _Acceptance] = {}
        self.counts = SizerCounts()

    # ------------------------------------------------------------------ decisions

    def plan(self, request_ids: Sequence[str]) -> TreePlan:
        """The trees of one verify step over ``request_ids`` (the running batch, in order)."""
        bsz = len(request_ids)
        everyone = tuple(range(bsz))
        if self.max_nodes == 1 or self.mode == "off" or bsz == 0:
            return self._note(TreePlan(self.max_nodes, everyone, full=True), bsz, active=False)
        calibration = self._calibration_size(bsz)
        if calibration is not None:
            return self._note(self._fixed(calibration, everyone), bsz, active=False,
                              calibrating=True)
        if self.mode == "auto" and (not self._rows_cost(bsz) or (
                not self._rows_cost(bsz, self.auto_full_max_ratio)
                and self._full_trees_pay(bsz))):
            return self._note(TreePlan(self.max_nodes, everyone, full=True), bsz, active=False)
        costs = self._size_costs(bsz)  # per step: the same for every request of the batch
        chosen = [self._best_size(self._state(r).accept, costs) for r in request_ids]
        drafted, probes = [], []
        for i, (rid, n) in enumerate(zip(request_ids, chosen, strict=True)):
            st = self._state(rid)
            if n > 1:
                drafted.append(i)
                st.idle_steps = 0
                continue
            st.idle_steps += 1
            if st.idle_steps >= (st.probe_every or self.probe_every):
                probes.append(i)
                drafted.append(i)
                chosen[i] = self.sizes[1]
                st.idle_steps = 0
        n_batch = max(chosen)
        plan = TreePlan(n_batch, tuple(drafted), full=False, probes=tuple(probes))
        if n_batch == self.max_nodes and len(drafted) == bsz:
            plan = TreePlan(n_batch, everyone, full=True, probes=tuple(probes))
        return self._note(plan, bsz, active=True)

    def _fixed(self, n: int, everyone: tuple[int, ...]) -> TreePlan:
        if n == self.max_nodes:
            return TreePlan(n, everyone, full=True)
        return TreePlan(1, (), full=False)

    def _calibration_size(self, bsz: int) -> int | None:
        """While the cost of a full tree or of a plain decode at this batch size is unknown
        (fewer than one kept sample), the size that measures it: full trees first."""
        if self.cost.samples(bsz * self.max_nodes) < 1:
            return self.max_nodes
        if self.cost.samples(bsz) < 1:
            return 1
        return None

    def _rows_cost(self, bsz: int, ratio: float | None = None) -> bool:
        """``auto``: whether a full tree costs at least ``ratio`` (default
        :attr:`auto_min_ratio`) plain decodes (False while either cost is unknown)."""
        full, plain = self.cost.verify_ms(bsz * self.max_nodes), self.cost.verify_ms(bsz)
        if ratio is None:
            ratio = self.auto_min_ratio
        return full is not None and plain is not None and full >= ratio * plain

    def _full_trees_pay(self, bsz: int) -> bool:
        """``auto``: whether full trees at :attr:`engine_accept` commit more tokens per ms
        than plain decoding by :attr:`margin` (module doc); False while a cost is unknown."""
        full, plain = self.cost.verify_ms(bsz * self.max_nodes), self.cost.verify_ms(bsz)
        if full is None or plain is None or plain <= 0:
            return False
        per_request_ms = full / bsz + (self.cost.draft_ms(self.max_nodes) or 0.0)
        if per_request_ms <= 0:
            return False
        rate_full = expected_tokens(self.max_nodes, self.engine_accept) / per_request_ms
        return rate_full > (bsz / plain) * (1.0 + self.margin)

    def _size_costs(self, bsz: int) -> SizeCosts | None:
        """What :meth:`_best_size` prices each request's sizes with at batch ``bsz``: the
        plain decode's rate (tokens per ms per request) and each measured tree size's ms per
        request (its verify share plus its propose), in :attr:`sizes` order; None while the
        plain decode's cost is unknown. Computed once per step (the cost model's
        interpolation per size and request was ~5 calls a request at batch 64)."""
        plain_ms = self.cost.verify_ms(bsz)
        if plain_ms is None or plain_ms <= 0:
            return None
        sizes: list[tuple[int, float]] = []
        for n in self.sizes[1:]:
            ms = self.cost.verify_ms(bsz * n)
            if ms is None:
                continue
            per_request_ms = ms / bsz + (self.cost.draft_ms(n) or 0.0)
            if per_request_ms <= 0:  # an unmeasurably fast size: no basis to prefer it
                continue
            sizes.append((n, per_request_ms))
        return 1.0 / (plain_ms / bsz), sizes

    def _best_size(self, accept: float, costs: SizeCosts | None) -> int:
        """``argmax_n E(n) / C(n)`` over :attr:`sizes` (module doc) with the step's
        :meth:`_size_costs`; 1 unless a tree beats plain decoding by :attr:`margin`; the
        full tree while the plain decode's cost is unknown."""
        if costs is None:
            return self.max_nodes
        best_rate, sizes = costs
        best_n = 1
        threshold = best_rate * (1.0 + self.margin)
        for n, per_request_ms in sizes:
            rate = expected_tokens(n, accept) / per_request_ms
            if rate > threshold and rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def _note(self, plan: TreePlan, bsz: int, *, active: bool,
              calibrating: bool = False) -> TreePlan:
        c = self.counts
        c.drafting = len(plan.drafted) if plan.num_nodes > 1 else 0
        c.plain = bsz - c.drafting
        c.adaptive_active = active
        c.calibrating = calibrating
        return plan

    # ------------------------------------------------------------------ observations

    def _state(self, request_id: str) -> _Acceptance:
        st = self._reqs.get(request_id)
        if st is None:
            a = self.engine_accept
            st = self._reqs[request_id] = _Acceptance(successes=a, trials=1.0)
        return st

    def observe_step(self, rows: int, step_ms: float, draft_ms: float, num_drafted: int,
                     draft_nodes: int = 0) -> None:
        """One verify step's timing (see :meth:`VerifyCostModel.observe`); ``draft_nodes``:
        the planned tree size of its propose."""
        self.cost.observe(rows, max(step_ms - draft_ms, 0.0), draft_ms=draft_ms,
                          num_drafted=num_drafted, draft_nodes=draft_nodes)

    def observe_request(self, request_id: str, proposed: int, accepted: int, *,
                        probe: bool = False) -> None:
        """One request's verify result: ``proposed`` real draft nodes, ``accepted`` of them
        committed (nothing is learned from a step without drafts). ``probe``: the step was a
        re-probe (its outcome sets the next probe interval)."""
        if proposed <= 0:
            return
        # the engine passes counts of one verify; anything else must not poison the EWMAs
        accepted = min(max(int(accepted), 0), int(proposed))
        st = self._state(request_id)
        trials = accepted + (1 if accepted < proposed else 0)
        if trials == 0:
            return
        for est, alpha in ((st, ACCEPT_EWMA_ALPHA), (self._engine, ENGINE_ACCEPT_EWMA_ALPHA)):
            est.successes += alpha * (accepted - est.successes)
            est.trials += alpha * (trials - est.trials)
        if probe:
            base = self.probe_every
            st.probe_every = base if accepted else min(2 * (st.probe_every or base),
                                                       self.max_probe_every)

    @property
    def engine_accept(self) -> float:
        """Engine-wide per-token acceptance: slow EWMA of successes over slow EWMA of
        trials of every drafted request-step (a new request's starting estimate, and
        ``auto``'s full-tree test)."""
        return self._engine.accept

    @engine_accept.setter
    def engine_accept(self, accept: float) -> None:
        """Reset the engine-wide estimate to ``accept``.

        Raises:
            ValueError: ``accept`` is not a number in [0, 1].
        """
        a = float(accept)
        if not 0.0 <= a <= 1.0:  # NaN fails too: it would stick and stop all drafting
            raise ValueError(f"engine_accept={accept!r}: expected a number in [0, 1]")
        self._engine = _Acceptance(successes=a, trials=1.0)

    def accept(self, request_id: str) -> float:
        """The request's current acceptance estimate (the engine's average if unseen)."""
        st = self._reqs.get(request_id)
        return self.engine_accept if st is None else st.accept

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._reqs.pop(request_id, None)

    def num_tracked(self) -> int:
        """Requests with an acceptance estimate (tests)."""
        return len(self._reqs)


def host_tree_nodes(real_nodes: Sequence[int], sizes: Sequence[int]) -> int:
    """The smallest size of ``sizes`` (ascending) holding every row's real nodes (node 0
    included): a host drafter that found fewer drafts than the plan allows (an n-gram with no
    earlier match) gets a smaller verify, its padding columns dropped."""
    need = max(real_nodes, default=1)
    for n in sizes:
        if n >= need:
            return n
    return sizes[-1] if sizes else max(1, math.ceil(need))
