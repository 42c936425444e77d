"""Write a trained EAGLE-3 head in the checkpoint layout sglang and SpecForge use.

The directory holds ``config.json`` and ``model.safetensors``:

* config.json: ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, the
  head's dimensions (``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``num_hidden_layers: 1``, ``rms_norm_eps``,
  ``rope_theta``, ``rope_scaling``, ``max_position_embeddings``), ``vocab_size`` (the
  target's), ``tie_word_embeddings: false``, ``torch_dtype``, and
  ``eagle_config.eagle_aux_hidden_state_layer_ids``. A head with a reduced draft vocabulary
  adds ``draft_vocab_size``; a head that shares the target's ``lm_head`` leaves it out, which
  is how sglang's ``llama_eagle3`` knows to take the target's lm_head
  (``load_lm_head_from_target``) and how :func:`structspec.models.eagle_head.parse_eagle_config`
  reads it.
* model.safetensors: ``fc.weight`` ``[H, 3H]``; ``midlayer.{input_layernorm, hidden_norm,
  post_attention_layernorm}.weight``; ``midlayer.self_attn.{q,k,v}_proj.weight`` (input 2H) and
  ``o_proj.weight``; ``midlayer.mlp.{gate,up,down}_proj.weight``; ``norm.weight``; with a
  reduced vocabulary also ``lm_head.weight`` ``[V', H]``, ``d2t`` (int64 ``[V']``, target id
  minus draft id) and ``t2d`` (bool ``[V]``, which target ids the draft vocabulary holds).

No embeddings are written: EAGLE-3 heads use the target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from structspec.config import ModelConfig
from structspec.models.eagle_head import EagleHead, EagleHeadConfig, parse_eagle_config

#: The tensor names a head with its own lm_head carries beyond the shared-lm_head ones.
REDUCED_VOCAB_TENSORS = ("lm_head.weight", "d2t", "t2d")


def eagle3_config_json(target: ModelConfig, aux_layers: tuple[int, ...], draft_vocab_size: int,
                       dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of an EAGLE-3 head for ``target``.

    Args:
        target: the target model's config (the head copies its dimensions).
        aux_layers: target decoder layers of the feature.
        draft_vocab_size: 0 = share the target's lm_head (no ``draft_vocab_size`` key), else
            the reduced draft vocabulary's size.
        dtype: the stored weights' dtype (``torch_dtype``).
    """
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": dict(target.rope_scaling) if target.rope_scaling else None,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }
    if draft_vocab_size:
        cfg["draft_vocab_size"] = draft_vocab_size
    return cfg


def eagle3_head_config(target: ModelConfig, aux_layers: tuple[int, ...],
                       draft_vocab_size: int) -> EagleHeadConfig:
    """The :class:`EagleHeadConfig` the loader will build for the exported head (so a trained
    head and the loaded one are the same module, with the same numerics)."""
    cfg = eagle3_config_json(target, aux_layers, draft_vocab_size, torch.float32)
    names = ["fc.weight", "norm.weight", "midlayer.hidden_norm.weight"]
    if draft_vocab_size:
        names += list(REDUCED_VOCAB_TENSORS)
    return parse_eagle_config(cfg, names, target)


def head_tensors(head: EagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's parameters under the SpecForge names (fused qkv / gate_up split), on the
    CPU in ``dtype``; ``d2t`` / ``t2d`` when it has its own lm_head.

    Raises:
        ValueError: ``head`` is not an EAGLE-3 head.
    """
    m = head.midlayer
    if m is None:
        raise ValueError("only EAGLE-3 heads are exported")
    c = head.config.layer
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", dtype).contiguous()

    qkv = m.self_attn.qkv_proj.weight
    gate_up = m.mlp.gate_up_proj.weight
    out = {
        "fc.weight": cpu(head.fc.weight),
        "midlayer.input_layernorm.weight": cpu(m.input_layernorm.weight),
        "midlayer.hidden_norm.weight": cpu(m.hidden_norm.weight),
        "midlayer.post_attention_layernorm.weight": cpu(m.post_attention_layernorm.weight),
        "midlayer.self_attn.q_proj.weight": cpu(qkv[:q]),
        "midlayer.self_attn.k_proj.weight": cpu(qkv[q:q + kv]),
        "midlayer.self_attn.v_proj.weight": cpu(qkv[q + kv:]),
        "midlayer.self_attn.o_proj.weight": cpu(m.self_attn.o_proj.weight),
        "midlayer.mlp.gate_proj.weight": cpu(gate_up[:inter]),
        "midlayer.mlp.up_proj.weight": cpu(gate_up[inter:]),
        "midlayer.mlp.down_proj.weight": cpu(m.mlp.down_proj.weight),
    }
    if head.fc.bias is not None:
        out["fc.bias"] = cpu(head.fc.bias)
    if head.norm is not None:
        out["norm.weight"] = cpu(head.norm.weight)
    if head.lm_head is not None:
        ids = head.d2t.detach().to("cpu", torch.int64)
        out["lm_head.weight"] = cpu(head.lm_head.weight)
        out["d2t"] = ids - torch.arange(ids.numel())
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def export_eagle3_head(head: EagleHead, out_dir: str | Path, *, target: ModelConfig,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``head`` as ``out_dir/config.json`` + ``out_dir/model.safetensors`` (see the module
    docstring); files are written to temporary names first and renamed, so a reader never
    sees half a checkpoint.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: ``head`` is not an EAGLE-3 head.
        OSError: ``out_dir`` cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    own = head.lm_head is not None
    cfg = eagle3_config_json(target, head.config.aux_hidden_layers,
                             head.config.draft_vocab_size if own else 0, dtype)
    tensors = head_tensors(head, dtype)
    tmp_w, tmp_c = out / "model.safetensors.tmp", out / "config.json.tmp"
    save_file(tensors, str(tmp_w), metadata={"format": "pt"})
    tmp_c.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp_w.replace(out / "model.safetensors")
    tmp_c.replace(out / "config.json")
    return out
