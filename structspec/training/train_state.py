"""The train stage's resumable state on disk: the checkpoint file, the fingerprint a resumed run
must match, and the step log's truncation on resume. Only rank 0 writes them."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from structspec.training.sequences import TrainSequence
from structspec.training.train_config import TrainEagleConfig

#: Fingerprint keys that older checkpoints lack, with the value they had then.
FINGERPRINT_DEFAULTS: dict[str, Any] = {"batches_per_step": 1}

#: Keys every checkpoint holds (what a resume reads unconditionally).
CHECKPOINT_KEYS = ("fingerprint", "head", "d2t", "optimizer", "scheduler", "step", "epoch", "pos",
                   "plan", "rng_cpu")


class Checkpoint:
    """Save / load of the resumable state (``torch.save`` dict, atomic writes).

    Args:
        path: the checkpoint file (``out/checkpoint/train_state.pt``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def save(self, state: dict[str, Any]) -> None:
        """Write ``state`` (temporary file, then rename).

        Raises:
            OSError: the folder cannot be written.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)

    def load(self) -> dict[str, Any]:
        """The saved state, tensors on the CPU.

        Raises:
            FileNotFoundError: no checkpoint (naming ``--resume``).
            ValueError: the file is not a readable checkpoint of this trainer (truncated,
                another format, or a dict without the keys :meth:`save` writes), naming
                ``--resume`` and the path.
        """
        if not self.path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {self.path}")
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as e:
            # torch.load's own message ("PytorchStreamReader failed reading zip archive")
            # names neither the file nor the flag
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"--resume: {self.path}: not a readable train-eagle checkpoint "
                             f"({first})") from None
        missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"--resume: {self.path}: not a train-eagle checkpoint (missing "
                             f"{', '.join(missing)})")
        return state


def fingerprint(cfg: TrainEagleConfig, seqs: list[TrainSequence], aux: tuple[int, ...],
                total: int, batches_per_step: int) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint's run. ``batches_per_step``
    (``world_size * grad_accum``) is there, not the split: a run may resume on another number
    of processes with the same global batch."""
    return {"num_sequences": len(seqs), "num_tokens": sum(len(s.token_ids) for s in seqs),
            "ttt_steps": cfg.ttt_steps, "draft_vocab_size": cfg.draft_vocab_size,
            "aux_hidden_layers": list(aux), "batch_tokens": cfg.batch_tokens,
            "max_seq_len": cfg.max_seq_len, "seed": cfg.seed, "total_steps": total,
            "batches_per_step": batches_per_step}


def check_fingerprint(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse a checkpoint of another run.

    Raises:
        ValueError: naming ``--resume`` and the first differing key with both values.
    """
    for key, value in now.items():
        old = saved.get(key, FINGERPRINT_DEFAULTS.get(key))
        if old != value:
            hint = (" (world_size x grad_accum: keep the global batch, e.g. fewer processes "
                    "with a larger --grad-accum)" if key == "batches_per_step" else "")
            raise ValueError(f"--resume: the checkpoint's {key} is {old!r}, this run's is "
                             f"{value!r}{hint}")


def truncate_log(path: Path, step: int) -> None:
    """Keep the log records of steps ``<= step`` (a resumed run rewrites the later ones)."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines()
            if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in keep))
