"""The attention of one TTT step (:mod:`structspec.training.ttt`), in two exact forms.

Step k's query row t reads the step-0 keys of positions ``0..t`` (causal) and its own keys of
steps ``1..k`` at row t (the "diagonal"). Both forms compute that softmax:

* ``dense``: SDPA over the concatenated keys ``[step-0 | step-1 | ... | step-k]`` with a
  boolean ``[T, (k+1) T]`` mask (:func:`ttt_mask`). On CUDA (the H200 run, torch 2.11) that
  mask sent SDPA to its math kernel, which materialises ``[B, H, T, (k+1) T]`` scores and keeps
  them for backward: the memory of the K steps grows with ``K^2 T^2`` (108.8 GiB at 65,536
  tokens per batch). On the CPU a fused flash kernel takes the mask; either way each step does
  ``(k+1)`` times the causal score work. Kept as the reference.
* ``split``: the causal part runs as a causal SDPA (flash / memory-efficient kernels on CUDA,
  the flash kernel for CPU), the diagonal part is ``k`` dot products per row and head
  (elementwise), and the two are merged exactly (:func:`split_ttt_attention`).

How the split form merges (why not flex_attention or a hand-written LSE): merging two softmax
blocks exactly needs the causal part's log-sum-exp, and its gradient. SDPA's public API does
not return the LSE; ``flex_attention(return_lse=True)`` does (with its gradient) but is fast
on CUDA only under ``torch.compile`` (in eager mode it is unfused and materialises the scores
like the math kernel), has no backward at all on the CPU (torch 2.13), and a compile per batch
width (rows vary up to ``max_seq_len``) or a dynamic-shape compile is a new failure surface on
each torch release (2.11 on the GPU host, 2.13 here). Computing the causal LSE by hand in
chunks of query rows is exact and portable but writes ``[B, H, chunk, T]`` float32 scores to
memory where a fused kernel keeps them on-chip (``benchmarks/ttt_attention.py`` measures it as
``chunked``). The split form instead folds the whole diagonal part into ONE extra "sink" key
of a plain causal SDPA: with the diagonal scores ``d_s`` of row t, ``a_t = logsumexp_s d_s``
and ``V^d_t = sum_s softmax(d)_s V_s[t]``,

    softmax over {step-0 keys 0..t} + {diag keys} = softmax over {step-0 keys 0..t, sink_t}
    with sink score a_t, followed by replacing the sink's value with V^d_t,

so a causal SDPA whose keys are ``[sink, K0_0 .. K0_{T-1}]`` and queries ``[dummy, q_0 ..
q_{T-1}]`` (square, so ``is_causal`` is unambiguous) gives ``(1 - w_t) * out_causal_t`` in the
first D value channels and the sink's weight ``w_t`` in one extra value channel, and the
result is ``that + w_t * V^d_t``. The sink's score ``a_t`` travels in two extra query channels
(a high and a low part, so bf16 carries it to ~2^-16 relative) against key channels equal to
1; every step-0 key is 0 there, so their scores are unchanged. Head dims are padded by 8 (flash
kernels need multiples of 8). Gradients are autograd's own through SDPA, the log-sum-exp and
the elementwise part: nothing hand-derived. Only public, stable SDPA arguments (``is_causal``,
``scale``) are used, so the path is the same on every torch with SDPA.

Cost per step: one causal attention over T (+1) rows at head dim D + 8 instead of a masked one
over (k+1) T keys; memory ``O(B H T D)`` per step instead of ``O(B H T (k+1) T)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: extra head-dim channels of the split form's SDPA: sink score (high, low part) and the
#: sink's weight; padded to 8 because flash kernels need head dims that are multiples of 8.
SINK_CHANNELS = 8


def ttt_mask(width: int, num_steps: int, device: torch.device) -> torch.Tensor:
    """``[width, num_steps * width]`` bool: query row t may read key ``(s, j)`` (block s, row j)
    when ``s == 0 and j <= t`` or ``s >= 1 and j == t``. Step k uses the first ``k+1``
    blocks."""
    t = torch.arange(width, device=device)
    blocks = [t.unsqueeze(1) >= t.unsqueeze(0)]
    eye = t.unsqueeze(1) == t.unsqueeze(0)
    blocks += [eye] * (num_steps - 1)
    return torch.cat(blocks, dim=1)


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, T, Hkv, D]`` -> ``[B, Hkv * group, T, D]`` (each KV head repeated ``group`` times,
    as query head h reads KV head ``h // group``)."""
    return x.repeat_interleave(group, dim=2).transpose(1, 2)


def dense_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference form: masked SDPA over the concatenated keys of steps ``0..k``.

    Args:
        q: ``[B, T, H, D]`` this step's queries (step k = ``len(keys) - 1``).
        keys, values: per step ``0..k``, ``[B, T, Hkv, D]`` (``H`` a multiple of ``Hkv``).
        mask: ``[T, >= (k+1) T]`` bool (:func:`ttt_mask`; its first ``(k+1) T`` columns used).
        scale: the softmax scale.

    Returns:
        ``[B, T, H, D]`` in SDPA's output dtype.
    """
    group = q.shape[2] // keys[0].shape[2]
    kk = _heads_first(torch.cat(keys, dim=1), group)
    vv = _heads_first(torch.cat(values, dim=1), group)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv,
                                         attn_mask=mask[:, : kk.shape[2]], scale=scale)
    return out.transpose(1, 2)


def diagonal_part(q: torch.Tensor, scale: float, *kv: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The diagonal keys of each row, in float32 (or float64 for float64 inputs).

    Args:
        q: ``[B, T, H, D]``; ``kv``: the ``k`` diagonal keys then their ``k`` values, each
            ``[B, T, Hkv, D]``.

    Returns:
        ``(lse [B, T, H], v_diag [B, T, H, D])``: the log-sum-exp of the ``k`` scores of each
        row and head, and their softmax-weighted values.
    """
    b, t, h, d = q.shape
    steps = len(kv) // 2
    hkv = kv[0].shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(b, t, hkv, h // hkv, d)
    scores = torch.stack([(qg * kv[s].to(acc).unsqueeze(3)).sum(-1) for s in range(steps)],
                         dim=-1) * scale  # [B, T, Hkv, G, k]
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    v_diag = sum(p[..., s:s + 1] * kv[steps + s].to(acc).unsqueeze(3) for s in range(steps))
    assert isinstance(v_diag, torch.Tensor)
    return lse.reshape(b, t, h), v_diag.reshape(b, t, h, d)


def split_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        scale: float) -> torch.Tensor:
    """The same function as :func:`dense_ttt_attention` with a causal SDPA and an exact
    sink merge (see the module docstring); no ``[T, (k+1) T]`` scores exist.

    Args:
        q: ``[B, T, H, D]`` this step's queries (step k = ``len(keys) - 1``).
        keys, values: per step ``0..k``, ``[B, T, Hkv, D]`` (``H`` a multiple of ``Hkv``).
        scale: the softmax scale.

    Returns:
        ``[B, T, H, D]`` in ``q``'s dtype.
    """
    b, t, h, d = q.shape
    group = h // keys[0].shape[2]
    k0 = _heads_first(keys[0], group)
    v0 = _heads_first(values[0], group)
    qh = q.transpose(1, 2)
    if len(keys) == 1:  # step 0: the causal part alone
        out = F.scaled_dot_product_attention(qh, k0, v0, is_causal=True, scale=scale)
        return out.transpose(1, 2)
    # Recomputed in backward (elementwise, cheap): its float32 copies of q and of the diagonal
    # keys / values would otherwise be kept for every step.
    lse, v_diag = checkpoint(diagonal_part, q, scale, *keys[1:], *values[1:],
                             use_reentrant=False)
    dt = qh.dtype
    a = (lse / scale).transpose(1, 2).unsqueeze(-1)  # [B, H, T, 1]: sink score / scale
    a_hi = a.to(dt)
    # the low part carries what the rounding to dt lost; its gradient is the high part's
    a_lo = (a - a_hi.to(a.dtype)).detach().to(dt)
    pad = SINK_CHANNELS
    q_row = torch.cat((qh, a_hi, a_lo, qh.new_zeros(b, h, t, pad - 2)), dim=-1)
    q_ext = torch.cat((qh.new_zeros(b, h, 1, d + pad), q_row), dim=2)  # dummy query row 0
    sink_k = k0.new_zeros(b, h, 1, d + pad)
    sink_k[..., d:d + 2] = 1.0
    k_ext = torch.cat((sink_k, F.pad(k0, (0, pad))), dim=2)
    sink_v = v0.new_zeros(b, h, 1, d + pad)
    sink_v[..., d] = 1.0
    v_ext = torch.cat((sink_v, F.pad(v0, (0, pad))), dim=2)
    o = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, is_causal=True,
                                       scale=scale)[:, :, 1:]
    o = o.transpose(1, 2)  # [B, T, H, D + pad]
    w = o[..., d:d + 1].to(v_diag.dtype)
    return (o[..., :d].to(v_diag.dtype) + w * v_diag).to(q.dtype)
