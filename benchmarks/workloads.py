"""Deterministic benchmark workloads (no downloads): JSON extraction and maskbench schemas.

The generators live in :mod:`structspec.training.workloads` (EAGLE training builds its prompts
from them, and ``benchmarks/`` is not installed); this module re-exports them unchanged.
"""

from __future__ import annotations

from structspec.training.workloads import (
    CITY,
    EXTRACTION_SCHEMA,
    FIRST,
    JOB,
    LAST,
    MASKBENCH_EVAL_LIMIT,
    SLOW_COMPILE_S,
    extraction_prompts,
    maskbench_cases,
    maskbench_eval_cases,
    schema_prompt,
    slow_compile_names,
)

__all__ = ["CITY", "EXTRACTION_SCHEMA", "FIRST", "JOB", "LAST", "MASKBENCH_EVAL_LIMIT",
           "SLOW_COMPILE_S", "extraction_prompts", "maskbench_cases", "maskbench_eval_cases",
           "schema_prompt", "slow_compile_names"]
