"""One optimizer step's pieces: the head's TTT loss as a module (what
``DistributedDataParallel`` wraps) and the step's statistics summed over micro-batches and
ranks (the log record)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from structspec.training.ttt import SoftTargets, TTTForward


class TTTLoss(nn.Module):
    """The weighted TTT loss of one micro-batch, as a module whose only parameters are the
    head's: ``DistributedDataParallel`` wraps it, and its forward is the whole differentiable
    computation (the target's embedding and ``lm_head`` stay outside: frozen, not
    parameters here).

    Args:
        ttt: the unrolled forward (its head is registered as ``head``).
        decay: per TTT step k, the loss weight (``ttt_decay ** k``).
    """

    def __init__(self, ttt: TTTForward, decay: list[float]) -> None:
        super().__init__()
        self.head = ttt.head
        self.decay = list(decay)
        # a plain attribute (not a Module): its target modules must not become parameters
        self.__dict__["ttt"] = ttt

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, lengths: torch.Tensor,
                num_prompt: torch.Tensor, probs: torch.Tensor,
                top1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor]:
        """The micro-batch's loss and per-step statistics.

        Args:
            input_ids, aux_hidden, lengths, num_prompt: see :meth:`TTTForward.__call__`.
            probs, top1: the batch's :class:`~structspec.training.ttt.SoftTargets` fields.

        Returns:
            ``(loss, step_loss, correct, count)``: the scalar weighted loss (differentiable);
            ``[K]`` float64 per-step mean losses (detached), ``[K]`` float64 top-1 agreement
            counts and ``[K]`` float64 counted rows, all on the loss's device.
        """
        ttt: TTTForward = self.__dict__["ttt"]
        stats = ttt(input_ids, aux_hidden, lengths, num_prompt, SoftTargets(probs, top1))
        device = input_ids.device
        loss = sum((w * s.loss for w, s in zip(self.decay, stats, strict=True)),
                   torch.zeros((), device=device))
        step_loss = torch.stack([s.loss.detach() for s in stats]).double()
        correct = torch.stack([s.correct for s in stats]).double()
        count = torch.tensor([float(s.count) for s in stats], dtype=torch.float64,
                             device=device)
        return loss, step_loss, correct, count


class StepTotals:
    """Sums of one optimizer step's micro-batch statistics (this rank's, then all ranks'
    through :func:`structspec.training.distributed.reduce_step`).

    Args:
        num_steps: K, the TTT steps.
        device: where the sums live (the process group's device).
    """

    def __init__(self, num_steps: int, device: torch.device) -> None:
        self.num_steps = num_steps
        self.values = torch.zeros(3 + 3 * num_steps, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, step_loss: torch.Tensor, correct: torch.Tensor,
            count: torch.Tensor, *, rows: int, tokens: int) -> None:
        """Add one micro-batch: :class:`TTTLoss`'s outputs, its rows and real tokens."""
        k = self.num_steps
        v = self.values
        v[0] += loss.detach().double()
        v[1] += rows
        v[2] += tokens
        v[3:3 + k] += step_loss
        v[3 + k:3 + 2 * k] += correct
        v[3 + 2 * k:] += count

    def record(self, sums: torch.Tensor, batches: int) -> dict[str, Any]:
        """The log fields of summed values ``sums`` over ``batches`` micro-batches: ``loss``
        and ``step_loss`` (means over the micro-batches), ``acc`` (per TTT step, agreeing
        rows over counted rows), ``rows`` and ``tokens`` (totals)."""
        k = self.num_steps
        s = sums.tolist()
        correct, count = s[3 + k:3 + 2 * k], s[3 + 2 * k:]
        return {"loss": s[0] / batches,
                "acc": [round(c / n, 4) if n else 0.0 for c, n in zip(correct, count,
                                                                       strict=True)],
                "step_loss": [round(x / batches, 4) for x in s[3:3 + k]],
                "rows": int(s[1]), "tokens": int(s[2])}
