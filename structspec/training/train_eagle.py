"""``train_eagle``: self-distillation data, then EAGLE-3 head training, for any model the engine
loads.

Stages (``TrainEagleConfig.stage``), so that each can run in its own GPU session:

* ``data``: build the prompt set (:func:`structspec.training.prompts.build_prompt_set`), let
  the target answer it through the engine (:func:`structspec.training.distill.distill`), save
  the sequences in shards as they come and merge them into ``out/sequences.npz``
  (:mod:`structspec.training.data_stage`: time limit, SIGTERM, resume); prints progress lines
  and sequences/s and tokens/s.
* ``train``: load the target with the engine's loader, train the head on the sequences
  (:func:`structspec.training.trainer.train_head`), export it into ``out``; prints tokens/s and
  the per-step top-1 agreement.
* ``all``: both (only training when a prebuilt ``sequences`` file is given).

Several GPUs: the data stage runs ``data_parallel`` engine processes
(:mod:`structspec.training.data_parallel`); the train stage runs under ``torchrun
--nproc-per-node N -m structspec train-eagle --stage train ...``, one process per GPU with
``DistributedDataParallel`` (:mod:`structspec.training.distributed`); under ``torchrun`` only
the train stage runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from structspec.training.distributed import (
    DistContext,
    init_distributed,
    launched_world_size,
    shutdown,
)
from structspec.training.sequences import HELD_OUT_SOURCE, TrainSequence, load_sequences
from structspec.training.train_config import SEQUENCES_FILE, TrainEagleConfig
from structspec.write_probe import probe_dir_writable


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``auto`` device / dtype -> cuda + bfloat16 when CUDA is available, else cpu + float32.

    Raises:
        ValueError: a CUDA device without CUDA, or an unknown device string (naming
            ``device``).
    """
    try:
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                           else "cpu" if device == "auto" else device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def prepare_out(out: str) -> Path:
    """Create ``out`` if needed and check that it is a writable directory.

    Raises:
        ValueError: naming ``out``: it is a file, cannot be created, or is not writable.
    """
    p = Path(out).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"out: {str(p)!r} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out: cannot create {str(p)!r}: {e.strerror or e}") from e
    # A real probe, not os.access (root passes it on /sys): the data stage would otherwise
    # lose minutes of generation at its first shard.
    try:
        probe_dir_writable(p)
    except OSError as e:
        raise ValueError(f"out: directory {str(p)!r} is not writable: {e.strerror or e}") from e
    return p


def require_file(path: Path, field: str = "sequences") -> None:
    """Check that ``path`` is a file, before anything is loaded or generated.

    Args:
        field: the option that named ``path``, for the errors.

    Raises:
        FileNotFoundError: ``path`` does not exist (naming ``field``).
        ValueError: ``path`` is a directory or another non-file (naming ``field``).
    """
    if path.is_file():
        return
    if path.exists():
        raise ValueError(f"{field}: {str(path)!r} is a directory or another non-file, not a "
                         f"sequences file (OUT/sequences.npz of a data stage)")
    hint = (" (run --stage data first, or pass --sequences FILE)"
            if field == "sequences" else "")
    raise FileNotFoundError(f"{field}: {str(path)!r} not found{hint}")


def read_sequences(path: Path, field: str = "sequences") -> list[TrainSequence]:
    """The sequences of ``path``.

    Args:
        field: the option that named ``path``, for the errors.

    Raises:
        FileNotFoundError: ``path`` does not exist (naming ``field``).
        ValueError: ``path`` is a directory; malformed or empty file (naming ``field``).
    """
    require_file(path, field)
    try:
        seqs = load_sequences(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{field}: {e}") from e
    if not seqs:
        raise ValueError(f"{field}: {str(path)!r} holds no sequences")
    return seqs


def training_sequences(paths: Sequence[Path]) -> list[TrainSequence]:
    """The training sequences of ``paths`` (concatenated in order).

    Raises:
        FileNotFoundError, ValueError: see :func:`read_sequences`; ValueError also when a
            file holds sequences of held-out prompts (:data:`HELD_OUT_SOURCE`: evaluation
            data, passed as ``eval_sequences``), naming the file and the count.
    """
    out: list[TrainSequence] = []
    for path in paths:
        seqs = read_sequences(path)
        held = sum(s.source == HELD_OUT_SOURCE for s in seqs)
        if held:
            raise ValueError(f"sequences: {str(path)!r} holds {held} sequences of held-out "
                             f"prompts (source {HELD_OUT_SOURCE!r}): evaluation data is never "
                             f"trained on; pass it as --eval-sequences")
        out += seqs
    return out


def eval_paths(config: TrainEagleConfig) -> list[Path]:
    """The evaluation files of ``config.eval_sequences`` (none when unset)."""
    listed = config.eval_sequences
    if not listed:
        return []
    listed = (listed,) if isinstance(listed, str) else listed
    return [Path(p).expanduser() for p in listed]


def sequence_paths(config: TrainEagleConfig, out: Path) -> list[Path]:
    """The sequences files the train stage reads: ``config.sequences`` (one path or several,
    in order), else ``out/sequences.npz``."""
    if not config.sequences:
        return [out / SEQUENCES_FILE]
    listed = (config.sequences,) if isinstance(config.sequences, str) else config.sequences
    return [Path(p).expanduser() for p in listed]


def run_train_stage(config: TrainEagleConfig, out: Path,
                    dist_ctx: DistContext | None = None) -> Path:
    """Train the head on the sequences file and export it into ``out``; returns ``out``.

    Args:
        dist_ctx: this process's rank in a ``torchrun`` job (``config.device`` is then
            already its own device); only rank 0 prints the summary.
    """
    from structspec.models.loader import load_model
    from structspec.training.trainer import train_head

    ctx = dist_ctx or DistContext()
    seqs = training_sequences(sequence_paths(config, out))
    eval_seqs = [s for path in eval_paths(config)
                 for s in read_sequences(path, "eval_sequences")]
    device, dtype = resolve_device(config.device, config.dtype)
    model, model_config = load_model(config.model, device=device, dtype=dtype,
                                     load_format=config.load_format, seed=config.seed)
    if config.aux_hidden_layers is not None:
        nl = model_config.num_hidden_layers
        bad = [i for i in config.aux_hidden_layers if not 0 <= i < nl]
        if bad:
            raise ValueError(f"aux_hidden_layers: {bad} out of range for {nl} layers")
    if config.draft_vocab_size > model_config.vocab_size:
        raise ValueError(f"draft_vocab_size={config.draft_vocab_size}: larger than the "
                         f"target's vocab_size {model_config.vocab_size}")
    t0 = time.perf_counter()
    result = train_head(config, model, model_config, seqs, device=device, dtype=dtype,
                        dist_ctx=ctx, eval_seqs=eval_seqs)
    dt = time.perf_counter() - t0
    last = result.last or {}
    if not ctx.is_main:
        return result.head_dir
    on = f" on {ctx.world} processes" if ctx.world > 1 else ""
    print(f"train-eagle train: step {result.step}/{result.total_steps} in {dt:.1f} s; last "
          f"loss {last.get('loss', float('nan')):.4f}, top-1 agreement per TTT step "
          f"{last.get('acc')}, {last.get('tokens_per_s')} tokens/s{on} -> {result.head_dir}",
          file=sys.stderr)
    if result.last_eval is not None:
        ev = result.last_eval
        print(f"train-eagle eval: step {ev['step']} on {ev['tokens']} tokens: loss "
              f"{ev['loss']:.4f}, top-1 agreement per TTT step {ev['acc']}", file=sys.stderr)
    return result.head_dir


def train_eagle(config: TrainEagleConfig) -> Path:
    """Run ``config.stage`` of the EAGLE-3 self-distillation pipeline.

    Returns:
        The sequences file for ``stage="data"``; the head directory (``config.out``, loadable
        with ``draft_model=`` and ``speculative_algorithm="eagle"``) otherwise.

    Raises:
        ValueError: a bad option (named), an unwritable ``out``, an empty prompt set, an empty
            or malformed sequences file, a data stage under ``torchrun``; for ``stage="all"``
            without ``sequences``, held-out prompts to generate or an ``eval_sequences`` path
            that is not a file (both before the data stage runs); held-out prompts beside
            prompts of another source in one data stage.
        FileNotFoundError: a missing model, sequences or eval sequences file.
        structspec.training.data_parallel.DataRankError: a ``data_parallel`` rank crashed.
    """
    config.validate()
    if config.stage == "data" and config.sequences:
        raise ValueError("sequences: a prebuilt sequences file leaves no data stage to run "
                         "(use stage 'train')")
    data_stage = config.stage != "train" and not config.sequences
    world = launched_world_size()
    if world > 1 and data_stage:
        raise ValueError(f"stage={config.stage!r}: under torchrun (WORLD_SIZE={world}) only the "
                         f"train stage runs; generate the data once with --stage data "
                         f"--data-parallel N, without torchrun")
    if data_stage and config.stage == "all":
        # refused before the data stage spends its time, not after it
        if config.num_sharegpt_held_out:
            raise ValueError(f"num_sharegpt_held_out={config.num_sharegpt_held_out}: held-out "
                             f"prompts are evaluation data, never trained on; answer them in "
                             f"a stage 'data' of their own (the other prompt counts 0) and "
                             f"pass its sequences file as eval_sequences")
        for path in eval_paths(config):
            require_file(path, "eval_sequences")
    others = {name: getattr(config, name) for name in (
        "num_sharegpt", "num_extraction", "num_schema", "num_sharegpt_later")}
    if data_stage and config.num_sharegpt_held_out and any(others.values()):
        # a mixed file is refused as training data, and as evaluation data it would hold the
        # training prompts themselves (the same seed draws them again)
        given = ", ".join(f"{k}={v}" for k, v in others.items() if v)
        raise ValueError(f"num_sharegpt_held_out={config.num_sharegpt_held_out}: held-out "
                         f"prompts are answered in a data stage of their own, with the other "
                         f"prompt counts 0 (got {given}; the defaults are not 0)")
    out = prepare_out(config.out)
    if data_stage:
        if config.data_parallel > 1:  # the parent only merges: no engine here
            from structspec.training.data_parallel import run_data_parallel as run_data
        else:  # loads the engine (heavy): imported only when a data stage runs
            from structspec.training.data_stage import run_data_stage as run_data
        sequences = run_data(config, out)
        if config.stage == "data":
            return sequences
    ctx, device = init_distributed(config.device)
    try:
        return run_train_stage(replace(config, device=device), out, ctx)
    finally:
        shutdown(ctx)
