"""``train-eagle --stage data --data-parallel N``: N engine processes, spread round-robin
over the visible CUDA devices, answer disjoint parts of the prompt set; this parent merges
their shards.

* Rank R (a ``python -m structspec.training.data_worker`` process, its
  ``CUDA_VISIBLE_DEVICES`` set to visible GPU ``R % num_gpus``; all ranks on the CPU with
  ``--device cpu``) answers the prompts whose index is R modulo N, in the interleaved source
  order, and saves its own shards ``OUT/sequences.part-rankR-NNNNN.npz``.
* ``--resume``: every rank reads the shards of every rank (and of one-process runs) and skips
  what they hold, so a run may resume with another N. Without ``--resume`` the parent
  refuses a folder holding shards before starting any rank (the ranks then run as resumes:
  one rank's first shard must not look like an earlier run to a rank still loading).
* N larger than the GPU count puts several engines on one GPU: a small target (SmolLM2-135M)
  leaves the GPU idle while one engine's host loop (scheduling, grammar masks, sampling)
  runs, and N / num_gpus engines per GPU overlap those host loops. Each engine sizes its own
  KV cache (262,144 tokens by default, 6 GiB for SmolLM2), so memory rarely binds.
* The time limit counts from the parent's start for every rank (the monotonic clock is one
  per host). A SIGTERM to the parent is forwarded once to every rank, which stops and saves
  like the one-process run; the ranks run in sessions of their own and stop by themselves
  when the parent is gone.
* Each rank's output lines (progress every ~15 s, its summary, errors) are forwarded to
  stderr prefixed ``[data rank R/N]``; at the end the parent merges every shard into
  ``OUT/sequences.npz`` in prompt order and prints one summary over all ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from structspec.models.default_model import resolve_model_path
from structspec.training.data_result import RESULT_MARK, DataStageResult, summary_line
from structspec.training.data_shards import (
    has_shards,
    read_shards,
    refuse_without_resume,
    write_merged,
)
from structspec.training.train_config import TrainEagleConfig

#: Seconds a rank gets to save and exit after the parent's Ctrl-C before it is killed.
STOP_GRACE_S = 120.0
#: Output lines of each rank kept for the error message of a failed rank.
TAIL_LINES = 20


class DataRankError(RuntimeError):
    """A data rank process failed (crashed, killed); the other ranks' shards are saved."""


@dataclass(frozen=True)
class RankLaunch:
    """How one data rank is started.

    Attributes:
        rank: its rank in ``[0, world)``.
        device: its engine's ``device`` (``cuda``: the one GPU it sees, or ``cpu``).
        env: environment variables set for it on top of the parent's.
        grammar_workers: its engine's grammar mask workers (None: the engine's default).
    """

    rank: int
    device: str
    env: dict[str, str] = field(default_factory=dict)
    grammar_workers: int | None = None


def visible_cuda_devices() -> list[str]:
    """The CUDA devices this process sees, as ``CUDA_VISIBLE_DEVICES`` entries (their
    physical indices or UUIDs); [] without CUDA."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in listed.split(",") if d.strip()][:count]


def plan_ranks(device: str, world: int, *, cuda_devices: list[str],
               cores: int) -> list[RankLaunch]:
    """Where each of ``world`` data ranks runs.

    Args:
        device: the config's ``device``: ``auto`` (CUDA when any device is visible, else the
            CPU), ``cuda`` or ``cpu``.
        cuda_devices: :func:`visible_cuda_devices`.
        cores: CPU cores of the host; each rank's torch threads (``OMP_NUM_THREADS``, unless
            set) and, on CUDA, its grammar mask workers (``min(8, share // 2)``) come out of
            its ``cores // world`` share.

    Returns:
        One launch per rank; on CUDA rank ``r`` sees ``cuda_devices[r % len(cuda_devices)]``
        (more ranks than devices share them).

    Raises:
        ValueError: ``device`` names one CUDA device (``cuda:N``), or ``device="cuda"`` with
            no CUDA device visible.
    """
    share = max(1, cores // world)
    threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(share)}
    if device.startswith("cuda:"):
        raise ValueError(f"device={device!r}: --data-parallel runs one engine per visible "
                         f"CUDA device: use --device cuda (or auto) and choose the devices "
                         f"with CUDA_VISIBLE_DEVICES")
    use_cuda = device == "cuda" or (device == "auto" and bool(cuda_devices))
    if not use_cuda:
        return [RankLaunch(r, "cpu", dict(threads)) for r in range(world)]
    if not cuda_devices:
        raise ValueError(f"device={device!r} with data_parallel={world}: no CUDA device is "
                         f"visible")
    workers = min(8, share // 2) if share >= 4 else 0
    return [RankLaunch(r, "cuda", {**threads,
                                   "CUDA_VISIBLE_DEVICES": cuda_devices[r % len(cuda_devices)]},
                       workers) for r in range(world)]


class _Rank:
    """One running data rank: its process and the thread that forwards its output."""

    def __init__(self, launch: RankLaunch, world: int, config: TrainEagleConfig,
                 start_s: float) -> None:
        self.rank = launch.rank
        self.prefix = f"[data rank {launch.rank}/{world}] "
        self.outcome: dict[str, Any] | None = None
        #: set once the outcome line or the end of the output is read (the engine's own
        #: child processes may hold the pipe open after the rank exits: not waited for)
        self.outcome_read = threading.Event()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        cfg = replace(config, device=launch.device, progress=False, resume=True,
                      data_parallel=1)
        cmd = [sys.executable, "-m", "structspec.training.data_worker",
               "--config", cfg.to_json(), "--rank", str(launch.rank), "--world", str(world),
               "--start-s", repr(start_s), "--parent-pid", str(os.getpid())]
        if launch.grammar_workers is not None:
            cmd += ["--grammar-workers", str(launch.grammar_workers)]
        env = {**os.environ, **launch.env, "PYTHONUNBUFFERED": "1"}
        # the ranks import this very structspec, also when it is not the installed one
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]]
                                                      if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", bufsize=1,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._forward, name=f"data-rank-{self.rank}",
                                       daemon=True)
        self.reader.start()

    def _forward(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                line = line.rstrip("\n")
                if line.startswith(RESULT_MARK):
                    self.outcome = json.loads(line[len(RESULT_MARK):])
                    self.outcome_read.set()
                    continue
                self.tail.append(line)
                print(self.prefix + line, file=sys.stderr, flush=True)
        finally:
            self.outcome_read.set()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the rank if it still runs."""
        if self.proc.poll() is None:
            with _suppress_lookup():
                os.kill(self.proc.pid, signum)

    def error(self, world: int) -> Exception | None:
        """Why the finished rank failed, or None: its own bad-input error (the same type,
        with the rank appended), else a :class:`DataRankError`."""
        rc = self.proc.returncode
        if rc == 0 and self.outcome is not None and "result" in self.outcome:
            return None
        if self.outcome is not None and "error" in self.outcome:
            kind = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError,
                    "MemoryError": MemoryError}.get(self.outcome.get("type", ""), ValueError)
            return kind(f"{self.outcome['error']} (data rank {self.rank} of {world})")
        last = next((ln for ln in reversed(self.tail) if ln.strip()), "no output")
        return DataRankError(f"data rank {self.rank} of {world} failed (exit status {rc}): "
                             f"{last}; the other ranks' shards are saved: run again with "
                             f"--resume to continue")


@contextmanager
def _suppress_lookup() -> Iterator[None]:
    try:
        yield
    except ProcessLookupError:  # it exited between the poll and the kill
        pass


@contextmanager
def _forward_sigterm(ranks: list[_Rank]) -> Iterator[None]:
    """Within: the first SIGTERM is forwarded to every rank (they stop and save); a second
    one terminates the parent as usual (the ranks then stop by themselves). Main thread
    only; elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, previous)
        print("train-eagle data: SIGTERM: asking every data rank to stop and save",
              file=sys.stderr, flush=True)
        for r in ranks:
            r.signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_all(ranks: list[_Rank]) -> None:
    """SIGTERM every rank, wait up to :data:`STOP_GRACE_S` for them to save, kill the rest."""
    for r in ranks:
        r.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.signal(signal.SIGKILL)
            r.proc.wait()


def run_ranks(config: TrainEagleConfig, launches: list[RankLaunch],
              start_s: float) -> list[DataStageResult]:
    """Start one process per launch, forward their output, wait for all of them.

    Returns:
        Each rank's :class:`DataStageResult`, in rank order.

    Raises:
        ValueError / FileNotFoundError / MemoryError: a rank's own bad-input error (the
            lowest failing rank's; the others ran to their end).
        DataRankError: a rank crashed or was killed.
    """
    world = len(launches)
    ranks: list[_Rank] = []
    finished = False
    try:
        with _forward_sigterm(ranks):
            for launch in launches:
                ranks.append(_Rank(launch, world, config, start_s))
            for r in ranks:
                r.proc.wait()
        finished = True
    finally:
        if not finished:  # Ctrl-C or an error here: the ranks save what they have
            _stop_all(ranks)
        for r in ranks:
            r.outcome_read.wait(timeout=10.0)
    for r in ranks:
        err = r.error(world)
        if err is not None:
            raise err
    return [DataStageResult.from_json(r.outcome["result"]) for r in ranks
            if r.outcome is not None]


def merge_results(results: list[DataStageResult], out: Path) -> DataStageResult:
    """Merge every shard of ``out`` into ``out/sequences.npz`` and sum the ranks' results.

    Raises:
        ValueError: no shard holds a sequence.
    """
    saved = read_shards(out)
    stopped = next((r.stopped for r in results if r.stopped), "")
    if not saved.sequences:
        raise ValueError("the data stage produced no sequences" +
                         (f" (stopped: {stopped})" if stopped else ""))
    path = write_merged(out, saved.sequences)
    num_prompts = max(r.num_prompts for r in results)
    num_done = len(saved.done)
    return DataStageResult(
        path=path, num_prompts=num_prompts, num_done=num_done,
        num_sequences=len(saved.sequences), num_skipped=len(saved.skipped),
        new_sequences=sum(r.new_sequences for r in results),
        new_response_tokens=sum(r.new_response_tokens for r in results),
        distill_s=max(r.distill_s for r in results),
        stopped=stopped if num_done < num_prompts else "", ranks=len(results))


def run_data_parallel(config: TrainEagleConfig, out: Path) -> Path:
    """The data stage on ``config.data_parallel`` engine processes (module docstring); prints
    the summary line over all ranks and returns the merged sequences file.

    Raises:
        ValueError: ``out`` holds shards and ``resume`` is off (naming ``resume``); too few
            CUDA devices or a single-device ``device`` (naming it); a rank's bad-input error;
            nothing produced a sequence.
        FileNotFoundError: the model does not exist.
        DataRankError: a rank crashed or was killed.
    """
    start_s = time.monotonic()
    if not config.resume and has_shards(out):
        refuse_without_resume(out, read_shards(out), config.resume)
    # a missing model fails here once, and a GGUF (the default model's too) is converted
    # once, not by N ranks racing for the same cache folder
    resolve_model_path(config.model)
    cuda_devices = [] if config.device == "cpu" else visible_cuda_devices()
    launches = plan_ranks(config.device, config.data_parallel, cuda_devices=cuda_devices,
                          cores=os.cpu_count() or 1)
    results = run_ranks(config, launches, start_s)
    result = merge_results(results, out)
    print(summary_line(result, config), file=sys.stderr, flush=True)
    return result.path
