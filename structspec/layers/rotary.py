"""Rotary position embedding (RoPE) with HF-compatible frequency scaling.

Supported ``rope_scaling`` types (``rope_type`` or the legacy ``type`` key): none/"default",
"linear", "llama3", "yarn" and "dynamic". The inverse-frequency math mirrors transformers'
``ROPE_INIT_FUNCTIONS`` (re-written here, float32 throughout) so logits match HF.

"dynamic" (dynamic NTK): HF recomputes the frequencies whenever a batch's longest sequence
grows past ``max_position_embeddings``, which makes them depend on the batch and is not
consistent with a KV cache. We use the un-scaled frequencies, which equals HF for every
position below ``max_position_embeddings``; beyond it no dynamic rescaling happens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "dynamic"})


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low = float(p["low_freq_factor"])
    high = float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(base: float, dim: int, max_pos: int, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    orig = int(p.get("original_max_position_embeddings") or max_pos)
    factor = p.get("factor")
    factor = float(factor) if factor is not None else max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attn_factor = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, float(attn_factor)


def compute_inv_freq(
    *, head_dim: int, rope_theta: float, max_position_embeddings: int,
    rope_scaling: dict[str, Any] | None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for one rotary configuration.

    Returns:
        ``(inv_freq [head_dim // 2] float32 on CPU, attention_scaling)``; the scale multiplies
        cos and sin (1.0 except for yarn).

    Raises:
        ValueError: unknown ``rope_type`` or a missing scaling parameter (named in the message).
    """
    p = dict(rope_scaling or {})
    rope_type = p.get("rope_type", p.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
        )
    base = float(p.get("rope_theta", rope_theta))
    try:
        if rope_type == "yarn":
            return _yarn(base, head_dim, max_position_embeddings, p)
        inv_freq = _base_inv_freq(base, head_dim)
        if rope_type == "linear":
            inv_freq = inv_freq / float(p["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3(inv_freq, p)
    except KeyError as e:
        raise ValueError(f"rope_scaling type {rope_type!r} needs parameter {e.args[0]!r}") from e
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for explicit per-token positions (no cache, no host sync).

    ``inv_freq`` is a float32 non-persistent buffer. Call :meth:`reset_inv_freq` after moving
    the module from the meta device or after a dtype cast of the whole model.
    """

    def __init__(
        self, *, head_dim: int, rope_theta: float, max_position_embeddings: int,
        rope_scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self._args = dict(
            head_dim=head_dim, rope_theta=rope_theta,
            max_position_embeddings=max_position_embeddings, rope_scaling=rope_scaling,
        )
        # computed on CPU, then placed on the default device (meta while a model is built):
        # torch's meta-device decompositions of these ops import torch._dynamo (seconds)
        inv_freq, self.attention_scaling = compute_inv_freq(**self._args)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()),
                             persistent=False)

    def reset_inv_freq(self) -> None:
        """Recompute ``inv_freq`` in float32 on the buffer's current device."""
        inv_freq, _ = compute_inv_freq(**self._args)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, Q]`` int64 -> ``(cos, sin)``, each ``[B, Q, head_dim]`` of ``dtype``.

        Computed in float32 on the positions' device, then cast (as HF does).
        """
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, Q, heads, D]`` by ``cos``/``sin [B, Q, D]`` (NeoX/HF half-split layout)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin
