"""Deterministic benchmark workloads (no downloads): JSON extraction and maskbench schemas.

The generators live in :mod:`structspec.training.workloads` (EAGLE training builds its prompts
from them, and ``benchmarks/`` is not installed); this module re-exports them unchanged.
"""

from __future__ import annotations

import json

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
           "schema_prompt", "slow_compile_names", "valid_record"]


def valid_record(text: str) -> bool:
    """The text parses as :data:`EXTRACTION_SCHEMA`'s object, every field of the right type
    (the benchmarks' "valid" column for extraction outputs)."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError:
        return False
    types = {"string": str, "integer": int, "array": list}
    props = EXTRACTION_SCHEMA["properties"]
    return isinstance(rec, dict) and all(
        k in rec and isinstance(rec[k], types[props[k]["type"]]) for k in props)
