"""Masked paged attention in Triton: prefill, decode and tree verify with one kernel.

Drop-in for :class:`structspec.layers.attention.TorchAttentionBackend`: queries ``[B, Q, Hq,
D]`` attend over the KV-pool slots ``fb.kv_slots [B, L]`` under the boolean mask
``fb.mask() [B, Q, L]`` (for a causal chain, the rule ``fb.causal_start`` gives, with no mask
built); K/V are gathered from the pool on the fly (no ``index_select`` copies), scale
``1/sqrt(D)``, online softmax in float32, GQA with query head ``h`` reading KV head
``h // (Hq // Hkv)``.

Work split: one program owns ``BLOCK_M`` rows of the ``Q * G`` (query token, head-in-group)
pairs of one ``(request, KV head)``, so each K/V tile is loaded once for the whole GQA group.
KV blocks in which no row of the program may attend (causal upper triangle in prefill,
bucket padding past a request's length in verify) are skipped after reading their mask tile.

Split-KV (flash-decoding): when ``B * Hkv`` (times the row blocks) is too small to fill the
GPU and ``L`` is long, the KV axis is cut into ``S`` chunks handled by separate programs that
write float32 partial outputs and log-sum-exps; a second kernel merges them. ``S`` depends
only on tensor shapes, so the launch is the same on every replay of a CUDA graph: no host
syncs, no data-dependent shapes.

``TritonAttentionBackend(batch_invariant=True)`` fixes ``BLOCK_M`` and cuts the KV axis into
fixed :data:`INVARIANT_KV_CHUNK`-key splits merged in order, so a row's output does not depend
on the batch or the query count (a verify forward's first-chain nodes match plain decodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from structspec.kernels import next_pow2, sm_count
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch

_LOG2E = 1.4426950408889634

INVARIANT_KV_CHUNK = 1024
"""Keys per KV split in batch-invariant mode (a multiple of every ``BLOCK_N``): the splits
of a forward are ``cdiv(L, INVARIANT_KV_CHUNK)`` fixed column ranges, so where a key's
partial sum starts and ends never depends on the batch, the query count or the GPU."""


@triton.jit
def _program_rows(Q, stride_qb, stride_qq, stride_qh, num_q,
                  HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's rows and queries: program ``(pid_m, b * HKV + kvh, split)`` owns rows
    ``pid_m * BLOCK_M ..`` of request ``b``'s ``num_q * GROUP`` (query token, head-in-group)
    pairs; row ``r`` is query token ``r // GROUP`` of query head ``kvh * GROUP + r % GROUP``.
    Returns ``b, kvh, qi, h, d, row_ok, d_ok`` and the ``[BLOCK_M, BLOCK_D]`` queries (0 on
    rows and dims past the ends)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    kvh = pid_bh % HKV
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_q * GROUP
    qi = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + qi[:, None] * stride_qq + h[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    return b, kvh, qi, h, d, row_ok, d_ok, q


@triton.jit
def _store_rows(Out, Lse, acc, m_i, l_i, pid_s, b, qi, h, d, row_ok, d_ok,
                stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb, stride_lq,
                SPLIT: tl.constexpr):
    """A program's epilogue: ``acc / l`` per row, in ``Out``'s dtype (one split), or the
    float32 partial and its log2-sum-exp for :func:`_combine_kernel` (split ``pid_s``). A row
    that saw no column (``l = 0``) stores 0 and ``lse = -inf`` (weight 0 in the merge)."""
    pid_s = pid_s.to(tl.int64)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptr = (Out + pid_s * stride_os + b * stride_ob + qi[:, None] * stride_oq
             + h[:, None] * stride_oh + d[None, :])
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        tl.store(o_ptr, o, mask=o_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(Lse + pid_s * stride_ls + b * stride_lb + qi * stride_lq + h, lse, mask=row_ok)
    else:
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=o_mask)


@triton.jit
def _attn_kernel(
    Q, KC, VC, Slots, Mask, Out, Lse,
    stride_qb, stride_qq, stride_qh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_sb, stride_mb, stride_mq,
    stride_os, stride_ob, stride_oq, stride_oh,
    stride_ls, stride_lb, stride_lq,
    num_q, kv_len, kv_chunk, qk_scale,
    HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_s = tl.program_id(2).to(tl.int64)
    b, kvh, qi, h, d, row_ok, d_ok, q = _program_rows(
        Q, stride_qb, stride_qq, stride_qh, num_q, HKV, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = pid_s * kv_chunk
    end = tl.minimum(start + kv_chunk, kv_len)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        allowed = tl.load(
            Mask + b * stride_mb + qi[:, None] * stride_mq + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :], other=0,
        ) != 0
        # Skip KV tiles nobody in this program may see: no K/V traffic, no dot products.
        if tl.sum(tl.sum(allowed.to(tl.int32), axis=1), axis=0) > 0:
            slots = tl.load(Slots + b * stride_sb + cols, mask=col_ok, other=0)
            kt = tl.load(
                KC + slots[None, :] * stride_kcs + kvh * stride_kch + d[:, None],
                mask=d_ok[:, None] & col_ok[None, :], other=0.0,
            )
            if IEEE:  # float32 models: no TF32 rounding in the scores
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(allowed, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row with nothing allowed so far keeps m = -inf; use 0 as its reference so
            # exp2(-inf - ref) is 0 rather than exp2(-inf + inf) = NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                VC + slots[:, None] * stride_vcs + kvh * stride_vch + d[None, :],
                mask=col_ok[:, None] & d_ok[None, :], other=0.0,
            )
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    _store_rows(Out, Lse, acc, m_i, l_i, pid_s, b, qi, h, d, row_ok, d_ok,
                stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb, stride_lq,
                SPLIT=SPLIT)


@triton.jit
def _softmax_tile(q, kt, v_ptrs, v_mask, cols, last_col, m_i, l_i, acc, qk_scale,
                  MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One K/V tile of the online softmax (FlashAttention-2): scores ``q @ kt`` scaled to
    log2 units, ``MASKED`` keeps column ``c`` for a row only where ``c <= last_col[row]``;
    the V tile (``v_ptrs`` under ``v_mask``) is loaded once the probabilities are known.
    Returns the updated running max ``m``, denominator ``l`` and output accumulator."""
    if IEEE:  # float32 models: no TF32 rounding in the scores
        s = tl.dot(q, kt, input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, kt) * qk_scale
    if MASKED:
        s = tl.where(cols[None, :] <= last_col[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:  # a row that has seen no column yet keeps m = -inf: 0 as its reference
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _causal_kernel(
    Q, KC, VC, Slots, Start, Out, Lse,
    stride_qb, stride_qq, stride_qh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_sb,
    stride_os, stride_ob, stride_oq, stride_oh,
    stride_ls, stride_lb, stride_lq,
    num_q, kv_len, kv_chunk, qk_scale,
    HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    """:func:`_attn_kernel` for a causal chain, with no mask tensor: query ``qi`` of request
    ``b`` sits at position ``Start[b] + qi`` and sees columns ``0 .. Start[b] + qi``.

    The FlashAttention-2 loop split (Dao, "FlashAttention-2", 2023, section 3.1.1): columns
    below the program's first row position are visible to every row, so that stretch runs
    without any mask (its loads and dots are software-pipelined); only the diagonal tiles
    after it apply the causal rule, and columns past the program's last row are never read.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(2)
    b, kvh, qi, h, d, row_ok, d_ok, q = _program_rows(
        Q, stride_qb, stride_qq, stride_qh, num_q, HKV, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M)
    start = tl.load(Start + b)
    q_pos = start + qi  # the last column each row sees
    first_pos = start + (pid_m * BLOCK_M) // GROUP  # columns <= this: visible to every row
    last_pos = start + tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, num_q - 1)
    lo = pid_s * kv_chunk
    hi = tl.minimum(tl.minimum(lo + kv_chunk, kv_len), last_pos + 1)
    full_hi = tl.maximum(lo, lo + (tl.minimum(hi, first_pos + 1) - lo) // BLOCK_N * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slot_row = Slots + b * stride_sb
    for n0 in range(lo, full_hi, BLOCK_N):  # every column visible to every row
        cols = n0 + tl.arange(0, BLOCK_N)
        slots = tl.load(slot_row + cols)
        kt = tl.load(KC + slots[None, :] * stride_kcs + kvh * stride_kch + d[:, None],
                     mask=d_ok[:, None], other=0.0)
        v_ptrs = VC + slots[:, None] * stride_vcs + kvh * stride_vch + d[None, :]
        m_i, l_i, acc = _softmax_tile(q, kt, v_ptrs, d_ok[None, :], cols, q_pos, m_i, l_i,
                                      acc, qk_scale, MASKED=False, IEEE=IEEE)
    for n0 in range(full_hi, hi, BLOCK_N):  # the diagonal: the causal rule per row
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        slots = tl.load(slot_row + cols, mask=col_ok, other=0)
        kt = tl.load(KC + slots[None, :] * stride_kcs + kvh * stride_kch + d[:, None],
                     mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        v_ptrs = VC + slots[:, None] * stride_vcs + kvh * stride_vch + d[None, :]
        # one bound for both rules: c <= q_pos (causal) and c < hi (this split's end)
        m_i, l_i, acc = _softmax_tile(q, kt, v_ptrs, col_ok[:, None] & d_ok[None, :], cols,
                                      tl.minimum(q_pos, hi - 1), m_i, l_i, acc, qk_scale,
                                      MASKED=True, IEEE=IEEE)
    _store_rows(Out, Lse, acc, m_i, l_i, pid_s, b, qi, h, d, row_ok, d_ok,
                stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb, stride_lq,
                SPLIT=SPLIT)


@triton.jit
def _combine_kernel(
    Part, Lse, Out, num_splits, stride_ps, stride_ls,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # flattened (b, q, h) row
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(Lse + s * stride_ls + r, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(s_ok, tl.exp2(lse - mx), 0.0)  # splits that saw no key have lse -inf: w 0
    part = tl.load(Part + s[:, None] * stride_ps + r * HEAD_DIM + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    den = tl.sum(w, axis=0)
    den = tl.where(den == 0.0, 1.0, den)
    out = tl.sum(w[:, None] * part, axis=0) / den
    tl.store(Out + r * HEAD_DIM + d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _combine_ordered_kernel(
    Part, Lse, Out, num_splits, stride_ps, stride_ls,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The split merge of batch-invariant mode: the splits are visited one at a time in
    order (no tree reduction whose shape follows ``next_pow2(num_splits)``), so a row whose
    keys lie in the first ``j`` chunks gets the same bits for any ``num_splits >= j``: a
    chunk that saw no key has ``lse = -inf`` and a zero partial, hence weight exactly 0 and
    ``den + 0 == den``, ``acc + 0 * 0 == acc``; with one non-empty chunk the weight is
    ``exp2(0) == 1`` and the result is that chunk's ``acc / l``, exactly what the unsplit
    kernel stores."""
    r = tl.program_id(0).to(tl.int64)  # flattened (b, q, h) row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mx = tl.load(Lse + r)
    for s in range(1, num_splits):
        mx = tl.maximum(mx, tl.load(Lse + s * stride_ls + r))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(Lse + s * stride_ls + r) - mx)
        part = tl.load(Part + s * stride_ps + r * HEAD_DIM + d, mask=d_ok, other=0.0)
        den += w
        acc += w * part
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(Out + r * HEAD_DIM + d, (acc / den).to(Out.dtype.element_ty), mask=d_ok)


def _launch(kernel: Any, grid: tuple[int, int, int], inputs: tuple[torch.Tensor, ...],
            strides: tuple[int, ...], out: torch.Tensor, kv_len: int, chunk: int,
            meta: dict[str, Any], *, ordered: bool) -> torch.Tensor:
    """Launch ``kernel`` (:func:`_attn_kernel` or :func:`_causal_kernel`, whose arguments
    share one layout: ``inputs``, the outputs, ``strides``, the output strides, sizes) over
    ``grid = (row blocks, B * Hkv, splits)``: straight into ``out`` ``[B, Q, Hq, D]`` with one
    split, else into float32 partials merged by :func:`_combine_kernel` (or, ``ordered``,
    :func:`_combine_ordered_kernel`). Returns ``out``."""
    bsz, nq, hq, d = out.shape
    splits = grid[2]
    qk_scale = _LOG2E / math.sqrt(d)
    if splits == 1:
        kernel[grid](*inputs, out, out, *strides,
                     0, out.stride(0), out.stride(1), out.stride(2), 0, 0, 0,
                     nq, kv_len, chunk, qk_scale, SPLIT=False, **meta)
        return out
    part = torch.empty((splits, bsz, nq, hq, d), dtype=torch.float32, device=out.device)
    lse = torch.empty((splits, bsz, nq, hq), dtype=torch.float32, device=out.device)
    kernel[grid](*inputs, part, lse, *strides,
                 part.stride(0), part.stride(1), part.stride(2), part.stride(3),
                 lse.stride(0), lse.stride(1), lse.stride(2),
                 nq, kv_len, chunk, qk_scale, SPLIT=True, **meta)
    combine = dict(HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], num_warps=1)
    if ordered:
        _combine_ordered_kernel[(bsz * nq * hq,)](
            part, lse, out, splits, part.stride(0), lse.stride(0), **combine)
    else:
        _combine_kernel[(bsz * nq * hq,)](
            part, lse, out, splits, part.stride(0), lse.stride(0),
            BLOCK_S=next_pow2(splits), **combine)
    return out


@dataclass(frozen=True)
class CausalConfig:
    """Launch shape of :func:`_causal_kernel` (prompt chunks: many query rows, long prefix).

    Attributes:
        block_m: (query token, head-in-group) rows per program, a power of two >= 16; a
            forward with fewer rows uses ``next_pow2(rows)``.
        block_n: KV columns per tile, a power of two >= 16.
        num_warps, num_stages: Triton launch options (``num_stages`` pipelines the unmasked
            prefix loop's K/V loads).
        long_rows, long_block_m: forwards of more than ``long_rows`` rows use
            ``long_block_m`` (H200: 2,048-token pieces ran 2x faster with 64 than with 128).

    Defaults measured on an H200 (``benchmarks/attention_causal.py``, benchmarks/README.md).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    long_rows: int = 2048
    long_block_m: int = 64

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "long_block_m"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"CausalConfig.{name}={v}: expected a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"CausalConfig: num_warps={self.num_warps} (1..16, a power of "
                             f"two) / num_stages={self.num_stages} (>= 1)")


class TritonAttentionBackend:
    """Triton attention with the interface of
    :class:`~structspec.layers.attention.TorchAttentionBackend`.

    Args:
        num_splits: force the number of KV splits (tests); None = choose from the shapes:
            split only when the ``(row block, request, KV head)`` programs would not fill the
            GPU and ``L`` spans several KV blocks.
        max_splits: upper bound on the heuristic's splits.
        batch_invariant: make every output row bitwise independent of the batch (which
            other requests, how many query tokens): ``BLOCK_M`` 16 always, ``BLOCK_N`` from
            ``D`` only, and the KV axis cut into fixed ``kv_chunk``-column splits (``S =
            cdiv(L, kv_chunk)``) merged in order by :func:`_combine_ordered_kernel`. A
            row's softmax then visits the same key tiles, in the same chunks, in the same
            order in a decode forward (``Q = 1``) as in a tree-verify forward (``Q`` nodes,
            a larger ``L`` bucket): columns it may not see give ``s = -inf``, ``p = 0``,
            which leave ``m``, ``l`` and ``acc`` bitwise unchanged (``alpha = exp2(0) = 1``,
            ``x * 1 + 0 == x``), whole masked tiles and empty chunks likewise. This is the
            attention half of the "batch-invariant ops" of Thinking Machines' "Defeating
            Nondeterminism in LLM Inference" (cf. sglang ``--enable-deterministic-inference``,
            vLLM ``VLLM_BATCH_INVARIANT``). Slower on short batches (fewer, fixed splits).
        kv_chunk: keys per split in batch-invariant mode (a multiple of 64; tests shrink it).
        causal_config: tile sizes of the causal-chain kernel (forwards that set
            ``fb.causal_start``: prompts and prompt chunks; not in batch-invariant mode).

    Runs on CUDA (or on CPU tensors under ``TRITON_INTERPRET=1``). Launch shapes depend only
    on tensor shapes, so forwards can be captured in CUDA graphs.
    """

    def __init__(self, num_splits: int | None = None, max_splits: int = 32, *,
                 batch_invariant: bool = False, kv_chunk: int = INVARIANT_KV_CHUNK,
                 causal_config: CausalConfig = CausalConfig()) -> None:
        if batch_invariant and (not isinstance(kv_chunk, int) or isinstance(kv_chunk, bool)
                                or kv_chunk <= 0 or kv_chunk % 64):
            raise ValueError(f"kv_chunk={kv_chunk}: expected a positive multiple of 64")
        if batch_invariant and num_splits is not None:
            raise ValueError("num_splits cannot be forced with batch_invariant=True: the "
                             "splits are fixed kv_chunk column ranges")
        self.num_splits = num_splits
        self.max_splits = max_splits
        self.batch_invariant = batch_invariant
        self.kv_chunk = kv_chunk
        self.causal_config = causal_config

    def _splits(self, programs: int, kv_len: int, block_n: int, device: torch.device) -> int:
        if self.num_splits is not None:
            return max(1, self.num_splits)
        blocks = triton.cdiv(kv_len, block_n)
        target = 2 * sm_count(device)
        if programs * 2 >= target or blocks < 4:
            return 1
        return max(1, min(self.max_splits, blocks, triton.cdiv(target, programs)))

    def forward(
        self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, kv_pool: KVPool
    ) -> torch.Tensor:
        """Attend.

        Args:
            q: ``[B, Q, Hq, D]`` queries after rotary (any strides with unit stride on ``D``),
                float16/bfloat16/float32, on the pool's device.
            layer_id: decoder layer index into ``kv_pool``.
            fb: uses ``kv_slots [B, L]`` int64 and ``causal_start`` (the causal kernel) or
                the mask ``fb.mask()`` ``[B, Q, L]`` bool; every row must allow at least one
                column (as :class:`ForwardBatch` guarantees).
            kv_pool: ``k_cache[layer_id]`` / ``v_cache[layer_id]`` ``[num_slots, Hkv, D]``
                holding this forward's K/V already.

        Returns:
            ``[B, Q, Hq, D]`` contiguous, ``q``'s dtype and device.
        """
        bsz, nq, hq, d = q.shape
        kc, vc = kv_pool.k_cache[layer_id], kv_pool.v_cache[layer_id]
        hkv = kc.shape[1]
        if hq % hkv:
            raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
        group = hq // hkv
        if q.stride(-1) != 1:
            q = q.contiguous()
        slots = fb.kv_slots
        if slots.stride(-1) != 1:
            slots = slots.contiguous()
        kv_len = slots.shape[1]
        out = torch.empty((bsz, nq, hq, d), dtype=q.dtype, device=q.device)
        if out.numel() == 0:
            return out
        rows = nq * group
        block_d = max(16, next_pow2(d))
        if fb.causal_start is not None and not self.batch_invariant:
            return self._causal(q, kc, vc, slots, fb.causal_start, out, group, block_d)
        mask = fb.mask()
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask = mask.view(torch.uint8)  # same bytes; Triton loads bytes more portably than i1
        block_n = 64 if d <= 128 else 32
        if self.batch_invariant:  # nothing below may depend on B or Q (see the class doc)
            block_m = 16
            chunk = self.kv_chunk
        else:
            block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
            splits = self._splits(triton.cdiv(rows, block_m) * bsz * hkv, kv_len, block_n,
                                  q.device)
            chunk = triton.cdiv(triton.cdiv(kv_len, splits), block_n) * block_n
        m_blocks = triton.cdiv(rows, block_m)
        splits = triton.cdiv(kv_len, chunk)
        meta = dict(HKV=hkv, GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m,
                    BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=4)
        strides = (q.stride(0), q.stride(1), q.stride(2), kc.stride(0), kc.stride(1),
                   vc.stride(0), vc.stride(1), slots.stride(0), mask.stride(0), mask.stride(1))
        return _launch(_attn_kernel, (m_blocks, bsz * hkv, splits), (q, kc, vc, slots, mask),
                       strides, out, kv_len, chunk, meta, ordered=self.batch_invariant)

    def _causal(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                slots: torch.Tensor, start: torch.Tensor, out: torch.Tensor, group: int,
                block_d: int) -> torch.Tensor:
        """:meth:`forward` of a causal chain (``fb.causal_start`` set) through
        :func:`_causal_kernel`; same splitting and merge as the masked kernel."""
        bsz, nq, hq, d = q.shape
        hkv = kc.shape[1]
        kv_len = slots.shape[1]
        cfg = self.causal_config
        rows = nq * group
        block_m = cfg.long_block_m if rows > cfg.long_rows else cfg.block_m
        block_m = min(block_m, max(16, next_pow2(rows)))
        block_n = cfg.block_n if d <= 128 else min(cfg.block_n, 32)
        m_blocks = triton.cdiv(rows, block_m)
        splits = self._splits(m_blocks * bsz * hkv, kv_len, block_n, q.device)
        chunk = triton.cdiv(triton.cdiv(kv_len, splits), block_n) * block_n
        splits = triton.cdiv(kv_len, chunk)
        if start.dtype != torch.int64 or start.shape != (bsz,):
            raise ValueError(f"fb.causal_start: expected int64 [{bsz}], got {start.dtype} "
                             f"{tuple(start.shape)}")
        meta = dict(HKV=hkv, GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m,
                    BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        strides = (q.stride(0), q.stride(1), q.stride(2), kc.stride(0), kc.stride(1),
                   vc.stride(0), vc.stride(1), slots.stride(0))
        return _launch(_causal_kernel, (m_blocks, bsz * hkv, splits),
                       (q, kc, vc, slots, start), strides, out, kv_len, chunk, meta,
                       ordered=False)

    __call__ = forward
