"""Skinny GEMM / GEMV for decode: ``y[M, N] = x[M, K] @ W[N, K]^T`` with ``M <= MAX_ROWS``.

At decode batch sizes a linear layer is a weight stream: ``M`` (tokens, or batch x tree nodes
when verifying) is 1..16, so the FLOPs are negligible and the time is ``N*K*itemsize / HBM
bandwidth``. On an H200, cuBLAS streams the Llama-3-8B decode weights at 2.5 (o_proj) to
4.3 (lm_head) TB/s; this kernel is built to stream ``W`` exactly once at close to what a
plain streaming-read kernel of the same size gets:

* each program owns ``BLOCK_N`` output columns (= rows of ``W``) and a slice of ``K``
  (all of it, or ``1/SPLIT_K`` of it), and walks it in ``[BLOCK_N, BLOCK_K]`` tiles loaded
  with 16-byte vector loads along ``K`` (rows of ``W`` are contiguous: coalesced);
* every ``W`` tile is multiplied by all ``M`` rows of ``x`` (``x`` is tiny and stays in L2),
  so the weight is read once whatever ``M``;
* ``M == 1`` uses FMAs into a ``[BLOCK_N, BLOCK_K]`` float32 accumulator reduced once at the
  end (no per-tile shuffles); ``M > 1`` pads ``M`` to 16 with zero-masked rows (no memory
  traffic for them) and uses ``tl.dot(W_tile, x_tile^T)`` (tensor cores, with W as the
  left operand: the "swap AB" trick for skinny GEMMs; loads pipelined through shared memory
  by ``num_stages``), accumulating in float32;
* when ``N / BLOCK_N`` programs would not fill the GPU, ``K`` is split over ``SPLIT_K``
  programs that write float32 partials to a ``[SPLIT_K, M, N]`` workspace (``torch.empty``),
  and a second small kernel sums them in a fixed order (deterministic, no atomics, nothing
  to zero) and casts.

Launch configurations come from a small table keyed on ``(M, N, K)`` (:func:`_config`), not
from ``triton.autotune``: autotuning benchmarks on first call, which cannot happen inside
CUDA-graph capture (the model's decode step is captured) and would make the chosen kernel
depend on timing noise. The table was picked by a sweep on an H200 at the Llama-3-8B shapes
(``benchmarks/kernels_micro.py --gemv`` prints the comparison). Launch shapes depend only on
tensor shapes and no host sync happens, so calls can be captured in CUDA graphs.

Measured (H200, bf16, torch 2.11 / triton 3.6, CUDA-graph replay, weights cycled so every
call reads HBM), M=1: qkv 15.1 -> 14.1 us, o 13.3 -> 10.3, gate_up 56.9 -> 54.4, down
32.0 -> 28.8, lm_head 246 -> 231 (3.3-4.5 TB/s); M=2..16: 1.0-1.16x cuBLAS at every shape.
The Llama-3-8B decode step (B=1, CUDA graph) went from 4.79 to 4.38 ms (HBM floor 3.50).

:func:`invariant_linear` is the batch-invariant variant (``EngineConfig.batch_invariant``):
any ``M``, always the ``tl.dot`` path on 16-row tiles (a third grid axis) with a launch
configuration that ignores ``M``, so each row's bits do not depend on the other rows.

``ENABLED`` (module global, default on; environment ``STRUCTSPEC_GEMV=0`` turns it off at
import) makes :func:`linear` fall back to ``torch.nn.functional.linear`` for A/B runs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from structspec.env_flags import env_flag
from structspec.kernels import next_pow2, sm_count, triton_available
from structspec.layers.linear import linear_fp32_out

MAX_ROWS = 16
"""Largest ``M`` (rows of ``x``) served by the kernel; :func:`linear` uses cuBLAS above it."""


def _env_enabled() -> bool:
    """``STRUCTSPEC_GEMV`` unset or anything but ``0`` / ``false`` / ``off`` / ``no``."""
    return env_flag("STRUCTSPEC_GEMV")


ENABLED = _env_enabled()
"""Whether :func:`linear` may use the kernel (read at call time; tests and A/B runs flip it)."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Config(NamedTuple):
    """One launch configuration (all powers of two except ``split_k``)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool | None = None  # None: tl.dot when M > 1


@triton.jit
def _gemv_kernel(
    X, W, Bias, Y, P,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)  # tiles of BLOCK_M rows: always 0 except in invariant_linear
    # K and both row strides are multiples of 8 (checked on the host): 16-byte vector loads.
    stride_wn = tl.multiple_of(stride_wn, 8)
    stride_xm = tl.multiple_of(stride_xm, 8)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # Out-of-range rows re-read row N-1 (valid memory) instead of masking the W load, so the
    # loads stay unmasked along N; those columns are dropped at the store.
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # global rows of x / P / Y
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    if SPLIT:
        k_start = pid_k * k_per_split
        k_end = tl.minimum(K, k_start + k_per_split)
    else:  # keeps the loop as lean as possible (registers decide the occupancy)
        k_start = 0
        k_end = K
    w_ptr = W + rows_w[:, None] * stride_wn + offs_k[None, :]
    if BLOCK_M == 1:
        x_ptr = X + offs_k[None, :]
    else:  # padded rows (m >= M) are masked to zero (no memory traffic)
        x_ptr = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptr + k)
            if BLOCK_M == 1:
                x = tl.load(x_ptr + k)
            else:
                x = tl.load(x_ptr + k, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k) < k_end
            w = tl.load(w_ptr + k, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        elif BLOCK_M == 1:
            acc2 += w.to(tl.float32) * x.to(tl.float32)  # x is [1, BLOCK_K]
        else:
            acc3 += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    if not USE_DOT:
        if BLOCK_M == 1:
            acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
        else:
            acc = tl.trans(tl.sum(acc3, axis=2))  # [BLOCK_N, BLOCK_M]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        # Partials P[pid_k, m, n] in float32; _splitk_reduce_kernel sums them.
        # int64: invariant_linear serves prefill-sized M, where M * N can pass 2**31.
        p_ptr = P + (pid_k * M + offs_m[None, :].to(tl.int64)) * N + offs_n[:, None]
        tl.store(p_ptr, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y_ptr = Y + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    P, Bias, Y, M, N, stride_ym,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(P + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=ok)


def _config(m: int, n: int, k: int, sms: int, itemsize: int = 2) -> Config:
    """The launch configuration for ``x [m, k] @ W[n, k]^T`` on a GPU with ``sms`` SMs, for
    elements of ``itemsize`` bytes (the table is for 2-byte types; float32 halves ``BLOCK_K``
    so a tile keeps its bytes, its registers and its shared memory).

    A fixed table, picked by sweeps on an H200 (bf16, weights cycled so every call reads HBM;
    see the module docstring for why there is no autotuning):

    * ``M == 1``: FMA path, ``BLOCK_N`` 4 x ``BLOCK_K`` 2048, 4 warps. 16 KB of ``W`` per
      program per step and exactly 128 registers per thread, so 4 programs (64 KB of loads
      in flight) fit per SM; ``N / 4`` programs (>= 1024 at Llama-3-8B shapes) balance well.
      Within ~3% of a pure streaming-read kernel of the same size at every Llama-3-8B shape
      (more registers per thread, e.g. 130, cost ~15% by dropping to 3 programs per SM).
    * ``M > 1``: ``tl.dot`` path (``M`` padded to 16), loads pipelined through shared memory:
      ``BLOCK_N`` 128 x ``BLOCK_K`` 128, 3 stages for wide ``N`` (gate_up, lm_head);
      ``BLOCK_N`` 64 x ``BLOCK_K`` 256, 4 stages otherwise.
    * ``K`` is split only when the column blocks alone would leave most SMs idle (small
      ``N``: small models, tests); at the Llama-3-8B shapes splitting measured no faster,
      and it costs a second launch.
    """
    kp2 = max(16, triton.next_power_of_2(k))
    scale = max(1, itemsize // 2)
    if m == 1:
        cfg = Config(block_n=4, block_k=min(2048 // scale, kp2), num_warps=4, num_stages=1)
    elif n >= 16384:
        cfg = Config(block_n=128, block_k=min(128 // scale, kp2), num_warps=4, num_stages=3)
    else:
        cfg = Config(block_n=64, block_k=min(256 // scale, kp2), num_warps=4, num_stages=4)
    programs = triton.cdiv(n, cfg.block_n)
    if 4 * programs < sms:
        split = min(triton.cdiv(2 * sms, programs), triton.cdiv(k, cfg.block_k), 16)
        cfg = cfg._replace(split_k=max(1, split))
    return cfg


def config_for(m: int, n: int, k: int, device: torch.device,
               dtype: torch.dtype = torch.bfloat16) -> Config:
    """The configuration :func:`skinny_linear` launches for ``x [m, k] @ W[n, k]^T`` in
    ``dtype`` on ``device`` (:func:`_config` with the device's SM count; benchmarks print it)."""
    return _config(m, n, k, sm_count(device), dtype.itemsize)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype | None) -> torch.Tensor:
    """Validate the arguments of :func:`skinny_linear` / :func:`invariant_linear` (``x`` 2-D);
    returns ``x`` with unit stride along ``K`` and a row stride that is a multiple of 8."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K]: got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    k = x.shape[1]
    n = weight.shape[0]
    if x.dtype != weight.dtype or x.dtype not in _DTYPES or x.device != weight.device:
        raise ValueError(f"x and weight must share a float16/bfloat16/float32 dtype and a "
                         f"device: {x.dtype}@{x.device} vs {weight.dtype}@{weight.device}")
    if not weight.is_contiguous() or k % 8:
        raise ValueError(f"weight must be contiguous with K % 8 == 0 (K={k})")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] of {x.dtype} on {x.device}: got "
                         f"{tuple(bias.shape)} {bias.dtype}@{bias.device}")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype={out_dtype}: expected float16, bfloat16 or float32")
    if x.stride(1) != 1 or x.stride(0) % 8:
        x = x.contiguous()
    return x


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: Config | None = None, out_dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for few rows: ``F.linear`` semantics, float32 accumulation.

    Args:
        x: ``[M, K]`` with ``1 <= M <= MAX_ROWS`` (``M == 0`` returns an empty result),
            float16/bfloat16/float32, unit stride along ``K`` (copied otherwise), CUDA (or CPU
            under ``TRITON_INTERPRET=1``, float32 only there).
        weight: ``[N, K]`` contiguous (an ``nn.Linear`` weight), ``x``'s dtype and device.
        bias: optional ``[N]`` of ``x``'s dtype, added in float32 before the final rounding.
        config: force a launch configuration (benchmark sweeps); None = :func:`_config`.
        out_dtype: dtype of the result (float16/bfloat16/float32); None = ``x``'s dtype.
            float32 stores the float32 accumulator unrounded (the LM head: logits without
            bf16's 1/8 quantization at magnitude 16-32, which makes exact ties common).

    Returns:
        A new contiguous ``[M, N]`` tensor of ``out_dtype`` on ``x``'s device (the only
        allocation, plus a ``[SPLIT_K, M, N]`` float32 workspace when ``K`` is split).

    Raises:
        ValueError: wrong ranks, mismatched ``K`` / dtypes / devices, ``M > MAX_ROWS``,
            a non-contiguous weight, an unsupported dtype, or ``K`` not a multiple of 8.
    """
    m, k = x.shape if x.dim() == 2 else (0, 0)
    if m > MAX_ROWS:
        raise ValueError(f"M={m} rows > MAX_ROWS={MAX_ROWS}: use F.linear")
    x = _check(x, weight, bias, out_dtype)
    n = weight.shape[0]
    return _launch(x, weight, bias, config or config_for(m, n, k, x.device, x.dtype),
                   out_dtype or x.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            cfg: Config, out_dtype: torch.dtype) -> torch.Tensor:
    """Launch on validated ``x [M, K]`` (unit K stride) and ``weight [N, K]``; returns
    ``[M, N]`` in ``out_dtype``."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    use_dot = m > 1 if cfg.use_dot is None else cfg.use_dot
    block_m = 16 if use_dot else next_pow2(m)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty splits
    even_k = k % cfg.block_k == 0  # then every split's range is whole BLOCK_K tiles too
    part = (torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1
            else out)
    bias_arg = bias if bias is not None else out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # Third axis: tiles of block_m rows. 1 for M <= MAX_ROWS (skinny_linear); more only in
    # invariant_linear, where each tile runs the same code on its 16 rows whatever M is.
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, block_m))](
        x, weight, bias_arg, out, part, m, n, k, k_per_split,
        # A 1-row x may carry any row stride; the kernel assumes a multiple of 8 (only
        # masked rows would use it), so pass K (a multiple of 8) instead.
        x.stride(0) if m > 1 else k, weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=use_dot,
        EVEN_K=even_k, SPLIT=split > 1, HAS_BIAS=bias is not None, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            part, bias_arg, out, m, n, out.stride(0),
            SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4,
        )
    return out


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` would run the kernel on these arguments (else ``F.linear``).

    True when :data:`ENABLED`, ``1 <= rows <= MAX_ROWS``, shapes/dtypes/devices agree, the
    weight is contiguous with ``K % 8 == 0``, no autograd is needed, and the device is CUDA
    (or CPU float32 under ``TRITON_INTERPRET=1``).
    """
    if not ENABLED or x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False
    k = weight.shape[1]
    if k == 0 or k % 8 or not 1 <= x.numel() // k <= MAX_ROWS:
        return False
    if x.dtype != weight.dtype or x.dtype not in _DTYPES or x.device != weight.device:
        return False
    if not weight.is_contiguous():
        return False
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype
                             or bias.device != x.device):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False  # no backward for the kernel
    if x.device.type == "cuda":
        return triton_available()
    return x.device.type == "cpu" and x.dtype == torch.float32 and _interpreter()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Drop-in ``F.linear(x, weight, bias)``: the skinny kernel when :func:`use_kernel` says
    so, else ``F.linear`` itself (so large ``M``, CPU, autograd, ... are unchanged).

    Args:
        x: ``[..., K]``; the leading dims are flattened into ``M`` rows.
        weight: ``[N, K]``.
        bias: optional ``[N]``.
        out_dtype: dtype of the result; None = ``x``'s. float32 from 16-bit inputs keeps
            the float32 accumulator unrounded on both paths (:func:`linear_fp32_out`).

    Returns:
        ``[..., N]`` of ``out_dtype`` (or ``x``'s dtype), on ``x``'s device.
    """
    if not use_kernel(x, weight, bias):
        if out_dtype == torch.float32 and bias is None:
            return linear_fp32_out(x, weight)
        y = F.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)
    k = x.shape[-1]
    y = skinny_linear(x.reshape(-1, k), weight, bias, out_dtype=out_dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def invariant_config(n: int, k: int, device: torch.device,
                     dtype: torch.dtype = torch.bfloat16) -> Config:
    """The launch configuration of :func:`invariant_linear` for ``W [n, k]``: the
    :func:`_config` table entry for 16 rows (``tl.dot`` path, ``split_k`` included), so it
    depends on ``(n, k, dtype, SM count)`` only, never on the number of rows."""
    return _config(MAX_ROWS, n, k, sm_count(device), dtype.itemsize)._replace(use_dot=True)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batch-invariant ``F.linear(x, weight, bias)``: every output row is bitwise the same
    whatever the other rows are, and however many (``M >= 1``, any size).

    Why: cuBLAS (and :func:`linear`'s own M-dependent choice between the FMA kernel, the
    16-row ``tl.dot`` kernel and cuBLAS) pick a different algorithm, tile shape and split-K
    per ``M``, so a token's hidden state depends on how many rows shared its forward. With
    speculative decoding a verify forward has ``batch x tree`` rows where plain decode has
    ``batch`` rows, so greedy outputs drift apart. Following the batch-invariant ops of
    Thinking Machines' "Defeating Nondeterminism in LLM Inference" (He et al., 2025), as in
    sglang's ``--enable-deterministic-inference`` and vLLM's ``VLLM_BATCH_INVARIANT``, this
    always runs the skinny kernel's ``tl.dot`` path on tiles of exactly 16 rows (rows past
    ``M`` are zero-masked and dropped), with the launch configuration of
    :func:`invariant_config` (independent of ``M``): each row then goes through the same
    instructions, K order and split-K reduction order whatever ``M`` is. The price: ``W``
    is streamed once per 16-row tile, so large ``M`` (prefill) is much slower than cuBLAS.

    Args:
        x: ``[..., K]`` (leading dims flattened into ``M`` rows), float16/bfloat16/float32,
            CUDA (or CPU float32 under ``TRITON_INTERPRET=1``).
        weight: ``[N, K]`` contiguous, ``K % 8 == 0``, ``x``'s dtype and device.
        bias: optional ``[N]`` of ``x``'s dtype, added in float32 before the final rounding.
        out_dtype: float16/bfloat16/float32; None = ``x``'s dtype. float32 keeps the
            float32 accumulator unrounded (the LM head).

    Returns:
        ``[..., N]`` of ``out_dtype`` on ``x``'s device.

    Raises:
        ValueError: as :func:`skinny_linear` (except that any ``M`` is accepted).
    """
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"expected x [..., K] and weight [N, K]: got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    k = x.shape[-1]
    x2 = _check(x.reshape(-1, k), weight, bias, out_dtype)
    n = weight.shape[0]
    y = _launch(x2, weight, bias, invariant_config(n, k, x.device, x.dtype),
                out_dtype or x.dtype)
    return y.view(*x.shape[:-1], n)
