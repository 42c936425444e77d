"""Sampling penalties and logit bias on verify-tree logits, exact per tree path.

Every row of a verify forward predicts the token after one tree node, so its penalties must
count the tokens *of its own path*: the request's committed output plus the drafted
ancestors of that node (node 0, the last committed token, is already in the committed counts).
Then greedy output with speculation equals greedy output without it, and sampling draws from
the penalised distribution that a plain decode would have used (invariant 2).

State per request lives in a :class:`PenaltyTable` on the device, one *slot* (row) per
penalised request; slot 0 is all-neutral, for the rows of requests without penalties and for
the dummy rows of a CUDA-graph bucket. Nothing here reads a value on the host: the functions
run inside the post-forward CUDA graph as well as eagerly.

The formula (:func:`penalize`; vLLM's order: logit bias, then the repetition penalty, then the
frequency and presence penalties)::

    x = logit + bias[t]
    x = x / r if x > 0 else x * r         for tokens t in the prompt or the path's output
    x = x - f * count[t] - p * (count[t] > 0)

With the neutral values (bias 0, r 1, f 0, p 0) every step returns ``x`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyTable:
    """Per-slot penalty state of the penalised requests, on the model device.

    Attributes:
        counts: ``[S, V]`` float32, how often each token occurs in the slot's committed
            output (exact integers; updated on the device by :func:`count_accepted_`).
        prompt_mask: ``[S, V]`` bool, tokens of the slot's prompt (read only when its
            repetition penalty is not 1).
        logit_bias: ``[S, V]`` float32, added to the logits.
        presence, frequency, repetition: ``[S]`` float32 per-slot penalties (0, 0, 1 = off).

    Slot 0 keeps the neutral values forever (it is never handed to a request, and
    :func:`count_accepted_` never counts into it).
    """

    counts: torch.Tensor
    prompt_mask: torch.Tensor
    logit_bias: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, vocab_size: int, device: torch.device) -> PenaltyTable:
        """A table of ``num_slots`` neutral slots (slot 0 included) on ``device``."""
        return cls(
            counts=torch.zeros((num_slots, vocab_size), dtype=torch.float32, device=device),
            prompt_mask=torch.zeros((num_slots, vocab_size), dtype=torch.bool, device=device),
            logit_bias=torch.zeros((num_slots, vocab_size), dtype=torch.float32, device=device),
            presence=torch.zeros(num_slots, dtype=torch.float32, device=device),
            frequency=torch.zeros(num_slots, dtype=torch.float32, device=device),
            repetition=torch.ones(num_slots, dtype=torch.float32, device=device),
        )

    @staticmethod
    def nbytes(num_slots: int, vocab_size: int) -> int:
        """Device bytes of a table of ``num_slots`` slots over ``vocab_size`` tokens."""
        return num_slots * (vocab_size * (4 + 1 + 4) + 3 * 4)

    @property
    def num_slots(self) -> int:
        return int(self.counts.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.counts.shape[1])


@dataclass(frozen=True)
class PenaltyInputs:
    """The penalty state of one step: the table and each request's slot.

    Attributes:
        table: the engine's :class:`PenaltyTable`.
        slots: ``[B]`` int64 on the table's device, the slot of each request of the batch
            (0: no penalties).
    """

    table: PenaltyTable
    slots: torch.Tensor


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
             presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
             bias: torch.Tensor) -> torch.Tensor:
    """The penalty formula (module doc), elementwise with broadcasting; a new tensor.

    Args:
        logits: float32 logits.
        counts: float32 output counts of each logit's token.
        seen: bool, the token is in the prompt or the output (repetition penalty applies).
        presence, frequency, repetition: float32 penalties (broadcast to ``logits``).
        bias: float32 logit bias of each logit's token.
    """
    x = logits + bias
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0).to(x.dtype)


def penalize_(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
              presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
              bias: torch.Tensor) -> None:
    """:func:`penalize` in place on ``logits``, bit for bit the same values, with one
    full-size float temporary instead of about five (the ``[B * N, V]`` pass of every
    penalised step). The repetition penalty is applied to every token with a factor of 1 on
    the unseen ones: ``x / 1`` and ``x * 1`` are ``x`` exactly.

    Args: as :func:`penalize`; ``counts``, ``seen`` and ``bias`` broadcast to ``logits``
    (``[B, 1, V]`` against ``[B, N, V]``), the penalties ``[B, 1, 1]``.
    """
    factor = torch.where(seen, repetition, torch.ones_like(repetition))  # [B, 1, V]
    logits.add_(bias)
    multiplied = logits * factor
    positive = logits > 0
    logits.div_(factor)
    torch.where(positive, logits, multiplied, out=logits)
    logits.sub_(frequency * counts)
    logits.sub_(presence * (counts > 0).to(logits.dtype))


def apply_penalties_(logits: torch.Tensor, inputs: PenaltyInputs, draft_tokens: torch.Tensor,
                     ancestor_mask: torch.Tensor) -> None:
    """Penalise every verify row for its own path, in place. No host sync.

    Each row first gets its request's committed counts (one broadcast pass over the logits);
    then the entries of the tokens drafted on the row's path are recomputed from their
    original logits with the path's counts (``[B * N, N]`` gathered entries, not a
    ``[B * N, V]`` count tensor).

    Args:
        logits: ``[B * N, V]`` float32 on the device (row ``b * N + i`` = node i of request b).
        inputs: the table and the ``[B]`` slots.
        draft_tokens: ``[B, N]`` int64 tree tokens (-1: padding).
        ancestor_mask: ``[B, N, N]`` bool, ``[b, i, k]`` = node k is node i or an ancestor.
    """
    bsz, n = draft_tokens.shape
    vocab = logits.shape[1]
    table, slots = inputs.table, inputs.slots
    counts = table.counts.index_select(0, slots)  # [B, V]
    prompt = table.prompt_mask.index_select(0, slots)
    seen = prompt | (counts > 0)
    bias = table.logit_bias.index_select(0, slots)
    presence = table.presence.index_select(0, slots).view(bsz, 1, 1)
    frequency = table.frequency.index_select(0, slots).view(bsz, 1, 1)
    repetition = table.repetition.index_select(0, slots).view(bsz, 1, 1)
    tokens = draft_tokens.clamp(min=0)  # padding reads token 0: written back unchanged below
    # cols[b * N + i, j] = token of node j: every node's token, in every row of its request
    cols = tokens.unsqueeze(1).expand(bsz, n, n).reshape(bsz * n, n)
    original = logits.gather(1, cols)
    penalize_(logits.view(bsz, n, vocab), counts.unsqueeze(1), seen.unsqueeze(1), presence,
              frequency, repetition, bias.unsqueeze(1))
    if n == 1:  # a root-only tree: no drafted token on any path
        return
    node = torch.arange(n, device=draft_tokens.device)
    # drafted[b, i, k]: node k is a real drafted node (not node 0) on node i's path
    drafted = ancestor_mask & (node > 0).view(1, 1, n) & (draft_tokens >= 0).unsqueeze(1)
    same = tokens.unsqueeze(2) == tokens.unsqueeze(1)  # [b, j, k]: nodes j and k share a token
    # on_path[b, i, j]: drafted nodes on i's path whose token is node j's (exact small ints)
    on_path = torch.bmm(drafted.to(torch.float32), same.to(torch.float32).transpose(1, 2))
    path_counts = counts.gather(1, tokens).unsqueeze(1) + on_path  # [B, N(i), N(j)]
    path_seen = prompt.gather(1, tokens).unsqueeze(1) | (path_counts > 0)
    fixed = penalize(original.view(bsz, n, n), path_counts, path_seen, presence, frequency,
                     repetition, bias.gather(1, tokens).unsqueeze(1))
    # Every column j holds the value of token t_j for row i: columns sharing a token write
    # the same value, and a token no drafted ancestor has gets its broadcast value again.
    logits.scatter_(1, cols, fixed.view(bsz * n, n))


def count_accepted_(inputs: PenaltyInputs, accept_tokens: torch.Tensor,
                    accept_len: torch.Tensor) -> None:
    """Add each request's committed run to its slot's output counts, in place. No host sync.

    Tokens a later host-side cut removes (EOS, a stop string, ``max_tokens``, the grammar's
    end, the repetition stop) are counted too: every such cut ends the request, whose slot is
    reset before it is handed out again.

    Args:
        inputs: the table and the ``[B]`` slots (slot 0 is never counted into).
        accept_tokens: ``[B, N]`` int64 committed runs (-1 past ``accept_len``).
        accept_len: ``[B]`` int64 run lengths (0: nothing committed).
    """
    table, slots = inputs.table, inputs.slots
    n = accept_tokens.shape[1]
    valid = (torch.arange(n, device=accept_tokens.device).view(1, n) < accept_len.view(-1, 1))
    valid &= (slots != 0).view(-1, 1) & (accept_tokens >= 0)
    flat = slots.view(-1, 1) * table.vocab_size + accept_tokens.clamp(min=0)
    table.counts.view(-1).index_add_(0, flat.view(-1), valid.view(-1).to(torch.float32))
