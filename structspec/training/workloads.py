"""Deterministic prompt workloads shared by EAGLE training and the benchmarks (no downloads):
JSON extraction prompts, MaskBench schema cases and their prompt, and the MaskBench cases that
``benchmarks/maskbench_e2e.py`` evaluates.

They live in the package (not in ``benchmarks/``, which is not installed) so that
``structspec train-eagle`` can build its prompts from the same generators the benchmarks use;
``benchmarks/workloads.py`` re-exports them unchanged.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Gustav", "Hana", "Ivan", "Jia",
         "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
LAST = ["Okafor", "Silva", "Nakamura", "Novak", "Haddad", "Larsen", "Moreau", "Kowalski",
        "Fischer", "Ibrahim", "Rossi", "Tanaka", "Schmidt", "Dubois", "Kaur", "Müller"]
CITY = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Valparaiso", "Tbilisi", "Hobart",
        "Reykjavik", "Montevideo", "Ljubljana", "Da Nang"]
JOB = ["marine biologist", "civil engineer", "pastry chef", "data analyst", "violin teacher",
       "airline pilot", "pharmacist", "urban planner"]

EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "occupation", "email", "skills"],
    "additionalProperties": False,
}


def extraction_prompts(n: int, seed: int = 0,
                       example: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """``n`` (prompt, expected record) pairs; the JSON answer copies values from the prompt.

    Args:
        n: how many.
        seed: the records' generator seed.
        example: end the prompt with an example of the format (the benchmarks' workload since
            the start, kept unchanged). SmolLM2-135M-Instruct answers every such prompt with
            the example itself (``"Jane Doe"``, greedy), so that workload measures copying one
            fixed record; without the example it extracts the described person (with the odd
            mistake), which is what a drafter for extraction should be measured on.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        rec = {
            "name": f"{first} {last}",
            "age": rng.randint(21, 70),
            "city": rng.choice(CITY),
            "occupation": rng.choice(JOB),
            "email": f"{first.lower()}.{last.lower()}@example.org",
            "skills": rng.sample(["sailing", "chess", "welding", "python", "pottery",
                                  "first aid", "photography", "spanish"], 3),
        }
        prose = (
            f"{rec['name']} is a {rec['age']}-year-old {rec['occupation']} who lives in "
            f"{rec['city']}. You can reach {first} at {rec['email']}. In their free time they "
            f"enjoy {rec['skills'][0]}, {rec['skills'][1]} and {rec['skills'][2]}."
        )
        prompt = (
            "Extract the person described below into JSON with the fields name, age, city, "
            "occupation, email and skills (a list).\n\n" + prose
        )
        if example:
            prompt += "\n\nExample of the format: " + json.dumps(
                {"name": "Jane Doe", "age": 30, "city": "Paris", "occupation": "nurse",
                 "email": "jane.doe@example.org", "skills": ["a", "b", "c"]})
        out.append((prompt, rec))
    return out


def maskbench_cases(root: Path) -> list[dict[str, Any]]:
    """Every maskbench case under ``root`` (``{description, meta, schema, tests}`` plus ``_name``,
    the file stem), sorted by name."""
    cases = []
    for p in sorted(root.glob("*.json")):
        if p.name == COMPILE_SECONDS_FILE:
            continue
        case = json.loads(p.read_text())
        case["_name"] = p.stem
        cases.append(case)
    return cases


#: The instruction of :func:`schema_prompt`, before the schema's JSON text.
SCHEMA_PROMPT_PREFIX = (
    "Generate a small, realistic JSON instance that conforms to this JSON Schema. Keep it "
    "minimal: include the required fields, use short string values and at most two items per "
    "array. Reply with the JSON only.\n\nSchema:\n")


def schema_prompt(schema: dict[str, Any]) -> str:
    """A chat prompt asking for a JSON instance of ``schema``."""
    return SCHEMA_PROMPT_PREFIX + json.dumps(schema)


#: How many MaskBench cases ``benchmarks/maskbench_e2e.py`` evaluates by default (``--limit``).
MASKBENCH_EVAL_LIMIT = 120

#: A case whose grammar compile took longer than this (seconds, ``compile_seconds.json``) is
#: skipped by ``maskbench_e2e.py --skip-slow-compile``.
SLOW_COMPILE_S = 5.0

#: The file of measured compile times next to the cases (not a case itself).
COMPILE_SECONDS_FILE = "compile_seconds.json"


def slow_compile_names(root: Path) -> set[str]:
    """Names of the cases under ``root`` whose compile took over :data:`SLOW_COMPILE_S`
    (empty when ``root`` has no ``compile_seconds.json``)."""
    timing = root / COMPILE_SECONDS_FILE
    if not timing.exists():
        return set()
    return {k for k, v in json.loads(timing.read_text()).items() if v > SLOW_COMPILE_S}


def maskbench_eval_cases(root: Path, limit: int = MASKBENCH_EVAL_LIMIT, *,
                         skip_slow_compile: bool = False) -> list[dict[str, Any]]:
    """The cases ``benchmarks/maskbench_e2e.py`` evaluates: the first ``limit`` of
    :func:`maskbench_cases` by name, after dropping the slow-compiling ones when
    ``skip_slow_compile``."""
    slow = slow_compile_names(root) if skip_slow_compile else set()
    return [c for c in maskbench_cases(root) if c["_name"] not in slow][:limit]
