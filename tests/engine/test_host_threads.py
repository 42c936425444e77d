"""Torch's intra-op threads in the engine process (structspec/engine/cpu_threads.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from structspec.engine.cpu_threads import physical_cores, set_cpu_threads, set_gpu_host_threads


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_gpu_engine_host_uses_one_thread(monkeypatch: pytest.MonkeyPatch,
                                         restore_threads: None) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert set_gpu_host_threads() == 1 == torch.get_num_threads()


def test_cpu_engine_uses_the_physical_cores(monkeypatch: pytest.MonkeyPatch,
                                            restore_threads: None) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    assert set_cpu_threads() == physical_cores() == torch.get_num_threads()


@pytest.mark.parametrize("setter", [set_gpu_host_threads, set_cpu_threads])
def test_omp_num_threads_from_the_user_wins(monkeypatch: pytest.MonkeyPatch,
                                            restore_threads: None, setter) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert setter() == 3
