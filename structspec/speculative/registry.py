"""Create the configured drafter (``SpecConfig.algorithm``)."""

from __future__ import annotations

from typing import Any

from structspec.config import SpecConfig
from structspec.speculative.base import Drafter, NoDrafter


def drafter_names() -> tuple[str, ...]:
    """The ``--speculative-algorithm`` names the engine knows, in registry order."""
    return ("none", "ngram", "draft_model", "eagle")


def create_drafter(spec: SpecConfig, **kwargs: Any) -> Drafter:
    """Build the drafter named by ``spec.algorithm``.

    ``kwargs`` carry what model-based drafters need (``target``: the target ModelRunner,
    ``device``, ``dtype``, ``max_batch_size``). ``load_format`` and ``seed`` (the engine's) go
    to the ``draft_model`` drafter only, whose draft model is loaded like the target
    (``"dummy"``: seeded random weights from its config.json); an EAGLE head is always read
    from its directory.

    Raises:
        ValueError: for an unknown algorithm name.
    """
    model_kwargs = {k: kwargs.pop(k) for k in ("load_format", "seed") if k in kwargs}
    if spec.algorithm == "none":
        return NoDrafter()
    if spec.algorithm == "ngram":
        from structspec.speculative.ngram import NgramDrafter

        return NgramDrafter(spec)
    if spec.algorithm == "draft_model":
        from structspec.speculative.draft_model import DraftModelDrafter

        return DraftModelDrafter(spec, **kwargs, **model_kwargs)
    if spec.algorithm == "eagle":
        from structspec.speculative.eagle import EagleDrafter

        return EagleDrafter(spec, **kwargs)
    raise ValueError(f"unknown speculative_algorithm {spec.algorithm!r}")
