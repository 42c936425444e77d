"""What one data stage run did (:class:`DataStageResult`) and its summary line; no engine import,
so the ``--data-parallel`` parent process can report without loading a model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from structspec.training.train_config import TrainEagleConfig


@dataclass(frozen=True)
class DataStageResult:
    """What a data stage run (one process, one data rank, or all ranks together) did.

    Attributes:
        path: the merged sequences file (every saved sequence, in prompt order); a data rank
            names the file its parent writes.
        num_prompts: prompts in the prompt set.
        num_done: prompts finished so far, this run and earlier ones (sequences + skipped).
        num_sequences: sequences in ``path``.
        num_skipped: prompts that finished without a sequence.
        new_sequences / new_response_tokens: made by this run.
        distill_s: seconds this run spent generating (the slowest rank's).
        stopped: why the run stopped before every prompt was done (``time limit``,
            ``SIGTERM``, ``parent exited``), or "" when it is complete.
        ranks: data ranks (engines) that generated.
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
    ranks: int = 1

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (``path`` as a string)."""
        return {**asdict(self), "path": str(self.path)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DataStageResult:
        """Inverse of :meth:`to_json`.

        Raises:
            TypeError: a missing or unknown field.
        """
        return cls(**{**d, "path": Path(d["path"])})


def summary_line(result: DataStageResult, config: TrainEagleConfig) -> str:
    """The stage's last line: prompts done of the set, skipped, this run's rates, and when it
    stopped early, why and how to continue."""
    dt = max(result.distill_s, 1e-9)
    r = result
    on = f" on {r.ranks} ranks" if r.ranks > 1 else ""
    head = (f"train-eagle data: {r.num_done} of {r.num_prompts} prompts done "
            f"({r.num_sequences} sequences, {r.num_skipped} skipped); this run "
            f"{r.new_sequences} sequences in {r.distill_s:.1f} s{on} "
            f"({r.new_sequences / dt:.2f} sequences/s, {r.new_response_tokens / dt:.0f} "
            f"response tokens/s)")
    if r.stopped:
        limit = (f" {config.data_time_limit_s:g} s" if r.stopped == "time limit" else "")
        head += f"; stopped at the {r.stopped}{limit}: --resume continues"
    return f"{head} -> {r.path}"


#: A data rank process prints its outcome as one stdout line: this mark, then JSON
#: (``{"result": DataStageResult.to_json()}`` or ``{"error": message, "type": class name}``).
RESULT_MARK = "structspec-data-rank-outcome: "
