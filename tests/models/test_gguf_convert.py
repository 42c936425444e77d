"""GGUF -> HF conversion on tiny GGUFs written here the way llama.cpp's converter writes them
(Q/K rows permuted for llama, Q8_0-quantized matrices), compared with the HF original."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from structspec.models.gguf_convert import MARKER, convert_gguf, default_out_dir
from structspec.models.loader import load_model

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, rope_theta=5000.0)
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, suffix = hf_name.rsplit(".", 1)
    if base in top:
        return f"{top[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{BLOCK[rest]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf: PreTrainedModel, arch: str, path: Path) -> None:
    """Write ``hf`` as a GGUF and set ``hf``'s weights to what the GGUF stores (Q8_0 rounding)."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(SHAPE["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    with torch.no_grad():
        for name, param in hf.named_parameters():  # tied lm_head is listed once (as embed)
            arr = param.detach().numpy().astype(np.float32)
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
            n_head = next((h for k, h in heads.items() if f".{k}." in name), None)
            perm = np.arange(arr.shape[0])
            if arch == "llama" and n_head is not None:
                perm = _llama_cpp_permute(perm, n_head)
            stored = arr[perm]
            if stored.ndim == 2:
                q = gguf.quants.quantize(stored, GGMLQuantizationType.Q8_0)
                w.add_tensor(_gguf_name(name), q, raw_dtype=GGMLQuantizationType.Q8_0)
                stored = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(_gguf_name(name), stored)
            param.copy_(torch.from_numpy(stored[np.argsort(perm)].copy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.no_grad()
def test_convert_matches_hf(arch: str, tmp_path: Path, fbh: SimpleNamespace) -> None:
    if arch == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True))
    else:
        hf = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False))
    fbh.randomize(hf.eval(), seed=4)
    src = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(hf, arch, src)
    out = convert_gguf(src, tmp_path / "conv")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is (arch == "llama")
    assert cfg["attention_bias"] is (arch == "qwen2")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 3]
    ours, mcfg = load_model(str(out), device=torch.device("cpu"), dtype=torch.float32)
    seq = [5, 9, 200, 17, 3, 99, 42]
    hidden = ours(fbh.make_batch([fbh.extend_row(0, 0, seq)]), fbh.make_pool(mcfg, 1)).hidden_states
    got = ours.compute_logits(hidden[0])
    ref = hf(torch.tensor([seq])).logits[0]
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max().item() < 1e-4


def test_cache_dir_reuse_and_atomicity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fbh: SimpleNamespace
) -> None:
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE))
    src = tmp_path / "m.gguf"
    _write_gguf(hf, "llama", src)
    monkeypatch.setenv("STRUCTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    out = convert_gguf(src)
    assert out == default_out_dir(src)
    assert out.parent == tmp_path / "cache" / "gguf" and out.name.startswith("m-")
    assert (out / MARKER).is_file()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(src) == out  # reused, not rewritten
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp dirs left behind
    os.utime(src, ns=(1, 1))  # touched, same bytes: the same entry (rehashed once)
    assert default_out_dir(src) == out
    copy = tmp_path / "elsewhere" / "m.gguf"  # e.g. another virtualenv's package data
    copy.parent.mkdir()
    shutil.copyfile(src, copy)
    assert convert_gguf(copy) == out
    with open(copy, "ab") as f:  # changed bytes: a new entry
        f.write(b"\0")
    assert default_out_dir(copy) != out
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("user data")
    with pytest.raises(FileExistsError, match="not a completed GGUF conversion"):
        convert_gguf(src, busy)


def test_convert_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        convert_gguf(tmp_path / "g.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
