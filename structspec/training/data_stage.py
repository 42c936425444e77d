"""The ``data`` stage of ``train-eagle``: the target answers the prompt set; the sequences are
saved in shards as they come and merged into ``out/sequences.npz`` at the end.

Nothing done is lost: shards (:mod:`structspec.training.data_shards`) are written every 256
finished prompts or ~30 s; ``data_time_limit_s`` and a SIGTERM (what ``timeout`` sends) stop
the run cleanly (no new prompt, the requests in flight aborted, shards and the merged file
written); ``resume`` skips the prompts the shards hold. The prompts go in
:func:`~structspec.training.prompts.interleaved_order`, so a run cut short holds a share of
every source.

With ``data_parallel`` N > 1 (:mod:`structspec.training.data_parallel`) N processes each run
:func:`distill_rank` for one data rank: rank R answers the prompts whose index is R modulo N,
writes shards with its rank in the name, and leaves the merge to the parent.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from structspec.llm import LLM
from structspec.training.data_result import DataStageResult, summary_line
from structspec.training.data_shards import (
    SHARD_EVERY_PROMPTS,
    SHARD_PATTERN,
    ShardWriter,
    check_same_options,
    data_options,
    read_shards,
    refuse_without_resume,
    write_merged,
)
from structspec.training.distill import distill
from structspec.training.prompts import TrainPrompt, build_prompt_set, interleaved_order
from structspec.training.train_config import SEQUENCES_FILE, TrainEagleConfig

__all__ = ["DataStageResult", "distill_rank", "generate_data", "run_data_stage",
           "summary_line"]


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
                  shard_every: int = SHARD_EVERY_PROMPTS, rank: int = 0, world: int = 1,
                  extra_stop: Callable[[], str] | None = None) -> DataStageResult:
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
        rank, world: with ``world`` > 1 this process is data rank ``rank``: it answers only
            the prompts with ``index % world == rank`` not done in any rank's shards, names its
            shards ``sequences.part-rankR-*`` and writes no merged file (the parent merges;
            the result's ``path`` names the file it will write).
        extra_stop: checked with the time limit before every engine step; a non-empty reason
            stops the run like the time limit does (a data rank stops when its parent is gone).

    Raises:
        ValueError: ``out`` holds shards and ``resume`` is off (naming ``resume``); shards
            of other data options (naming the option); nothing produced a sequence (one
            process only: a data rank may finish with none); a bad ``rank`` / ``world``.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank}: expected 0 <= rank < world={world}")
    options = data_options(config, prompts)
    saved = read_shards(out)
    where = str(Path(out) / SHARD_PATTERN)
    refuse_without_resume(out, saved, config.resume)
    done = saved.done
    if saved.options is not None:
        check_same_options(saved.options, options, where)
        share = range(rank, len(prompts), world)
        mine = sum(1 for i in share if i in done)
        if world == 1 or mine:  # a rank: not the other ranks' shards of this very run
            print(f"train-eagle data: resuming: {mine} of {len(share)} prompts done in "
                  f"{saved.num_shards} shards", file=sys.stderr, flush=True)
    order = [i for i in interleaved_order(prompts) if i % world == rank and i not in done]
    writer_rank = rank if world > 1 else None
    writer = ShardWriter(out, options, saved.next_number(writer_rank), every=shard_every,
                         clock=clock, rank=writer_rank)
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
            elif extra_stop is not None:
                stopped = extra_stop()
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
        path = Path(out) / SEQUENCES_FILE
        if world == 1:
            if not seqs:
                raise ValueError("the data stage produced no sequences" +
                                 (f" (stopped: {stopped})" if stopped else ""))
            write_merged(out, seqs)
    num_done = len(seqs) + len(skipped)
    return DataStageResult(
        path=path, num_prompts=len(prompts), num_done=num_done, num_sequences=len(seqs),
        num_skipped=len(skipped), new_sequences=len(writer.sequences),
        new_response_tokens=sum(s.num_response_tokens for s in writer.sequences.values()),
        distill_s=distill_s, stopped=stopped if num_done < len(prompts) else "")


def distill_rank(config: TrainEagleConfig, out: Path, *, start_s: float, rank: int = 0,
                 world: int = 1, grammar_workers: int | None = None,
                 extra_stop: Callable[[], str] | None = None) -> DataStageResult:
    """Load the target's engine on ``config.device``, build the prompt set and run
    :func:`generate_data` for data rank ``rank`` of ``world`` (0 of 1: the whole set).

    Args:
        start_s: ``time.monotonic()`` at the stage's start (a data rank gets its parent's:
            the monotonic clock is one per host, so the time limit is the same for all).
        grammar_workers: the engine's grammar mask workers (None: its default).
        extra_stop: see :func:`generate_data`.

    Raises:
        ValueError: see :func:`generate_data` and
            :func:`~structspec.training.prompts.build_prompt_set`.
    """
    llm = LLM(config.model, device=config.device, dtype=config.dtype,
              max_batch_size=config.gen_batch_size, seed=config.seed,
              load_format=config.load_format, grammar_workers=grammar_workers,
              # the head learns the float target (the one train_eagle reads features from)
              quantization="none")
    try:
        # With the target's tokenizer, prompts over 1024 tokens are left out (long ShareGPT
        # turns: their prefill is slow and the head trains on the response only).
        prompts = build_prompt_set(num_sharegpt=config.num_sharegpt,
                                   num_extraction=config.num_extraction,
                                   num_schema=config.num_schema,
                                   num_sharegpt_later=config.num_sharegpt_later,
                                   num_sharegpt_held_out=config.num_sharegpt_held_out,
                                   seed=config.seed,
                                   tokenizer=llm.tokenizer)
        return generate_data(llm, prompts, config, out, start_s=start_s, rank=rank,
                             world=world, extra_stop=extra_stop)
    finally:
        llm.close()


def run_data_stage(config: TrainEagleConfig, out: Path) -> Path:
    """Run the data stage with one engine in this process (``data_parallel`` > 1 runs
    :func:`structspec.training.data_parallel.run_data_parallel` instead), print the summary
    line; returns the merged sequences file.

    Raises:
        ValueError: see :func:`generate_data` and
            :func:`~structspec.training.prompts.build_prompt_set`.
    """
    result = distill_rank(config, out, start_s=time.monotonic())
    print(summary_line(result, config), file=sys.stderr, flush=True)
    return result.path
