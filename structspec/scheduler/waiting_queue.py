"""The queue of requests ready to run: kept in admission order, priority first.

Admission (``Scheduler._admit``) takes requests from the front, in order, and stops at the
first that does not fit, so the order of this queue *is* the admission order. A request's
place is its :func:`admission_key`: its ``priority`` (lower first, as vLLM's ``priority``),
then preempted requests before fresh ones (a preempted request goes back to the front of
its priority, as in vLLM), then arrival. With every priority at the default 0 and no
preemption that is first come, first served, and :meth:`WaitingQueue.push` is an append.
"""

from __future__ import annotations

from collections import deque

from structspec.scheduler.request import Req


def admission_key(req: Req) -> tuple[int, int, int]:
    """``(priority, 0 if preempted else 1, arrival number)``: smaller is admitted first."""
    return (req.priority, 0 if req.preempted else 1, req.arrival_seq)


def victim_key(req: Req) -> tuple[int, int]:
    """``(priority, arrival number)``: the running request with the largest key is preempted
    first (the lowest priority, and the newest among equals)."""
    return (req.priority, req.arrival_seq)


class WaitingQueue(deque[Req]):
    """A deque of ready requests sorted by :func:`admission_key` (front = next admitted).

    Insert with :meth:`push` (not ``append``); ``popleft``, ``remove``, iteration and
    ``len`` are the deque's own. Host-only; O(1) for a push behind the last request (the
    FCFS case), O(len) otherwise.
    """

    def push(self, req: Req) -> None:
        """Insert ``req`` at its place (behind every request with a key not larger)."""
        key = admission_key(req)
        if not self or admission_key(self[-1]) <= key:
            self.append(req)
            return
        for i, other in enumerate(self):
            if admission_key(other) > key:
                self.insert(i, req)
                return
        self.append(req)  # unreachable: the last request's key is larger
