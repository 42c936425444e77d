"""A step's deferred host work: the grammar barrier and the text work of its committed ids.

With ``SchedulerConfig.overlap`` the requests a verify step committed to are handed to the
next step, which runs their grammar barrier (phase B of :mod:`structspec.scheduler.commit`)
and text work (phase C) while its own verify forward runs on the GPU
(:class:`PreviousStepWork`); before a prefill, without overlap, or when nothing runs, the work
is finished at once (:func:`finish_deferred`). Outputs are identical either way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from structspec.core import now
from structspec.scheduler.commit import process_text
from structspec.scheduler.grammar_service import GrammarPlan, GrammarService
from structspec.scheduler.logprobs import trim_logprobs
from structspec.scheduler.request import Req
from structspec.scheduler.step_stats import StepTimer

#: the text work polls whether the mask workers' walks are in at most this often (a poll
#: costs a few microseconds)
WALK_POLL_INTERVAL_S = 40e-6


def finish_deferred(grammar: GrammarService, timer: StepTimer, reqs: Sequence[Req]) -> None:
    """Run the grammar barrier and the text work of ``reqs`` now (timer phases ``barrier``
    and ``text``)."""
    grammar.barrier(reqs)
    timer.phase("barrier")
    for req in reqs:
        process_text(req)
        trim_logprobs(req)  # the barrier or a stop string may have dropped ids
    timer.phase("text")


class PreviousStepWork:
    """The previous step's deferred work, run under this step's verify forward.

    :meth:`barrier_and_text` runs where the grammar mask build puts it (before an in-process
    walk, or while the mask workers walk): the grammar barrier over the previous step's ids,
    then, when ``text_first``, their text work until every worker walk is in.
    :meth:`finish_text` does the text work left once the mask is queued to the device.

    Args:
        plan: the step's grammar plan (its ``previous`` requests are this work's).
        grammar: the grammar service (runs the barrier as ``plan`` says).
        timer: the step timer (phases ``barrier`` and ``text``).
        text_first: the text work goes before the mask build (into a device tree's D2H wait,
            or while the workers advance and walk); else after the mask is queued.
        mask_build: this step builds a tree mask (the barrier then runs inside the build);
            else the step calls :meth:`barrier_and_text` itself.
    """

    def __init__(self, plan: GrammarPlan, grammar: GrammarService, timer: StepTimer, *,
                 text_first: bool, mask_build: bool) -> None:
        self.reqs = list(plan.previous)
        self._plan = plan
        self._grammar = grammar
        self._timer = timer
        self._text_first = text_first
        self._mask_build = mask_build
        self._todo = deque(self.reqs)  # requests whose text work has not run

    def barrier_and_text(self, until: Callable[[], bool] | None = None) -> None:
        """The grammar barrier, then (``text_first``) text work until the walks are in, or
        until ``until()`` turns true (polled as the walks are: while a device tree is on its
        way, the mask build stops this first call when it has arrived and calls it again,
        without ``until``, once the build is sent).

        Safe to call again (after a failed worker pool the in-process build runs it once
        more, and a build may split it as above): the grammar advance and the text work are
        idempotent, and text work done is not done again."""
        self._grammar.advance_previous(self._plan, in_mask_build=self._mask_build)
        self._timer.phase("barrier")
        if not self._text_first:
            return
        # While the workers walk. Once every walk is in, the rest waits until the mask is
        # uploaded: the forward may be about to need it, and text work is ~10 us per
        # request against ~35 us per tree walk spread over the workers.
        poll = self._plan.poll_walks if until is None else until
        todo = self._todo
        next_poll = 0.0
        while todo:
            process_text(todo.popleft())
            if poll is not None and todo and (t := now()) >= next_poll:
                if poll():
                    break
                next_poll = t + WALK_POLL_INTERVAL_S
        self._timer.phase("text")

    def finish_text(self) -> list[Req]:
        """The text work left (still under the GPU step); returns the previous step's
        requests, whose progress the step reports."""
        while self._todo:
            process_text(self._todo.popleft())
        for req in self.reqs:  # the barrier or a stop string may have dropped ids
            trim_logprobs(req)
        return self.reqs
