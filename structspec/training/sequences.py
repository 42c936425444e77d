"""Training sequences (prompt + the target's own response) and their JSONL file.

One line per sequence: ``{"token_ids": [...], "num_prompt_tokens": P, "source": "..."}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence.

    Attributes:
        token_ids: the prompt's tokens (chat template applied) followed by the response.
        num_prompt_tokens: how many leading ``token_ids`` are the prompt (loss is taken on
            the response only).
        source: where the prompt came from (e.g. ``"sharegpt"``, ``"schema"``).
    """

    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    source: str


def save_sequences(path: str | Path, seqs: Iterable[TrainSequence]) -> None:
    """Write ``seqs`` to ``path`` as JSONL (overwrites)."""
    with open(path, "w") as f:
        for s in seqs:
            f.write(json.dumps({"token_ids": list(s.token_ids),
                                "num_prompt_tokens": s.num_prompt_tokens,
                                "source": s.source}) + "\n")


def load_sequences(path: str | Path) -> list[TrainSequence]:
    """Read a file written by :func:`save_sequences`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not a JSON object with integer ``token_ids``, an integer
            ``num_prompt_tokens`` in ``[0, len(token_ids)]`` and a string ``source`` (the
            message names the line).
    """
    out: list[TrainSequence] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = rec["token_ids"]
                num_prompt = rec["num_prompt_tokens"]
                source = rec.get("source", "")
                ok = (isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)
                      and type(num_prompt) is int and 0 <= num_prompt <= len(ids)
                      and isinstance(source, str))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{lineno}: not a training sequence: {e}") from e
            if not ok:
                raise ValueError(f"{path}:{lineno}: not a training sequence (need token_ids: "
                                 f"non-negative ints, num_prompt_tokens: int in "
                                 f"[0, len(token_ids)], source: str)")
            out.append(TrainSequence(tuple(ids), num_prompt, source))
    return out
