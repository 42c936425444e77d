"""Shared GPU check: a forward step runs without host syncs and replays in a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_no_sync_and_graph_replay(step: Callable[[], torch.Tensor],
                                    expected: torch.Tensor) -> torch.cuda.CUDAGraph:
    """Run ``step`` under ``set_sync_debug_mode("error")`` (eagerly, then on a side stream as
    the capture warm-up), capture it in a CUDA graph, replay, and compare with ``expected``.

    Returns:
        The captured graph (its outputs are ``step``'s static tensors), e.g. for timing.

    Raises:
        AssertionError: the replay differs from ``expected``; RuntimeError from torch when a
        blocking host sync happens inside ``step``.
    """
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # raises on any blocking host sync
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step()
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(static, expected)
    return graph
