"""Llama / Qwen2 / Qwen3 decoder-only transformer over a paged KV pool.

One module serves the three architectures; the differences come from :class:`ModelConfig`:
Qwen2 has a bias on q/k/v (not on o_proj), Qwen3 applies a per-head RMSNorm to q and k before
rotary and may have ``head_dim != hidden_size / num_heads``. q/k/v and gate/up projections are
fused into one matmul each; :meth:`LlamaForCausalLM.load_weights` splits HF tensors into them.

Two implementations of the same forward, chosen by :meth:`LlamaForCausalLM.set_kernels`:

* ``"torch"`` (default): reference torch ops, bit-identical to Hugging Face in fp32 (CPU).
* ``"triton"``: fused kernels from :mod:`structspec.kernels` (~10 CUDA launches per layer
  instead of ~43, measured on SmolLM2; launches are what bound small models at small batch):
  the residual add is fused into the next RMSNorm, rotary into the K/V store, SiLU into the
  multiply, and attention is one gather-free kernel (two with split-KV). Same math, different
  rounding (tolerance-level agreement).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from structspec.config import ModelConfig
from structspec.kvcache.pool import KVPool
from structspec.layers.attention import AttentionBackend, TorchAttentionBackend, write_kv
from structspec.layers.forward_batch import ForwardBatch
from structspec.layers.linear import linear_fp32_out
from structspec.layers.norm import RMSNorm
from structspec.layers.quant_linear import Fp16Linear, Int4Linear, Int8Linear
from structspec.layers.rotary import RotaryEmbedding, apply_rotary
from structspec.models.output import ModelOutput

__all__ = ["LlamaForCausalLM", "ModelOutput", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


@functools.cache
def triton_ops() -> SimpleNamespace:
    """The fused kernels, imported on first use (triton is optional; CPU CI lacks it)."""
    from structspec.kernels.activation import silu_and_mul
    from structspec.kernels.gemv import invariant_linear, linear
    from structspec.kernels.norm import fused_add_rmsnorm, rmsnorm
    from structspec.kernels.rotary import rotary_and_store_kv

    return SimpleNamespace(silu_and_mul=silu_and_mul, fused_add_rmsnorm=fused_add_rmsnorm,
                           rmsnorm=rmsnorm, rotary_and_store_kv=rotary_and_store_kv,
                           linear=linear, invariant_linear=invariant_linear)


def _linear(layer: nn.Linear, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """``layer(x)`` on the Triton path: :func:`structspec.kernels.gemv.linear`, the skinny
    GEMV for few rows (decode), ``F.linear`` otherwise or with ``STRUCTSPEC_GEMV=0``; with
    ``batch_invariant`` :func:`structspec.kernels.gemv.invariant_linear` (any row count, each
    row's bits independent of the others; see :meth:`LlamaForCausalLM.set_kernels`)."""
    if batch_invariant:
        return triton_ops().invariant_linear(x, layer.weight, layer.bias)
    return triton_ops().linear(x, layer.weight, layer.bias)


def _o_proj_bias(config: ModelConfig) -> bool:
    # Qwen2's attention_bias means q/k/v only; Llama/Qwen3's means all four projections.
    return config.attention_bias and config.architecture != "Qwen2ForCausalLM"


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused qkv, optional q/k norm, rotary, KV write, attend."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=_o_proj_bias(config))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.batch_invariant = False  # set by LlamaForCausalLM.set_kernels

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
        kv_pool: KVPool, backend: AttentionBackend,
    ) -> torch.Tensor:
        """``x [B, Q, H]`` -> ``[B, Q, H]``; writes this block's K/V at ``fb.out_slots``."""
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(kv_pool, self.layer_id, fb.out_slots, k, v)
        out = backend.forward(q, self.layer_id, fb, kv_pool)
        return self.o_proj(out.reshape(b, s, self.q_size))

    def forward_fused(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
        kv_pool: KVPool, backend: AttentionBackend,
    ) -> torch.Tensor:
        """:meth:`forward` with Triton kernels: rotary and the K/V store are one launch.

        ``x [B, Q, H]`` (model dtype, CUDA) -> ``[B, Q, H]``.
        """
        ops = triton_ops()
        b, s, _ = x.shape
        q, k, v = _linear(self.qkv_proj, x, self.batch_invariant).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)  # strided views of the qkv output
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head norm first
            q = ops.rmsnorm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rmsnorm(k, self.k_norm.weight, self.k_norm.eps)
        ops.rotary_and_store_kv(q, k, v, cos, sin, kv_pool.k_cache[self.layer_id],
                                kv_pool.v_cache[self.layer_id], fb.out_slots)  # q rotated in place
        out = backend.forward(q, self.layer_id, fb, kv_pool)
        return _linear(self.o_proj, out.reshape(b, s, self.q_size), self.batch_invariant)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with gate/up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.batch_invariant = False  # set by LlamaForCausalLM.set_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with the Triton ``silu_and_mul`` (CUDA): ``[..., H]`` -> ``[..., H]``."""
        inv = self.batch_invariant
        return _linear(self.down_proj,
                       triton_ops().silu_and_mul(_linear(self.gate_up_proj, x, inv)), inv)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
        kv_pool: KVPool, backend: AttentionBackend,
    ) -> torch.Tensor:
        """``h [B, Q, H]`` residual stream in -> out."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, fb, kv_pool, backend)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(
        self, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm, cos: torch.Tensor,
        sin: torch.Tensor, fb: ForwardBatch, kv_pool: KVPool, backend: AttentionBackend,
    ) -> torch.Tensor:
        """The block with Triton kernels, residual adds fused into the following norms.

        Args:
            x: ``input_layernorm(residual)``, ``[B, Q, H]``.
            residual: ``[B, Q, H]`` contiguous residual stream; updated in place to this
                block's output.
            next_norm: the norm applied to the block's output (the next layer's
                ``input_layernorm`` or the model's final norm).

        Returns:
            ``next_norm(residual)`` after the update, ``[B, Q, H]``.
        """
        add_norm = triton_ops().fused_add_rmsnorm
        attn = self.self_attn.forward_fused(x, cos, sin, fb, kv_pool, backend)
        post = self.post_attention_layernorm
        x = add_norm(attn, residual, post.weight, post.eps)
        return add_norm(self.mlp.forward_fused(x), residual, next_norm.weight, next_norm.eps)


class LlamaForCausalLM(nn.Module):
    """Causal LM over a :class:`KVPool`; also serves Qwen2/Qwen3 via config flags.

    Attributes:
        config: the :class:`ModelConfig` it was built from.
        embed_tokens: ``nn.Embedding [V, H]``.
        layers: the decoder layers.
        norm: final RMSNorm.
        lm_head: ``nn.Linear(H, V)``; when ``tie_word_embeddings`` its weight *is*
            ``embed_tokens.weight``. After :func:`structspec.models.quantize.quantize_model`
            the decoder linears and possibly the LM head are weight-only int8/int4 layers
            (:mod:`structspec.layers.quant_linear`, CPU, torch path).
        attn_backend: object with ``forward(q, layer_id, fb, kv_pool)``; the torch reference by
            default, :class:`~structspec.kernels.attention.TritonAttentionBackend` after
            ``set_kernels("triton")``.
        kernels: ``"torch"`` (reference ops) or ``"triton"`` (fused kernels); see
            :meth:`set_kernels`.
        batch_invariant: whether the Triton forward uses batch-invariant kernels; see
            :meth:`set_kernels`.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        self.config = config
        # nn.Embedding's own init, but skipped on the meta device (the loader builds there and
        # fills the weight): its normal_ there imports torch._dynamo, seconds of every engine
        # process's start
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            head_dim=config.head_dim, rope_theta=config.rope_theta,
            max_position_embeddings=config.max_position_embeddings,
            rope_scaling=config.rope_scaling_dict,
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.attn_backend: AttentionBackend = TorchAttentionBackend()
        self.kernels = "torch"
        self.batch_invariant = False

    def set_kernels(self, kernels: str, batch_invariant: bool = False) -> None:
        """Choose the forward's implementation (``EngineConfig.kernels``, resolved).

        Args:
            kernels: ``"torch"``: reference ops and :class:`TorchAttentionBackend` (the CPU
                path, bit-identical to HF in fp32). ``"triton"``: fused Triton kernels and
                :class:`~structspec.kernels.attention.TritonAttentionBackend` (CUDA; CPU only
                under ``TRITON_INTERPRET=1``); needs the triton package.
            batch_invariant: with ``"triton"`` (``EngineConfig.batch_invariant``): every
                linear, the LM head included, runs
                :func:`~structspec.kernels.gemv.invariant_linear` and attention runs
                ``TritonAttentionBackend(batch_invariant=True)``, so a token's logits are
                bitwise the same whether its forward has 1 row per request (decode) or a
                draft tree's (verify). The norm, rotary, SwiGLU and bitmask kernels are
                already per row (their launch shapes depend on the hidden sizes only).

        Raises:
            ValueError: any other value, or ``batch_invariant`` with ``"torch"``.
        """
        if batch_invariant and kernels != "triton":
            raise ValueError(f"batch_invariant=True needs kernels='triton', got {kernels!r}")
        if kernels == "triton":
            from structspec.kernels.attention import TritonAttentionBackend

            self.attn_backend = TritonAttentionBackend(batch_invariant=batch_invariant)
        elif kernels == "torch":
            if not isinstance(self.attn_backend, TorchAttentionBackend):
                self.attn_backend = TorchAttentionBackend()
        else:
            raise ValueError(f"kernels={kernels!r}: expected 'torch' or 'triton'")
        self.kernels = kernels
        self.batch_invariant = batch_invariant
        for module in self.modules():
            if isinstance(module, LlamaAttention | LlamaMLP):
                module.batch_invariant = batch_invariant

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``embed_tokens.weight`` when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, fb: ForwardBatch, kv_pool: KVPool, *, aux_hidden_layers: tuple[int, ...] = ()
    ) -> ModelOutput:
        """Run all layers over the ``[B, Q]`` query block of ``fb``.

        Writes every query token's K/V into ``kv_pool`` at ``fb.out_slots`` (padding rows write
        the sink slot 0), attends over ``fb.kv_slots`` under ``fb.attn_mask``.

        Args:
            fb: batch metadata (all tensors on the model device).
            kv_pool: KV storage with this model's layer count/heads/dtype.
            aux_hidden_layers: decoder layer indices whose outputs to return (EAGLE-3).

        Returns:
            :class:`ModelOutput`: ``hidden_states [B, Q, H]`` after the final norm, and the aux
            layer outputs ``[B, Q, H]`` (before the final norm), in ``aux_hidden_layers`` order.

        Raises:
            ValueError: an aux layer index is outside ``[0, num_hidden_layers)``.
        """
        n = len(self.layers)
        bad = [i for i in aux_hidden_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"aux_hidden_layers {bad} out of range for {n} layers")
        h = self.embed_tokens(fb.input_ids)
        cos, sin = self.rotary(fb.positions, h.dtype)
        if self.kernels == "triton":
            return self._forward_fused(h, cos, sin, fb, kv_pool, aux_hidden_layers)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, fb, kv_pool, self.attn_backend)
            if i in aux_hidden_layers:
                captured[i] = h
        return ModelOutput(self.norm(h), [captured[i] for i in aux_hidden_layers])

    def _forward_fused(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
        kv_pool: KVPool, aux_hidden_layers: tuple[int, ...],
    ) -> ModelOutput:
        """The layer loop with Triton kernels: ``h [B, Q, H]`` embeddings (a fresh tensor,
        used as the residual stream and updated in place)."""
        rmsnorm = triton_ops().rmsnorm
        if not self.layers:
            return ModelOutput(rmsnorm(h, self.norm.weight, self.norm.eps), [])
        residual = h
        first = self.layers[0].input_layernorm
        x = rmsnorm(residual, first.weight, first.eps)
        captured: dict[int, torch.Tensor] = {}
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < n else self.norm
            x = layer.forward_fused(x, residual, nxt, cos, sin, fb, kv_pool, self.attn_backend)
            if i in aux_hidden_layers:
                captured[i] = residual.clone()  # the next layer adds into residual in place
        return ModelOutput(x, [captured[i] for i in aux_hidden_layers])

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """``hidden_rows [R, H]`` (model dtype) -> logits ``[R, V]`` float32, same device.

        On CUDA the LM head writes its float32 accumulator directly (never rounded to bf16):
        bf16 logits are quantized to 1/8 at magnitude 16-32, which makes exact top-2 ties
        common and lets two forwards that round differently (a 1-row decode, an 8-row
        verify) pick different argmaxes; it is also one pass instead of a GEMM plus a cast.
        """
        if isinstance(self.lm_head, Int8Linear | Int4Linear | Fp16Linear):  # --quantization
            return self.lm_head(hidden_rows)
        if self.kernels == "triton":
            linear = (triton_ops().invariant_linear if self.batch_invariant
                      else triton_ops().linear)
            return linear(hidden_rows, self.lm_head.weight, out_dtype=torch.float32)
        return linear_fp32_out(hidden_rows, self.lm_head.weight)

    def weight_names(self) -> dict[str, tuple[str, int, int]]:
        """HF checkpoint tensor name -> ``(our parameter name, row offset, row count)``.

        ``row count`` 0 means the whole parameter. Lists exactly the tensors a checkpoint must
        provide (``lm_head.weight`` only when embeddings are untied).
        """
        c = self.config
        names: dict[str, tuple[str, int, int]] = {
            "model.embed_tokens.weight": ("embed_tokens.weight", 0, 0),
            "model.norm.weight": ("norm.weight", 0, 0),
        }
        if not c.tie_word_embeddings:
            names["lm_head.weight"] = ("lm_head.weight", 0, 0)
        qkv = {"q": (0, c.q_size), "k": (c.q_size, c.kv_size), "v": (c.q_size + c.kv_size, c.kv_size)}
        for i in range(c.num_hidden_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                names[f"{hf}{norm}.weight"] = (f"{ours}{norm}.weight", 0, 0)
            suffixes = ("weight", "bias") if c.attention_bias else ("weight",)
            for p, (off, size) in qkv.items():
                for suf in suffixes:
                    names[f"{hf}self_attn.{p}_proj.{suf}"] = (f"{ours}self_attn.qkv_proj.{suf}", off, size)
            for suf in ("weight", "bias") if _o_proj_bias(c) else ("weight",):
                names[f"{hf}self_attn.o_proj.{suf}"] = (f"{ours}self_attn.o_proj.{suf}", 0, 0)
            if c.qk_norm:
                for p in ("q_norm", "k_norm"):
                    names[f"{hf}self_attn.{p}.weight"] = (f"{ours}self_attn.{p}.weight", 0, 0)
            inter = c.intermediate_size
            names[f"{hf}mlp.gate_proj.weight"] = (f"{ours}mlp.gate_up_proj.weight", 0, inter)
            names[f"{hf}mlp.up_proj.weight"] = (f"{ours}mlp.gate_up_proj.weight", inter, inter)
            names[f"{hf}mlp.down_proj.weight"] = (f"{ours}mlp.down_proj.weight", 0, 0)
        return names

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str = "checkpoint"
    ) -> None:
        """Copy HF-named tensors (any dtype/device) into the parameters (cast to their dtype).

        Ignored names: ``*rotary_emb.inv_freq`` and, with tied embeddings, ``lm_head.weight``.

        Raises:
            ValueError: a tensor has an unexpected name or shape, or expected tensors are
                missing; the message names the tensors and ``source``.
        """
        names = self.weight_names()
        params = dict(self.named_parameters(remove_duplicate=False))
        pending = set(names)
        unexpected: list[str] = []
        for name, tensor in weights:
            if name not in names:
                ignorable = name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings
                )
                if not ignorable:
                    unexpected.append(name)
                continue
            pname, off, size = names[name]
            param = params[pname]
            dst = param.data if size == 0 else param.data.narrow(0, off, size)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(dst.shape)} for {self.config.architecture}"
                )
            dst.copy_(tensor)
            pending.discard(name)
        if unexpected:
            raise ValueError(
                f"{source}: unexpected tensors not used by {self.config.architecture}: "
                f"{sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}"
            )
        if pending:
            missing = sorted(pending)
            raise ValueError(
                f"{source}: missing {len(missing)} weight tensor(s): {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}"
            )


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v bias (``ModelConfig.attention_bias``)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm (``ModelConfig.qk_norm``), explicit head_dim."""
