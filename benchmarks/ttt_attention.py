"""TTT attention forms: time and peak memory of one EAGLE-3 TTT forward + backward.

One random-weight EAGLE-3 head at the SmolLM2-135M shape (hidden 576, 9 heads, 3 KV heads,
head_dim 64, intermediate 1536) runs K unrolled midlayer steps over ``[B, T]`` (the trainer's
:meth:`~structspec.training.ttt.TTTForward.layer_step`), then the backward of a fixed random
projection of the K outputs. The soft cross-entropy head is left out: it is the same work in
every form. Forms (``--paths``):

* ``dense``: the reference, masked SDPA over ``[step-0 | ... | step-k]`` keys, with the
  kernel SDPA picks (on the CPU a fused flash kernel that takes the mask).
* ``dense_math``: ``dense`` forced onto SDPA's math kernel, which materialises the
  ``[B, H, T, (k+1) T]`` scores: the kernel the H200 training run's dense path fell to.
* ``split``: causal SDPA + diagonal keys merged through one sink key (the trainer's default).
* ``chunked``: the measured alternative: causal scores in chunks of ``--chunk`` query rows
  (``[B, H, chunk, T]`` at a time, recomputed in backward), merged with the diagonal part by
  log-sum-exp.
* ``flex``: ``flex_attention`` over the concatenated keys with the TTT block mask, compiled
  (CUDA; on the CPU it runs eager, unfused).

Each configuration runs in a fresh subprocess, so its peak memory is its own: on CUDA
``torch.cuda.max_memory_allocated`` over the allocation before the run; on the CPU the
resident set's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) over the
resident set before one extra run, with glibc told to ``mmap`` every block of 64 KiB or more
(``mallopt``) and trimmed first, so freed memory leaves the resident set at once and the mark
is the run's live peak (weights and inputs excluded). Times come from the runs before that
(default allocator). One line per configuration:

    path=split device=cpu dtype=float32 B=2 T=512 K=7 ms=... tokens_per_s=... peak_bytes=...

Usage: ``PYTHONPATH=$PWD python benchmarks/ttt_attention.py [--device cpu|cuda]
[--batch 2] [--width 512] [--steps 7] [--paths dense dense_math split chunked flex]
[--repeats 3] [--threads N]``
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from structspec.config import ModelConfig  # noqa: E402
from structspec.models.eagle_head import EagleHead  # noqa: E402
from structspec.training import ttt as ttt_module  # noqa: E402
from structspec.training.export import eagle3_head_config  # noqa: E402
from structspec.training.ttt import TTTForward  # noqa: E402
from structspec.training.ttt_attention import diagonal_part, ttt_mask  # noqa: E402

PATHS = ("dense", "dense_math", "split", "chunked", "flex")


def smollm2_shape(layers: int = 30) -> ModelConfig:
    """The SmolLM2-135M target shape (the head copies its layer dimensions)."""
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                       tie_word_embeddings=True)


def _causal_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start..start+c`` of a causal attention: ``q [B, H, c, D]`` against the first
    ``start + c`` keys; float32 ``(out [B, H, c, D], lse [B, H, c])``."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    rows = torch.arange(start, start + q.shape[2], device=q.device)
    cols = torch.arange(k.shape[2], device=q.device)
    s = s.masked_fill(cols.unsqueeze(0) > rows.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p.to(v.dtype), v).float(), lse


def chunked_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor],
                          values: list[torch.Tensor], scale: float,
                          chunk: int) -> torch.Tensor:
    """The TTT attention with the causal part's numerator and log-sum-exp made ``chunk`` query
    rows at a time (each chunk recomputed in backward), merged with the diagonal part."""
    b, t, h, d = q.shape
    group = h // keys[0].shape[2]
    k0 = keys[0].repeat_interleave(group, dim=2).transpose(1, 2)
    v0 = values[0].repeat_interleave(group, dim=2).transpose(1, 2)
    qh = q.transpose(1, 2)
    outs, lses = [], []
    for start in range(0, t, chunk):
        end = min(t, start + chunk)
        o, lse = checkpoint(_causal_chunk, qh[:, :, start:end], k0[:, :, :end],
                            v0[:, :, :end], start, scale, use_reentrant=False)
        outs.append(o)
        lses.append(lse)
    out_c = torch.cat(outs, dim=2).transpose(1, 2)  # [B, T, H, D]
    lse_c = torch.cat(lses, dim=2).transpose(1, 2)  # [B, T, H]
    if len(keys) == 1:
        return out_c.to(q.dtype)
    lse_d, v_diag = checkpoint(diagonal_part, q, scale, *keys[1:], *values[1:],
                               use_reentrant=False)
    total = torch.logaddexp(lse_c, lse_d)
    w_c = torch.exp(lse_c - total).unsqueeze(-1)
    w_d = torch.exp(lse_d - total).unsqueeze(-1)
    return (w_c * out_c + w_d * v_diag).to(q.dtype)


def flex_ttt_attention_factory(width: int, num_steps: int, device: torch.device):  # noqa: ANN201
    """A TTT attention through ``flex_attention`` over the concatenated keys, with one block
    mask per step (compiled on CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        block, j = kv_idx // width, kv_idx % width
        return ((block == 0) & (j <= q_idx)) | ((block > 0) & (j == q_idx))

    masks = [create_block_mask(mask_mod, None, None, width, (k + 1) * width,
                               device=str(device)) for k in range(num_steps)]
    fn = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

    def attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
               scale: float) -> torch.Tensor:
        kk = torch.cat(keys, dim=1).transpose(1, 2)
        vv = torch.cat(values, dim=1).transpose(1, 2)
        out = fn(q.transpose(1, 2), kk, vv, block_mask=masks[len(keys) - 1], scale=scale,
                 enable_gqa=True)
        return out.transpose(1, 2)

    return attend


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _exact_rss_mode() -> bool:
    """Make glibc return freed blocks of >= 64 KiB to the OS at once (``M_MMAP_THRESHOLD``)
    and trim its heap, so the resident set follows live memory; False without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3
        ok = libc.mallopt(m_mmap_threshold, 64 * 1024) == 1
        libc.malloc_trim(0)
        return ok
    except (OSError, AttributeError):
        return False


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(reset: bool) -> int:
    if reset:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(path: str, batch: int, width: int, steps: int, device: torch.device,
            dtype: torch.dtype, repeats: int, chunk: int) -> dict[str, object]:
    """Time one configuration in this process; the summary record."""
    mc = smollm2_shape()
    torch.manual_seed(0)
    head = EagleHead(eagle3_head_config(mc, (1, 14, 26), 0)).to(device)
    head.rotary.reset_inv_freq()
    embed = torch.nn.Embedding(64, mc.hidden_size).to(device).requires_grad_(False)
    ttt = TTTForward(head, embed, torch.zeros(1, device=device), steps,
                     "dense" if path.startswith("dense") else "split")
    if path == "chunked":
        ttt_module.split_ttt_attention = (  # type: ignore[assignment]
            lambda q, k, v, s: chunked_ttt_attention(q, k, v, s, chunk))
    elif path == "flex":
        ttt_module.split_ttt_attention = flex_ttt_attention_factory(width, steps, device)
    embeds = torch.randn(batch, width, mc.hidden_size, device=device)
    aux = torch.randn(batch, width, 3 * mc.hidden_size, device=device)
    probes = torch.randn(steps, batch, width, mc.hidden_size, device=device)
    mask = ttt_mask(width, steps, device) if path.startswith("dense") else None
    pos = torch.arange(width, device=device).expand(batch, width)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def kernels() -> contextlib.AbstractContextManager:
        return (sdpa_kernel([SDPBackend.MATH]) if path == "dense_math"
                else contextlib.nullcontext())

    def once() -> None:
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        with autocast, kernels():
            h = head.fc(aux)
            loss = torch.zeros((), device=device)
            for k in range(steps):
                h = ttt.layer_step(embeds, h, pos + k, keys, values, mask)
                loss = loss + (h.float() * probes[k]).sum()
        loss.backward()
        head.zero_grad(set_to_none=True)

    once()  # warm-up (kernel selection, compile)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        exact = _exact_rss_mode()
        base = _rss_bytes()
        reset = _reset_peak_rss()
        once()
        peak = _peak_rss_bytes(reset) - base
        if not (exact and reset):
            print("warning: peak_bytes is approximate (no glibc mallopt or clear_refs)",
                  file=sys.stderr)
    ms = statistics.median(times)
    return {"path": path, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
            "B": batch, "T": width, "K": steps, "ms": round(ms, 2),
            "tokens_per_s": round(batch * width / ms * 1e3, 1), "peak_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="autocast dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--batch", type=int, nargs="+", default=[2], help="rows B")
    ap.add_argument("--width", type=int, nargs="+", default=[512], help="row width T")
    ap.add_argument("--steps", type=int, nargs="+", default=[7], help="TTT steps K")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=["dense", "dense_math", "split", "chunked"])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs (median reported)")
    ap.add_argument("--chunk", type=int, default=128, help="query rows per chunk (chunked)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one config, JSON
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = ({"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
             if a.dtype != "auto" else
             torch.bfloat16 if device.type == "cuda" else torch.float32)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.one is not None:
        path, b, t, k = a.one.split(",")
        print(json.dumps(run_one(path, int(b), int(t), int(k), device, dtype, a.repeats,
                                 a.chunk)))
        return
    for b in a.batch:
        for t in a.width:
            for k in a.steps:
                for path in a.paths:
                    cmd = [sys.executable, __file__, "--device", a.device, "--dtype", a.dtype,
                           "--repeats", str(a.repeats), "--chunk", str(a.chunk),
                           "--threads", str(a.threads), "--one", f"{path},{b},{t},{k}"]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    if proc.returncode != 0:
                        err = (proc.stderr.strip().splitlines() or ["?"])[-1]
                        print(f"path={path} B={b} T={t} K={k} failed: {err}", flush=True)
                        continue
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                    print(" ".join(f"{key}={value}" for key, value in r.items()), flush=True)


if __name__ == "__main__":
    main()
