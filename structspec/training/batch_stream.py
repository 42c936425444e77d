"""The batches training consumes: epoch 0's plan, then epoch 1's, and so on, as one stream.

An optimizer step takes ``world_size * grad_accum`` consecutive batches of the stream (a step
may straddle two epochs); rank r's m-th micro-batch of the step is batch ``m * world_size + r``
of them. Every rank walks the same stream, so the ranks' micro-batches are disjoint and
together are exactly what one process with ``grad_accum = world_size * grad_accum`` would
take. The stream's position (epoch, plan, position in it) is what a checkpoint stores; it
is counted in batches, so a run may resume with another split of the same
``world_size * grad_accum``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from structspec.training.batching import plan_epoch


class BatchStream:
    """Batches (lists of sequence indices) in epoch order, planned by
    :func:`~structspec.training.batching.plan_epoch`.

    Args:
        lengths: each sequence's (truncated) token count; not empty.
        batch_tokens, max_len, seed: the plan's options.
    """

    def __init__(self, lengths: Sequence[int], *, batch_tokens: int, max_len: int,
                 seed: int) -> None:
        self.lengths = list(lengths)
        self.batch_tokens = batch_tokens
        self.max_len = max_len
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self.plan = self._plan(0)

    def _plan(self, epoch: int) -> list[list[int]]:
        return plan_epoch(self.lengths, batch_tokens=self.batch_tokens, max_len=self.max_len,
                          seed=self.seed, epoch=epoch)

    def next(self) -> list[int]:
        """The next batch (the next epoch's plan starts when this one is used up)."""
        if self.pos >= len(self.plan):
            self.epoch, self.pos = self.epoch + 1, 0
            self.plan = self._plan(self.epoch)
        self.pos += 1
        return self.plan[self.pos - 1]

    def take_step(self, world: int, rank: int, grad_accum: int) -> list[list[int]]:
        """One optimizer step's batches for ``rank``: of the next ``world * grad_accum``
        batches, those at ``m * world + rank`` for ``m < grad_accum`` (the stream advances
        past all of them on every rank)."""
        group = [self.next() for _ in range(world * grad_accum)]
        return [group[m * world + rank] for m in range(grad_accum)]

    def state(self) -> dict[str, Any]:
        """The position, for a checkpoint (``epoch``, ``pos``, ``plan``)."""
        return {"epoch": self.epoch, "pos": self.pos, "plan": self.plan}

    def load(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`'s position."""
        self.epoch, self.pos, self.plan = state["epoch"], state["pos"], state["plan"]


def total_steps(steps: int, epochs: int, lengths: Sequence[int], *, batch_tokens: int,
                max_len: int, seed: int, batches_per_step: int) -> int:
    """The schedule's optimizer steps: ``steps``, or when it is 0 the steps that cover
    ``epochs`` epochs' batches, ``batches_per_step`` a step (the last one rounded up)."""
    if steps:
        return steps
    batches = sum(len(plan_epoch(lengths, batch_tokens=batch_tokens, max_len=max_len,
                                 seed=seed, epoch=e)) for e in range(epochs))
    return math.ceil(batches / batches_per_step)
