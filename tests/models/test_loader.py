"""Checkpoint loading: sharded safetensors, dtype cast, and the error messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from structspec.models.loader import load_model
from structspec.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

CPU = torch.device("cpu")
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture
def ckpt(tmp_path: Path, fbh: SimpleNamespace) -> tuple[LlamaForCausalLM, Path]:
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)).eval()
    fbh.randomize(hf, seed=5)
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    return hf, tmp_path / "m"


def _logits(model: torch.nn.Module, cfg: object, fbh: SimpleNamespace) -> torch.Tensor:
    seq = [3, 1, 4, 1, 5, 9]
    with torch.no_grad():
        out = model(fbh.make_batch([fbh.extend_row(0, 0, seq)]), fbh.make_pool(cfg, 1, model.embed_tokens.weight.dtype))
        return model.compute_logits(out.hidden_states[0])


def test_registry() -> None:
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= SUPPORTED_ARCHITECTURES
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        get_model_class("GPT2LMHeadModel")


def test_sharded_and_bf16(tmp_path: Path, fbh: SimpleNamespace) -> None:
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True)).eval()
    fbh.randomize(hf, seed=6)
    hf.save_pretrained(tmp_path / "s", safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "s" / "model.safetensors.index.json").is_file()
    model, cfg = load_model(str(tmp_path / "s"), device=CPU, dtype=torch.float32)
    ref = hf(torch.tensor([[3, 1, 4, 1, 5, 9]])).logits[0]
    assert (_logits(model, cfg, fbh) - ref).abs().max() < 1e-4
    bf16, cfg = load_model(str(tmp_path / "s"), device=CPU, dtype=torch.bfloat16)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.rotary.inv_freq.dtype == torch.float32
    assert bf16.lm_head.weight.data_ptr() == bf16.embed_tokens.weight.data_ptr()  # tied
    got = _logits(bf16, cfg, fbh)
    assert got.dtype == torch.float32 and (got - ref).abs().max() < 0.1 * ref.abs().max()
    shard = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())["weight_map"]
    gone = tmp_path / "s" / sorted(set(shard.values()))[-1]
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=f"{gone.name}: shard listed in"):
        load_model(str(tmp_path / "s"), device=CPU, dtype=torch.float32)


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), device=CPU, dtype=torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path / "empty"), device=CPU, dtype=torch.float32)
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not .gguf"):
        load_model(str(tmp_path / "w.bin"), device=CPU, dtype=torch.float32)


def test_config_errors(ckpt: tuple[LlamaForCausalLM, Path]) -> None:
    _, path = ckpt
    cfg_path = path / "config.json"
    good = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**good, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(path), device=CPU, dtype=torch.float32)
    cfg_path.write_text(json.dumps({**good, "mlp_bias": True}))
    with pytest.raises(ValueError, match="mlp_bias"):
        load_model(str(path), device=CPU, dtype=torch.float32)
    cfg_path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(path), device=CPU, dtype=torch.float32)


def test_weight_errors(ckpt: tuple[LlamaForCausalLM, Path]) -> None:
    _, path = ckpt
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.down_proj.weight"}, str(weights))
    with pytest.raises(ValueError, match=r"missing 1 weight tensor\(s\): \['model.layers.1.mlp.down_proj.weight'\]"):
        load_model(str(path), device=CPU, dtype=torch.float32)
    save_file({**tensors, "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}, str(weights))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight' has shape \(3, 3\)"):
        load_model(str(path), device=CPU, dtype=torch.float32)
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, str(weights))
    with pytest.raises(ValueError, match="unexpected tensors .*model.extra.weight"):
        load_model(str(path), device=CPU, dtype=torch.float32)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights"):
        load_model(str(path), device=CPU, dtype=torch.float32)


def test_building_a_model_does_not_import_dynamo(ckpt: tuple[LlamaForCausalLM, Path]) -> None:
    """Loading builds the model on the meta device; a meta-device op without a meta kernel
    (nn.Embedding's normal_ init, the rotary frequencies) imports torch._dynamo there, which
    cost every engine process 2-4 s of its start. The load runs in a fresh interpreter."""
    code = ("import sys, torch\n"
            "from structspec.models.loader import load_model\n"
            f"load_model({str(ckpt[1])!r}, device=torch.device('cpu'), dtype=torch.float32)\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
