"""fp32 ``F.linear`` time per row count on this CPU: does a forward of M rows (a verify tree, a
prefill) cost more than M decodes' worth of weight reads?

    PYTHONPATH=$PWD python benchmarks/cpu_linear_rows.py --rows 1 4 8 16 32

The shapes are SmolLM2-135M's: the tied LM head (49,152 x 576), the fused gate/up (3,072 x
576) and the down projection (576 x 1,536). One line per shape and row count: ms per call
(median of ``--reps`` after 2 warm-up calls), the weight read rate, GFLOPS.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = ((49152, 576, "lm_head"), (3072, 576, "gate_up"), (576, 1536, "down"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# torch {torch.__version__} threads={torch.get_num_threads()} "
          f"capability={torch.backends.cpu.get_cpu_capability()}")
    for n, k, name in SHAPES:
        w = torch.randn(n, k)
        for m in args.rows:
            x = torch.randn(m, k)
            for _ in range(2):
                torch.nn.functional.linear(x, w)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            print(f"cpu_linear shape={name} n={n} k={k} rows={m} ms={s * 1e3:.2f} "
                  f"weight_gb_s={w.numel() * 4 / s / 1e9:.1f} gflops={2 * m * n * k / s / 1e9:.1f}")


if __name__ == "__main__":
    main()
