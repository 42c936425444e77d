"""``load_format="dummy"``: seeded random weights from config.json alone, on the requested
device and dtype, deterministic for a seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import structspec.models.loader as loader
from structspec.models.loader import init_dummy_weights, load_model

CPU = torch.device("cpu")
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, rope_theta=10000.0)


def _config_dir(tmp_path: Path, name: str, **extra: object) -> Path:
    d = tmp_path / name
    d.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], **SHAPE, **extra}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_is_seeded_and_on_device_dtype(tmp_path: Path, dtype: torch.dtype,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    d = _config_dir(tmp_path, "m", tie_word_embeddings=False)  # config.json only, no weights

    def no_read(*a: object, **k: object) -> None:
        raise AssertionError("dummy load must not look for or read checkpoint files")

    monkeypatch.setattr(loader, "find_weight_files", no_read)
    monkeypatch.setattr(loader, "iter_safetensors", no_read)
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    a, cfg = load_model(str(d), device=CPU, dtype=dtype, load_format="dummy", seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    b, _ = load_model(str(d), device=CPU, dtype=dtype, load_format="dummy", seed=7)
    c, _ = load_model(str(d), device=CPU, dtype=dtype, load_format="dummy", seed=8)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert cfg.vocab_size == 96 and not a.training
    assert sa.keys() == sb.keys() and sa
    for name, p in a.named_parameters():
        assert p.device == CPU and p.dtype == dtype, name
        assert not p.requires_grad, name
        assert torch.equal(sa[name], sb[name]), name  # same seed: bit-identical
        if "norm" in name:
            assert torch.all(p == 1), name
        else:
            assert not torch.equal(sa[name], sc[name]), name  # another seed: other values
            std = p.float().std().item()
            assert 0.015 < std < 0.025, (name, std)  # normal(0, 0.02)
    assert a.rotary.inv_freq.dtype == torch.float32
    assert a.lm_head.weight.data_ptr() != a.embed_tokens.weight.data_ptr()  # untied


def test_dummy_ties_embeddings_and_zeroes_biases(tmp_path: Path) -> None:
    d = _config_dir(tmp_path, "q", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                    initializer_range=0.05)
    model, cfg = load_model(str(d), device=CPU, dtype=torch.float32, load_format="dummy")
    assert cfg.attention_bias
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    assert biases and all(torch.all(p == 0) for p in biases)
    assert 0.04 < model.embed_tokens.weight.std().item() < 0.06  # initializer_range
    # a working model: finite logits
    logits = model.compute_logits(model.embed_tokens.weight[:3])
    assert logits.shape == (3, 96) and torch.isfinite(logits).all()


def test_dummy_matches_init_dummy_weights(tmp_path: Path) -> None:
    """load_model's dummy path is exactly init_dummy_weights on the built model."""
    d = _config_dir(tmp_path, "m")
    model, _ = load_model(str(d), device=CPU, dtype=torch.float32, load_format="dummy", seed=3)
    want = _state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    init_dummy_weights(model, seed=3)
    assert all(torch.equal(want[n], p) for n, p in model.named_parameters())


def test_load_format_errors(tmp_path: Path) -> None:
    d = _config_dir(tmp_path, "m")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(d), device=CPU, dtype=torch.float32)  # auto needs weights
    with pytest.raises(ValueError, match="load_format='bogus'"):
        load_model(str(d), device=CPU, dtype=torch.float32, load_format="bogus")
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        init_dummy_weights(meta, seed=0)


def test_engine_config_rejects_bad_load_format() -> None:
    from structspec.config import EngineConfig, resolve_engine_config

    with pytest.raises(ValueError, match="load_format"):
        resolve_engine_config(EngineConfig(device="cpu", load_format="random"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dummy_on_cuda_bf16(tmp_path: Path) -> None:
    d = _config_dir(tmp_path, "m")
    dev = torch.device("cuda", torch.cuda.current_device())
    a, _ = load_model(str(d), device=dev, dtype=torch.bfloat16, load_format="dummy", seed=1)
    b, _ = load_model(str(d), device=dev, dtype=torch.bfloat16, load_format="dummy", seed=1)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert p.device == dev and p.dtype == torch.bfloat16, name
        assert torch.equal(p, q), name
