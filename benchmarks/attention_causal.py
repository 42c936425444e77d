"""GPU micro-benchmark: a prompt chunk's attention, masked kernel vs the causal-chain kernel.

A chunk of ``Q`` prompt tokens over ``prefix`` cached ones (SmolLM2-135M heads: 9 query / 3 KV
heads of 64, bf16, pages of 16 slots in shuffled order, ``L`` = the prefix + chunk rounded up
to a power-of-two page-table width, as the prefill graphs see it) through
:class:`~structspec.kernels.attention.TritonAttentionBackend`: once under ``fb.attn_mask``
(the tree-verify kernel every chunk used before), once with ``fb.causal_start`` (the causal
kernel) for each ``--configs`` tile shape. Each time is the median per call inside a CUDA
graph of 20 calls (:func:`benchmarks.kernels_micro.graph_us`); the causal outputs are checked
against the masked one.

One line per (shape, variant): microseconds per layer call, the 30-layer total in ms, the
attention TFLOP/s (causal FLOPs: ``4 * D * Hq * sum of visible columns``) and the max abs
difference to the masked output. Last, the fastest causal config per shape.

Usage: ``PYTHONPATH=$PWD python benchmarks/attention_causal.py [--shapes 512:6500 ...]
[--configs 128:64:8:2 ...]`` (``Q:prefix``; ``block_m:block_n:num_warps:num_stages``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels_micro import graph_us  # noqa: E402
from structspec.kernels.attention import CausalConfig, TritonAttentionBackend  # noqa: E402
from structspec.kvcache.pool import KVPool  # noqa: E402
from structspec.layers.forward_batch import ForwardBatch  # noqa: E402

HQ, HKV, D, LAYERS, PAGE = 9, 3, 64, 30, 16
DEV = torch.device("cuda")


def chunk_batch(q: int, prefix: int, num_pages: int) -> tuple[ForwardBatch, int]:
    """One request computing positions ``prefix .. prefix + q - 1`` over its shuffled pages;
    returns the batch and the number of visible (query, column) pairs per head."""
    total = prefix + q
    width = 1 << (-(-total // PAGE) - 1).bit_length()
    kv_len = width * PAGE
    g = torch.Generator().manual_seed(total)
    pages = 1 + torch.randperm(num_pages - 1, generator=g)[:width]
    slots = (pages.view(-1, 1) * PAGE + torch.arange(PAGE)).view(1, kv_len)
    slots[:, total:] = 0
    col = torch.arange(kv_len).view(1, 1, kv_len)
    pos = prefix + torch.arange(q).view(1, q)
    mask = col <= pos.unsqueeze(2)
    ids = torch.zeros(1, q, dtype=torch.int64)
    fb = ForwardBatch(ids.to(DEV), pos.to(DEV), slots[:, prefix:total].contiguous().to(DEV),
                      slots.to(DEV), mask.to(DEV))
    visible = q * prefix + q * (q + 1) // 2
    return fb, visible


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["512:512", "512:3000", "512:6500",
                                                     "256:6700", "2048:0", "2048:6000"])
    ap.add_argument("--configs", nargs="+", default=["128:64:8:2", "128:64:4:2", "64:64:4:2",
                                                      "128:128:8:2", "128:64:8:3",
                                                      "64:64:4:3"])
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split(":"))) for s in args.shapes]
    configs = [CausalConfig(*map(int, c.split(":"))) for c in args.configs]
    num_pages = 1 + max(1 << (-(-(q + p) // PAGE) - 1).bit_length() for q, p in shapes)
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=PAGE, num_kv_heads=HKV,
                  head_dim=D, dtype=torch.bfloat16, device=DEV)
    for c in pool.k_cache + pool.v_cache:
        c.normal_()
    masked = TritonAttentionBackend()
    best: list[str] = []
    with torch.inference_mode():
        for q_len, prefix in shapes:
            fb, visible = chunk_batch(q_len, prefix, num_pages)
            q = torch.randn(1, q_len, HQ, D, device=DEV, dtype=torch.bfloat16)
            flop = 4 * D * HQ * visible
            ref = masked.forward(q, 0, fb, pool)
            us = graph_us(lambda fb=fb, q=q: masked.forward(q, 0, fb, pool))
            shape = f"Q={q_len} prefix={prefix} L={fb.kv_slots.shape[1]}"
            print(f"attention_causal {shape} variant=masked us={us:.1f} "
                  f"layers_ms={us * LAYERS / 1e3:.2f} tflops={flop / us / 1e6:.1f}", flush=True)
            causal_fb = ForwardBatch(fb.input_ids, fb.positions, fb.out_slots, fb.kv_slots,
                                     fb.attn_mask, causal_start=torch.tensor([prefix],
                                                                             device=DEV))
            results = []
            for cfg in configs:
                backend = TritonAttentionBackend(causal_config=cfg)
                name = f"{cfg.block_m}:{cfg.block_n}:{cfg.num_warps}:{cfg.num_stages}"
                try:
                    out = backend.forward(q, 0, causal_fb, pool)
                    diff = (out.float() - ref.float()).abs().max().item()
                    us_c = graph_us(lambda b=backend, q=q, f=causal_fb: b.forward(q, 0, f, pool))
                except Exception as e:  # noqa: BLE001 - report and go on with the next config
                    print(f"attention_causal {shape} variant=causal:{name} ERROR "
                          f"{type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                results.append((us_c, name))
                print(f"attention_causal {shape} variant=causal:{name} us={us_c:.1f} "
                      f"layers_ms={us_c * LAYERS / 1e3:.2f} tflops={flop / us_c / 1e6:.1f} "
                      f"max_abs_diff={diff:.2e} speedup={us / us_c:.2f}x", flush=True)
            if results:
                us_c, name = min(results)
                best.append(f"{shape}: masked {us:.1f} us, best causal {name} {us_c:.1f} us "
                            f"({us / us_c:.2f}x)")
    print("\n".join(["best per shape:", *best]))


if __name__ == "__main__":
    main()
