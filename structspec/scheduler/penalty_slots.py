"""Which penalised request owns which row of the device :class:`PenaltyTable`.

A request with penalties, a logit bias or one-token bad words (``Req.has_penalties``) gets a slot when it
is admitted (before its prefill), filled from its parameters and prompt by device ops queued
on the current stream (host values staged through :mod:`structspec.staging`, no host sync);
from then on the slot's output counts are kept on the device by the selection phase
(:func:`~structspec.layers.penalties.count_accepted_`). The slot is freed when the request
retires; refilling it for the next request is queued behind every step that used it.

The table is allocated at the first penalised request (``max_batch_size + 1`` slots, slot 0
neutral) and never moved afterwards, so the post-forward CUDA graphs that read it stay valid.
Batches without a penalised request never touch it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from structspec.layers.penalties import PenaltyInputs, PenaltyTable
from structspec.memory import check_fits
from structspec.scheduler.request import Req
from structspec.staging import Staging, to_device


class PenaltySlots:
    """The engine's penalty table and its slot bookkeeping (host side).

    Args:
        vocab_size: the logits width ``V``.
        max_requests: the most requests running at once (``max_batch_size``): one slot each.
        device: the model device.
        staging: the runner's pinned staging (None on the CPU).
    """

    def __init__(self, *, vocab_size: int, max_requests: int, device: torch.device,
                 staging: Staging | None) -> None:
        self.vocab_size = vocab_size
        self.max_requests = max_requests
        self.device = device
        self.staging = staging
        #: the device table, allocated by :meth:`reserve` (None until a penalised request)
        self.table: PenaltyTable | None = None
        self._free = list(range(max_requests, 0, -1))  # slot 0 is never handed out

    def reserve(self) -> None:
        """Allocate the table if it does not exist yet (the first penalised request).

        Raises:
            MemoryError: the table does not fit in the device's free memory (naming it).
        """
        if self.table is not None:
            return
        slots = self.max_requests + 1
        check_fits(PenaltyTable.nbytes(slots, self.vocab_size), self.device,
                   f"the sampling-penalty table ({slots} x {self.vocab_size} tokens)",
                   "lower max_batch_size (--max-batch-size), or send no penalties")
        self.table = PenaltyTable.allocate(slots, self.vocab_size, self.device)

    def assign(self, req: Req) -> None:
        """Give ``req`` (with penalties) a slot and fill it: the counts of its committed
        output (none, unless it resumes after a preemption), its prompt's tokens (when its
        repetition penalty is on), its logit bias (-inf for every token outside its
        ``allowed_token_ids`` and for its one-token ``bad_words``) and its three penalties.

        Raises:
            RuntimeError: no slot is free (more penalised requests running than
                ``max_requests``: a scheduler bug, since admission keeps at most that many).
        """
        self.reserve()
        table = self.table
        assert table is not None
        if not self._free:
            raise RuntimeError(f"no free penalty slot: more than {self.max_requests} "
                               "penalised requests running")
        slot = self._free.pop()
        p = req.params
        table.counts[slot].zero_()
        table.prompt_mask[slot].zero_()
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(req.prompt_ids)), dtype=torch.int64)
            table.prompt_mask[slot].index_fill_(0, self._to_device(ids), True)
        bias = dict(p.logit_bias or {})
        if p.allowed_token_ids is None:
            table.logit_bias[slot].zero_()
        else:
            # allowed_token_ids: every other token's bias is -inf (its logit stays -inf
            # through the penalties); an allowed token keeps its logit_bias, if any
            table.logit_bias[slot].fill_(float("-inf"))
            allowed = set(p.allowed_token_ids)
            bias = {t: bias.get(t, 0.0) for t in allowed}
        if req.bad_words is not None:
            # a one-token bad word is banned at every position (vLLM's bad_words): -inf like
            # a token outside allowed_token_ids, whatever logit_bias it was given
            bias.update(dict.fromkeys(req.bad_words.single, float("-inf")))
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.int64)
            values = torch.tensor(list(bias.values()), dtype=torch.float32)
            table.logit_bias[slot].index_copy_(0, self._to_device(ids), self._to_device(values))
        # fill_ with a host scalar is a kernel argument, not a copy: no sync
        if req.output_ids:
            # a preempted request resumes: its committed output counts again (the counts
            # are the penalties' state, rebuilt like its KV)
            ids = torch.tensor(req.output_ids, dtype=torch.int64)
            table.counts[slot].index_add_(0, self._to_device(ids),
                                          torch.ones(len(req.output_ids), dtype=torch.float32,
                                                     device=self.device))
        table.presence[slot].fill_(float(p.presence_penalty))
        table.frequency[slot].fill_(float(p.frequency_penalty))
        table.repetition[slot].fill_(float(p.repetition_penalty))
        req.penalty_slot = slot

    def release(self, req: Req) -> None:
        """Free ``req``'s slot (once; a request without one is ignored)."""
        if req.penalty_slot:
            self._free.append(req.penalty_slot)
            req.penalty_slot = 0

    @staticmethod
    def slots_of(reqs: Sequence[Req]) -> list[int] | None:
        """Each request's slot (0: none), or None when no request of the batch has one (the
        whole penalty pass is then skipped)."""
        slots = [r.penalty_slot for r in reqs]
        return slots if any(slots) else None

    def inputs(self, slots: Sequence[int]) -> PenaltyInputs:
        """A step's :class:`PenaltyInputs` for eager selection: ``slots`` staged to the
        device (one ``non_blocking`` copy)."""
        assert self.table is not None, "a slot was assigned, so the table exists"
        return PenaltyInputs(self.table,
                             self._to_device(torch.tensor(list(slots), dtype=torch.int64)))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return to_device(host, self.device, self.staging)
