"""The ``data`` stage of ``train-eagle``: the target answers the prompt set; the sequences are
saved in shards as they come and merged into ``out/sequences.npz`` at the end.

Nothing done is lost: shards (:mod:`structspec.training.data_shards`) are written every 256
finished prompts or ~30 s; ``data_time_limit_s`` and a SIGTERM (what ``timeout`` sends) stop
the run cleanly (no new prompt, the requests in flight aborted, shards and the merged file
written); ``resume`` skips the prompts the shards hold. The prompts go in
:func:`~structspec.training.prompts.interleaved_order`, so a run cut short holds a share of
every source.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structspec.llm import LLM
from structspec.training.data_shards import (
    SHARD_EVERY_PROMPTS,
    SHARD_PATTERN,
    ShardWriter,
    check_same_options,
    data_options,
    read_shards,
)
from structspec.training.distill import distill
from structspec.training.prompts import TrainPrompt, build_prompt_set, interleaved_order
from structspec.training.sequences import save_sequences
from structspec.training.train_config import SEQUENCES_FILE, TrainEagleConfig


@dataclass(frozen=True)
class DataStageResult:
    """What :func:`generate_data` did.

    Attributes:
        path: the merged sequences file (every saved sequence, in prompt order).
        num_prompts: prompts in the prompt set.
        num_done: prompts finished so far, this run and earlier ones (sequences + skipped).
        num_sequences: sequences in ``path``.
        num_skipped: prompts that finished without a sequence.
        new_sequences / new_response_tokens: made by this run.
        distill_s: seconds this run spent generating.
        stopped: why the run stopped before every prompt was done (``time limit``,
            ``SIGTERM``), or "" when it is complete.
    """

    path: Path
    num_prompts: int
    num_done: int
    num_sequences: int
    num_skipped: int
    new_sequences: int
    new_response_tokens: int
    distill_s: float
    stopped: str


@contextlib.contextmanager
def _sigterm_requests_stop() -> Iterator[list[str]]:
    """Within: the first SIGTERM only sets a flag (the yielded list gets ``"SIGTERM"``), so the
    run saves and exits cleanly; a second one terminates as usual. Main thread only (signal
    handlers cannot be set elsewhere); elsewhere the flag is never set."""
    flag: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        flag.append("SIGTERM")
        signal.signal(signal.SIGTERM, previous)
        print("train-eagle data: SIGTERM: adding no more prompts, saving what is done",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)


def generate_data(llm: LLM, prompts: Sequence[TrainPrompt], config: TrainEagleConfig,
                  out: Path, *, start_s: float, clock: Callable[[], float] = time.monotonic,
                  shard_every: int = SHARD_EVERY_PROMPTS) -> DataStageResult:
    """Distill ``prompts`` on ``llm`` into shards under ``out`` and merge them into
    ``out/sequences.npz``.

    Args:
        llm: the target's engine.
        prompts: the run's deterministic prompt set (a prompt is known by its index).
        config: its data options (``max_tokens``, ``temperature``, ``gen_batch_size``,
            ``data_time_limit_s``, ``resume``, ``progress``; the others go into the shards'
            fingerprint).
        out: the output folder (exists).
        start_s: ``clock()`` at the stage's start; ``data_time_limit_s`` counts from it.
        clock: monotonic seconds (injectable for tests).
        shard_every: finished prompts per shard.

    Raises:
        ValueError: ``out`` holds shards and ``resume`` is off (naming ``resume``); shards
            of other data options (naming the option); nothing produced a sequence.
    """
    options = data_options(config, prompts)
    saved = read_shards(out)
    where = str(Path(out) / SHARD_PATTERN)
    if saved.num_shards and not config.resume:
        raise ValueError(f"resume: {where} holds {len(saved.done)} finished prompts of an "
                         f"earlier data stage: pass --resume to continue it, or remove those "
                         f"files (or use another --out)")
    if saved.options is not None:
        check_same_options(saved.options, options, where)
        print(f"train-eagle data: resuming: {len(saved.done)} of {len(prompts)} prompts done "
              f"in {saved.num_shards} shards", file=sys.stderr, flush=True)
    done = saved.done
    order = [i for i in interleaved_order(prompts) if i not in done]
    writer = ShardWriter(out, options, saved.next_number, every=shard_every, clock=clock)
    limit_s = config.data_time_limit_s
    stopped = ""
    t0 = clock()
    with _sigterm_requests_stop() as term:
        def should_stop() -> bool:
            nonlocal stopped
            if term:
                stopped = term[0]
            elif limit_s > 0 and clock() - start_s >= limit_s:
                stopped = "time limit"
            return bool(stopped)

        try:
            if order:
                # A window of several engine batches in flight: admission always finds
                # waiting requests, so every step stays full until the last prompts.
                distill(llm, prompts, max_tokens=config.max_tokens,
                        batch_size=4 * config.gen_batch_size, temperature=config.temperature,
                        progress=config.progress, order=order, on_result=writer.add,
                        should_stop=should_stop, clock=clock)
        finally:
            writer.flush()  # an error or Ctrl-C still keeps what finished
        distill_s = clock() - t0
        seqs = {**saved.sequences, **writer.sequences}
        skipped = (saved.skipped | writer.skipped) - set(seqs)
        if not seqs:
            raise ValueError("the data stage produced no sequences" +
                             (f" (stopped: {stopped})" if stopped else ""))
        path = Path(out) / SEQUENCES_FILE
        save_sequences(path, [seqs[i] for i in sorted(seqs)])
    num_done = len(seqs) + len(skipped)
    return DataStageResult(
        path=path, num_prompts=len(prompts), num_done=num_done, num_sequences=len(seqs),
        num_skipped=len(skipped), new_sequences=len(writer.sequences),
        new_response_tokens=sum(s.num_response_tokens for s in writer.sequences.values()),
        distill_s=distill_s, stopped=stopped if num_done < len(prompts) else "")


def summary_line(result: DataStageResult, config: TrainEagleConfig) -> str:
    """The stage's last line: prompts done of the set, skipped, this run's rates, and when it
    stopped early, why and how to continue."""
    dt = max(result.distill_s, 1e-9)
    r = result
    head = (f"train-eagle data: {r.num_done} of {r.num_prompts} prompts done "
            f"({r.num_sequences} sequences, {r.num_skipped} skipped); this run "
            f"{r.new_sequences} sequences in {r.distill_s:.1f} s "
            f"({r.new_sequences / dt:.2f} sequences/s, {r.new_response_tokens / dt:.0f} "
            f"response tokens/s)")
    if r.stopped:
        limit = (f" {config.data_time_limit_s:g} s" if r.stopped == "time limit" else "")
        head += f"; stopped at the {r.stopped}{limit}: --resume continues"
    return f"{head} -> {r.path}"


def run_data_stage(config: TrainEagleConfig, out: Path) -> Path:
    """Load the target, build the prompt set, generate, print the summary line; returns the
    merged sequences file.

    Raises:
        ValueError: see :func:`generate_data` and
            :func:`~structspec.training.prompts.build_prompt_set`.
    """
    start_s = time.monotonic()
    llm = LLM(config.model, device=config.device, dtype=config.dtype,
              max_batch_size=config.gen_batch_size, seed=config.seed,
              load_format=config.load_format)
    try:
        # With the target's tokenizer, prompts over 1024 tokens are left out (long ShareGPT
        # turns: their prefill is slow and the head trains on the response only).
        prompts = build_prompt_set(num_sharegpt=config.num_sharegpt,
                                   num_extraction=config.num_extraction,
                                   num_schema=config.num_schema, seed=config.seed,
                                   tokenizer=llm.tokenizer)
        result = generate_data(llm, prompts, config, out, start_s=start_s)
    finally:
        llm.close()
    print(summary_line(result, config), file=sys.stderr, flush=True)
    return result.path
