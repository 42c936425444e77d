"""Load a local Hugging Face checkpoint (config.json + safetensors) or a .gguf file, or build a
model with seeded random weights from its config.json alone (``load_format="dummy"``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from structspec.config import ModelConfig
from structspec.memory import check_fits
from structspec.models.default_model import resolve_model_path
from structspec.models.registry import get_model_class

INDEX_FILE = "model.safetensors.index.json"
#: ``load_format`` values: read the checkpoint, or seeded random weights from config.json only.
LOAD_FORMATS = ("auto", "dummy")
#: std of the ``dummy`` normal initialisation when config.json has no ``initializer_range``.
DUMMY_STD = 0.02


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """Parse ``model_dir/config.json``.

    Raises:
        FileNotFoundError: no config.json in ``model_dir``.
        ValueError: config.json is not a JSON object, or asks for a feature we do not implement
            (quantization, ``mlp_bias``, sliding-window attention); the message names the field.
    """
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: not found; a model directory needs a Hugging Face config.json"
        )
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if cfg.get("quantization_config"):
        raise ValueError(f"{path}: quantized checkpoints ('quantization_config') are not supported")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{path}: 'mlp_bias': true is not supported")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{path}: 'use_sliding_window': true is not supported")
    return cfg


def find_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of ``model.safetensors.index.json`` if
    present, else every ``*.safetensors`` in ``model_dir`` (sorted).

    Raises:
        FileNotFoundError: no safetensors weights, or a shard named by the index is missing.
        ValueError: the index file is malformed.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: malformed index (need a 'weight_map' object): {e}") from e
        files = [model_dir / s for s in shards]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard listed in {index.name} does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no *.safetensors weights found (only safetensors checkpoints are "
            "supported; convert pytorch_model.bin first)"
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(tensor name, CPU tensor in its stored dtype)`` over all files.

    Raises:
        ValueError: a file cannot be read as safetensors (the message names it).
    """
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{f}: cannot read safetensors file: {e}") from e


def load_model_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint from its config.json alone (no weights are
    read), for checks that should fail before the weights load.

    Raises:
        FileNotFoundError / ValueError: as :func:`load_model` for the path and config.json.
    """
    model_dir = Path(resolve_model_path(path))
    return _model_config(model_dir, read_hf_config(model_dir))


def _model_config(model_dir: Path, hf_cfg: dict[str, Any]) -> ModelConfig:
    try:
        return ModelConfig.from_hf_config(hf_cfg)
    except ValueError as e:
        raise ValueError(f"{model_dir / 'config.json'}: {e}") from e


def load_model(
    path: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for a local checkpoint and load (or, ``dummy``, randomly make) its weights.

    Parameters are allocated once, uninitialised, directly on ``device`` in ``dtype`` (built on
    the meta device first, so no CPU copy of the model ever exists), then filled.

    Args:
        path: a HF model directory (config.json + ``*.safetensors``, sharded index supported) or
            a ``.gguf`` file (converted once to a cached HF directory, see
            :func:`structspec.models.gguf_convert.convert_gguf`). With ``load_format="dummy"``
            only config.json is read (the directory needs no weights).
        device: where parameters live.
        dtype: parameter dtype; checkpoint tensors are cast to it (rotary frequencies stay fp32).
        load_format: ``"auto"`` reads the checkpoint's safetensors; ``"dummy"`` fills the
            parameters with seeded random values on the device instead (see
            :func:`init_dummy_weights`): for benchmarks of shapes whose weights are not at hand.
        seed: seed of the ``dummy`` initialisation (same path, seed, device and dtype give
            bit-identical weights); unused by ``auto``.

    Returns:
        ``(model in eval mode without grads, its ModelConfig)``.

    Raises:
        FileNotFoundError: missing path, config.json, weights or shard (message names the file).
        MemoryError: the weights cannot fit in the device's free memory (checked before
            allocating).
        ValueError: unsupported architecture/feature, malformed files, missing/unexpected/
            mis-shaped tensors (message names the tensor and file set), unknown
            ``load_format``.
    """
    model_dir = Path(resolve_model_path(path))
    hf_cfg = read_hf_config(model_dir)
    config = _model_config(model_dir, hf_cfg)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    files = find_weight_files(model_dir) if load_format == "auto" else []
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    model.to(dtype=dtype)  # free on meta; then allocate once, uninitialised, on the device
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    check_fits(weight_bytes, torch.device(device), f"{model_dir.name} weights ({dtype})",
               "use a smaller model, a GPU, or dtype bfloat16")
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.reset_inv_freq()
    if load_format == "dummy":
        std = float(hf_cfg.get("initializer_range") or DUMMY_STD)
        init_dummy_weights(model, seed=seed, std=std)
        model.tie_weights()
    else:
        source = str(files[0]) if len(files) == 1 else f"{model_dir} ({len(files)} safetensors shards)"
        model.load_weights(iter_safetensors(files), source=source)
    model.eval().requires_grad_(False)
    return model, config


@torch.no_grad()
def init_dummy_weights(model: nn.Module, *, seed: int, std: float = DUMMY_STD) -> None:
    """Fill every parameter of ``model`` in place with seeded random values, on its device.

    Norm weights (parameters of a module whose name contains ``norm``, e.g.
    ``input_layernorm``, ``q_norm``, the final ``norm``) become 1, biases 0, every other
    parameter (embeddings, linear weights) ``normal(0, std)``, drawn in the parameter's own
    dtype from a ``torch.Generator`` on the parameter's device seeded with ``seed``, in
    ``named_parameters()`` order (tied parameters once). Same model class, config, seed, device
    and dtype give bit-identical weights; the global RNG is not touched.

    Args:
        model: a module whose parameters are allocated (not on the meta device).
        seed: generator seed.
        std: standard deviation of the normal initialisation (HF's ``initializer_range``).

    Raises:
        ValueError: a parameter is still on the meta device.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device; allocate it first")
        module_name, _, leaf = name.rpartition(".")
        if "norm" in module_name.rpartition(".")[2]:
            p.fill_(1.0)
        elif leaf == "bias":
            p.zero_()
        else:
            g = generators.get(p.device)
            if g is None:
                g = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(mean=0.0, std=std, generator=g)
