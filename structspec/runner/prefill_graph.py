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
``seq_len = start``: :func:`~structspec.runner.batch_builder.build_chain_batch` lays it out,
the causal rule over the cached prefix and the chunk given by ``causal_start`` (no mask). ``n`` is cut into pieces
whose sizes are graph buckets (:func:`plan_pieces`: pieces of :data:`MAX_PIECE_TOKENS`, then
the rest *padded* up to the next power of two), each piece one replay over the KV the previous
pieces wrote (stream order). Padding instead of splitting the rest into its binary digits
matters most on the step that ends a prompt: it waits for its pieces' device time to sample
the first token, and every replay is a whole 30-layer forward with its fixed cost (H200: a
7,000-token prompt's last 344 tokens as 4 replays made its step 8.3 ms against ~2 ms, the
one slow step of the running streams' ITL, benchmarks/README.md "Chunked prefill"). Padding
positions sit after the chunk's last real one, so causal attention keeps them out of every
real row; their K/V lands in the request's own pages past the chunk (rewritten by the next
chunk or decode step before anything reads it: each layer stores its K/V before it attends)
or, past the request's pages, in the sink page 0 (the page table's padding). Their token ids
are 0 and the logits are read at the last real position (a staged index). One graph per
``(piece tokens, page-table width, variant)`` bucket, captured on first use
into a memory pool of its own (the verify graphs' static outputs are never overwritten by a
prefill replay). A graph computes the last position's logits (``[1, V]``) and, in its *feature*
variant (a runner whose drafter reads target features: EAGLE), also every position's final
hidden states and the EAGLE-3 aux layers' outputs (``[1, N, H]`` each): an EAGLE request's
prefill was the eager ~20 ms of launches before its first draft (H200 host, batch 1: 14-28 ms
to the first token against 3.5 ms without a drafter), most of a short answer's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from structspec.env_flags import env_flag
from structspec.kvcache.pool import KVPool
from structspec.runner.batch_builder import build_chain_batch, page_table_array
from structspec.runner.cuda_graph import capture_after_warmup, pick_bucket
from structspec.staging import Staging

FEATURE_GRAPHS = env_flag("STRUCTSPEC_FEATURE_PREFILL_GRAPHS")
"""Whether a prefill whose hidden states are read (EAGLE) replays the feature graphs. The
environment variable is read once, at import; the runner reads this module attribute on every
call, so tests flip it (``STRUCTSPEC_FEATURE_PREFILL_GRAPHS=0``: the eager prefill, A/B runs)."""

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
                page_buckets: Sequence[int],
                max_piece: int = MAX_PIECE_TOKENS) -> list[tuple[int, int, int, int]]:
    """The replays that compute positions ``start..end-1``: ``(position, piece tokens,
    page-table width, real tokens)`` each, in order. ``max_piece`` pieces as often as they
    fit, then the rest as one piece padded up to the next power of two (``real tokens`` of
    them are the prompt's, the others padding, module doc); where the padded piece would
    reach past the largest page bucket, the rest is cut into its binary digits instead
    (:func:`split_chunk`, no padding). The width is the smallest bucket covering the piece's
    last (padded) position.

    Raises:
        ValueError: ``end <= start``, or a piece reaches past the largest page bucket.
    """
    if end <= start:
        raise ValueError(f"start={start}, end={end}: expected start < end")
    limit = page_buckets[-1] * page_size if page_buckets else 0
    full, rest = divmod(end - start, max_piece)
    sizes = [(max_piece, max_piece)] * full
    if rest:
        padded = 1 << (rest - 1).bit_length()
        if start + full * max_piece + padded <= limit:
            sizes.append((padded, rest))
        else:
            sizes += [(p, p) for p in split_chunk(rest, max_piece)]
    out, pos = [], start
    for piece, real in sizes:
        width = pick_bucket(-(-(pos + piece) // page_size), page_buckets)
        if width is None:
            raise ValueError(f"{pos + piece} positions exceed the largest page bucket")
        out.append((pos, piece, width, real))
        pos += real
    return out


class FeatureBuffers:
    """The outputs every feature graph of one cache copies its features into: ``[1, T, H]``
    final hidden states and one ``[1, T, H]`` per aux layer, ``T`` = the largest piece.

    Why shared: a graph's own static outputs stay allocated as long as the graph, and a
    feature graph's are ``(1 + aux layers) x N x H`` (an 8B target: 4 x 2,048 x 4,096 bf16 =
    64 MiB per 2,048-token bucket, over a GiB for every piece size and page-table width),
    captured lazily after the KV pool has taken the free memory. Copied into one set of
    buffers inside each graph (four copy kernels per replay), the forward's own outputs are
    pool memory the next capture reuses. Replays are sequential on one stream and the caller
    copies a piece's rows out before the next replay, so one set serves every graph.

    Args:
        max_tokens: ``T``, the largest piece.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.hidden: torch.Tensor | None = None
        self.aux: tuple[torch.Tensor, ...] = ()

    def write(self, hidden: torch.Tensor, aux: Sequence[torch.Tensor],
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Copy a piece's ``[1, N, H]`` outputs into rows ``0..N-1``; returns those views.
        The buffers are allocated at the first call (a capture's eager warm-up, outside the
        graph pool)."""
        if self.hidden is None:
            shape = (1, self.max_tokens, hidden.shape[2])
            self.hidden = hidden.new_empty(shape)
            self.aux = tuple(a.new_empty(shape) for a in aux)
        n = hidden.shape[1]
        out_hidden = self.hidden[:, :n]
        out_hidden.copy_(hidden)
        out_aux = tuple(o[:, :n] for o in self.aux)
        for o, a in zip(out_aux, aux, strict=True):
            o.copy_(a)
        return out_hidden, out_aux


class PrefillGraph:
    """Static buffers, and once captured the graph, of one ``(N, P)`` bucket.

    Attributes:
        num_tokens, pages: the bucket's piece size ``N`` and page-table width ``P``.
        ints: ``[2 + P + N]`` int64 device buffer ``start | last | page_table | token_ids``
            (the host fills all of it: one staged copy per replay); ``last`` is the index
            of the piece's last real position (``< N`` when the piece is padded).
        aux_hidden_layers: None: logits only; else the feature variant, which also outputs
            the final hidden states and these decoder layers' outputs (EAGLE-3; may be empty).
        features: the feature variant's output buffers (shared by a cache's feature graphs;
            None: the forward's own tensors).
        logits: ``[1, V]`` float32 static output, the last real position's (after capture).
        hidden: ``[1, N, H]`` final (post-norm) hidden states of every position (the feature
            variant, after capture; rows past the piece's real tokens are padding): a view
            of ``features`` when given, valid until another feature graph replays.
        aux: ``[1, N, H]`` output per aux layer (the feature variant, after capture; same).
    """

    def __init__(self, num_tokens: int, pages: int, device: torch.device,
                 aux_hidden_layers: tuple[int, ...] | None = None,
                 features: FeatureBuffers | None = None) -> None:
        self.num_tokens, self.pages = num_tokens, pages
        self.aux_hidden_layers = aux_hidden_layers
        self.features = features
        self.ints = torch.zeros(2 + pages + num_tokens, dtype=torch.int64, device=device)
        self.start = self.ints[:1]
        self.last = self.ints[1:2]
        self.page_table = self.ints[2 : 2 + pages].view(1, pages)
        self.token_ids = self.ints[2 + pages :].view(1, num_tokens)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.aux: tuple[torch.Tensor, ...] = ()

    def fill(self, out: np.ndarray, token_ids: Sequence[int], pages: Sequence[int],
             start: int, real: int | None = None) -> None:
        """Write this piece's host inputs into ``out`` (``int64 [2 + P + N]``, the layout of
        :attr:`ints`): positions ``start .. start + real - 1`` of the request whose prompt (up
        to the chunk's end) is ``token_ids`` and whose pages are ``pages``, then ``N - real``
        padding tokens (id 0; ``real`` defaults to ``N``).

        Raises:
            ValueError: ``real`` is not in ``1..N`` or ``token_ids`` ends before it.
        """
        n = self.num_tokens if real is None else real
        if not 0 < n <= self.num_tokens or start + n > len(token_ids):
            raise ValueError(f"real={n} tokens from {start}: expected 1..{self.num_tokens} "
                             f"within the {len(token_ids)} token ids")
        out[0], out[1] = start, n - 1
        out[2 : 2 + self.pages] = page_table_array([pages], self.pages).reshape(-1)
        ids = out[2 + self.pages :]
        ids[:n] = token_ids[start : start + n]
        ids[n:] = 0

    def forward(self, model: nn.Module, kv_pool: KVPool, page_size: int,
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """The piece's forward on the static inputs, run eagerly (what the graph records):
        writes its K/V; returns the last real position's logits ``[1, V]`` float32 and, in
        the feature variant, the hidden states ``[1, N, H]`` and the aux layers' outputs
        (``(logits, None, ())`` otherwise)."""
        fb = build_chain_batch(self.token_ids, self.start, self.page_table, page_size=page_size)
        out = model(fb, kv_pool, aux_hidden_layers=self.aux_hidden_layers or ())
        hidden = out.hidden_states  # [1, N, H]
        logits = model.compute_logits(hidden[0].index_select(0, self.last))
        if self.aux_hidden_layers is None:
            return logits, None, ()
        if self.features is not None:
            return (logits, *self.features.write(hidden, out.aux_hidden_states))
        return logits, hidden, tuple(out.aux_hidden_states)

    def capture(self, model: nn.Module, kv_pool: KVPool, page_size: int, pool: tuple) -> None:
        """Warm up once on a side stream, then capture into ``pool``. Syncs the device (only
        here, never in replay). The warm-up writes the same K/V the replay will write (its
        inputs are already staged)."""
        self.graph, (self.logits, self.hidden, self.aux) = capture_after_warmup(
            lambda: self.forward(model, kv_pool, page_size), pool)


@dataclass
class PrefillGraphOutput:
    """One request's replayed chunk (fresh tensors: a later replay does not change them).

    Attributes:
        logits: ``[1, V]`` float32 logits of the chunk's last position.
        hidden_states: ``[1, n, H]`` final hidden states of the chunk's ``n`` positions
            (feature graphs), else None.
        aux_hidden_states: ``[1, n, H]`` per aux layer (feature graphs), else empty.
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor | None
    aux_hidden_states: list[torch.Tensor]


class PrefillGraphCache:
    """The prefill graphs of one runner, by ``(piece tokens, page-table width, aux layers)``
    (aux layers None: the logits-only graphs).

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
        self.pool: tuple | None = None  # not the verify graphs' (module doc); at first capture
        self.graphs: dict[tuple[int, int, tuple[int, ...] | None], PrefillGraph] = {}
        #: the feature graphs' shared outputs, per aux-layer set (one in practice)
        self.features: dict[tuple[int, ...], FeatureBuffers] = {}

    def fits(self, token_ids: Sequence[Sequence[int]], num_cached: Sequence[int]) -> bool:
        """Whether a prefill of these requests replays graphs (few requests, each computing
        at most :data:`MAX_GRAPH_TOKENS` positions inside the largest page bucket)."""
        if not 0 < len(token_ids) <= MAX_GRAPH_REQUESTS:
            return False
        largest = self.page_buckets[-1] * self.page_size if self.page_buckets else 0
        return all(len(t) - c <= MAX_GRAPH_TOKENS and len(t) <= largest
                   for t, c in zip(token_ids, num_cached, strict=True))

    def run(self, staging: Staging, token_ids: Sequence[int], pages: Sequence[int],
            start: int, aux_hidden_layers: tuple[int, ...] | None = None,
            ) -> PrefillGraphOutput:
        """Compute positions ``start..len(token_ids)-1`` of one request (its KV written),
        piece by piece; launched, not waited on.

        Args:
            staging: the runner's pinned staging (each piece's inputs: one staged copy).
            token_ids: the request's prompt up to the chunk's end.
            pages: its pages (covering ``len(token_ids)`` positions).
            start: positions already in its pages (``< len(token_ids)``).
            aux_hidden_layers: None: logits only; else feature graphs (the chunk's hidden
                states and these layers' outputs too; graphs of their own bucket key).

        Returns:
            The chunk's last logits (and its features): fresh tensors, each copied right
            after its piece's replay (stream order), before a later piece of the same bucket
            replays over the static outputs.

        Raises:
            ValueError: the chunk does not fit the largest page bucket (check :meth:`fits`).
        """
        logits: torch.Tensor | None = None
        hidden: list[torch.Tensor] = []
        aux: list[list[torch.Tensor]] = [[] for _ in aux_hidden_layers or ()]
        for pos, piece, width, real in plan_pieces(
                start, len(token_ids), page_size=self.page_size, page_buckets=self.page_buckets):
            key = (piece, width, aux_hidden_layers)
            g = self.graphs.get(key)
            if g is None:
                features = None
                if aux_hidden_layers is not None:
                    features = self.features.setdefault(aux_hidden_layers,
                                                         FeatureBuffers(MAX_PIECE_TOKENS))
                g = self.graphs[key] = PrefillGraph(piece, width, self.device,
                                                    aux_hidden_layers, features)
            logits, piece_hidden, piece_aux = self._replay(staging, g, token_ids, pages, pos, real)
            if piece_hidden is not None:
                hidden.append(piece_hidden[:, :real].clone())
                for out, a in zip(aux, piece_aux, strict=True):
                    out.append(a[:, :real].clone())
        assert logits is not None
        return PrefillGraphOutput(
            logits=logits.clone(),  # enqueued right after the last replay: stream order keeps it
            hidden_states=_cat_rows(hidden) if aux_hidden_layers is not None else None,
            aux_hidden_states=[_cat_rows(a) for a in aux])

    def _replay(self, staging: Staging, g: PrefillGraph, token_ids: Sequence[int],
                pages: Sequence[int], pos: int, real: int,
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """Stage one piece's inputs and replay its graph (captured on first use); returns
        the graph's static outputs (``PrefillGraph.forward``'s)."""
        ring = staging.ring(torch.int64)
        buf = ring.acquire(g.ints.numel())
        g.fill(buf.numpy(), token_ids, pages, pos, real)
        ring.copy_to(buf, g.ints)  # stream-ordered before the replay that reads it
        if g.graph is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g.capture(self.model, self.kv_pool, self.page_size, self.pool)
        g.graph.replay()  # type: ignore[union-attr]
        assert g.logits is not None
        return g.logits, g.hidden, g.aux


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pieces' ``[1, n_i, H]`` outputs as one ``[1, sum n_i, H]`` (no copy for one piece)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
