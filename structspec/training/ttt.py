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
attention differs in form (:mod:`structspec.training.ttt_attention`: a causal SDPA plus the
diagonal keys merged exactly, ``split``, or the reference ``dense`` SDPA over ``[step-0 keys |
step-1 keys | ...]`` with a boolean mask, instead of the paged KV pool). ``auto`` runs
``split``; on CUDA it first checks ``split`` against ``dense`` on a slice of the first batch
(:meth:`TTTForward.check_split`) and falls back to ``dense`` with a warning if they differ or
``split`` raises, so a kernel surprise on a GPU never costs a training run.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from structspec.layers.rotary import apply_rotary
from structspec.models.eagle_head import EagleHead
from structspec.training.train_config import TTT_ATTENTION
from structspec.training.ttt_attention import (
    dense_ttt_attention,
    split_ttt_attention,
    ttt_mask,
)

#: logits rows computed at once by the loss (bounds the ``[rows, V]`` float32 scratch).
LOSS_CHUNK_ELEMENTS = 1 << 27
#: the ``auto`` self-check's slice of the first batch (rows, width).
CHECK_ROWS = 2
CHECK_WIDTH = 256
#: ``split`` may differ from ``dense`` by this many times ``dense``'s own rounding error...
CHECK_NOISE_FACTOR = 4.0
#: ...plus this relative difference: float32 training has no rounding to measure against
#: (``dense`` is its own reference), yet its kernels differ in accumulation order (and use
#: TF32 where enabled, ~1e-4); a wrong kernel or mask is off by ~1e-1.
CHECK_FLOOR = 1e-3


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
        attention: ``auto``, ``dense`` or ``split`` (see the module docstring).

    Attributes:
        attention_used: the form the forward runs (``dense`` or ``split``); None until the
            first call resolves ``auto``.

    Raises:
        ValueError: a head without a midlayer, or an unknown ``attention`` (named).
    """

    def __init__(self, head: EagleHead, embed: torch.nn.Module, lm_head_weight: torch.Tensor,
                 num_steps: int, attention: str = "auto") -> None:
        if head.midlayer is None:
            raise ValueError("TTT training needs an EAGLE-3 head")
        if attention not in TTT_ATTENTION:
            raise ValueError(f"ttt_attention={attention!r}: expected one of "
                             f"{', '.join(TTT_ATTENTION)}")
        self.head = head
        self.embed = embed
        self.lm_head_weight = lm_head_weight
        self.num_steps = num_steps
        self.attention = attention
        self.attention_used: str | None = None if attention == "auto" else attention
        self._masks: dict[tuple[int, str], torch.Tensor] = {}

    def _mask(self, width: int, device: torch.device) -> torch.Tensor:
        key = (width, str(device))
        if key not in self._masks:
            self._masks = {key: ttt_mask(width, self.num_steps, device)}
        return self._masks[key]

    def layer_step(self, embeds: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                   keys: list[torch.Tensor], values: list[torch.Tensor],
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """One step of the midlayer over a whole ``[B, T]`` block.

        Args:
            embeds, h: ``[B, T, H]`` token embeddings and paired features.
            positions: ``[B, T]`` rotary positions.
            keys, values: earlier steps' ``[B, T, Hkv, D]`` keys / values (this step's are
                appended).
            mask: ``[T, >= (k+1) * T]`` bool (see :func:`ttt_mask`): the ``dense`` form; None:
                the ``split`` form.

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
        scale = attn.head_dim**-0.5
        if mask is None:
            out = split_ttt_attention(q, keys, values, scale)
        else:
            out = dense_ttt_attention(q, keys, values, mask, scale)
        h = h + attn.o_proj(out.reshape(b, t, attn.q_size))
        return h + m.mlp(m.post_attention_layernorm(h))

    def _unroll(self, embeds_all: torch.Tensor, h: torch.Tensor, dense: bool,
                step: Callable[..., torch.Tensor]) -> Iterator[torch.Tensor]:
        """The K steps' outputs ``h^k [B, T, H]`` of token embeddings ``embeds_all [B, T, H]``
        and projected features ``h [B, T, H]``, one step at a time."""
        b, t = h.shape[:2]
        mask = self._mask(t, h.device) if dense else None
        base_pos = torch.arange(t, device=h.device).expand(b, t)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for k in range(self.num_steps):
            h = step(_shifted(embeds_all, 1 + k), h, base_pos + k, keys, values, mask)
            yield h

    def __call__(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, lengths: torch.Tensor,
                 num_prompt: torch.Tensor, targets: SoftTargets) -> list[StepStats]:
        """Run the K steps over ``input_ids [B, T]`` with target features ``aux_hidden
        [B, T, 3H]``; per-step loss and agreement (see the module docstring).

        The first call resolves ``auto`` (:meth:`resolve_attention`).

        Args:
            lengths, num_prompt: ``[B]`` int64 on the device.
            targets: the batch's :class:`SoftTargets` (rows ``b * T + j``).
        """
        b, t = input_ids.shape
        device = input_ids.device
        if self.attention_used is None:
            self.attention_used = self.resolve_attention(input_ids, aux_hidden,
                                                         check=device.type == "cuda")
        with torch.no_grad():
            embeds_all = self.embed(input_ids)
        h0 = self.head.fc(aux_hidden)
        stats: list[StepStats] = []
        steps = self._unroll(embeds_all, h0, self.attention_used == "dense", self.layer_step)
        for k, h in enumerate(steps):
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

    def resolve_attention(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
                          check: bool) -> str:
        """The form ``attention`` runs: ``auto`` is ``split``, unless ``check`` is set and
        :meth:`check_split` on the first ``CHECK_ROWS x CHECK_WIDTH`` of this batch reports a
        problem or raises; then ``dense``, with a :class:`RuntimeWarning` saying why.

        Args:
            input_ids, aux_hidden: a batch as :meth:`__call__` takes it.
            check: run the self-check (the trainer sets it on CUDA, where the fused SDPA
                kernels the split form relies on differ by GPU, dtype and torch build).
        """
        if self.attention != "auto":
            return self.attention
        if not check:
            return "split"
        try:
            problem = self.check_split(input_ids[:CHECK_ROWS, :CHECK_WIDTH],
                                       aux_hidden[:CHECK_ROWS, :CHECK_WIDTH])
        except Exception as e:  # any failure of the split form's kernels: keep training
            problem = f"it raised {type(e).__name__}: {e}"
        if problem is None:
            return "split"
        warnings.warn(f"TTT attention: the split form failed its self-check on "
                      f"{input_ids.device} ({problem}); training with the dense form instead "
                      f"(same result, more memory and time; --ttt-attention dense skips the "
                      f"check)", RuntimeWarning, stacklevel=2)
        return "dense"

    def check_split(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor) -> str | None:
        """Compare the ``split`` form with the ``dense`` one on a (small) batch: the K steps'
        outputs and the head's gradients of a fixed random projection of them.

        Both run in the ambient autocast dtype; a float32 ``dense`` run (autocast off) measures
        that dtype's own rounding, and ``split`` passes when it is within
        ``CHECK_NOISE_FACTOR`` times that rounding (plus ``CHECK_FLOOR``) of ``dense``: a
        wrong kernel or mask is off by far more. Uses the uncompiled layer step; draws no
        global random numbers; accumulates no ``.grad``.

        Args:
            input_ids: ``[b, t]`` int64; aux_hidden: ``[b, t, 3H]`` (device tensors).

        Returns:
            None when they agree, else what differs (relative norms).
        """
        step = functools.partial(TTTForward.layer_step, self)  # not a torch.compile'd one
        params = [p for p in self.head.parameters() if p.requires_grad]
        with torch.no_grad():
            embeds_all = self.embed(input_ids)
        gen = torch.Generator(device=input_ids.device).manual_seed(0)
        probes = torch.randn((self.num_steps, *input_ids.shape, embeds_all.shape[-1]),
                             generator=gen, device=input_ids.device)

        def run(dense: bool, float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
            emb, aux = embeds_all, aux_hidden
            ctx = (torch.autocast(input_ids.device.type, enabled=False) if float32
                   else contextlib.nullcontext())
            if float32:
                emb, aux = emb.float(), aux.float()
            with torch.enable_grad(), ctx:
                outs = list(self._unroll(emb, self.head.fc(aux), dense, step))
                loss = sum(((o.float() * p).sum() for o, p in zip(outs, probes, strict=True)),
                           torch.zeros((), device=input_ids.device))
                grads = torch.autograd.grad(loss, params, allow_unused=True)
            flat = torch.cat([g.flatten().float() for g in grads if g is not None])
            return torch.stack([o.detach().float() for o in outs]), flat

        reference = run(dense=True, float32=True)
        dense = run(dense=True, float32=False)
        split = run(dense=False, float32=False)
        problems = []
        for i, what in enumerate(("outputs", "gradients")):
            if not bool(torch.isfinite(split[i]).all()):
                problems.append(f"non-finite {what}")
                continue
            noise = _rel(dense[i], reference[i])
            err = _rel(split[i], dense[i])
            if err > CHECK_NOISE_FACTOR * noise + CHECK_FLOOR:
                problems.append(f"{what}: relative difference {err:.2e} to dense, whose own "
                                f"rounding is {noise:.2e}")
        return "; ".join(problems) or None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (float)."""
    return float((a - b).norm() / b.norm().clamp(min=1e-30))
