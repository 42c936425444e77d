"""Where a verify step's host time goes: host microseconds per step of the calls the step
makes (wrapped with a timer, no profiler), and what one CUDA-graph launch costs the host.

    PYTHONPATH=$PWD python3 benchmarks/host_step_cost.py --algorithms none eagle --grammar
    PYTHONPATH=$PWD python3 benchmarks/host_step_cost.py --algorithms eagle --grammar \
        --batch 8 32 --profile /tmp/step   # + cProfile of the timed steps, top rows printed

At batch 1 a step is bound by its host (2026-12-03 trace, H200: an EAGLE + JSON step spent
4.9 ms of host against 3.95 ms of GPU busy time; the verify launch alone 1.3-2.0 ms of host
for a single graph replay), so the question is which calls hold it. Prints one ``host_step``
line per configuration with the step's wall time and each wrapped call's host us per step
(calls nest: ``verify`` holds ``stage_graph_inputs`` and ``forward_graph_replay``;
``build_mask`` holds the grammar barrier, the text work run while the mask workers walk and
the pool's round trip), then one ``graph_launch`` line: host us of ``CUDAGraph.replay()`` of
the batch-1 forward graph alone, back to back (the device drained every 16 launches, so the
queue never blocks the host), against a one-kernel graph's.

``--batch`` above 1 asks where the grammar's host work goes at batch 8-64, where an EAGLE +
JSON step can be host-bound on a slow host (benchmarks/README.md, twelfth H200 run): every
request gets the same extraction prompt's long-array schema. ``--profile PREFIX`` adds a
cProfile of each configuration's timed steps (``PREFIX.<algo>.<grammar>.bs<B>.prof``) and
prints its top rows by own time (a profiler slows Python calls ~1.5-2x, so read the rows
as shares, and the wrapped timings of a run without it as the times).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
import types
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_overlap import LONG_SCHEMA, draft_for  # noqa: E402
from benchmarks.workloads import extraction_prompts  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.engine.llm_engine import LLMEngine  # noqa: E402
from structspec.grammar import tree_mask  # noqa: E402
from structspec.runner.cuda_graph import VerifyGraph  # noqa: E402
from structspec.scheduler import deferred_work  # noqa: E402
from structspec.scheduler.deferred_work import PreviousStepWork  # noqa: E402
from structspec.scheduler.pending import PendingStep  # noqa: E402


class HostClock:
    """Host time per label of wrapped callables (``clock`` around each call: wall time by
    default, ``time.thread_time`` for the calling thread's CPU time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.us: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Time ``owner.name`` (an instance, class or module attribute) as ``label``."""
        original = getattr(owner, name)
        on_class = isinstance(owner, (type, types.ModuleType))
        us, calls, clock = self.us, self.calls, self.clock

        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return original(*a, **k)
            finally:
                us[label] += (clock() - t0) * 1e6
                calls[label] += 1

        if on_class:
            raw = owner.__dict__[name]
            setattr(owner, name, timed)
            self._undo.append(lambda: setattr(owner, name, raw))
        else:
            setattr(owner, name, timed)
            self._undo.append(lambda: delattr(owner, name))

    def reset(self) -> None:
        self.us.clear()
        self.calls.clear()

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def wrap_step(clock: HostClock, eng: LLMEngine) -> None:
    """Wrap the calls of a verify step (labels as printed)."""
    verify = eng.scheduler._verify
    runner = eng.runner
    clock.wrap(verify, "_propose", "propose")
    clock.wrap(verify.drafter, "propose", "drafter.propose")
    clock.wrap(verify, "_stage_tree", "stage_tree")
    clock.wrap(runner, "verify", "verify")
    clock.wrap(runner, "_stage_graph_inputs", "stage_graph_inputs")
    clock.wrap(VerifyGraph, "replay", "forward_graph_replay")
    clock.wrap(verify.select, "prepare", "select.prepare")
    grammar = verify.grammar
    clock.wrap(grammar, "stage_tree", "grammar.stage_tree")
    clock.wrap(grammar, "plan_step", "grammar.plan_step")
    clock.wrap(grammar, "build_mask", "build_mask")
    clock.wrap(grammar, "advance_previous", "grammar.barrier")
    clock.wrap(PreviousStepWork, "finish_text", "text_after_mask")
    clock.wrap(deferred_work, "process_text", "process_text")
    if grammar.pool is not None:
        clock.wrap(grammar.pool, "_dispatch", "pool.round_trip")
    clock.wrap(tree_mask, "settle_tree_rows_batch", "settle_rows")
    clock.wrap(verify.select, "launch", "select.launch")
    clock.wrap(runner, "greedy_verify", "greedy_verify")
    clock.wrap(PendingStep, "wait", "wait")
    clock.wrap(verify, "_commit", "commit")
    if verify.feeds_hidden:
        clock.wrap(verify.drafter, "on_target_hidden", "on_target_hidden")


def graph_launch_us(eng: LLMEngine, reps: int = 320) -> tuple[float, float]:
    """Host us per ``replay()`` of the batch-1 forward graph, and of a one-kernel graph."""
    graphs = eng.runner.graphs
    assert graphs is not None
    captured = [g for g in graphs.graphs.values() if g.captured and g.bsz == 1]
    # the full tree's graph (the steps above replayed it), at its smallest KV bucket
    g = min(captured, key=lambda g: (-g.num_nodes, g.pages)) if captured else None

    def per_launch(replay: Callable[[], None]) -> float:
        total = 0.0
        for _ in range(reps // 16):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(16):
                replay()
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
        return total / (reps // 16 * 16) * 1e6

    x = torch.zeros(1, device="cuda")
    tiny = torch.cuda.CUDAGraph()
    with torch.cuda.graph(tiny):
        x.add_(1)
    tiny_us = per_launch(tiny.replay)
    return (per_launch(g.graph.replay) if g is not None else float("nan")), tiny_us


def run_one(algo: str, batch: int, grammar: bool, args: argparse.Namespace) -> None:
    """One configuration: ``host_step`` (wrapped calls, us per step), ``phases`` (the step
    timer's host phases, ms per step), ``gpu_step`` and, at batch 1, ``graph_launch``."""
    llm = LLM(args.model, speculative_algorithm=algo, max_batch_size=batch,
              load_format=args.load_format, draft_model=draft_for(algo, args),
              speculative_adaptive="off")
    eng = llm.engine
    sp = SamplingParams(max_tokens=(args.steps + 40) * 8, ignore_eos=True,
                        grammar=JsonSchemaConstraint(LONG_SCHEMA) if grammar else None)
    prompt, _ = extraction_prompts(1, seed=3)[0]
    for _ in range(batch):
        eng.add_request(prompt, sp)
    while len(eng.scheduler.running) < batch:
        eng.step()
    eng.warmup_cuda_graphs(batch_sizes=[batch])
    for _ in range(20):
        eng.step()
    tag = f"algo={algo} grammar={grammar} bs={batch}"
    clock = HostClock()
    wrap_step(clock, eng)
    eng.step_stats(reset=True)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    wall_us = (time.perf_counter() - t0) * 1e6 / args.steps
    clock.restore()
    stats = eng.step_stats()
    parts = " ".join(f"{k}={v / args.steps:.0f}" for k, v in clock.us.items())
    print(f"host_step {tag} wall_us={wall_us:.0f} {parts}")
    print(f"phases {tag} " + " ".join(f"{k[4:-3]}_ms={v:.3f}" for k, v in stats.items()
                                      if k.startswith("cpu_")))
    # the same steps seen from the GPU (the step timer's CUDA events): where the device
    # is busy and how long it idles between one step's end and the next one's start
    gpu = {k: v for k, v in stats.items() if k.startswith("gpu_")}
    if gpu:
        print(f"gpu_step {tag} " + " ".join(f"{k[4:-3]}_us={v * 1e3:.0f}"
                                              for k, v in gpu.items()))
    if args.profile:
        path = f"{args.profile}.{algo}.{'json' if grammar else 'none'}.bs{batch}.prof"
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            eng.step()
        prof.disable()
        prof.dump_stats(path)
        print(f"# cProfile of {args.steps} more steps ({tag}): {path}; top by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    if eng.runner.device.type == "cuda" and batch == 1:
        fwd_us, tiny_us = graph_launch_us(eng)
        print(f"graph_launch algo={algo} forward_graph_replay_us={fwd_us:.1f} "
              f"one_kernel_graph_replay_us={tiny_us:.1f}")
    llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithms", nargs="+", default=["none", "eagle"])
    ap.add_argument("--grammar", nargs="?", const="on", default="off",
                    choices=["off", "on", "both"],
                    help="every request under the long-array JSON Schema (bare flag: on); "
                         "both: each configuration without, then with it")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="cProfile the configuration's steps (as many again, after the timed "
                         "ones) into PREFIX.<algo>.<json|none>.bs<B>.prof")
    ap.add_argument("--top", type=int, default=35, help="profile rows printed")
    args = ap.parse_args()
    grammars = {"off": [False], "on": [True], "both": [False, True]}[args.grammar]
    for algo in args.algorithms:
        for batch in args.batch:
            for grammar in grammars:
                run_one(algo, batch, grammar, args)


if __name__ == "__main__":
    main()
