"""Which EAGLE feature rows differ between two drafters fed the same target hidden states
(CUDA): the feature-store graph against the eager store, and two eager stores.

    PYTHONPATH=$PWD python3 benchmarks/feature_store_sink.py

The test of the graphed store (tests/speculative/test_eagle.py) once compared whole feature
tables and failed on the H200 in row 0 only. This is the diagnosis that ran then (2026-12-03,
as an untracked script at the repository root): after the prefill and after each of 6 verify
stores it prints the rows that differ. Row 0 is the sink slot, written by every padding column
of the prefill: CUDA's ``index_copy_`` keeps any one of duplicate writes, so even two eager
stores differ there (printed ``[0]`` for EAGLE-1 both ways; for EAGLE-3 ``[0]`` graph vs eager and
``[]`` eager vs eager), and nothing else differs.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from structspec.config import CacheConfig, SpecConfig  # noqa: E402
from structspec.models.eagle_head import build_random_eagle_head  # noqa: E402
from structspec.models.loader import load_model  # noqa: E402
from structspec.runner.model_runner import ModelRunner  # noqa: E402
from structspec.speculative.base import DraftRequest  # noqa: E402
from structspec.speculative.eagle import EagleDrafter  # noqa: E402
from tests.speculative.test_eagle import AUX, PAGE, VOCAB  # noqa: E402


def differing_rows(a: EagleDrafter, b: EagleDrafter) -> list[int]:
    torch.cuda.synchronize()
    return (a.features != b.features).any(-1).nonzero().flatten().tolist()


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp / "t", safe_serialization=True)
    dev = torch.device("cuda")
    model, mcfg = load_model(str(tmp / "t"), device=dev, dtype=torch.float32)
    for version in (1, 3):
        for mode in ("graph_vs_eager", "eager_vs_eager"):
            head = build_random_eagle_head(mcfg, tmp / f"h{version}", seed=1, version=version,
                                           draft_vocab_size=40, aux_hidden_layers=AUX)
            target = ModelRunner(model, mcfg, CacheConfig(page_size=PAGE, num_pages=80),
                                 device=dev, dtype=torch.float32)
            spec = SpecConfig(algorithm="eagle", draft_model=str(head), num_draft_tokens=4,
                              depth=2, topk=2)
            graphs = (True, False) if mode == "graph_vs_eager" else (False, False)
            a, b = (EagleDrafter(spec, target=target, device=dev, dtype=torch.float32,
                                 num_pages=80, use_cuda_graph=g) for g in graphs)
            gen = torch.Generator(device=dev).manual_seed(0)
            nsrc = len(a.aux_hidden_layers) or 1
            hidden = [torch.empty(2, 4, mcfg.hidden_size, device=dev) for _ in range(nsrc)]
            rows = torch.empty(2, 4, dtype=torch.int64, device=dev)
            prompts = {"a": 5, "b": 3}
            prefill = [torch.randn(2, 5, mcfg.hidden_size, generator=gen, device=dev)
                       for _ in range(nsrc)]
            for d in (a, b):
                d.on_target_hidden([DraftRequest(r, [1] * n, 0) for r, n in prompts.items()],
                                   prefill[0], None, [5, 3], prefill if nsrc > 1 else ())
            print(f"version={version} mode={mode} after_prefill diff_rows={differing_rows(a, b)}")
            seq = dict(prompts)
            rng = random.Random(0)
            for step in range(6):
                for h in hidden:
                    h.normal_(generator=gen)
                rows.copy_(torch.randint(-1, 4, (2, 4), generator=gen, device=dev))
                reqs = [DraftRequest(r, [1] * seq[r], seq[r]) for r in prompts]
                runs = [rng.randint(1, 4) for _ in reqs]
                for d in (a, b):
                    d.on_target_hidden(reqs, hidden[0], rows, None, hidden if nsrc > 1 else ())
                    d.commit_target_hidden(reqs, runs)
                for r, n in zip(prompts, runs, strict=True):
                    seq[r] += n
                print(f"version={version} mode={mode} step={step} "
                      f"diff_rows={differing_rows(a, b)}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("feature_store_sink.py needs CUDA")
    main()
