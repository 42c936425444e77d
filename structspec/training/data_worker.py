"""One data rank of ``train-eagle --data-parallel N``: the process
:mod:`structspec.training.data_parallel` starts as ``python -m structspec.training.data_worker``
(not a user command). It loads its own engine on the device it was given (its parent sets
``CUDA_VISIBLE_DEVICES`` to one GPU), answers the prompts whose index is its rank modulo N
(:func:`structspec.training.data_stage.distill_rank`), and prints its outcome as one
:data:`~structspec.training.data_result.RESULT_MARK` line on stdout. Exit status: 0 done (also
when stopped early: the time limit, SIGTERM, its parent gone), 2 a bad option or input (the
error is in the outcome line), 1 a crash (traceback on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from structspec.training.data_result import RESULT_MARK
from structspec.training.train_config import TrainEagleConfig


def parent_gone(parent_pid: int) -> Callable[[], str]:
    """A stop check: ``"parent exited"`` once this process's parent is no longer
    ``parent_pid`` (it died and the process was re-parented), else ``""``. The ranks run in
    sessions of their own (a terminal's Ctrl-C or ``timeout``'s group signal reaches only the
    parent, which forwards one SIGTERM), so this keeps a rank from running on alone."""
    def check() -> str:
        return "parent exited" if os.getppid() != parent_pid else ""

    return check


def _outcome(payload: dict[str, object]) -> None:
    print(RESULT_MARK + json.dumps(payload), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run one data rank; the exit status of the module docstring."""
    p = argparse.ArgumentParser(prog="python -m structspec.training.data_worker",
                                description="one data rank of train-eagle --data-parallel")
    p.add_argument("--config", required=True, help="TrainEagleConfig.to_json()")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--start-s", type=float, required=True,
                   help="the parent's time.monotonic() at the stage's start")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--grammar-workers", type=int, default=None)
    args = p.parse_args(argv)
    # imported here: the engine is heavy and --help should not wait for it
    from structspec.training.data_stage import distill_rank

    config = TrainEagleConfig.from_json(args.config)
    try:
        result = distill_rank(config, Path(config.out), start_s=args.start_s, rank=args.rank,
                              world=args.world, grammar_workers=args.grammar_workers,
                              extra_stop=parent_gone(args.parent_pid))
    except (ValueError, FileNotFoundError, MemoryError) as e:
        _outcome({"error": str(e), "type": type(e).__name__})
        return 2
    _outcome({"result": result.to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
