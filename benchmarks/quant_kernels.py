"""One decode step's linears on CPU per weight format (issue 22): float32, bfloat16 (oneDNN),
int8 and int4 (torch's packed kernels, bfloat16 activations), fp16 (FBGEMM).

The shapes are SmolLM2-135M's (30 layers of q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536, plus the 49152x576 LM head) with random weights; one "step" runs every linear once
on ``M`` rows. Prints the median and min of 7 steps per format.

    PYTHONPATH=$PWD python benchmarks/quant_kernels.py --rows 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
Linear = Callable[[torch.Tensor], torch.Tensor]


def formats(weights: list[torch.Tensor]) -> dict[str, list[Linear]]:
    """Each format's list of callables ``x [M, K] float32 -> [M, N] float32``."""
    def int8(w: torch.Tensor) -> Linear:
        s = w.abs().amax(1) / 127
        q = torch.round(w / s[:, None]).to(torch.int8)
        sb = s.bfloat16()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, sb).float()

    def int4(w: torch.Tensor, gs: int) -> Linear:
        n, k = w.shape
        wg = w.view(n, k // gs, gs)
        lo, hi = wg.amin(-1), wg.amax(-1)
        sc = (hi - lo) / 15
        q = torch.round((wg - lo[..., None]) / sc[..., None]).clamp(0, 15).to(torch.int32)
        sz = torch.stack([sc, lo + 8 * sc], -1).transpose(0, 1).contiguous().bfloat16()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k), 1)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, gs,
                                                                    sz).float()

    def fp16(w: torch.Tensor) -> Linear:
        p = torch.ops.quantized.linear_prepack_fp16(w, None)
        return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, p)

    def bf16(w: torch.Tensor) -> Linear:
        wb = w.bfloat16()
        return lambda x: F.linear(x.bfloat16(), wb).float()

    return {
        "float32": [lambda x, w=w: F.linear(x, w) for w in weights],
        "bf16": [bf16(w) for w in weights],
        "int8 (bf16 act)": [int8(w) for w in weights],
        "int4 g32 (bf16 act)": [int4(w, 32) for w in weights],
        "int4 g64 (bf16 act)": [int4(w, 64) for w in weights],
        "fp16 (FBGEMM)": [fp16(w) for w in weights],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1, help="M: rows per call (1 = batch-1 decode)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    xs = {k: torch.randn(args.rows, k) for k in (576, 1536)}
    fmts = formats(weights)
    times: dict[str, list[float]] = {name: [] for name in fmts}
    for _ in range(args.repeats):
        for name, fns in fmts.items():
            t0 = time.perf_counter()
            for fn, (_, k) in zip(fns, SHAPES, strict=True):
                fn(xs[k])
            times[name].append((time.perf_counter() - t0) * 1e3)
    for name, ts in times.items():
        ts.sort()
        print(f"M={args.rows} {name:<22} {ts[len(ts) // 2]:7.1f} ms per step (min {ts[0]:.1f})")


if __name__ == "__main__":
    main()
