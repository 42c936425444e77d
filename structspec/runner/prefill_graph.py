"""CUDA graphs of small prefills: a prompt chunk replayed instead of launched kernel by kernel.

Why: an eager prefill forward of the default model launches ~300 kernels (30 layers of
GEMMs, norms, rotary, attention), ~20 ms of host time on an H200 host, whatever the chunk's
size: a 512-token chunk's GPU work is ~1 ms. With chunked prefill the running streams wait
one prefill step between two verify steps, so the eager launch cost alone put their
inter-token latency at ~10x its value without the arrival (benchmarks/long_prompt_itl.py,
benchmarks/README.md "Chunked prefill"). Replayed, a chunk costs its GPU time plus a few
launches.

A chunk of ``n`` prompt positions computed over ``start`` positions already in its pages is
a verify forward of one *chain* tree (node ``j`` at depth ``j``, ancestors ``0..j``) with
``seq_len = start``: :func:`~structspec.runner.batch_builder.build_verify_batch_from_tensors`
builds exactly the causal mask over the cached prefix and the chunk. ``n`` is cut into pieces
whose sizes are graph buckets (:func:`split_chunk`: pieces of :data:`MAX_PIECE_TOKENS`, then
descending powers of two), each piece one replay over the KV the previous pieces wrote (stream
order). One graph per ``(piece tokens, page-table width)`` bucket, captured on first use
into a memory pool of its own (the verify graphs' static outputs are never overwritten by a
prefill replay). Only the last position's logits are computed (``[1, V]``): no hidden states,
so runners whose drafter reads target features (EAGLE) keep the eager prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from structspec.kvcache.pool import KVPool
from structspec.runner.batch_builder import build_verify_batch_from_tensors, page_table_array
from structspec.runner.cuda_graph import capture_after_warmup, pick_bucket
from structspec.staging import Staging

#: the largest piece (graph bucket) in tokens; longer chunks replay it several times
MAX_PIECE_TOKENS = 2048
#: prefill steps of at most this many requests replay graphs (one request after the other);
#: a larger batch of prompts runs as one eager padded forward, which keeps the GPU busier
MAX_GRAPH_REQUESTS = 2
#: a request computing more positions than this in one step runs eagerly
MAX_GRAPH_TOKENS = 4 * MAX_PIECE_TOKENS


def split_chunk(num_tokens: int, max_piece: int = MAX_PIECE_TOKENS) -> list[int]:
    """The replay pieces of a chunk of ``num_tokens`` positions: ``max_piece`` as often as it
    fits, then the binary digits of the rest, largest first (``1000 -> [512, 256, 128, 64,
    32, 8]``), so that every piece size is one of ``log2(max_piece) + 1`` buckets.

    Raises:
        ValueError: ``num_tokens < 1`` or ``max_piece`` is not a power of two.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens}: expected >= 1")
    if max_piece < 1 or max_piece & (max_piece - 1):
        raise ValueError(f"max_piece={max_piece}: expected a power of two")
    pieces = [max_piece] * (num_tokens // max_piece)
    rest = num_tokens % max_piece
    bit = max_piece >> 1
    while rest:
        if rest & bit:
            pieces.append(bit)
            rest -= bit
        bit >>= 1
    return pieces


def plan_pieces(start: int, end: int, *, page_size: int,
                page_buckets: Sequence[int]) -> list[tuple[int, int, int]]:
    """The replays that compute positions ``start..end-1``: ``(position, tokens, page-table
    width)`` each, in order (:func:`split_chunk` sizes; the width is the smallest bucket
    covering the piece's last position).

    Raises:
        ValueError: a piece reaches past the largest page bucket.
    """
    out, pos = [], start
    for piece in split_chunk(end - start):
        width = pick_bucket(-(-(pos + piece) // page_size), page_buckets)
        if width is None:
            raise ValueError(f"{pos + piece} positions exceed the largest page bucket")
        out.append((pos, piece, width))
        pos += piece
    return out


class PrefillGraph:
    """Static buffers, and once captured the graph, of one ``(N, P)`` bucket.

    Attributes:
        num_tokens, pages: the bucket's piece size ``N`` and page-table width ``P``.
        ints: ``[1 + P + N]`` int64 device buffer ``start | page_table | token_ids`` (the
            host fills all of it: one staged copy per replay).
        depth: ``[1, N]`` int64 ``0..N-1``; ancestor_mask: ``[1, N, N]`` bool lower
            triangle (constants: a chain).
        logits: ``[1, V]`` float32 static output, the last position's (after capture).
    """

    def __init__(self, num_tokens: int, pages: int, device: torch.device) -> None:
        self.num_tokens, self.pages = num_tokens, pages
        self.ints = torch.zeros(1 + pages + num_tokens, dtype=torch.int64, device=device)
        self.start = self.ints[:1]
        self.page_table = self.ints[1 : 1 + pages].view(1, pages)
        self.token_ids = self.ints[1 + pages :].view(1, num_tokens)
        self.depth = torch.arange(num_tokens, device=device).view(1, num_tokens)
        self.ancestor_mask = torch.ones((num_tokens, num_tokens), dtype=torch.bool,
                                        device=device).tril_().view(1, num_tokens, num_tokens)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def fill(self, out: np.ndarray, token_ids: Sequence[int], pages: Sequence[int],
             start: int) -> None:
        """Write this piece's host inputs into ``out`` (``int64 [1 + P + N]``, the layout of
        :attr:`ints`): positions ``start .. start + N - 1`` of the request whose prompt (up
        to the chunk's end) is ``token_ids`` and whose pages are ``pages``."""
        out[0] = start
        out[1 : 1 + self.pages] = page_table_array([pages], self.pages).reshape(-1)
        out[1 + self.pages :] = token_ids[start : start + self.num_tokens]

    def forward(self, model: nn.Module, kv_pool: KVPool, page_size: int) -> torch.Tensor:
        """The piece's forward on the static inputs, run eagerly (what the graph records):
        writes its K/V, returns the last position's logits ``[1, V]`` float32."""
        fb = build_verify_batch_from_tensors(self.token_ids, self.depth, self.ancestor_mask,
                                             self.start, self.page_table, page_size=page_size)
        hidden = model(fb, kv_pool).hidden_states  # [1, N, H]
        return model.compute_logits(hidden[:, -1])

    def capture(self, model: nn.Module, kv_pool: KVPool, page_size: int, pool: tuple) -> None:
        """Warm up once on a side stream, then capture into ``pool``. Syncs the device (only
        here, never in replay). The warm-up writes the same K/V the replay will write (its
        inputs are already staged)."""
        self.graph, self.logits = capture_after_warmup(
            lambda: self.forward(model, kv_pool, page_size), pool)


class PrefillGraphCache:
    """The prefill graphs of one runner, by ``(piece tokens, page-table width)``.

    Args:
        model: the target model (its forward must be capturable: the Triton kernels).
        kv_pool: the KV pool the pieces write.
        page_size: tokens per page.
        page_buckets: page-table widths (ascending), the verify graphs' KV-length buckets.
        device: the CUDA device.
    """

    def __init__(self, model: nn.Module, kv_pool: KVPool, *, page_size: int,
                 page_buckets: Sequence[int], device: torch.device) -> None:
        self.model, self.kv_pool, self.page_size = model, kv_pool, page_size
        self.page_buckets = tuple(page_buckets)
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # not the verify graphs' (module doc)
        self.graphs: dict[tuple[int, int], PrefillGraph] = {}

    def fits(self, token_ids: Sequence[Sequence[int]], num_cached: Sequence[int]) -> bool:
        """Whether a prefill of these requests replays graphs (few requests, each computing
        at most :data:`MAX_GRAPH_TOKENS` positions inside the largest page bucket)."""
        if not 0 < len(token_ids) <= MAX_GRAPH_REQUESTS:
            return False
        largest = self.page_buckets[-1] * self.page_size if self.page_buckets else 0
        return all(len(t) - c <= MAX_GRAPH_TOKENS and len(t) <= largest
                   for t, c in zip(token_ids, num_cached, strict=True))

    def run(self, staging: Staging, token_ids: Sequence[int], pages: Sequence[int],
            start: int) -> torch.Tensor:
        """Compute positions ``start..len(token_ids)-1`` of one request (its KV written),
        piece by piece; launched, not waited on.

        Args:
            staging: the runner's pinned staging (each piece's inputs: one staged copy).
            token_ids: the request's prompt up to the chunk's end.
            pages: its pages (covering ``len(token_ids)`` positions).
            start: positions already in its pages (``< len(token_ids)``).

        Returns:
            ``[1, V]`` float32 logits of the last position: a fresh tensor (a later replay
            of the same bucket does not change it).

        Raises:
            ValueError: the chunk does not fit the largest page bucket (check :meth:`fits`).
        """
        ring = staging.ring(torch.int64)
        logits: torch.Tensor | None = None
        for pos, piece, width in plan_pieces(start, len(token_ids), page_size=self.page_size,
                                             page_buckets=self.page_buckets):
            g = self.graphs.get((piece, width))
            if g is None:
                g = self.graphs[(piece, width)] = PrefillGraph(piece, width, self.device)
            buf = ring.acquire(g.ints.numel())
            g.fill(buf.numpy(), token_ids, pages, pos)
            ring.copy_to(buf, g.ints)  # stream-ordered before the replay that reads it
            if g.graph is None:
                g.capture(self.model, self.kv_pool, self.page_size, self.pool)
            g.graph.replay()  # type: ignore[union-attr]
            logits = g.logits
        assert logits is not None
        return logits.clone()  # enqueued right after the last replay: stream order keeps it
