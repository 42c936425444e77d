"""Up-front memory checks and the tokenizer-less directory error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structspec.memory import available_bytes, check_fits
from structspec.models.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "benchmarks" / "assets"


def test_check_fits_refuses_what_cannot_fit() -> None:
    free = available_bytes(torch.device("cpu"))
    assert free is not None and free > 0
    check_fits(1024, torch.device("cpu"), "a small buffer", "n/a")
    with pytest.raises(MemoryError, match="the KV cache needs .* GiB on cpu .*lower it"):
        check_fits(free * 4, torch.device("cpu"), "the KV cache", "lower it")


def test_8b_float32_dummy_is_refused_before_allocating() -> None:
    from structspec.models.loader import load_model

    free = available_bytes(torch.device("cpu"))
    if free is not None and free > 40 * (1 << 30):
        pytest.skip("this machine could hold the 8B shape in float32")
    with pytest.raises(MemoryError, match="llama3-8b-shape weights"):
        load_model(str(ASSETS / "llama3-8b-shape"), device=torch.device("cpu"),
                   dtype=torch.float32, load_format="dummy")


def test_directory_without_tokenizer_says_so() -> None:
    with pytest.raises(ValueError, match="no tokenizer files"):
        Tokenizer(ASSETS / "llama3-1b-draft-shape")
