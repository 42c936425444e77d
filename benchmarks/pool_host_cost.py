"""The engine thread's own CPU time for a verify step's grammar work with the mask worker pool:
what a JSON-Schema step adds to the step loop on the host. No GPU needed.

On the H200 an EAGLE + JSON step at batch 8-64 is bound by its host on slow hosts
(benchmarks/README.md, thirteenth to fifteenth H200 runs): what decides the gate's ratio is the
grammar's host time in the engine process (plan, pool requests, the send, the predicted
verdicts, the read, settle and upload), not the workers' walks. This drives
:class:`~structspec.scheduler.grammar_service.GrammarService` as the verify step does
(``plan_step``, ``pool_walks``, ``stage_tree``, ``build_mask`` with the mirrors serving the
barrier) with real Req objects, an xgrammar matcher each and a real
:class:`~structspec.grammar.worker_pool.MaskWorkerPool`, on the records workload of
``grammar_overlap.py`` (8-node chains of the true next tokens, the n-gram drafter's tree
there), and times the engine thread with ``time.thread_time`` (CPU time: the wait for the
workers' replies and other processes' load do not count).

One line per batch size::

    pool_host_cost bs=64 workers=1 cpu_us_min=... cpu_us_p50=... per_request_us=... wall_us_p50=...

``cpu_us_*``: the engine thread's CPU time per step over ``--steps`` steps (min and median),
``per_request_us``: the median over the batch size.

    PYTHONPATH=$PWD python benchmarks/pool_host_cost.py --batch 8 64
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_overlap import LONG_SCHEMA  # noqa: E402
from benchmarks.host_step_cost import HostClock  # noqa: E402
from benchmarks.tree_mask_cost import VOCAB, record_outputs, step_trees  # noqa: E402
from structspec.constraints import JsonSchemaConstraint  # noqa: E402
from structspec.core import SamplingParams  # noqa: E402
from structspec.grammar import tree_mask  # noqa: E402
from structspec.grammar.backend import GrammarBackend  # noqa: E402
from structspec.grammar.worker_pool import MaskWorkerPool  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402
from structspec.models.tokenizer import Tokenizer  # noqa: E402
from structspec.scheduler.grammar_service import GrammarService  # noqa: E402
from structspec.scheduler.request import Req, ReqStatus  # noqa: E402
from structspec.scheduler.step_stats import StepTimer  # noqa: E402

#: ``--by-call``: the calls timed one by one (``owner``, attribute, label; calls nest:
#: ``build_mask`` holds ``pool.build``, which holds ``_dispatch``, which holds ``_recv``)
BY_CALL = (
    (GrammarService, "plan_step", "plan_step"),
    (GrammarService, "pool_walks", "pool_walks"),
    (GrammarService, "stage_tree", "stage_tree"),
    (GrammarService, "build_mask", "build_mask"),
    (MaskWorkerPool, "build", "pool.build"),
    (MaskWorkerPool, "_dispatch", "dispatch"),
    (MaskWorkerPool, "_recv", "recv"),
    (tree_mask, "_settle_and_upload", "settle_upload"),
)


@contextlib.contextmanager
def timed_calls(clock: HostClock) -> Iterator[None]:
    """The :data:`BY_CALL` callables timed by ``clock`` while inside; restored on exit."""
    for owner, name, label in BY_CALL:
        clock.wrap(owner, name, label)
    try:
        yield
    finally:
        clock.restore()


def run(batch: int, args: argparse.Namespace, tok: Tokenizer, backend: GrammarBackend,
        compiled: object) -> None:
    """One batch size: warm-up steps, then ``args.steps`` timed steps; prints one line."""
    n = args.num_nodes
    stop_ids = list(tok.eos_token_ids)
    copies = 2 + (40 + (args.steps + args.warmup + 2) * n) // 20
    outputs = record_outputs(tok, batch, copies)
    pool = MaskWorkerPool(backend.tokenizer_info, num_workers=args.workers, vocab_size=VOCAB,
                          max_rows=batch * n, stop_token_ids=stop_ids, spin_ms=args.spin_ms)
    timer = StepTimer(torch.device("cpu"))
    reqs: list[Req] = []
    service = GrammarService(backend, device=torch.device("cpu"), vocab_size=VOCAB,
                             timer=timer, live_requests=lambda: reqs, pool=pool)
    try:
        params = SamplingParams(max_tokens=10**6, ignore_eos=True)
        for b in range(batch):
            req = Req(f"r{b}", [1], params, 0.0, 10**6, frozenset(stop_ids),
                      status=ReqStatus.RUNNING, matcher=backend.create_matcher(compiled))
            req.output_ids.extend(outputs[b][:20])
            reqs.append(req)
            service.prepare(req)
        deadline = time.monotonic() + 120
        while not all(service.pool.ready(r.request_id, compiled) for r in reqs):  # type: ignore[union-attr]
            service.pool.collect_shipped()  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise RuntimeError("grammars not loaded by the workers after 120 s")
            time.sleep(0.01)
        def one_step() -> tuple[float, float]:
            """One verify step's grammar work (thread CPU us, wall us), then its commit."""
            starts = [len(r.output_ids) for r in reqs]
            tree = step_trees(outputs, starts, n, "chain")
            timer.begin(batch, n, batch)
            c0, w0 = time.thread_time(), time.perf_counter()
            plan = service.plan_step(reqs, reqs)
            walks = service.pool_walks(reqs, plan)
            gtree = service.stage_tree(reqs, tree)
            assert gtree is not None and plan.barrier_in_workers
            mask = service.build_mask(reqs, gtree, plan=plan, while_walking=None,
                                      pool_requests=walks)
            c1, w1 = time.thread_time(), time.perf_counter()
            timer.end()
            assert mask is not None and mask.mirror is not None and not mask.mirror.mismatched
            for b, (req, pos) in enumerate(zip(reqs, starts, strict=True)):  # a full chain
                req.output_ids.extend(outputs[b][pos: pos + n])
            return (c1 - c0) * 1e6, (w1 - w0) * 1e6

        for _ in range(args.warmup):
            one_step()
        by_call = HostClock(time.thread_time)  # the engine thread's CPU time per call
        with timed_calls(by_call) if args.by_call else contextlib.nullcontext():
            cpu_us, wall_us = zip(*(one_step() for _ in range(args.steps)), strict=True)
        p50 = statistics.median(cpu_us)
        p10 = statistics.quantiles(cpu_us, n=10)[0]
        print(f"pool_host_cost bs={batch} workers={args.workers} nodes={n} "
              f"cpu_us_min={min(cpu_us):.0f} cpu_us_p10={p10:.0f} cpu_us_p50={p50:.0f} "
              f"per_request_us={p50 / batch:.2f} wall_us_p50={statistics.median(wall_us):.0f}",
              flush=True)
        if args.by_call:  # mean thread CPU per step of each wrapped call (calls nest)
            print(f"pool_host_calls bs={batch} " + " ".join(
                f"{label}_us={by_call.us.get(label, 0.0) / args.steps:.1f}"
                for _, _, label in BY_CALL), flush=True)
    finally:
        service.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--num-nodes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--spin-ms", type=float, default=0.0,
                    help="the workers' spin window (0: they sleep between builds)")
    ap.add_argument("--by-call", action="store_true",
                    help="also a pool_host_calls line: thread CPU per step of each call the "
                         "step makes (the wrappers add ~1 us a call)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer(resolve_model_path(None))
    backend = GrammarBackend(tok.hf, vocab_size=VOCAB, stop_token_ids=list(tok.eos_token_ids))
    compiled = backend.compile(JsonSchemaConstraint(LONG_SCHEMA))
    for batch in args.batch:
        run(batch, args, tok, backend, compiled)


if __name__ == "__main__":
    main()
