"""CUDA graphs of small device functions whose inputs are other graphs' static outputs.

Some per-step device work is dozens of tiny kernels whose inputs are the outputs of a graph
replayed just before: the EAGLE feature store after a verify (its inputs: the verify graph's
hidden states and the post graph's ``accept_nodes``). At batch 1 such launches are host time
on the critical path of a step (the feature store: ~0.5 ms on the H200 host,
``host_step_cost.py``). Captured, each function is one replay.

**What a graph reads.** A graph is keyed by the address, shape, strides and dtype of every
device input and by the shape of the host input. When the producing graph replays from its
static buffers the key is the same every step of a batch bucket; a replay then reads exactly
the tensors the caller passed (same addresses), wherever they came from. Eager producers' fresh
outputs that land at new addresses miss; so that they do not capture graph after graph, a key
is captured only on its second sighting (the first runs eagerly) and at most ``max_graphs``
graphs are kept (then every new key runs eagerly).

**Host input.** Copied into the key's static device buffer through a pinned ring (one
non-blocking copy on the current stream, queued before the replay on that stream); the ring
waits for a buffer's previous copy before refilling it.

**Outputs.** A replay returns the outputs captured (static tensors: valid until the key's next
replay, like every graph output here). ``fn`` must be a pure function of its inputs, or write
the same values each time it runs on the same inputs: a capture runs it once eagerly (warm-up,
Triton compiles) and then replays it once, for this step's outputs. Capture syncs the device
(once per key, like the other graphs); a replay never does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np
import torch

from structspec.runner.cuda_graph import capture_after_warmup
from structspec.staging import PinnedRing

T = TypeVar("T")

#: graphs kept per :class:`KeyedGraphs` (a batch bucket x tree size each, in practice)
MAX_KEYED_GRAPHS = 64

#: first sightings remembered; cleared when full
MAX_PENDING_KEYS = 256

_Key = tuple[object, ...]


def _tensor_key(t: torch.Tensor) -> tuple[object, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


class KeyedGraphs(Generic[T]):
    """Graphs of one function ``fn(*device_inputs, host_input_gpu) -> T`` (CUDA only).

    Args:
        fn: the eager function (see the module doc for what it may do).
        device: its CUDA device.
        ring: a pinned ring of the host input's dtype (a drafter's staging ring).
        max_graphs: graphs kept; further keys run eagerly.
    """

    def __init__(self, fn: Callable[..., T], device: torch.device, ring: PinnedRing, *,
                 max_graphs: int = MAX_KEYED_GRAPHS) -> None:
        self.fn = fn
        self.device = device
        self.ring = ring
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        #: key -> (graph, its static host-input buffer, its static outputs)
        self._graphs: dict[_Key, tuple[torch.cuda.CUDAGraph, torch.Tensor, T]] = {}
        self._seen: set[_Key] = set()
        #: replays and eager runs so far (tests, benchmarks)
        self.replays = 0
        self.eager_runs = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, device_inputs: Sequence[torch.Tensor], host_input: np.ndarray) -> T:
        """``fn(*device_inputs, host_input on the device)``: a replay when the key was
        captured, a capture on its second sighting, else eagerly.

        Args:
            device_inputs: tensors on ``device``.
            host_input: a host array of the ring's dtype (any shape).

        Returns:
            ``fn``'s outputs (a replay's: the graph's static outputs).
        """
        key = (*(_tensor_key(t) for t in device_inputs), host_input.shape)
        hit = self._graphs.get(key)
        if hit is not None:
            graph, staged, out = hit
            self._upload(host_input, staged)
            graph.replay()
            self.replays += 1
            return out
        staged = torch.empty(host_input.shape, dtype=self.ring.dtype, device=self.device)
        self._upload(host_input, staged)
        if key not in self._seen or len(self._graphs) >= self.max_graphs:
            if len(self._seen) >= MAX_PENDING_KEYS:
                self._seen.clear()
            self._seen.add(key)
            self.eager_runs += 1
            return self.fn(*device_inputs, staged)
        self._seen.discard(key)
        graph, out = capture_after_warmup(lambda: self.fn(*device_inputs, staged), self.pool)
        self._graphs[key] = (graph, staged, out)
        graph.replay()  # the capture executed nothing: this step's outputs
        self.replays += 1
        return out

    def _upload(self, host: np.ndarray, dst: torch.Tensor) -> None:
        buf = self.ring.acquire(host.size)
        buf.numpy()[:] = host.reshape(-1)
        self.ring.copy_to(buf, dst)
