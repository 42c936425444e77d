"""Create the configured drafter (``SpecConfig.algorithm``)."""

from __future__ import annotations

from typing import Any

from structspec.config import SpecConfig
from structspec.spec.base import Drafter, NoDrafter


def create_drafter(spec: SpecConfig, **kwargs: Any) -> Drafter:
    """Build the drafter named by ``spec.algorithm``.

    ``kwargs`` carry what model-based drafters need (``target``: the target ModelRunner,
    ``device``, ``dtype``).

    Raises:
        ValueError: for an unknown algorithm name.
    """
    if spec.algorithm == "none":
        return NoDrafter()
    if spec.algorithm == "ngram":
        from structspec.spec.ngram import NgramDrafter

        return NgramDrafter(spec)
    if spec.algorithm == "draft_model":
        from structspec.spec.draft_model import DraftModelDrafter

        return DraftModelDrafter(spec, **kwargs)
    if spec.algorithm == "eagle":
        from structspec.spec.eagle import EagleDrafter

        return EagleDrafter(spec, **kwargs)
    raise ValueError(f"unknown speculative_algorithm {spec.algorithm!r}")
