"""What drawing the sampled rows of a verify step costs (``structspec.layers.sampler.sample_rows``):
every row drawn by its request's seed and output position (the inverse CDF in vocabulary order
with a keyed uniform), by rows and filter, on the CPU or a GPU.

Runs on the tree before the keyed draw too (one generator per request then), so the two can
be timed with the same script in two checkouts. One line per configuration::

    sampler_cost device=cpu rows=64 filter=top_p vocab=49152 ms=...

``ms``: median over ``--reps`` calls of one ``sample_rows`` on random logits (CUDA: the device
drained before and after each call, so the time is the GPU's and the host's together).

    PYTHONPATH=$PWD python benchmarks/sampler_cost.py --rows 8 64 256
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from structspec.layers.sampler import SamplingBatch, sample_rows  # noqa: E402


def batch(rows: int, per_request: int, flt: str, device: torch.device) -> SamplingBatch:
    """``rows`` sampled rows (T = 0.8) of ``rows / per_request`` requests, one filter."""
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=device)
    common = dict(
        temperature=full(0.8), top_k=full(50 if flt == "top_k" else 0, torch.int64),
        top_p=full(0.95 if flt == "top_p" else 1.0), min_p=full(0.0),
        rows_per_request=per_request, all_greedy=False, use_top_k=flt == "top_k",
        use_top_p=flt == "top_p", use_min_p=False, top_k_max=50 if flt == "top_k" else 0)
    if "seeds" not in inspect.signature(SamplingBatch).parameters:
        # a tree before the keyed draw (commit 1a772fa and earlier): one generator per
        # request, so that ``ab_compare``-style runs can time the old draw with this script
        return SamplingBatch(**common, generators=[  # type: ignore[call-arg]
            torch.Generator(device=device).manual_seed(r)
            for r in range(rows // per_request)])
    return SamplingBatch(**common, seeds=torch.arange(rows, device=device) // per_request * 7919,
                         starts=torch.full((rows,), 100, dtype=torch.int64, device=device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--nodes", type=int, default=8, help="rows per request (tree size)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--filters", nargs="+", default=["none", "top_k", "top_p"])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for rows in args.rows:
        per_request = min(args.nodes, rows)
        depth = torch.arange(per_request, device=device).repeat(rows // per_request)
        for flt in args.filters:
            sb = batch(rows, per_request, flt, device)
            logits = torch.randn(rows, args.vocab, device=device)
            keyed = "depth" in inspect.signature(sample_rows).parameters
            extra = (depth,) if keyed else ()
            sample_rows(logits, sb, *extra)  # warm-up
            times = []
            for _ in range(args.reps):
                sync()
                t0 = time.perf_counter()
                sample_rows(logits, sb, *extra)
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            print(f"sampler_cost device={device.type} rows={rows} filter={flt} "
                  f"vocab={args.vocab} ms={statistics.median(times):.2f}", flush=True)


if __name__ == "__main__":
    main()
