"""The HBM floor of a decode step: bytes a step must read / measured device memory bandwidth.

A decode (or tree-verify) step at small batch is bound by reading every weight once from HBM,
so no implementation can beat ``floor_ms = bytes read per step / bandwidth``. The bandwidth is
measured here, not taken from a data sheet: the best of several large device-to-device copies
(``dst.copy_(src)``, timed with CUDA events), counting the bytes read plus the bytes written.

Bytes read per step (:func:`step_read_bytes`): every parameter once (a tied embedding once),
except an *untied* input embedding table, of which a step reads only its ``batch`` rows (so
the Llama-3-8B floor uses 15.0 of its 16.1 GB). :func:`kv_read_bytes` adds the KV cache a
step attends over (``batch * context`` tokens, all layers), which matters at large batch.

Standalone (no model needed; shapes are built on the meta device)::

    PYTHONPATH=$PWD python benchmarks/hbm_floor.py --model benchmarks/assets/llama3-8b-shape \\
        --batch 1 8 32 64 --context 512

prints the measured bandwidth and one line per batch with ``floor_ms`` (weights) and
``floor_kv_ms`` (weights + KV). ``benchmarks/gpu_decode.py`` prints the same floors next to
its measured CUDA-graph step times.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from structspec.config import ModelConfig

GIB = 1 << 30


@dataclass(frozen=True)
class Bandwidth:
    """Result of :func:`copy_bandwidth`.

    Attributes:
        bytes_per_s: best rate, (bytes read + bytes written) / s.
        best_ms: fastest copy, milliseconds.
        median_ms: median copy, milliseconds.
        nbytes: size of the copied tensor in bytes (each copy moves ``2 * nbytes``).
        reps: timed copies.
    """

    bytes_per_s: float
    best_ms: float
    median_ms: float
    nbytes: int
    reps: int

    @property
    def tb_per_s(self) -> float:
        """Best rate in TB/s (10^12 bytes per second)."""
        return self.bytes_per_s / 1e12

    def describe(self) -> str:
        """One comment line for benchmark output."""
        return (f"# HBM bandwidth {self.tb_per_s:.3f} TB/s (read+write, best of {self.reps} "
                f"{self.nbytes / GIB:g} GiB device-to-device copies: best {self.best_ms:.3f} ms, "
                f"median {self.median_ms:.3f} ms)")


def copy_bandwidth(nbytes: int = 4 * GIB, reps: int = 10, device: torch.device | str = "cuda",
                   warmup: int = 3) -> Bandwidth:
    """Measure device memory bandwidth with ``dst.copy_(src)`` of two ``nbytes`` tensors.

    Args:
        nbytes: size of the source tensor in bytes (2-4 GiB keeps caches irrelevant; the
            H200's L2 is 60 MiB). Needs ``2 * nbytes`` free device memory, freed on return.
        reps: timed copies (CUDA events around each); the best one gives the rate.
        device: a CUDA device.
        warmup: untimed copies first.

    Returns:
        :class:`Bandwidth`; ``bytes_per_s = 2 * nbytes / best time``.

    Raises:
        ValueError: ``device`` is not CUDA, or ``nbytes``/``reps`` < 1.
        torch.OutOfMemoryError: not enough free device memory.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"copy_bandwidth needs a CUDA device, got {dev}")
    if nbytes < 1 or reps < 1:
        raise ValueError("nbytes and reps must be >= 1")
    n = nbytes // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    nbytes = 2 * n
    try:
        for _ in range(warmup):
            dst.copy_(src)
        times: list[float] = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    finally:
        del src, dst
        torch.cuda.empty_cache()
    best = min(times)
    return Bandwidth(bytes_per_s=2 * nbytes / (best / 1e3), best_ms=best,
                     median_ms=statistics.median(times), nbytes=nbytes, reps=reps)


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters of ``model``, tied/shared ones counted once (buffers such as
    rotary frequencies are left out: a few hundred bytes). Works on the meta device: only
    shapes and dtypes are read."""
    return sum(p.numel() * p.element_size() for p in model.parameters())  # deduplicated


def step_read_bytes(model: nn.Module, config: ModelConfig, batch: int = 1) -> int:
    """Bytes one decode step of ``batch`` sequences must read: :func:`param_bytes`, minus an
    untied input embedding table (only ``batch`` of its rows are gathered)."""
    total = param_bytes(model)
    embed = getattr(model, "embed_tokens", None)
    if embed is not None and not config.tie_word_embeddings:
        w = embed.weight
        total -= (w.shape[0] - min(batch, w.shape[0])) * w.shape[1] * w.element_size()
    return total


def kv_read_bytes(config: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
    """Bytes of K and V a step attends over: ``batch * context`` tokens, every layer."""
    per_token = 2 * config.num_hidden_layers * config.kv_size * torch.empty(
        (), dtype=dtype).element_size()
    return batch * context * per_token


def floor_ms(nbytes: int, bandwidth: Bandwidth) -> float:
    """Milliseconds to stream ``nbytes`` once at the measured rate."""
    return nbytes / bandwidth.bytes_per_s * 1e3


def meta_model(path: str, dtype: torch.dtype) -> tuple[nn.Module, ModelConfig]:
    """The model class of ``path/config.json`` built on the meta device in ``dtype`` (no
    memory, no weights read): enough for :func:`step_read_bytes`.

    Raises:
        FileNotFoundError / ValueError: as :func:`structspec.models.loader.read_hf_config`.
    """
    from structspec.models.default_model import resolve_model_path
    from structspec.models.loader import read_hf_config
    from structspec.models.registry import get_model_class

    cfg = ModelConfig.from_hf_config(read_hf_config(Path(resolve_model_path(path))))
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg)
    return model.to(dtype=dtype), cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="benchmarks/assets/llama3-8b-shape",
                    help="model directory (only config.json is read)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=512, help="KV tokens per sequence")
    ap.add_argument("--gib", type=float, default=4.0, help="size of the copied tensor, GiB")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dtype = torch.bfloat16
    model, cfg = meta_model(args.model, dtype)
    bw = copy_bandwidth(int(args.gib * GIB), args.reps)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(bw.describe())
    name = Path(args.model).name
    for b in args.batch:
        w = step_read_bytes(model, cfg, b)
        kv = kv_read_bytes(cfg, b, args.context, dtype)
        print(f"hbm_floor model={name} B={b:<3d} context={args.context} "
              f"weights_gb={param_bytes(model) / 1e9:.3f} read_gb={w / 1e9:.3f} "
              f"kv_gb={kv / 1e9:.3f} floor_ms={floor_ms(w, bw):.3f} "
              f"floor_kv_ms={floor_ms(w + kv, bw):.3f}", flush=True)


if __name__ == "__main__":
    main()
