"""EAGLE-3 training-time test (TTT): the head's differentiable forward over whole sequences,
unrolled for K steps, and its soft cross-entropy against the target.

Layout (one row of a batch; ``x_0..x_{n-1}`` the tokens, ``f_t`` the target feature of
position t, ``Z_j`` the target's logits at position j, i.e. its distribution of ``x_{j+1}``):

* step 0, row t: token ``x_{t+1}`` with feature ``fc(f_t)`` at rotary position t: the head's
  committed entry t (:mod:`structspec.speculative.eagle`); output ``h^0_t``.
* step k >= 1, row t: token ``x_{t+1+k}`` with the head's own previous output ``h^{k-1}_t`` at
  rotary position ``t + k``: the k-th drafted step after entry t.
* step k's row t attends to the step-0 keys of positions ``0..t`` (causal) and to its own
  keys of steps ``1..k`` (all at row t): exactly the keys a chain drafted after entry t sees at
  inference (the committed entries, then its ancestors). This is SpecForge's EAGLE-3 mask
  (causal block plus same-position diagonal blocks) and rotary shift (``position + k``).
* ``h^k_t`` predicts ``x_{t+2+k}``; its target is ``softmax(Z_{t+1+k})`` (over the draft
  vocabulary, renormalised, when it is reduced). The loss of step k counts row t when the
  predicted token is a response token that exists: ``P - 1 <= t + 1 + k <= n - 2`` (P = prompt
  length), and, with a reduced vocabulary, when the target's top-1 token is in it (as
  SpecForge does).

The forward uses the inference head's own modules (:class:`~structspec.models.eagle_head.
EagleHead`), so a trained head computes the same function when the engine loads it; only the
attention differs in form (dense SDPA over ``[step-0 keys | step-1 keys | ...]`` with a
boolean mask instead of the paged KV pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from structspec.layers.rotary import apply_rotary
from structspec.models.eagle_head import EagleHead

#: logits rows computed at once by the loss (bounds the ``[rows, V]`` float32 scratch).
LOSS_CHUNK_ELEMENTS = 1 << 27


@dataclass
class SoftTargets:
    """The target side of one batch, flattened over ``[B * T]`` rows (device tensors).

    Attributes:
        probs: ``[B * T, V']`` float32 target probabilities over the draft vocabulary.
        top1: ``[B * T]`` int64 draft id of the target's top-1 token, -1 when the draft
            vocabulary lacks it.
    """

    probs: torch.Tensor
    top1: torch.Tensor


@dataclass
class StepStats:
    """One TTT step's result.

    Attributes:
        loss: scalar mean soft cross-entropy over the counted rows (0 when none, with grad).
        correct: rows where the head's top-1 equals the target's (a 0-dim device tensor).
        count: rows counted (host int).
    """

    loss: torch.Tensor
    correct: torch.Tensor
    count: int


def soft_targets(logits: torch.Tensor, draft_ids: torch.Tensor | None) -> SoftTargets:
    """``[B, T, V]`` float32 target logits -> :class:`SoftTargets` (consumes ``logits``).

    Args:
        draft_ids: ``[V']`` int64 target ids of the draft vocabulary, or None (full vocab).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    top1 = flat.argmax(-1)
    if draft_ids is None:
        return SoftTargets(probs=torch.softmax(flat, dim=-1), top1=top1)
    to_draft = torch.full((flat.shape[-1],), -1, dtype=torch.int64, device=flat.device)
    to_draft[draft_ids] = torch.arange(draft_ids.numel(), device=flat.device)
    return SoftTargets(probs=torch.softmax(flat[:, draft_ids], dim=-1), top1=to_draft[top1])


def step_rows(lengths: torch.Tensor, num_prompt: torch.Tensor, width: int,
              step: int) -> torch.Tensor:
    """``[B, width]`` bool: rows t of step ``step`` that the loss counts
    (``P - 1 <= t + 1 + step <= n - 2``, see the module docstring).

    Args:
        lengths, num_prompt: ``[B]`` int64 sequence lengths and prompt lengths (same device).
    """
    j = torch.arange(width, device=lengths.device).unsqueeze(0) + 1 + step
    return (j >= (num_prompt - 1).clamp(min=1).unsqueeze(1)) & (j <= (lengths - 2).unsqueeze(1))


def ttt_mask(width: int, num_steps: int, device: torch.device) -> torch.Tensor:
    """``[width, num_steps * width]`` bool: query row t may read key ``(s, j)`` (block s, row j)
    when ``s == 0 and j <= t`` or ``s >= 1 and j == t``. Step k uses the first ``k+1``
    blocks."""
    t = torch.arange(width, device=device)
    blocks = [t.unsqueeze(1) >= t.unsqueeze(0)]
    eye = t.unsqueeze(1) == t.unsqueeze(0)
    blocks += [eye] * (num_steps - 1)
    return torch.cat(blocks, dim=1)


def _shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x [B, T, ...]`` shifted left by ``shift`` along T, zero-filled at the end."""
    if shift == 0:
        return x
    pad = torch.zeros_like(x[:, :shift])
    return torch.cat((x[:, shift:], pad), dim=1)[:, : x.shape[1]]


def _soft_ce_chunk(h: torch.Tensor, probs: torch.Tensor, head: EagleHead,
                   lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed soft cross-entropy of ``h [R, H]`` against ``probs [R, V']`` and the head's
    top-1 draft ids ``[R]`` (run under activation checkpointing: only ``h`` is kept)."""
    x = head.norm(h) if head.norm is not None else h
    logits = F.linear(x, lm_head_weight).float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(probs * logp).sum(), logits.argmax(-1)


def soft_ce(h: torch.Tensor, probs: torch.Tensor, top1: torch.Tensor, head: EagleHead,
            lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean soft cross-entropy and the top-1 agreement count of the rows ``h [R, H]``.

    The ``[R, V']`` logits are made ``LOSS_CHUNK_ELEMENTS // V'`` rows at a time under
    activation checkpointing (recomputed in backward), so a large batch never holds a full
    ``[R, V']`` float32 logits tensor per TTT step for backward.

    Args:
        probs: ``[R, V']`` target probabilities; top1: ``[R]`` target top-1 draft ids.
        lm_head_weight: ``[V', H]`` (the target's, frozen, or the head's own).

    Returns:
        ``(loss, correct)``: scalar mean loss (differentiable), 0-dim int64 agreement count.
    """
    rows = h.shape[0]
    chunk = max(1, LOSS_CHUNK_ELEMENTS // probs.shape[1])
    total = h.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.int64, device=h.device)
    for start in range(0, rows, chunk):
        sl = slice(start, start + chunk)
        loss, pred = checkpoint(_soft_ce_chunk, h[sl], probs[sl], head, lm_head_weight,
                                use_reentrant=False)
        total = total + loss
        correct = correct + (pred == top1[sl]).sum()
    return total / max(rows, 1), correct


class TTTForward:
    """The unrolled training forward of one EAGLE-3 head.

    Args:
        head: the head being trained (its ``midlayer``, ``fc``, ``norm``, ``rotary``, and
            ``lm_head`` when it has its own).
        embed: the target's (frozen) token embedding module.
        lm_head_weight: the weight the logits use: the head's own ``lm_head.weight`` or the
            target's (frozen) ``lm_head.weight``.
        num_steps: K, the unrolled steps.
    """

    def __init__(self, head: EagleHead, embed: torch.nn.Module, lm_head_weight: torch.Tensor,
                 num_steps: int) -> None:
        if head.midlayer is None:
            raise ValueError("TTT training needs an EAGLE-3 head")
        self.head = head
        self.embed = embed
        self.lm_head_weight = lm_head_weight
        self.num_steps = num_steps
        self._masks: dict[tuple[int, str], torch.Tensor] = {}

    def _mask(self, width: int, device: torch.device) -> torch.Tensor:
        key = (width, str(device))
        if key not in self._masks:
            self._masks = {key: ttt_mask(width, self.num_steps, device)}
        return self._masks[key]

    def layer_step(self, embeds: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                   keys: list[torch.Tensor], values: list[torch.Tensor],
                   mask: torch.Tensor) -> torch.Tensor:
        """One step of the midlayer over a whole ``[B, T]`` block.

        Args:
            embeds, h: ``[B, T, H]`` token embeddings and paired features.
            positions: ``[B, T]`` rotary positions.
            keys, values: earlier steps' ``[B, T, Hkv, D]`` keys / values (this step's are
                appended).
            mask: ``[T, (k+1) * T]`` bool (see :func:`ttt_mask`).

        Returns:
            ``[B, T, H]`` pre-norm output (the next step's feature).
        """
        m = self.head.midlayer
        assert m is not None
        attn = m.self_attn
        b, t, _ = h.shape
        x = torch.cat((m.input_layernorm(embeds), m.hidden_norm(h)), dim=-1)
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(b, t, attn.num_heads, attn.head_dim)
        k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
        v = v.view(b, t, attn.num_kv_heads, attn.head_dim)
        cos, sin = self.head.rotary(positions, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys.append(k)
        values.append(v)
        group = attn.num_heads // attn.num_kv_heads
        kk = torch.cat(keys, dim=1).repeat_interleave(group, dim=2)
        vv = torch.cat(values, dim=1).repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
            attn_mask=mask[:, : kk.shape[1]], scale=attn.head_dim**-0.5)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.q_size))
        return h + m.mlp(m.post_attention_layernorm(h))

    def __call__(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, lengths: torch.Tensor,
                 num_prompt: torch.Tensor, targets: SoftTargets) -> list[StepStats]:
        """Run the K steps over ``input_ids [B, T]`` with target features ``aux_hidden
        [B, T, 3H]``; per-step loss and agreement (see the module docstring).

        Args:
            lengths, num_prompt: ``[B]`` int64 on the device.
            targets: the batch's :class:`SoftTargets` (rows ``b * T + j``).
        """
        b, t = input_ids.shape
        device = input_ids.device
        mask = self._mask(t, device)
        with torch.no_grad():
            embeds_all = self.embed(input_ids)
        h = self.head.fc(aux_hidden)
        base_pos = torch.arange(t, device=device).expand(b, t)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        stats: list[StepStats] = []
        for k in range(self.num_steps):
            embeds = _shifted(embeds_all, 1 + k)
            h = self.layer_step(embeds, h, base_pos + k, keys, values, mask)
            rows = step_rows(lengths, num_prompt, t, k).reshape(-1)
            # the target row of draft row t is t + 1 + k, in the same sequence (rows counted
            # have t + 1 + k <= n - 2); the clamp only keeps uncounted rows' indices in range
            target_index = (torch.arange(b * t, device=device) + 1 + k).clamp(max=b * t - 1)
            top1 = targets.top1[target_index]
            idx = (rows & (top1 >= 0)).nonzero().squeeze(1)
            count = int(idx.numel())
            if count == 0:
                # a zero-weight loss through the same modules (final norm, own lm_head): every
                # head parameter still gets a gradient, as DistributedDataParallel requires
                zero, _ = soft_ce(h.reshape(b * t, -1)[:1], targets.probs[:1], top1[:1],
                                  self.head, self.lm_head_weight)
                stats.append(StepStats(zero * 0.0, torch.zeros((), dtype=torch.int64,
                                                               device=device), 0))
                continue
            tidx = target_index[idx]
            loss, correct = soft_ce(h.reshape(b * t, -1)[idx], targets.probs[tidx], top1[idx],
                                    self.head, self.lm_head_weight)
            stats.append(StepStats(loss, correct, count))
        return stats
