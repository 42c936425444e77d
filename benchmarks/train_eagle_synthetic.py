"""Write a synthetic sequences file for ``train-eagle`` throughput sizing: random token ids
with ShareGPT-like prompt / response lengths (no model or data needed).

    python benchmarks/train_eagle_synthetic.py OUT.jsonl --num 4000 --vocab 49152
"""

from __future__ import annotations

import argparse
import random

from structspec.training.sequences import TrainSequence, save_sequences


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--num", type=int, default=4000, help="sequences")
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(40, 600), help="min max")
    p.add_argument("--response-len", type=int, nargs=2, default=(60, 512), help="min max")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    seqs = []
    for _ in range(a.num):
        n_p = rng.randint(*a.prompt_len)
        n_r = rng.randint(*a.response_len)
        seqs.append(TrainSequence(tuple(rng.randrange(3, a.vocab) for _ in range(n_p + n_r)),
                                  n_p, "synthetic"))
    save_sequences(a.out, seqs)
    print(f"{a.num} synthetic sequences -> {a.out}")


if __name__ == "__main__":
    main()
