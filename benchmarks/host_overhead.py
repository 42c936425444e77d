"""Host overhead per engine step: how the step time grows with the batch when the forward costs
(almost) nothing, per drafter and share of JSON-Schema requests.

A window of exactly ``B`` requests stays in flight, as in ``train-eagle``'s data stage
(:func:`structspec.training.distill.distill`): each finished request is replaced at once, so
the running batch stays at ``B`` and finished requests' replacements are prefilled between the
verify steps, as in a long generation run. ``--grammar-share`` of the requests carry the JSON
extraction schema, the others none; every request ignores EOS and asks for a length drawn
from ``[max_tokens / 16, max_tokens]`` (seeded), so requests finish and enter at a steady
rate. Text is not detokenized (what ``distill`` does); ``--detokenize`` turns it on.

On the CPU (the default) the target is a tiny random Llama (1 layer, hidden 32) over SmolLM2's
tokenizer cut to its first ``--vocab`` ids (the special tokens and the first merges), built in
a temporary folder with ``load_format="dummy"``: its forward, logits and bitmask are ~free, so
what grows with the batch is the engine's host work. ``--device cuda`` runs the real default
model (SmolLM2-135M-Instruct, or ``--model``) on the GPU. EAGLE drafts with a random head
built for the target (``build_random_eagle_head``): it is rarely accepted, the step still
runs the whole propose.

One line per configuration::

    host_overhead algo=none grammar=0.25 bs=256 verify_ms=... step_ms=... prefill_steps=...
        tok/s=... accept_len=...

``verify_ms``: mean wall time of a verify step (the scheduler's StepTimer); ``step_ms``: wall
time per engine step, prefill steps and output collection included; ``tok/s``: committed
tokens per wall second over the timed steps.

    PYTHONPATH=$PWD python benchmarks/host_overhead.py                      # CPU, tiny model
    PYTHONPATH=$PWD python benchmarks/host_overhead.py --device cuda        # H200, SmolLM2
    PYTHONPATH=$PWD python benchmarks/host_overhead.py --algorithms none --batch 256 \\
        --grammar-share 0.25 --profile /tmp/step.prof    # cProfile of the timed steps
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.config import ModelConfig  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402
from structspec.models.eagle_head import build_random_eagle_head  # noqa: E402

#: unconstrained chat prompts (rotated), short and long
CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are the pros and cons of remote work? Give a balanced answer.",
    "Summarise the plot of a heist movie you would like to see, in five paragraphs.",
    "List ten tips for learning a new language and explain each one.",
    "Describe the water cycle, then write a poem about it.",
]

_TOKENIZER_FILES = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                    "special_tokens_map.json")


def build_tiny_model(out: Path, vocab: int) -> Path:
    """A 1-layer, hidden-32 Llama ``config.json`` (weights: ``load_format="dummy"``) with
    SmolLM2's tokenizer cut to ids ``< vocab`` (a BPE keeps the merges whose parts and result
    are all kept, so the cut tokenizer is a valid one over the same bytes)."""
    smol = Path(resolve_model_path(None))
    tok = json.loads((smol / "tokenizer.json").read_text())
    model = tok["model"]
    keep = {t: i for t, i in model["vocab"].items() if i < vocab}
    merges = []
    for m in model["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a in keep and b in keep and a + b in keep:
            merges.append(m)
    model["vocab"], model["merges"] = keep, merges
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < vocab]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    for name in _TOKENIZER_FILES:
        if (smol / name).is_file():
            (out / name).write_bytes((smol / name).read_bytes())
    cfg = json.loads((smol / "config.json").read_text())
    cfg.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, vocab_size=vocab, max_position_embeddings=4096)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def eagle_head_for(model_dir: str, out: Path) -> str:
    """A random EAGLE-1 head for the target in ``model_dir`` (timing only)."""
    cfg = ModelConfig.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    return str(build_random_eagle_head(cfg, str(out), seed=0))


class Workload:
    """The request stream: prompt, grammar and length of request ``i`` (seeded)."""

    def __init__(self, grammar_share: float, max_tokens: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.share = grammar_share
        self.max_tokens = max_tokens
        self.extraction = [p for p, _ in extraction_prompts(64, seed=seed)]
        self.schema = JsonSchemaConstraint(EXTRACTION_SCHEMA)
        self.count = 0

    def next(self) -> tuple[str, SamplingParams]:
        i = self.count
        self.count += 1
        length = self.rng.randint(max(1, self.max_tokens // 16), self.max_tokens)
        if self.rng.random() < self.share:
            return (self.extraction[i % len(self.extraction)],
                    SamplingParams(max_tokens=length, ignore_eos=True, grammar=self.schema))
        return CHAT_PROMPTS[i % len(CHAT_PROMPTS)], SamplingParams(max_tokens=length,
                                                                    ignore_eos=True)


class ModelClock:
    """Wall time spent inside the target's and the drafter's network calls (CPU: they run
    synchronously there, so this is their compute; the host overhead is the rest)."""

    def __init__(self, llm: LLM) -> None:
        self.total_s = 0.0
        eng = llm.engine
        model = eng.runner.model
        self._wrap(model, "forward")
        self._wrap(model, "compute_logits")
        for name in ("head", "model"):  # EAGLE head, draft model
            net = getattr(eng.drafter, name, None)
            if isinstance(net, torch.nn.Module) and net is not model:
                self._wrap(net, "forward")

    def _wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total_s += time.perf_counter() - t0

        setattr(obj, name, timed)


def run_config(llm: LLM, clock: ModelClock | None, algo: str, share: float, bsz: int,
               args: argparse.Namespace) -> str:
    """Fill a window of ``bsz`` requests, warm up, time ``args.steps`` engine steps."""
    eng = llm.engine
    work = Workload(share, args.max_tokens, seed=bsz)
    in_flight: set[str] = set()

    def top_up() -> None:
        while len(in_flight) < bsz:
            prompt, sp = work.next()
            in_flight.add(eng.add_request(prompt, sp))

    def step() -> int:
        top_up()
        tokens = 0
        for out in eng.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)
        return tokens

    top_up()
    deadline = time.monotonic() + 120
    while (len(eng.scheduler.running) < bsz or eng.scheduler.waiting) \
            and time.monotonic() < deadline:
        step()
    if eng.runner.device.type == "cuda":
        eng.runner.warmup_cuda_graphs(eng.drafter.num_nodes, batch_sizes=[bsz])
        eng.drafter.warmup_cuda_graphs(batch_sizes=[bsz])
    for _ in range(args.warmup):
        step()
    eng.step_stats(reset=True)
    prof = cProfile.Profile() if args.profile else None
    tokens = 0
    model_s0 = clock.total_s if clock is not None else 0.0
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tokens += step()
    if eng.runner.device.type == "cuda":
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - t0
    model_s = clock.total_s - model_s0 if clock is not None else 0.0
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    stats = eng.step_stats()
    verify_steps = int(stats["steps"])
    step_ms = wall_s * 1e3 / args.steps
    if clock is not None:  # CPU: the forwards ran inside the step
        host_ms = step_ms - model_s * 1e3 / args.steps
    else:  # CUDA: the host waited for the GPU in the verify steps' wait phase
        host_ms = step_ms - stats.get("cpu_wait_ms", 0.0) * verify_steps / args.steps
    # the window's requests are dropped: the next configuration starts empty
    for rid in list(in_flight):
        eng.abort_request(rid, "benchmark configuration done")
    while eng.has_unfinished_requests():
        eng.step()
    line = (f"host_overhead algo={algo} grammar={share:g} bs={bsz} "
            f"host_ms={host_ms:.2f} step_ms={step_ms:.2f} verify_ms={stats.get('wall_ms', 0.0):.2f} "
            f"prefill_steps={args.steps - verify_steps}/{args.steps} "
            f"tok/s={tokens / wall_s:.0f} "
            f"tok_per_req_step={tokens / max(verify_steps, 1) / bsz:.2f}")
    if args.phases:
        line += " " + " ".join(f"{k[4:-3]}={v:.2f}" for k, v in stats.items()
                               if k.startswith("cpu_"))
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None,
                    help="target model (default: tiny random model on cpu, SmolLM2 on cuda)")
    ap.add_argument("--vocab", type=int, default=1024, help="tiny model's vocabulary (cpu)")
    ap.add_argument("--algorithms", nargs="+", default=["none", "ngram", "eagle"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--grammar-share", type=float, nargs="+", default=[0.0, 0.25])
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=None,
                    help="engine steps before timing (default max_tokens / 16 + 5: the first "
                         "requests start finishing, so prefills interleave as in a long run)")
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--detokenize", action="store_true", help="detokenize outputs")
    ap.add_argument("--phases", action="store_true", help="add the host time per step phase")
    ap.add_argument("--profile", default=None,
                    help="cProfile the timed steps into this file (use with one configuration)")
    ap.add_argument("--top", type=int, default=40, help="rows of the printed profile")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (cpu; 1 keeps the tiny forward off the other core)")
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = args.max_tokens // 16 + 5
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="host_overhead_"))
    if args.model is not None:
        model, load_format = args.model, "auto"
    elif args.device == "cpu":
        model, load_format = str(build_tiny_model(tmp / "tiny", args.vocab)), "dummy"
    else:
        model, load_format = resolve_model_path(None), "auto"
    max_bs = max(args.batch)
    for algo in args.algorithms:
        draft = eagle_head_for(model, tmp / "eagle") if algo == "eagle" else None
        kw: dict[str, Any] = dict(
            speculative_algorithm=algo, draft_model=draft,
            num_draft_tokens=args.num_draft_tokens, max_batch_size=max_bs,
            device=args.device, load_format=load_format,
            kv_capacity_tokens=max_bs * (args.max_tokens + 640 + args.num_draft_tokens))
        if args.device == "cpu":
            kw["dtype"] = "float32"
        llm = LLM(model, **kw)
        llm.engine.detokenize = args.detokenize
        clock = ModelClock(llm) if args.device == "cpu" else None
        try:
            for share in args.grammar_share:
                for bsz in args.batch:
                    print(run_config(llm, clock, algo, share, bsz, args), flush=True)
        finally:
            llm.close()
            del llm
            gc.collect()


if __name__ == "__main__":
    main()
