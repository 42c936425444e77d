"""Sampling keyed by (seed, output position): a request's token at output position ``p`` is a
function of its sampling seed (its own, or one drawn from the engine seed when it was added),
``p`` and the distribution at ``p`` alone.

Why: a verify step samples the target at every node of the request's draft tree and accepts
the drafts that match (tree sample-and-match verification). With noise drawn from a per-request
generator, the draws a step consumes depend on the tree's size, which the adaptive sizer
changes with the measured verify cost, and on how many steps the request took, so a seed
reproduced its output only with a fixed tree size. Keyed by position instead, every node at
depth ``d`` of a step that starts at output length ``L`` samples position ``L + d`` with that
position's uniform, so the accepted path's tokens are exactly what decoding one token at a time
without speculation draws with the same seed: the output no longer depends on the drafter, the
tree sizes, the batch or preemption (up to float rounding of the logits, as for greedy
output). Siblings share their depth's uniform; only one path is ever kept, and each position's
uniform is independent of the drafts, so every emitted token is still an exact draw from the
target's distribution at its position.

The draw is the inverse CDF in vocabulary order: the first token whose cumulative probability
reaches ``u * total`` (a token of probability 0 is never drawn, ``u`` is never 0). Vocabulary
order, not sorted order, so that two near-equal probabilities swapping places under float
rounding cannot change the draw; only a ``u`` within rounding distance of a boundary can.

The uniform is a counter-based hash of ``(seed, position)``: two rounds of the ``lowbias32``
integer mixer (Chris Wellons' hash-prospector, bias ~0.17; https://github.com/skeeto/hash-prospector)
in int64 torch ops, so it runs on any device, in any batch, without a generator's state.
Multiplications are done modulo 2**32 with factors below 2**31 on values below 2**32, so the
int64 products never overflow.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# lowbias32's multipliers: 0x7FEB352D, and 0x846CA68B written as -(2**32 - 0x846CA68B) so that
# both factors stay below 2**31 (see the module doc)
_MUL_A = 0x7FEB352D
_MUL_B_NEG = 0x100000000 - 0x846CA68B
_GOLDEN = 0x9E3779B9


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each element of ``x`` (int64 values in ``[0, 2**32)``), same range."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _M32
    x = x ^ (x >> 15)
    x = (-((x * _MUL_B_NEG) & _M32)) & _M32
    return x ^ (x >> 16)


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform per ``(seed, position)`` pair, a pure function of the pair.

    Args:
        seeds: int64 ``[R]``, each in ``[0, 2**63)`` (``structspec.core.SEED_MAX``).
        positions: int64 ``[R]``, output positions ``>= 0`` (below ``2**32``), same device.

    Returns:
        float32 ``[R]`` in the open interval ``(0, 1)``, on the inputs' device (24 bits of
        the hash, offset by half a step).
    """
    lo, hi = seeds & _M32, seeds >> 32  # seeds are non-negative: the shift is logical
    k = _lowbias32(lo ^ _lowbias32(positions & _M32))
    k = _lowbias32(hi ^ _lowbias32(k ^ _GOLDEN))
    return ((k >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one column per row of ``probs`` with the given uniforms (inverse CDF, in column
    order).

    Args:
        probs: float ``[R, V]`` non-negative, each row with a positive sum (need not be 1).
        u: float ``[R]`` in ``(0, 1)``.

    Returns:
        int64 ``[R]``: per row the first column whose cumulative sum reaches ``u`` times the
        row's total; never a column of probability 0.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # float64: no drift over a 100k+ vocabulary
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)
