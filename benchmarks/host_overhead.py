"""Host overhead per engine step: how the step time grows with the batch when the forward costs
(almost) nothing, per drafter and share of JSON-Schema requests.

The submission loop is the one of ``train-eagle``'s data stage
(:func:`structspec.training.distill.distill`): an engine with ``max_batch_size = B`` and a
window of ``4 * B`` requests in flight (``--window-factor``), each finished request replaced at
once, final outputs only, no detokenization (``--detokenize`` turns it on). So the running
batch stays near ``B`` and the replacements' prefills come between the verify steps, as in a
long generation run. ``--grammar-share`` of the requests carry the JSON extraction schema, the
others none; every request ignores EOS and asks for a length drawn from
``[max_tokens / 16, max_tokens]`` (seeded), so requests finish and enter at a steady rate.
The timed steps start once the batch is full and ``--warmup`` more steps have run.

On the CPU (the default) the target is a tiny random Llama (1 layer, hidden 32) over SmolLM2's
tokenizer cut to its first ``--vocab`` ids (the special tokens and the first merges), built in
a temporary folder with ``load_format="dummy"``, so its forward, logits and bitmask cost
little; the time inside the target's and the drafter's network calls is measured and
subtracted from the step loop's CPU time (``host_ms``: CPU time of the engine's thread, which
a shared machine's other processes do not inflate as they do wall time; torch runs on that
one thread, ``--threads``). EAGLE drafts there with a random head built for the target
(``build_random_eagle_head``): it is rarely accepted, but every step runs the whole propose.

``--device cuda`` runs the real default model (SmolLM2-135M-Instruct, or ``--model``) on the
GPU, with every CUDA graph the timed steps need captured first; there ``host_ms`` is the step
time minus the verify steps' wait for the GPU, and EAGLE uses the trained head shipped for
SmolLM2 (a random one with ``--model``).

One line per configuration::

    host_overhead algo=none grammar=0.25 bs=256 host_ms=... step_ms=... verify_ms=...
        prefill_steps=9/30 tok/s=...

``step_ms``: wall time per engine step (verify and prefill steps, output collection);
``host_ms``: the part of it that is not the model's forward (see above); ``verify_ms``: mean
wall time of a verify step (the scheduler's StepTimer); ``prefill_steps``: how many of the
timed steps were prefills; ``tok/s``: committed tokens per wall second. ``--phases`` adds the
host time per verify-step phase.

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
from structspec.scheduler import select_verify as select_verify_module  # noqa: E402

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
    """CPU: this thread's CPU time spent in what a GPU would run as device work (the
    forwards inside the verify and prefill calls, the select/verify and KV compaction after
    them, the drafter's catch-up and tree expansion), so that the rest of the step's CPU time
    is what the host would spend.

    On the CPU these calls run synchronously (torch on one thread, ``--threads``), so their
    CPU time is their compute; on CUDA they are graph replays or kernel launches. The
    host-side input preparation that precedes them (page tables, staging) stays on the host
    side of the split. CPU time, not wall time: on a shared machine the wall time also counts
    the time other processes held the core.
    """

    def __init__(self, llm: LLM) -> None:
        self.total_s = 0.0
        self._inside = False
        eng = llm.engine
        runner = eng.runner
        for obj, name in ((runner, "_verify_eager"), (runner.model, "forward"),
                          (runner, "commit_accepted_kv"), (eng.drafter, "extend_forward"),
                          (eng.drafter, "expand")):
            if hasattr(obj, name):
                self._wrap(obj, name)
        # the post-forward selection: SelectVerifyPhase calls the module's function by name
        self._wrap(select_verify_module, "select_verify")

    def _wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            if self._inside:  # a wrapped call inside another (a forward inside a verify)
                return fn(*a, **kw)
            self._inside = True
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self._inside = False
                self.total_s += time.thread_time() - t0

        setattr(obj, name, timed)


def graph_warmup(llm: LLM, bsz: int, args: argparse.Namespace) -> None:
    """CUDA: capture every graph the timed steps may use (the batch buckets from half the
    batch up, the KV-length buckets up to the longest request), so none is captured while
    timing."""
    eng = llm.engine
    graphs = eng.runner.graphs
    if graphs is None:
        return
    sizes = sorted({b for b in graphs.batch_sizes if bsz // 2 <= b <= bsz} | {bsz})
    kv_lens, length = [], 256
    while length < args.max_tokens + 2048:
        kv_lens.append(length)
        length *= 2
    eng.warmup_cuda_graphs(batch_sizes=sizes, kv_lens=kv_lens)


def live_tokens(llm: LLM) -> int:
    """Output tokens of the requests the engine holds (finished ones leave with their output)."""
    return sum(len(r.output_ids) for r in llm.engine.scheduler.requests.values())


def run_config(llm: LLM, clock: ModelClock | None, algo: str, share: float, bsz: int,
               args: argparse.Namespace) -> str:
    """Keep ``window_factor * bsz`` requests in flight (the engine runs ``bsz``), warm up,
    time ``args.steps`` engine steps."""
    eng = llm.engine
    if hasattr(eng, "report_unfinished"):  # as distill: final outputs only
        eng.report_unfinished = False
    work = Workload(share, args.max_tokens, seed=bsz)
    window = args.window_factor * bsz
    in_flight: set[str] = set()
    finished_tokens = 0

    def step(limit: int = window) -> None:
        nonlocal finished_tokens
        while len(in_flight) < limit:
            prompt, sp = work.next()
            in_flight.add(eng.add_request(prompt, sp))
        for out in eng.step():
            if out.finished:
                in_flight.discard(out.request_id)
                finished_tokens += len(out.token_ids)

    # Fill the batch with the first B requests alone (the constrained ones reach the queue a
    # step later, after their compile: with the whole window queued at once the first batch
    # would hold none of them), then keep the window full.
    deadline = time.monotonic() + 300
    step(bsz)
    while len(eng.scheduler.running) < bsz and time.monotonic() < deadline:
        step(bsz)
    graph_warmup(llm, bsz, args)
    for _ in range(args.warmup):
        step()
    eng.step_stats(reset=True)
    prof = cProfile.Profile() if args.profile else None
    tokens_before = live_tokens(llm) + finished_tokens
    model_s0 = clock.total_s if clock is not None else 0.0
    if prof is not None:
        prof.enable()
    t0, cpu0 = time.perf_counter(), time.thread_time()
    for _ in range(args.steps):
        step()
    if eng.runner.device.type == "cuda":
        torch.cuda.synchronize()
    wall_s, cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    tokens = live_tokens(llm) + finished_tokens - tokens_before
    model_s = clock.total_s - model_s0 if clock is not None else 0.0
    stats = eng.step_stats()
    verify_steps = int(stats["steps"])
    step_ms = wall_s * 1e3 / args.steps
    if clock is not None:  # CPU: this thread's CPU time outside the device work
        host_ms = (cpu_s - model_s) * 1e3 / args.steps
    else:  # CUDA: the host waited for the GPU in the verify steps' wait phase
        host_ms = step_ms - stats.get("cpu_wait_ms", 0.0) * verify_steps / args.steps
    line = (f"host_overhead algo={algo} grammar={share:g} bs={bsz} "
            f"host_ms={host_ms:.2f} step_ms={step_ms:.2f} "
            f"verify_ms={stats.get('wall_ms', 0.0):.2f} "
            f"prefill_steps={args.steps - verify_steps}/{args.steps} "
            f"tok/s={tokens / wall_s:.0f}")
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
    ap.add_argument("--window-factor", type=int, default=4,
                    help="requests in flight per engine batch slot (train-eagle's data stage: 4)")
    ap.add_argument("--detokenize", action="store_true", help="detokenize outputs")
    ap.add_argument("--phases", action="store_true", help="add the host time per step phase")
    ap.add_argument("--profile", default=None,
                    help="cProfile the timed steps into this file (use with one configuration)")
    ap.add_argument("--top", type=int, default=40, help="rows of the printed profile")
    ap.add_argument("--grammar-workers", type=int, default=None,
                    help="mask worker processes (default: the engine's, 0 on the CPU)")
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
    for algo in args.algorithms:
        draft = None
        if algo == "eagle" and (args.model is not None or args.device == "cpu"):
            draft = eagle_head_for(model, tmp / "eagle")  # else the head shipped for SmolLM2
        for bsz in args.batch:
            # one engine per batch size, its max_batch_size = bsz, as train-eagle's data stage
            kw: dict[str, Any] = dict(
                speculative_algorithm=algo, draft_model=draft,
                num_draft_tokens=args.num_draft_tokens, max_batch_size=bsz,
                device=args.device, load_format=load_format,
                grammar_workers=args.grammar_workers,
                kv_capacity_tokens=bsz * (args.max_tokens + 1024 + args.num_draft_tokens))
            if args.device == "cpu":
                kw["dtype"] = "float32"
            llm = LLM(model, **kw)
            llm.engine.detokenize = args.detokenize
            clock = ModelClock(llm) if args.device == "cpu" else None
            try:
                for share in args.grammar_share:
                    print(run_config(llm, clock, algo, share, bsz, args), flush=True)
                    for rid in list(llm.engine.scheduler.requests):  # next share: start empty
                        llm.engine.abort_request(rid, "benchmark configuration done")
                    while llm.engine.has_unfinished_requests():
                        llm.engine.step()
            finally:
                llm.close()
                del llm
                gc.collect()

if __name__ == "__main__":
    main()
