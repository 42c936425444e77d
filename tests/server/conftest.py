"""Fixtures of the server tests that run over the fake engine (a module defining its own
``engine`` / ``client`` fixture overrides these)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.server.fake_client import fake_client
from tests.server.server_fakes import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    """A fresh fake engine per test (import this fixture with ``client``)."""
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    """The app over this test's ``engine``."""
    with fake_client(engine) as c:
        yield c


@pytest.fixture(scope="module")
def smol_dir() -> str:
    """SmolLM2's model directory (its tokenizer files); skips without the model."""
    from structspec.models.default_model import resolve_model_path

    try:
        return resolve_model_path(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
