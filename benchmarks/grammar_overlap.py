"""Is the grammar hidden? Verify-step time with a JSON-Schema grammar on every request vs none,
with overlap on and off, per batch size (one summary line per configuration).

Step time = wall time per scheduler verify step in steady state (prefills done, CUDA graphs
captured), averaged over ``--steps`` steps; it includes drafting, the verify forward, the
grammar barrier, the tree bitmask build and its application, verification and the D2H copy.
The schema forces long outputs (an array of at least 400 objects), so every request stays
constrained for the whole window.

Equal work on both sides (``--workload records``, the default): each prompt is a chat turn
asking for copies of a record, followed by the start of the answer (``{"items": [`` and three
copies), so the unconstrained model keeps copying records too; prompts it answers otherwise
without a grammar are dropped up front (:func:`record_prompts`). Both runs then commit about the
same tokens per verify step (printed for each), and the host work that grows with them
(drafting over a repetitive history, detokenization) is the same; only the grammar differs.
``--workload extraction`` sends the bare extraction prompt: without a grammar SmolLM2 then
writes prose that the n-gram drafter rarely predicts (1-2 tokens per step against ~7 with the
grammar), so that ratio also charges the grammar for the extra tokens it lets each step commit.

    PYTHONPATH=$PWD python benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64

With the EAGLE head shipped for the default model (issue 18: ratio <= 1.05 at every batch)::

    PYTHONPATH=$PWD python benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64 \
        --algorithms eagle --overlap on --repeats 3 --steps 60 --speculative-adaptive off

``--grammar-backend llguidance`` (or ``auto``) puts every constrained request on that backend.

Other models: ``--model DIR`` (default SmolLM2-135M-Instruct), with ``--load-format dummy`` for
seeded random weights built on the GPU from config.json alone, e.g. the Llama-3-8B shape with
the real Llama-3 tokenizer, drafting with a random Llama-3.2-1B-shaped model::

    PYTHONPATH=$PWD python benchmarks/grammar_overlap.py --device cuda \
        --model benchmarks/assets/llama3-8b-shape --load-format dummy \
        --algorithms none ngram draft_model --draft-model benchmarks/assets/llama3-1b-draft-shape

(random weights: the draft model's proposals are almost never accepted, and outputs are
whatever the grammar allows; the step times are what this measures.)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import extraction_prompts  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.engine.llm_engine import LLMEngine  # noqa: E402
from structspec.scheduler.build_order import PoolBuildOrder  # noqa: E402
from structspec.speculative.registry import drafter_info  # noqa: E402

LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 400, "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                       "age": {"type": "integer"}},
        "required": ["name", "city", "age"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


def record_prompts(llm: LLM, n: int, seed: int = 3, check_tokens: int = 128,
                   pool: int = 4) -> list[list[int]]:
    """``n`` token-id prompts of the ``records`` workload: a chat turn asking for 400 copies of a
    record, then the start of the answer (``{"items": [`` and three copies).

    Only prompts that the model, *without* a grammar, answers by copying the record are kept:
    up to ``pool * n`` candidates are generated greedily for ``check_tokens`` tokens, and a
    candidate is kept when its output (whitespace aside) continues the copies exactly. The
    others would make the two runs do different work, not only the grammar's: SmolLM2 (CPU,
    float32) answers 11 of the first 64 candidates by copying the prompt's format example
    (``Jane Doe``, with other fields) or a misspelt record, and on the H200 the run without a
    grammar committed 6.95 tokens per request per step at batch 32 against 7.84 with it
    before this filter.

    ``check_tokens=0`` skips the filter (random weights, which copy nothing).

    Raises:
        SystemExit: fewer than ``n`` of the candidates copy.
    """
    tok = llm.engine.tokenizer
    prompts, patterns = [], []
    for prose, rec in extraction_prompts(pool * n, seed=seed):
        item = {"name": rec["name"], "city": rec["city"], "age": rec["age"]}
        turn = tok.apply_chat_template([{"role": "user", "content": prose + "\nList 400 copies "
                                         "of the record as JSON."}])
        prompts.append(turn + tok.encode(json.dumps({"items": [item] * 3})[:-2] + ", "))
        patterns.append(re.sub(r"\s", "", json.dumps(item)) + ",")
    if check_tokens == 0:  # random weights (--load-format dummy) copy nothing: no filter
        return prompts[:n]
    kept: list[list[int]] = []
    for start in range(0, len(prompts), n):  # a batch of n at a time, until n are kept
        outs = llm.generate(prompts[start:start + n],
                            SamplingParams(max_tokens=check_tokens, ignore_eos=True))
        for prompt, pattern, out in zip(prompts[start:start + n],
                                        patterns[start:start + n], outs, strict=True):
            text = re.sub(r"\s", "", out.text)
            if (pattern * (len(text) // len(pattern) + 1)).startswith(text):
                kept.append(prompt)
        if len(kept) >= n:
            print(f"# records workload: {len(kept)} of {start + len(outs)} candidate prompts "
                  f"copy without a grammar for {check_tokens} tokens; using the first {n}",
                  flush=True)
            return kept[:n]
    raise SystemExit(f"only {len(kept)} of {len(prompts)} candidate prompts copy the record "
                     f"without a grammar; {n} needed")


def cpu_steal_ticks() -> tuple[int, int] | None:
    """``(steal, total)`` CPU ticks of the whole host since boot (``/proc/stat``'s ``cpu``
    line: user .. steal), or None where there is none. Time a hypervisor ran someone else on
    this guest's CPUs shows as steal; on the lent H200 hosts the step loop's own speed swings
    ~2x from one second to the next (benchmarks/README.md, fifteenth H200 run), so each side
    of a pair reports the steal it saw."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(x) for x in fields[1:9]]
    return ticks[7], sum(ticks)


def step_ms(llm: LLM, prompts: Sequence[str | list[int]], grammar: bool, steps: int,
            max_tokens: int = 4000,
            params: Sequence[SamplingParams] | None = None) -> dict[str, float]:
    """Verify-step timings over ``steps`` steady-state steps.

    ``params`` (one per prompt) replaces the request parameters (``grammar`` and
    ``max_tokens`` are then ignored; ``penalty_cost.py`` passes penalised ones).

    Returns the engine's step summary (``StepTimer.summary``: host phases, GPU busy, idle gap
    and grammar stall, ms per step) plus ``event_ms`` (CUDA-event time of the whole window /
    steps: the step time of issue #4; host wall time on the CPU) and ``tokens_per_req_step``.

    ``max_tokens`` must outlast the warm-up and the window (``(steps + 3) * N`` tokens) yet
    stay small: the scheduler reserves ``prompt + max_tokens`` KV slots per request at
    admission, and a request that does not fit waits, which would stall the warm-up loop.
    """
    engine = llm.engine
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                        grammar=JsonSchemaConstraint(LONG_SCHEMA) if grammar else None)
    ids = [engine.add_request(p, one)
           for p, one in zip(prompts, params or [sp] * len(prompts), strict=True)]
    sched = engine.scheduler
    # until every request runs: a grammar compiles off the step loop (a worker process for
    # xgrammar, a thread for llguidance), and the window must not start before it is in
    deadline = time.perf_counter() + 600
    while len(sched.running) < len(prompts):
        for o in engine.step():
            if o.request_id in ids and o.finished:
                raise RuntimeError(f"request {o.request_id} ended before the window: "
                                   f"{o.finish_reason} {o.error}")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{len(sched.running)} of {len(prompts)} requests running "
                               "after 600 s")
    # Capture every graph of this batch size now (each KV-length bucket, each tree size the
    # adaptive sizer may pick, the drafter's propose graphs, the penalised post graphs): the
    # window's sequences grow by ~N tokens per step, and a lazy capture inside it (an eager
    # warm-up forward plus the capture) would count as a step.
    engine.warmup_cuda_graphs(batch_sizes=[len(prompts)])
    for _ in range(3):  # warm-up steps (Triton kernels outside the graphs compile here)
        engine.step()
    cuda = torch.cuda.is_available() and engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    engine.step_stats(reset=True)
    before = sum(r.spec.committed_tokens for r in sched.running)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    steal0 = cpu_steal_ticks()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    steal1 = cpu_steal_ticks()
    if cuda:
        end.record()
        end.synchronize()
        window_ms = start.elapsed_time(end)
    else:
        window_ms = (time.perf_counter() - t0) * 1e3
    out = engine.step_stats()
    tokens = sum(r.spec.committed_tokens for r in sched.running) - before
    if out.get("steps", 0) != steps or len(sched.running) != len(prompts):
        raise RuntimeError(f"window not steady: {out.get('steps')} verify steps of {steps}, "
                           f"{len(sched.running)} of {len(prompts)} requests running")
    for r in list(sched.requests):
        engine.abort_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    out["event_ms"] = window_ms / steps
    if steal0 is not None and steal1 is not None and steal1[1] > steal0[1]:
        out["steal_pct"] = 100.0 * (steal1[0] - steal0[0]) / (steal1[1] - steal0[1])
    out["tokens_per_req_step"] = tokens / steps / max(len(prompts), 1)
    return out


def draft_for(algo: str, args: argparse.Namespace) -> str | None:
    """The draft of ``algo``: ``--draft-model`` for the drafters that read one; else for an
    EAGLE head (``eagle``) None, which the engine resolves to the head shipped for the default
    model (another ``--model`` needs ``--draft-model``), and for ``draft_model`` the target
    itself (SmolLM2 has no smaller sibling offline)."""
    info = drafter_info(algo)
    if not info.needs_draft_model:
        return None
    if args.draft_model or info.eagle_head:
        return args.draft_model
    from structspec.models.default_model import resolve_model_path

    return resolve_model_path(args.model)


#: ``--walks-order`` (here and in ``distinct_schemas.py``)
WALKS_ORDER_HELP = ("the mask-worker build sent before the verify launch, after it, or chosen "
                    "per step from the measured times (auto, the engine's default; a device "
                    "tree goes first only with 'before', and only while the mirrors serve "
                    "the barrier)")


def set_build_order(engine: LLMEngine, mode: str) -> None:
    """Fix when the mask-worker build is sent (``before`` / ``after`` the verify launch) or
    leave it to the engine (``auto``): :mod:`structspec.scheduler.build_order`."""
    verify = engine.scheduler._verify
    verify.build_order = PoolBuildOrder(mode,  # type: ignore[arg-type]
                                        forward_on_host=engine.runner.device.type != "cuda")


def breakdown(tag: str, s: dict[str, float]) -> str:
    """``tag.key=value`` pairs of the step summary that explain a step time (ms)."""
    keys = ("gpu_forward_ms", "gpu_busy_ms", "gpu_idle_before_ms", "gpu_grammar_stall_ms",
            "cpu_draft_ms", "cpu_launch_ms", "cpu_barrier_ms", "cpu_mask_ms", "cpu_text_ms",
            "cpu_wait_ms", "cpu_commit_ms", "pool_workers", "pool_send_ms", "pool_worker_max_ms",
            "pool_first_start_ms", "pool_last_reply_ms", "pool_read_ms", "pool_sent_first",
            "steal_pct")
    return " ".join(f"{tag}.{k.removesuffix('_ms')}={s[k]:.3f}" for k in keys if k in s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--algorithms", nargs="+", default=["ngram"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=1,
                    help="(none, JSON) pairs per batch size, alternating; the pair with the "
                         "median ratio is printed, with the smallest and largest ratio")
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--model", default=None,
                    help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="auto: read the weights; dummy: seeded random weights from "
                         "config.json (target and --draft-model)")
    ap.add_argument("--draft-model", default=None,
                    help="draft model directory (algorithm draft_model) or EAGLE head (eagle)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"],
                    help="forward kernels (auto: Triton on CUDA when available)")
    ap.add_argument("--kv-capacity-tokens", type=int, default=None,
                    help="KV cache size in tokens (default: the engine's)")
    ap.add_argument("--seed", type=int, default=0, help="engine seed (dummy weights too)")
    ap.add_argument("--overlap", nargs="+", default=["on", "off"], choices=["on", "off"],
                    help="scheduler overlap settings to run (default: both)")
    ap.add_argument("--grammar-workers", type=int, default=None,
                    help="worker processes for the tree bitmasks (0: in the engine process; "
                         "default: the engine's, min(8, cores // 2) on CUDA, 0 on CPU)")
    ap.add_argument("--grammar-backend", default="xgrammar",
                    choices=["xgrammar", "llguidance", "auto"],
                    help="grammar engine of every constrained request")
    ap.add_argument("--workload", default="records", choices=["records", "extraction"],
                    help="records: prompts the model keeps answering with copied JSON records "
                         "with or without the grammar (equal work); extraction: the bare "
                         "extraction prompts (prose without the grammar)")
    ap.add_argument("--speculative-adaptive", default="auto", choices=["auto", "on", "off"],
                    help="tree sizing (off: every step verifies the drafter's full tree, "
                         "as the EAGLE overlap measurement of issue 18 needs)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="per request (default: (steps + 8) * num_draft_tokens + 64, enough to "
                         "stay alive through the window; KV is reserved for all of it)")
    ap.add_argument("--walks-order", nargs="+", default=["auto"],
                    choices=["auto", "before", "after"],
                    help=WALKS_ORDER_HELP + "; several: each batch size runs each, on one "
                         "engine (an A/B on one host)")
    ap.add_argument("--text-while-drafting", nargs="+", default=["on"], choices=["on", "off"],
                    help="a device tree's text work while the tree is on its way (on, the "
                         "engine's) or after it arrived; several as --walks-order")
    args = ap.parse_args()
    max_tokens = args.max_tokens or (args.steps + 8) * args.num_draft_tokens + 64
    model_name = Path(args.model).name if args.model else "smollm2-135m"
    for algo in args.algorithms:
        for overlap in [o == "on" for o in args.overlap]:
            llm = LLM(args.model, device=args.device, speculative_algorithm=algo,
                      overlap=overlap, num_draft_tokens=args.num_draft_tokens,
                      max_batch_size=max(args.batch), load_format=args.load_format,
                      kernels=args.kernels, seed=args.seed,
                      kv_capacity_tokens=args.kv_capacity_tokens,
                      draft_model=draft_for(algo, args), grammar_workers=args.grammar_workers,
                      grammar_backend=args.grammar_backend,
                      speculative_adaptive=args.speculative_adaptive)
            kernels = llm.engine.config.kernels
            prompts_all: Sequence[str | list[int]] = (
                record_prompts(llm, max(args.batch),
                               check_tokens=0 if args.load_format == "dummy" else 128)
                if args.workload == "records"
                else [p for p, _ in extraction_prompts(max(args.batch), seed=3)])
            for bs, walks_order, text_early in itertools.product(
                    args.batch, args.walks_order, args.text_while_drafting):
                set_build_order(llm.engine, walks_order)
                llm.engine.scheduler._verify.text_while_drafting = text_early == "on"
                # Pairs alternate (none, JSON, none, JSON, ...) so that a drift in the host's
                # speed hits both sides; the pair with the median ratio is reported.
                pairs = []
                for _ in range(args.repeats):
                    plain = step_ms(llm, prompts_all[:bs], False, args.steps, max_tokens)
                    gram = step_ms(llm, prompts_all[:bs], True, args.steps, max_tokens)
                    pairs.append((gram["event_ms"] / plain["event_ms"], plain, gram))
                # the median of each side's step times, over all its runs: steadier than any
                # one pair when the host's speed drifts
                med_plain = statistics.median(p[1]["event_ms"] for p in pairs)
                med_gram = statistics.median(p[2]["event_ms"] for p in pairs)
                # each pair in run order: ratio, and the steal each side saw (%)
                in_order = ",".join(
                    f"{r:.3f}" + (f"/{pl['steal_pct']:.1f}/{gr['steal_pct']:.1f}"
                                  if "steal_pct" in pl and "steal_pct" in gr else "")
                    for r, pl, gr in pairs)
                pairs.sort(key=lambda p: p[0])
                _, plain, gram = pairs[len(pairs) // 2]
                spread = (f"ratio_min={pairs[0][0]:.3f} ratio_max={pairs[-1][0]:.3f} "
                          f"ratio_median={statistics.median(p[0] for p in pairs):.3f} "
                          f"ratio_of_medians={med_gram / med_plain:.3f} "
                          f"repeats={len(pairs)} pairs={in_order} " if len(pairs) > 1 else "")
                print(f"grammar_overlap model={model_name} kernels={kernels} algo={algo} "
                      f"workers={llm.engine.config.grammar.mask_build_workers} "
                      f"grammar_backend={args.grammar_backend} walks={walks_order} "
                      f"text_while_drafting={text_early} "
                      f"overlap={'on' if overlap else 'off'} "
                      f"bs={bs:<3} N={llm.engine.drafter.num_nodes} "
                      f"step_ms_no_grammar={plain['event_ms']:.3f} "
                      f"step_ms_json_schema={gram['event_ms']:.3f} "
                      f"ratio={gram['event_ms'] / plain['event_ms']:.3f} " + spread +
                      f"workload={args.workload} "
                      f"tokens_per_req_step_no_grammar={plain['tokens_per_req_step']:.2f} "
                      f"tokens_per_req_step_json_schema={gram['tokens_per_req_step']:.2f} "
                      + breakdown("plain", plain) + " " + breakdown("json", gram), flush=True)
            llm.close()
            del llm
            gc.collect()  # free this engine's weights and KV before the next one is built
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
