"""Host cost of the primitives a grammar-constrained verify step is made of, in isolation: the
device tree's staging for the host (``GrammarTree.from_device`` and its parts), and the mask
worker pool's round trip (one message to each of ``--workers`` processes, a reply from each).

    PYTHONPATH=$PWD python3 benchmarks/host_primitives.py              # CUDA host
    PYTHONPATH=$PWD python3 benchmarks/host_primitives.py --skip-cuda  # the round trip alone

Why (benchmarks/README.md, thirteenth H200 run): at batch 8 an EAGLE + JSON step spent ~235 us
of host in the tree staging and ~1.3 ms in the pool's round trip while its workers were busy
~0.18 ms; which primitive holds that time decides what to change.

One line per primitive: ``host_primitive name=... us=<median> p90=<p90>``; ``conn_poll_one``
and ``poll_all``: asking whether the workers' replies are in, one socket through
``Connection.poll`` against all of them through one ``poll(2)``. The round trip is
measured the way a step makes it: the parent sends each worker a job, does ``--host-work-us``
of its own work (the barrier and text work the step runs meanwhile), then reads every reply;
between rounds it idles ``--gap-us`` (the rest of the step), so the workers go back to waiting
as they do between steps. ``excess_us``: the round trip minus the parent's send, its own work
and the slowest worker's busy time, i.e. what waking the processes and passing the messages
cost. Worker modes: ``block`` (a blocking ``recv``, as the pool's workers wait) and ``spin``
(``poll()`` in a loop for up to ``--spin-us`` after each reply, then a blocking ``recv``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _worker(conn: Connection, spin_us: float, work_us: float) -> None:
    """Reply to each job after ``work_us`` of work; between jobs wait as the mode says."""
    while True:
        if spin_us > 0:
            end = time.perf_counter() + spin_us * 1e-6
            while not conn.poll() and time.perf_counter() < end:
                pass
        msg = conn.recv()
        if msg is None:
            return
        t0 = time.perf_counter()
        _busy(work_us)
        conn.send((msg, time.perf_counter() - t0))


def round_trip(workers: int, spin_us: float, work_us: float, host_work_us: float,
               gap_us: float, rounds: int, parent_poll: bool) -> dict[str, float]:
    """Median / p90 round trip (us) and its excess over the work done (module doc)."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(workers)]
    procs = [ctx.Process(target=_worker, args=(child, spin_us, work_us), daemon=True)
             for _, child in pipes]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    totals, excess = [], []
    job = [(b, f"req-{b}", 1, [11, 12, 13, 14]) for b in range(2)]
    for r in range(rounds + 20):
        t0 = time.perf_counter()
        for c in conns:
            c.send((job, [], [], 8, 8, True, 0.05))
        t_sent = time.perf_counter()
        _busy(host_work_us)
        busy = []
        for c in conns:
            if parent_poll:
                while not c.poll():
                    pass
            busy.append(c.recv()[1])
        total = (time.perf_counter() - t0) * 1e6
        if r >= 20:
            totals.append(total)
            excess.append(total - (t_sent - t0) * 1e6 - host_work_us - max(busy) * 1e6)
        _busy(gap_us)
    for c in conns:
        c.send(None)
    for p in procs:
        p.join(5)
    q = statistics.quantiles(totals, n=10)
    return {"us": statistics.median(totals), "p90": q[-1],
            "excess_us": statistics.median(excess)}


def time_us(fn: Callable[[], object], reps: int, sync_every: int = 32) -> tuple[float, float]:
    """Median and p90 host us of ``fn``, the device drained every ``sync_every`` calls."""
    import torch

    samples = []
    for i in range(reps):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples), statistics.quantiles(samples, n=10)[-1]


def reply_poll_primitives(workers: int, reps: int) -> None:
    """What asking "are the replies in?" costs with no reply there: one ``Connection.poll``
    (a selector built per call: what ``MaskWorkerPool.walks_ready`` called per worker before
    2026-12-04) against one ``poll(2)`` over every worker socket (what it calls now)."""
    import select

    pairs = [mp.Pipe() for _ in range(workers)]
    ours = [a for a, _ in pairs]
    poller = select.poll()
    for conn in ours:
        poller.register(conn.fileno(), select.POLLIN)
    for name, fn in (("conn_poll_one", ours[0].poll), ("poll_all", lambda: poller.poll(0))):
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        print(f"host_primitive name={name} sockets={1 if name == 'conn_poll_one' else workers} "
              f"us={statistics.median(samples):.2f} "
              f"p90={statistics.quantiles(samples, n=10)[-1]:.2f}", flush=True)
    for a, b in pairs:
        a.close()
        b.close()


def staging_primitives(batch: int, nodes: int, reps: int) -> None:
    """One line per part of a device tree's staging for the host at ``[batch, nodes]``."""
    import torch

    from structspec.grammar.tree_mask import GrammarTree

    dev = torch.device("cuda")
    nt, ns, dt, par = (torch.randint(-1, nodes, (batch, nodes), device=dev) for _ in range(4))
    nt32 = nt.to(torch.int32)
    stream = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    pinned = torch.empty((4, batch, nodes), dtype=torch.int64, pin_memory=True)
    stacked = torch.stack([nt, ns, dt, par])
    cases: dict[str, Callable[[], object]] = {
        "from_device": lambda: GrammarTree.from_device(nt, ns, dt, par),
        "current_stream": torch.cuda.current_stream,
        "event_new": torch.cuda.Event,
        "event_record": lambda: ev.record(stream),
        "record_stream": lambda: nt.record_stream(stream),
        "stack4": lambda: torch.stack([nt, ns, dt, par]),
        "to_int64": lambda: nt32.to(torch.int64),
        "empty_pinned": lambda: torch.empty((4, batch, nodes), dtype=torch.int64,
                                            pin_memory=True),
        "copy_d2h_nonblocking": lambda: pinned.copy_(stacked, non_blocking=True),
        "unbind4": lambda: pinned.unbind(0),
    }
    for name, fn in cases.items():
        med, p90 = time_us(fn, reps)
        print(f"host_primitive name={name} bs={batch} N={nodes} us={med:.1f} p90={p90:.1f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--skip-cuda", action="store_true")
    ap.add_argument("--workers", type=int, nargs="+", default=[8])
    ap.add_argument("--worker-work-us", type=float, default=30.0)
    ap.add_argument("--host-work-us", type=float, default=250.0)
    ap.add_argument("--gap-us", type=float, default=2000.0)
    ap.add_argument("--spin-us", type=float, default=5000.0)
    ap.add_argument("--rounds", type=int, default=500)
    args = ap.parse_args()
    if not args.skip_cuda:
        for b in args.batch:
            staging_primitives(b, args.nodes, args.reps)
    for w in args.workers:
        reply_poll_primitives(w, args.reps)
    for w in args.workers:
        for mode, spin in (("block", 0.0), ("spin", args.spin_us)):
            for parent_poll in (False, True):
                r = round_trip(w, spin, args.worker_work_us, args.host_work_us, args.gap_us,
                               args.rounds, parent_poll)
                print(f"host_primitive name=pool_round_trip workers={w} worker_wait={mode} "
                      f"parent_wait={'poll' if parent_poll else 'block'} "
                      f"us={r['us']:.1f} p90={r['p90']:.1f} excess_us={r['excess_us']:.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
