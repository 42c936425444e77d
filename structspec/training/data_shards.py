"""The data stage's shards: distilled sequences saved as they come, so that a killed or
time-limited run keeps its work and ``--resume`` continues it.

A shard is ``out/sequences.part-NNNNN.npz`` (one process) or
``out/sequences.part-rankR-NNNNN.npz`` (rank R of a ``--data-parallel`` run; each rank numbers
its own shards): a sequence file (the arrays of :mod:`structspec.training.sequences`, possibly
with no sequence) plus

==================  ========  =======  ======================================================
array               dtype     shape    meaning
==================  ========  =======  ======================================================
``shard_version``   int64     ()       :data:`SHARD_VERSION`
``prompt_index``    int64     [n]      each sequence's index in the run's prompt set
``skipped_index``   int64     [k]      prompts that finished without a sequence (failed)
``options``         <U        ()       JSON of :func:`data_options`: what the prompts and
                                       their answers depend on
==================  ========  =======  ======================================================

Shards are written atomically (temporary file + rename): after a kill each one on disk is
whole. A prompt is identified by its index in the deterministic prompt set; the options (and
a hash of the prompt set) tell whether a later run's indices mean the same prompts. Every
reader takes the shards of every rank, so a run may resume with another number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from structspec.training.prompts import TrainPrompt
from structspec.training.sequences import (
    SEQUENCE_KEYS,
    TrainSequence,
    read_npz,
    save_sequences,
    sequence_arrays,
    sequences_from_arrays,
    write_npz_atomic,
)
from structspec.training.train_config import SEQUENCES_FILE, TrainEagleConfig

#: Version of the shard layout.
SHARD_VERSION = 1
SHARD_PATTERN = "sequences.part-*.npz"
_SHARD_NAME = re.compile(r"^sequences\.part-(?:rank(\d+)-)?(\d{5,})\.npz$")
_SHARD_KEYS = (*SEQUENCE_KEYS, "shard_version", "prompt_index", "skipped_index", "options")

#: A shard is written after this many finished prompts ...
SHARD_EVERY_PROMPTS = 256
#: ... or once a finished prompt comes this many seconds after the last write.
SHARD_EVERY_S = 30.0


def shard_path(out: Path, number: int, rank: int | None = None) -> Path:
    """``out/sequences.part-NNNNN.npz``, or ``out/sequences.part-rankR-NNNNN.npz`` for a data
    rank ``R``."""
    tag = "" if rank is None else f"rank{rank}-"
    return Path(out) / f"sequences.part-{tag}{number:05d}.npz"


def prompt_set_digest(prompts: Sequence[TrainPrompt]) -> str:
    """SHA-256 (hex) of the prompts' messages, grammars and sources, in order: changes when the
    data files or the tokenizer's length cap change the prompt set under the same options."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([list(p.messages), repr(p.grammar), p.source],
                            sort_keys=True).encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def data_options(config: TrainEagleConfig, prompts: Sequence[TrainPrompt]) -> dict[str, Any]:
    """What a prompt's index and its answer depend on: the target, its dtype, the prompt-set
    options, the generation options, and the prompt set's digest. A resumed run must match
    all of them (``gen_batch_size`` and ``device`` may change)."""
    model = config.model
    if model is not None and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    return {"model": model, "load_format": config.load_format, "dtype": config.dtype,
            "seed": config.seed, "num_sharegpt": config.num_sharegpt,
            "num_extraction": config.num_extraction, "num_schema": config.num_schema,
            "num_sharegpt_later": config.num_sharegpt_later,
            "num_sharegpt_held_out": config.num_sharegpt_held_out,
            "max_tokens": config.max_tokens, "temperature": config.temperature,
            "prompt_set": prompt_set_digest(prompts)}


def check_same_options(saved: dict[str, Any], now: dict[str, Any], where: str) -> None:
    """Refuse to resume data made under other options.

    Raises:
        ValueError: starting with the first differing option's name (``max_tokens: ...``),
            with both values and ``where`` (the shards).
    """
    for key in now:
        if saved.get(key) != now[key]:
            what = ("the prompt set differs (the ShareGPT or MaskBench files or the tokenizer "
                    "changed)" if key == "prompt_set"
                    else f"{key}={saved.get(key)!r} there, {now[key]!r} now")
            raise ValueError(f"{key}: cannot resume the data in {where}: {what}; resume with "
                             f"the same data options or use another --out")


@dataclass
class SavedData:
    """What the shards of an ``out`` folder hold.

    Attributes:
        options: their :func:`data_options` (None when there is no shard).
        sequences: prompt index -> its sequence.
        skipped: prompt indices that finished without a sequence.
        next_numbers: per writer (None: the one-process run, R: data rank R), the number of
            its next shard.
        num_shards: shards read.
    """

    options: dict[str, Any] | None = None
    sequences: dict[int, TrainSequence] = field(default_factory=dict)
    skipped: set[int] = field(default_factory=set)
    next_numbers: dict[int | None, int] = field(default_factory=dict)
    num_shards: int = 0

    @property
    def done(self) -> set[int]:
        """Prompt indices finished (with or without a sequence)."""
        return set(self.sequences) | self.skipped

    def next_number(self, rank: int | None = None) -> int:
        """The number of the next shard the writer ``rank`` (None: one process) writes."""
        return self.next_numbers.get(rank, 0)


def has_shards(out: Path) -> bool:
    """Whether ``out`` holds a shard of any rank (without reading it)."""
    return any(_SHARD_NAME.match(p.name) for p in Path(out).glob(SHARD_PATTERN))


def read_shards(out: Path) -> SavedData:
    """Read every shard of ``out``, of every rank (in rank, then number order).

    Raises:
        ValueError: a shard that is not one (naming it), or shards written under different
            options.
    """
    found = sorted((-1 if m.group(1) is None else int(m.group(1)), int(m.group(2)), p)
                   for p in Path(out).glob(SHARD_PATTERN) if (m := _SHARD_NAME.match(p.name)))
    saved = SavedData()
    for rank, number, path in found:
        a = read_npz(path, _SHARD_KEYS, "data stage shard")
        if a["shard_version"].shape != () or int(a["shard_version"]) != SHARD_VERSION:
            raise ValueError(f"{path}: shard_version {a['shard_version']!r}, expected "
                             f"{SHARD_VERSION}")
        try:
            options = json.loads(str(a["options"]))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: corrupt data stage shard: options ({e})") from e
        seqs = sequences_from_arrays(path, a, allow_empty=True)
        index, skipped = a["prompt_index"], a["skipped_index"]
        if index.shape != (len(seqs),) or index.dtype != np.int64 \
                or skipped.ndim != 1 or skipped.dtype != np.int64:
            raise ValueError(f"{path}: corrupt data stage shard: prompt_index {index.shape} / "
                             f"skipped_index {skipped.shape} for {len(seqs)} sequences")
        if saved.options is None:
            saved.options = options
        else:
            check_same_options(saved.options, options, str(path))
        for i, seq in zip(index.tolist(), seqs, strict=True):
            saved.sequences.setdefault(i, seq)
        saved.skipped.update(skipped.tolist())
        saved.next_numbers[None if rank < 0 else rank] = number + 1
        saved.num_shards += 1
    saved.skipped -= set(saved.sequences)
    return saved


class ShardWriter:
    """Buffers finished prompts and writes them as shards: every ``every`` prompts, once a
    prompt finishes ``every_s`` seconds after the last write, and on :meth:`flush`.

    Args:
        out: the folder.
        options: :func:`data_options` of this run (stored in every shard).
        first_number: number of the first shard written.
        every / every_s: the write triggers.
        clock: monotonic seconds (injectable for tests).
        rank: the data rank whose shards these are (its number goes into the names), or None
            for a one-process run.
    """

    def __init__(self, out: Path, options: dict[str, Any], first_number: int, *,
                 every: int = SHARD_EVERY_PROMPTS, every_s: float = SHARD_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 rank: int | None = None) -> None:
        self.out = Path(out)
        self.rank = rank
        self.options_json = json.dumps(options, sort_keys=True)
        self.number = first_number
        self.every = every
        self.every_s = every_s
        self.clock = clock
        self._last_write_s = clock()
        self._seqs: list[tuple[int, TrainSequence]] = []
        self._skipped: list[int] = []
        #: every sequence written (or buffered) by this writer: prompt index -> sequence
        self.sequences: dict[int, TrainSequence] = {}
        self.skipped: set[int] = set()

    def add(self, index: int, seq: TrainSequence | None, error: str = "") -> None:
        """Prompt ``index`` finished with ``seq`` (None: skipped, ``error`` says why: not
        stored). The signature of :data:`structspec.training.distill.ResultCallback`."""
        if seq is None:
            self._skipped.append(index)
            self.skipped.add(index)
        else:
            self._seqs.append((index, seq))
            self.sequences[index] = seq
        if len(self._seqs) + len(self._skipped) >= self.every \
                or self.clock() - self._last_write_s >= self.every_s:
            self.flush()

    def flush(self) -> Path | None:
        """Write the buffered prompts as the next shard (atomically); the path, or None when
        nothing was buffered.

        Raises:
            OSError: the folder cannot be written.
        """
        self._last_write_s = self.clock()
        if not self._seqs and not self._skipped:
            return None
        path = shard_path(self.out, self.number, self.rank)
        arrays = sequence_arrays(path, [s for _, s in self._seqs])
        arrays.update(shard_version=np.int64(SHARD_VERSION),
                      prompt_index=np.array([i for i, _ in self._seqs], dtype=np.int64),
                      skipped_index=np.array(self._skipped, dtype=np.int64),
                      options=np.array(self.options_json))
        write_npz_atomic(path, arrays)
        self.number += 1
        self._seqs.clear()
        self._skipped.clear()
        return path


def refuse_without_resume(out: Path, saved: SavedData, resume: bool) -> None:
    """Refuse to start over a folder that holds an earlier data stage's shards.

    Raises:
        ValueError: ``saved`` holds shards and ``resume`` is off (naming ``resume``).
    """
    if saved.num_shards and not resume:
        raise ValueError(f"resume: {Path(out) / SHARD_PATTERN} holds {len(saved.done)} finished "
                         f"prompts of an earlier data stage: pass --resume to continue it, or "
                         f"remove those files (or use another --out)")


def write_merged(out: Path, sequences: dict[int, TrainSequence]) -> Path:
    """Write ``sequences`` (prompt index -> sequence) into ``out/sequences.npz`` in prompt
    order (atomically); returns the path.

    Raises:
        ValueError: ``sequences`` is empty.
        OSError: the folder cannot be written.
    """
    path = Path(out) / SEQUENCES_FILE
    save_sequences(path, [sequences[i] for i in sorted(sequences)])
    return path
