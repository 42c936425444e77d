"""Does a spinning mask worker slow the engine's step loop? The engine's host Python work timed
alone and beside worker processes that spin, sleep or are pinned away from it.

    PYTHONPATH=$PWD python3 benchmarks/spin_contention.py --workers 8 --reps 300

The mask workers poll their socket between steps (``mask_worker._spin_for_message``, the
pool's spin window, 20 ms by default on hosts with a core per worker and two to spare), so at
batch 32-64 eight processes keep eight CPUs busy beside the engine's thread. On a virtualised
host those CPUs may share physical cores, caches or a power budget with the engine's, and
the step loop, bound by its Python at batch 32-64, would then run slower with the grammar on
even in phases that do no grammar work (the fourteenth H200 run's ``cpu_draft``: +9-12% at
batch 32-64 with a JSON Schema). This script measures it directly: a fixed Python workload
(per-request dict, list and small-tensor bookkeeping, the shape of a step's host work at
batch 64) timed in this process under each configuration:

- ``alone``: no other process;
- ``spin``: ``--workers`` processes running the workers' spin loop on sockets that never
  receive (so they spin for the whole run, as between the steps of a busy engine);
- ``spin_pinned``: the same, this process pinned to one CPU and the spinners to others (with
  their SMT siblings excluded where the topology is readable);
- ``sleep``: the same processes blocked in ``recv`` (the pool's spin window 0).

Prints the topology, then one ``spin_contention`` line per configuration: the workload's
median and p90 host ms and the median's ratio to ``alone``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from structspec.grammar.mask_worker import _spin_for_message  # noqa: E402


def _siblings(cpu: int) -> set[int]:
    """The CPUs sharing ``cpu``'s physical core (itself only when the topology is unreadable)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        out: set[int] = set()
        for part in path.read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return out
    except OSError:
        return {cpu}


def _spinner(conn: Connection, mode: str, cpus: list[int] | None) -> None:
    """A stand-in mask worker: spin on ``conn`` (window 1 s, renewed) or block in ``recv``
    until the parent closes it."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        if mode == "sleep":
            conn.recv()
            return
        while True:
            _spin_for_message(conn, 1.0)
            if conn.poll():
                conn.recv()
                return
    except (EOFError, OSError):
        return


def _workload(n_requests: int) -> None:
    """Step-shaped host work: per request, dict lookups, list slices and appends, a tuple
    per job; a few small tensor ops per step."""
    state = {i: list(range(200 + i)) for i in range(n_requests)}
    synced: dict[int, int] = {}
    jobs: list[list[tuple]] = [[] for _ in range(8)]
    for _ in range(24):
        for key, ids in state.items():
            done = synced.get(key, 0)
            new_ids = ids[done: done + 5]
            synced[key] = done + len(new_ids)
            jobs[key % 8].append((key, done, tuple(new_ids)))
            if any(t == -1 for t in new_ids):
                break
        t = torch.zeros(n_requests, 9, dtype=torch.int64)
        t[:, 0] = 1
        t.sum().item()
        for job in jobs:
            job.clear()


def _time_workload(reps: int, n_requests: int) -> list[float]:
    for _ in range(20):  # warm-up
        _workload(n_requests)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _workload(n_requests)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--requests", type=int, default=64, help="requests in the workload")
    ap.add_argument("--per-cpu", type=int, default=0, metavar="PASSES",
                    help="instead: the workload alone, pinned to each CPU in turn, PASSES times")
    ap.add_argument("--sibling-scan", action="store_true",
                    help="instead: this process on one CPU against one spinner on each other")
    ap.add_argument("--configs", nargs="+", default=["alone", "spin", "spin_pinned", "sleep",
                                                     "alone"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    main_cpu = cpus[0]
    others = [c for c in cpus if c not in _siblings(main_cpu)]
    print(f"topology cpus={len(cpus)} main_cpu_siblings={sorted(_siblings(main_cpu))} "
          f"threads_per_core={len(_siblings(main_cpu))} cpus_for_pinned_workers={len(others)}")
    if args.per_cpu:
        for p in range(args.per_cpu):
            row = []
            for cpu in cpus:
                os.sched_setaffinity(0, [cpu])
                row.append(statistics.median(_time_workload(args.reps, args.requests)))
            os.sched_setaffinity(0, cpus)
            print(f"per_cpu pass={p} " + " ".join(f"cpu{c}={t:.3f}" for c, t in zip(cpus, row, strict=True))
                  + f" fastest={min(row):.3f} slowest={max(row):.3f}")
        return
    ctx = mp.get_context("spawn")
    if args.sibling_scan:
        # this process on its first CPU, one spinner on each other CPU in turn, each run
        # between two runs alone: a CPU whose spinner halves this process's speed every time
        # shares its physical core (hidden from the guest's topology)
        os.sched_setaffinity(0, [main_cpu])
        for cpu in others:
            alone = statistics.median(_time_workload(args.reps, args.requests))
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_spinner, args=(child, "spin", [cpu]), daemon=True)
            p.start()
            time.sleep(0.3)
            busy = statistics.median(_time_workload(args.reps, args.requests))
            parent.send(None)
            parent.close()
            p.join(timeout=5)
            after = statistics.median(_time_workload(args.reps, args.requests))
            print(f"sibling_scan main_cpu={main_cpu} spinner_cpu={cpu} alone_ms={alone:.3f} "
                  f"with_spinner_ms={busy:.3f} alone_after_ms={after:.3f}")
        return
    base = None
    for config in args.configs:
        procs, conns = [], []
        if config != "alone":
            mode = "sleep" if config == "sleep" else "spin"
            for i in range(args.workers):
                pin = [others[i % len(others)]] if config == "spin_pinned" and others else None
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_spinner, args=(child, mode, pin), daemon=True)
                p.start()
                procs.append(p)
                conns.append(parent)
            time.sleep(1.0)  # the spinners started and are spinning
        os.sched_setaffinity(0, [main_cpu] if config == "spin_pinned" else cpus)
        times = _time_workload(args.reps, args.requests)
        os.sched_setaffinity(0, cpus)
        for conn in conns:
            conn.send(None)
            conn.close()
        for p in procs:
            p.join(timeout=5)
        med = statistics.median(times)
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        if base is None:
            base = med
        print(f"spin_contention config={config} workers={len(procs)} requests={args.requests} "
              f"median_ms={med:.3f} p90_ms={p90:.3f} ratio_to_alone={med / base:.3f}")


if __name__ == "__main__":
    main()
