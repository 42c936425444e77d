"""EAGLE draft heads: the one-layer network an EAGLE drafter runs over the target's features,
and its checkpoint loader.

Sources: EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", arXiv:2401.15077), EAGLE-3 (Li et al., 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", arXiv:2503.01840). Checkpoint
layouts follow the public EAGLE repository and sglang's ``llama_eagle.py`` /
``llama_eagle3.py`` as publicly documented (written from those descriptions).

Supported head formats (a directory with ``config.json`` + ``*.safetensors`` or
``pytorch_model.bin``; a leading ``model.`` in tensor names is stripped):

* **EAGLE-1/2** (``architectures`` without "Eagle3"): ``fc`` = Linear(2H -> H, bias optional)
  over ``[embed(token); target feature]``, then ``num_hidden_layers`` (normally 1) Llama
  decoder layers ``layers.{i}.*`` whose ``input_layernorm`` is optional (EAGLE-1 drops it on
  layer 0), an optional final ``norm.weight``; logits through the TARGET's ``lm_head``; token
  embeddings are the TARGET's (a stored ``embed_tokens.weight`` is ignored). The target
  feature is the target's final hidden state (after its final norm, what its ``lm_head``
  reads).
* **EAGLE-3** (``architectures`` containing "Eagle3", or ``midlayer.*`` tensors): target
  features are three decoder-layer outputs (low, mid, high: ``eagle_config.
  eagle_aux_hidden_state_layer_ids`` in config.json, default ``(1, L//2 - 1, L - 4)``, i.e.
  the inputs of layers 2, L//2, L-3 as sglang captures them), concatenated to 3H and projected
  by ``fc`` (Linear(3H -> H)); one ``midlayer`` whose attention reads
  ``[input_layernorm(embed); hidden_norm(h)]`` (2H) with the residual on ``h``; final ``norm``;
  its own ``lm_head`` over a reduced draft vocabulary mapped to target ids by ``d2t``
  (``target = draft + d2t[draft]``; no ``d2t`` = identity). Drafted steps feed the midlayer's
  pre-norm output back as the next ``h`` (EAGLE-3's training-time test). Not supported:
  multi-layer EAGLE-3 heads, heads with their own trained embeddings.
* **EAGLE-3 sharing the target's lm_head**: no ``lm_head.weight`` tensor and no
  ``draft_vocab_size`` in config.json (or one equal to the target's ``vocab_size``): the head's
  logits come from the TARGET's ``lm_head`` over the full vocabulary (no ``d2t``). This is
  sglang's convention too (``draft_vocab_size`` absent -> ``load_lm_head_from_target``), and
  what ``structspec train-eagle`` writes by default (:mod:`structspec.training.export`).

The drafter that runs a head (catch-up, EAGLE-2 expansion, feature storage) is
:class:`structspec.speculative.eagle.EagleDrafter`; this module knows nothing of drafting.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from structspec.config import ModelConfig
from structspec.kvcache.pool import KVPool
from structspec.layers.attention import AttentionBackend, TorchAttentionBackend
from structspec.layers.forward_batch import ForwardBatch
from structspec.layers.norm import RMSNorm
from structspec.layers.rotary import RotaryEmbedding
from structspec.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, triton_ops

#: checkpoint tensors a head may carry that it does not use (its own copy of the target's
#: embeddings; EAGLE-3's target-to-draft vocabulary mask, the inverse of ``d2t``).
IGNORED_TENSORS = ("embed_tokens.weight", "t2d")


@dataclass(frozen=True)
class EagleHeadConfig:
    """What a head checkpoint is.

    Attributes:
        version: 1 (EAGLE-1/2 layout) or 3 (EAGLE-3).
        layer: dimensions of the head's decoder layer(s) (``vocab_size`` = the target's).
        fc_in: input width of ``fc`` (2H for EAGLE-1, 3H for EAGLE-3).
        fc_bias: ``fc`` has a bias.
        input_norm: per layer, whether ``input_layernorm.weight`` exists (EAGLE-1).
        final_norm: a final ``norm.weight`` exists.
        draft_vocab_size: rows of the head's own ``lm_head`` (EAGLE-3), else the target's.
        aux_hidden_layers: target decoder layers whose outputs form the EAGLE-3 feature.
        own_lm_head: an EAGLE-3 head with its own ``lm_head.weight``; False = logits through
            the target's ``lm_head`` (EAGLE-1/2, and EAGLE-3 heads that share it).
    """

    version: int
    layer: ModelConfig
    fc_in: int
    fc_bias: bool
    input_norm: tuple[bool, ...]
    final_norm: bool
    draft_vocab_size: int
    aux_hidden_layers: tuple[int, ...]
    own_lm_head: bool = False


def read_head_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a head checkpoint (CPU), names without a leading ``model.``.

    Raises:
        FileNotFoundError: no ``*.safetensors`` or ``pytorch_model.bin`` in ``path``.
    """
    from structspec.models.loader import find_weight_files, iter_safetensors

    items: Iterator[tuple[str, torch.Tensor]]
    if list(path.glob("*.safetensors")):
        items = iter_safetensors(find_weight_files(path))
    elif (path / "pytorch_model.bin").is_file():
        items = iter(torch.load(path / "pytorch_model.bin", map_location="cpu",
                                weights_only=True).items())
    else:
        raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model.bin EAGLE weights")
    return {n.removeprefix("model."): t for n, t in items}


def parse_eagle_config(
    cfg: dict[str, Any], names: Sequence[str], target: ModelConfig
) -> EagleHeadConfig:
    """Build an :class:`EagleHeadConfig` from ``config.json`` and the tensor names.

    Raises:
        ValueError: ``cfg`` is not a dict, a numeric field is not a number (named), hidden
            size differs from the target's, a required field is missing, or an
            EAGLE-3 head without ``lm_head.weight`` declares a ``draft_vocab_size`` other than
            the target's ``vocab_size``.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"EAGLE head config.json: expected a JSON object, got "
                         f"{type(cfg).__name__}")

    def num(key: str, default: Any, kind: type = int) -> Any:
        """``cfg[key]`` (``default`` when absent or null) as ``kind``, or a ValueError naming it."""
        value = cfg.get(key)
        if value is None:
            return kind(default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"EAGLE head config.json: {key}={value!r}: expected a number")
        return kind(value)

    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"EAGLE head config.json: architectures={archs!r}: expected a list of "
                         f"strings")
    archs = " ".join(archs)
    version = 3 if ("Eagle3" in archs or any(n.startswith("midlayer.") for n in names)) else 1
    hidden = num("hidden_size", target.hidden_size)
    if hidden != target.hidden_size:
        raise ValueError(f"EAGLE head hidden_size {hidden} != target hidden_size "
                         f"{target.hidden_size}")
    heads = num("num_attention_heads", target.num_attention_heads)
    rope_scaling = cfg.get("rope_scaling")
    if isinstance(rope_scaling, dict) and rope_scaling.get(
        "rope_type", rope_scaling.get("type")
    ) in (None, "default"):
        rope_scaling = None
    layers = 1 if version == 3 else num("num_hidden_layers", 1)
    layer = dataclasses.replace(
        target,
        hidden_size=hidden,
        intermediate_size=num("intermediate_size", target.intermediate_size),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=num("num_key_value_heads", heads) or heads,
        head_dim=num("head_dim", hidden // heads) or hidden // heads,
        rms_norm_eps=num("rms_norm_eps", target.rms_norm_eps, float),
        rope_theta=num("rope_theta", target.rope_theta, float),
        rope_scaling=(tuple(sorted(rope_scaling.items())) if rope_scaling
                      else (None if "rope_theta" in cfg else target.rope_scaling)),
        attention_bias=False, qk_norm=False, tie_word_embeddings=False,
    )
    nl = target.num_hidden_layers
    aux: tuple[int, ...] = ()
    if version == 3:
        eagle_cfg = cfg.get("eagle_config") or {}
        if not isinstance(eagle_cfg, dict):
            raise ValueError(f"EAGLE head config.json: eagle_config={eagle_cfg!r}: expected "
                             f"an object")
        ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ValueError(f"EAGLE head config.json: eagle_config."
                             f"eagle_aux_hidden_state_layer_ids={ids!r}: expected a list of "
                             f"layer indices")
        if ids and not all(0 <= i < nl for i in ids):
            # a head trained on another model's layers: its features would not exist here
            raise ValueError(f"EAGLE head config.json: eagle_config."
                             f"eagle_aux_hidden_state_layer_ids={ids}: the target has "
                             f"{nl} decoder layers (0..{nl - 1})")
        # the default, for targets of a few layers, clamped into range
        aux = tuple(ids) if ids else tuple(
            min(max(i, 0), nl - 1) for i in (1, nl // 2 - 1, nl - 4))
    own_lm_head = version == 3 and "lm_head.weight" in names
    draft_vocab = target.vocab_size
    if version == 3:
        draft_vocab = num("draft_vocab_size", target.vocab_size) or target.vocab_size
        if not own_lm_head and draft_vocab != target.vocab_size:
            raise ValueError(f"EAGLE-3 head: draft_vocab_size {draft_vocab} but no "
                             f"lm_head.weight tensor (a head that shares the target's lm_head "
                             f"must leave draft_vocab_size out or set it to the target's "
                             f"vocab_size {target.vocab_size})")
    return EagleHeadConfig(
        version=version,
        layer=layer,
        fc_in=(len(aux) if version == 3 else 2) * hidden,
        fc_bias="fc.bias" in names,
        input_norm=tuple(f"layers.{i}.input_layernorm.weight" in names for i in range(layers)),
        final_norm="norm.weight" in names,
        draft_vocab_size=draft_vocab,
        aux_hidden_layers=aux,
        own_lm_head=own_lm_head,
    )


#: positions past ``max_position_embeddings`` the head's rotary table still covers (the
#: expansion's scratch positions run a few past a sequence's end)
ROTARY_TABLE_MARGIN = 1024
#: positions per block while the rotary table is built (bounds its float32 temporaries)
ROTARY_TABLE_BLOCK = 16384


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3 ``midlayer``: attention over ``[input_layernorm(embed); hidden_norm(h)]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(dataclasses.replace(cfg, hidden_size=2 * hidden), 0)
        self.self_attn.o_proj = nn.Linear(cfg.q_size, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self, embeds: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        fb: ForwardBatch, kv_pool: KVPool, backend: AttentionBackend,
    ) -> torch.Tensor:
        """``embeds, h [B, Q, H]`` -> ``[B, Q, H]`` (pre-norm residual stream)."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(h)), dim=-1)
        h = h + self.self_attn(x, cos, sin, fb, kv_pool, backend)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(
        self, embeds: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        fb: ForwardBatch, kv_pool: KVPool, backend: AttentionBackend,
    ) -> torch.Tensor:
        """:meth:`forward` with the target's Triton kernels (CUDA; CPU under
        ``TRITON_INTERPRET=1``): the norms, rotary + K/V store, SwiGLU and the skinny GEMV.
        A draft forward has few rows, so its time is the count of kernel launches (in the
        propose graph, a few us each): ~14 launches here against ~50 for the torch ops.

        ``embeds, h [B, Q, H]`` (``h`` is not written: the residual stream starts as a copy,
        since ``h`` may be the stored features or a parent's fed-back output) ->
        ``[B, Q, H]``. Same rounding points as :meth:`forward` (the residual sum is rounded to
        the model dtype before the post-attention norm); only reduction orders differ.
        """
        ops = triton_ops()
        x = torch.cat((ops.rmsnorm(embeds, self.input_layernorm.weight, self.input_layernorm.eps),
                       ops.rmsnorm(h, self.hidden_norm.weight, self.hidden_norm.eps)), dim=-1)
        attn = self.self_attn.forward_fused(x, cos, sin, fb, kv_pool, backend)
        residual = h.clone(memory_format=torch.contiguous_format)
        post = self.post_attention_layernorm
        x = ops.fused_add_rmsnorm(attn, residual, post.weight, post.eps)
        return residual + self.mlp.forward_fused(x)


class EagleHead(nn.Module):
    """The draft head (no embeddings; the caller passes the target's token embeddings).

    Attributes:
        config: the :class:`EagleHeadConfig`.
        fc: Linear(``fc_in`` -> H).
        layers: EAGLE-1 decoder layers (empty for EAGLE-3).
        midlayer: the EAGLE-3 layer (None for EAGLE-1).
        norm: final RMSNorm or None.
        lm_head: EAGLE-3's Linear(H -> draft vocab) or None (EAGLE-1, and EAGLE-3 heads without
            their own, use the target's).
        d2t: ``[draft vocab]`` int64 buffer, absolute target id of each draft id (EAGLE-3).
    """

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        c = config.layer
        self.config = config
        self.fc = nn.Linear(config.fc_in, c.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList()
        self.midlayer: Eagle3DecoderLayer | None = None
        if config.version == 3:
            self.midlayer = Eagle3DecoderLayer(c)
        else:
            for i in range(c.num_hidden_layers):
                layer = LlamaDecoderLayer(c, i)
                if not config.input_norm[i]:
                    layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
                self.layers.append(layer)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if config.final_norm else None
        self.lm_head = (nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
                        if config.own_lm_head else None)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=False)
        self.rotary = RotaryEmbedding(
            head_dim=c.head_dim, rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position_embeddings, rope_scaling=c.rope_scaling_dict,
        )
        self.backend: AttentionBackend = TorchAttentionBackend()
        #: ``"torch"`` (reference ops) or ``"triton"`` (:meth:`set_kernels`)
        self.kernels = "torch"
        #: ``[P, 2, head_dim]`` cos / sin per position in the head's dtype (Triton path only,
        #: :meth:`rotary_cos_sin`), or None
        self._rotary_table: torch.Tensor | None = None

    def set_kernels(self, kernels: str, max_positions: int | None = None) -> None:
        """The head's implementation, as the target's (``LlamaForCausalLM.set_kernels``):
        ``"torch"``: reference ops and the torch attention backend; ``"triton"``: the Triton
        attention backend, and for an EAGLE-3 head the fused layer
        (:meth:`Eagle3DecoderLayer.forward_fused`) and final norm. EAGLE-1 layers keep the
        torch ops apart from attention. ``max_positions``: the longest sequence the engine
        serves; the Triton path's rotary table covers it plus :data:`ROTARY_TABLE_MARGIN`
        (default: the head's ``max_position_embeddings``).

        Raises:
            ValueError: any other value.
        """
        if kernels == "triton":
            from structspec.kernels.attention import TritonAttentionBackend

            self.backend = TritonAttentionBackend()
            self._rotary_table = self._build_rotary_table(max_positions)
        elif kernels == "torch":
            self.backend = TorchAttentionBackend()
            self._rotary_table = None
        else:
            raise ValueError(f"kernels={kernels!r}: expected 'torch' or 'triton'")
        self.kernels = kernels

    @torch.no_grad()
    def _build_rotary_table(self, max_positions: int | None) -> torch.Tensor:
        """cos / sin of every position below ``max_positions`` (default: the head's
        ``max_position_embeddings``) plus a margin for the expansion's scratch positions,
        ``[P, 2, head_dim]`` in the head's dtype and on its device: the same float32 maths as
        :class:`RotaryEmbedding`, so a lookup equals a recomputation up to the last ulp of
        ``cos``. Built in blocks of positions, so the float32 temporaries stay small."""
        weight = self.fc.weight
        limit = (max_positions if max_positions is not None
                 else self.config.layer.max_position_embeddings)
        n = limit + ROTARY_TABLE_MARGIN
        table = torch.empty((n, 2, self.config.layer.head_dim), dtype=weight.dtype,
                            device=weight.device)
        for start in range(0, n, ROTARY_TABLE_BLOCK):
            pos = torch.arange(start, min(n, start + ROTARY_TABLE_BLOCK), device=weight.device)
            cos, sin = self.rotary(pos.unsqueeze(0), weight.dtype)
            table[start : start + pos.shape[0], 0] = cos[0]
            table[start : start + pos.shape[0], 1] = sin[0]
        return table

    def rotary_cos_sin(self, positions: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, Q]`` int64 -> ``(cos, sin)``, each ``[B, Q, head_dim]`` of
        ``dtype``: :class:`RotaryEmbedding`'s values. On the Triton path one lookup into a
        table (2 launches instead of ~9: the head runs few rows a forward, four forwards a
        propose); positions past the table read its last row (a draft's rotation only, never
        the target's)."""
        table = self._rotary_table
        if table is None or table.dtype != dtype or table.device != positions.device:
            return self.rotary(positions, dtype)
        cos_sin = table[positions.clamp(0, table.shape[0] - 1)]  # [B, Q, 2, D]
        return cos_sin[..., 0, :], cos_sin[..., 1, :]

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The head's final norm of ``x [..., H]`` (``x`` itself without one)."""
        if self.norm is None:
            return x
        if self.kernels == "triton":
            return triton_ops().rmsnorm(x, self.norm.weight, self.norm.eps)
        return self.norm(x)

    @property
    def num_layers(self) -> int:
        return 1 if self.midlayer is not None else len(self.layers)

    def project_target(self, features: torch.Tensor) -> torch.Tensor:
        """Target feature ``[..., F]`` -> the ``[..., H]`` stored per position (EAGLE-3: ``fc``
        over the concatenated aux layers; EAGLE-1: unchanged, ``fc`` runs per entry)."""
        return self.fc(features) if self.config.version == 3 else features

    def forward(
        self, fb: ForwardBatch, kv_pool: KVPool, embeds: torch.Tensor, h: torch.Tensor
    ) -> torch.Tensor:
        """Run the head over ``fb``'s ``[B, Q]`` block; writes its KV at ``fb.out_slots``.

        Args:
            embeds: ``[B, Q, H]`` target embeddings of ``fb.input_ids``.
            h: ``[B, Q, H]`` paired features (stored target features or fed-back head outputs).

        Returns:
            ``[B, Q, H]`` pre-norm output (fed back as the children's feature).
        """
        cos, sin = self.rotary_cos_sin(fb.positions, embeds.dtype)
        if self.midlayer is not None:
            layer = (self.midlayer.forward_fused if self.kernels == "triton"
                     else self.midlayer)
            return layer(embeds, h, cos, sin, fb, kv_pool, self.backend)
        x = self.fc(torch.cat((embeds, h), dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin, fb, kv_pool, self.backend)
        return x

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        """Copy checkpoint tensors into the parameters (fused qkv / gate_up like llama.py).

        Raises:
            ValueError: unexpected, missing or mis-shaped tensors (named in the message).
        """
        c = self.config.layer
        qkv = {"q": (0, c.q_size), "k": (c.q_size, c.kv_size),
               "v": (c.q_size + c.kv_size, c.kv_size)}
        names: dict[str, tuple[str, int, int]] = {"fc.weight": ("fc.weight", 0, 0)}
        if self.config.fc_bias:
            names["fc.bias"] = ("fc.bias", 0, 0)
        if self.norm is not None:
            names["norm.weight"] = ("norm.weight", 0, 0)
        prefixes = ["midlayer."] if self.midlayer is not None else [
            f"layers.{i}." for i in range(len(self.layers))]
        for i, pre in enumerate(prefixes):
            norms = ["post_attention_layernorm"]
            if self.midlayer is not None:
                norms += ["input_layernorm", "hidden_norm"]
            if self.lm_head is not None:
                names["lm_head.weight"] = ("lm_head.weight", 0, 0)
            elif self.config.input_norm[i]:
                norms.append("input_layernorm")
            for nm in norms:
                names[f"{pre}{nm}.weight"] = (f"{pre}{nm}.weight", 0, 0)
            for p, (off, size) in qkv.items():
                names[f"{pre}self_attn.{p}_proj.weight"] = (f"{pre}self_attn.qkv_proj.weight",
                                                             off, size)
            names[f"{pre}self_attn.o_proj.weight"] = (f"{pre}self_attn.o_proj.weight", 0, 0)
            inter = c.intermediate_size
            names[f"{pre}mlp.gate_proj.weight"] = (f"{pre}mlp.gate_up_proj.weight", 0, inter)
            names[f"{pre}mlp.up_proj.weight"] = (f"{pre}mlp.gate_up_proj.weight", inter, inter)
            names[f"{pre}mlp.down_proj.weight"] = (f"{pre}mlp.down_proj.weight", 0, 0)
        params = dict(self.named_parameters())
        pending = set(names)
        unexpected = []
        for name, t in tensors.items():
            if name == "d2t" and self.midlayer is not None:
                if t.numel() != self.config.draft_vocab_size:
                    raise ValueError(f"{source}: d2t has {t.numel()} entries, expected "
                                     f"{self.config.draft_vocab_size}")
                if self.lm_head is None and bool(t.ne(0).any()):
                    raise ValueError(f"{source}: d2t maps draft ids to other target ids but "
                                     f"the head has no lm_head.weight of its own")
                self.d2t.copy_(torch.arange(t.numel()) + t.to(torch.int64).cpu())
                continue
            if name in names:
                pname, off, size = names[name]
                dst = params[pname].data
                dst = dst if size == 0 else dst.narrow(0, off, size)
                if tuple(t.shape) != tuple(dst.shape):
                    raise ValueError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                dst.copy_(t)
                pending.discard(name)
            elif not (name in IGNORED_TENSORS or name.endswith("rotary_emb.inv_freq")):
                unexpected.append(name)
        if unexpected or pending:
            raise ValueError(f"{source}: EAGLE-{self.config.version} head: unexpected tensors "
                             f"{sorted(unexpected)[:8]}, missing tensors {sorted(pending)[:8]}")


def read_head_folder(
    path: Path, target_config: ModelConfig
) -> tuple[EagleHeadConfig, dict[str, torch.Tensor]]:
    """A head directory's parsed config and its tensors (CPU), for a target of
    ``target_config``; shared by :func:`load_eagle_head` and train-eagle's ``--init-from``.

    Raises:
        FileNotFoundError: no config.json or no weights in ``path``.
        ValueError: config.json is not JSON, or not a config this target can run (the message
            starts with the file or folder and names the field).
    """
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: not found; an EAGLE head needs config.json")
    tensors = read_head_tensors(path)  # missing weights first: the folder is not a head
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    try:
        config = parse_eagle_config(cfg, list(tensors), target_config)
    except ValueError as e:  # its messages name the field; the path says which head
        raise ValueError(f"{path}: {e}") from None
    return config, tensors


def load_eagle_head(
    path: str | Path, target_config: ModelConfig, *, device: torch.device, dtype: torch.dtype
) -> EagleHead:
    """Load an EAGLE-1/2 or EAGLE-3 head directory (see the module docstring).

    Args:
        path: the head directory (``config.json`` and the weights).
        target_config: the target model's config (the head shares its hidden size, and its
            defaults fill fields the head's config.json leaves out).
        device, dtype: where and in which dtype the head's parameters live (``d2t`` stays
            int64).

    Returns:
        The head in eval mode, without gradients.

    Raises:
        FileNotFoundError: missing directory, config.json or weights.
        ValueError: malformed or incompatible head (message names the problem).
    """
    p = Path(path).expanduser()
    config, tensors = read_head_folder(p, target_config)
    head = EagleHead(config)
    head.load_tensors(tensors, source=str(p))
    head.to(device=device, dtype=dtype)
    head.d2t = head.d2t.to(device=device, dtype=torch.int64)
    head.rotary.reset_inv_freq()
    head.eval().requires_grad_(False)
    if int(head.d2t.max()) >= target_config.vocab_size or int(head.d2t.min()) < 0:
        raise ValueError(f"{p}: d2t maps draft ids outside the target vocabulary")
    return head


def build_random_eagle_head(
    target_config: ModelConfig,
    path: str | Path,
    seed: int = 0,
    *,
    version: int = 1,
    draft_vocab_size: int | None = None,
    aux_hidden_layers: Sequence[int] | None = None,
) -> Path:
    """Write a randomly initialised head for ``target_config`` in the EAGLE checkpoint format.

    EAGLE-1 layout: ``fc`` (with bias), ``layers.0.*`` without ``input_layernorm``, no final
    norm. EAGLE-3 layout: ``fc`` over 3H, ``midlayer.*``, ``norm``, ``lm_head`` over
    ``draft_vocab_size`` (default ``vocab // 2``) target ids chosen at random, ``d2t`` offsets
    and ``t2d``. A random head is a draft the target mostly rejects: for tests only.

    Args:
        target_config: the target the head drafts for.
        path: output directory (created).
        seed: seed of the CPU generator the weights are drawn from.
        version: 1 (EAGLE-1 layout) or 3 (EAGLE-3).
        draft_vocab_size: EAGLE-3 draft vocabulary size (default ``vocab // 2``).
        aux_hidden_layers: EAGLE-3 target layers (default ``(1, L//2 - 1, L - 4)`` clamped).

    Returns:
        ``path`` (created), holding ``config.json`` and ``model.safetensors`` (float32).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    c = target_config
    hidden, inter, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols**0.5

    def ln() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=g)

    cfg: dict[str, Any] = dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
        hidden_act="silu", torch_dtype="float32",
    )
    if c.rope_scaling is not None:
        cfg["rope_scaling"] = dict(c.rope_scaling)
    t: dict[str, torch.Tensor] = {}
    if version == 3:
        nl = c.num_hidden_layers
        aux = list(aux_hidden_layers) if aux_hidden_layers is not None else [
            min(max(i, 0), nl - 1) for i in (1, nl // 2 - 1, nl - 4)]
        dv = draft_vocab_size or max(1, c.vocab_size // 2)
        ids = torch.randperm(c.vocab_size, generator=g)[:dv].sort().values
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
        pre = "midlayer."
        t["fc.weight"] = w(hidden, len(aux) * hidden)
        t[f"{pre}input_layernorm.weight"] = ln()
        t[f"{pre}hidden_norm.weight"] = ln()
        attn_in = 2 * hidden
        t["norm.weight"] = ln()
        t["lm_head.weight"] = 4.0 * w(dv, hidden)
        t["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    else:
        cfg.update(architectures=["LlamaForCausalLM"])
        pre = "layers.0."
        t["fc.weight"] = w(hidden, 2 * hidden)
        t["fc.bias"] = 0.02 * torch.randn(hidden, generator=g)
        attn_in = hidden
    t[f"{pre}self_attn.q_proj.weight"] = w(q, attn_in)
    t[f"{pre}self_attn.k_proj.weight"] = w(kv, attn_in)
    t[f"{pre}self_attn.v_proj.weight"] = w(kv, attn_in)
    t[f"{pre}self_attn.o_proj.weight"] = w(hidden, q)
    t[f"{pre}post_attention_layernorm.weight"] = ln()
    t[f"{pre}mlp.gate_proj.weight"] = w(inter, hidden)
    t[f"{pre}mlp.up_proj.weight"] = w(inter, hidden)
    t[f"{pre}mlp.down_proj.weight"] = w(hidden, inter)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    return out
