"""ModelRunner: owns the target model and its KV pool; runs prefill and tree-verify forwards.

Inputs are host-side descriptions (token lists, page lists, a verify tree); outputs stay on the
device until the scheduler copies what it needs.

On CUDA, ``verify`` replays a captured CUDA graph per (batch, tree size, KV length) bucket
(:mod:`structspec.runner.cuda_graph`) and stages its small host inputs through pinned buffers
with non-blocking copies (:mod:`structspec.staging`): no host sync on the way in. On CPU
it runs the same eager code as always.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from structspec.config import CacheConfig, ModelConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.verify import VerifyResult
from structspec.kvcache.page_table import PageRows
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch
from structspec.layers.penalties import PenaltyTable
from structspec.memory import check_fits
from structspec.runner import prefill_graph
from structspec.runner.batch_builder import (
    build_prefill_batch,
    build_verify_batch,
    build_verify_batch_from_tensors,
    compact_accepted_kv,
    fill_seq_lens_and_pages,
    page_table_tensor,
)
from structspec.runner.cuda_graph import (
    DEFAULT_BATCH_SIZES,
    SelectVerify,
    VerifyGraph,
    VerifyGraphCache,
)
from structspec.runner.prefill_graph import PrefillGraphCache
from structspec.runner.prompt_logprobs import (
    PromptLogprobRows,
    PromptLogprobsSpec,
    score_prompt_rows,
)
from structspec.staging import Staging, to_device, upload_pinned


@dataclass
class VerifyForwardOutput:
    """What a verify forward leaves on the device.

    Attributes:
        logits: ``[B * N, V]`` float32, row ``b * N + i`` = node i of request b.
        seq_lens: ``[B]`` int64 committed lengths the forward ran with.
        page_table: ``[B, P]`` int64 pages it wrote through.
        hidden_states: ``[B, N, H]`` final hidden states (EAGLE drafters read them).
        aux_hidden_states: outputs of ``ModelRunner.aux_hidden_layers``, each ``[B, N, H]``.
        graph: the CUDA-graph bucket that produced it (None when eager); enables
            :meth:`ModelRunner.greedy_verify` (once a select/verify function is installed).
    """

    logits: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor]
    graph: VerifyGraph | None = None


@dataclass
class PrefillOutput:
    """What a prefill forward leaves on the device.

    Attributes:
        logits: ``[B, V]`` float32 logits of each request's last prompt token.
        hidden_states: ``[B, Q, H]`` final hidden states of every computed (padded) prompt
            position (row ``j`` = position ``num_cached[b] + j``, see :meth:`ModelRunner.prefill`).
        aux_hidden_states: outputs of ``ModelRunner.aux_hidden_layers``, each ``[B, Q, H]``.
        prompt_hidden_states: ``[B, L, H]`` final hidden states of every prompt position
            (row ``j`` = position ``j``, cached ones included, read from the runner's prompt
            feature store), when the runner keeps one (:meth:`ModelRunner.keep_prompt_features`)
            and some request started over cached KV; else None (``hidden_states`` has them).
        prompt_aux_hidden_states: the same for each aux layer (each ``[B, L, H]``), or None.
        prompt_logprobs: per request, the scores of its ``PromptLogprobsSpec`` (device
            tensors), None for a request without one; None when no request asked
            (:meth:`ModelRunner.prefill`'s ``prompt_logprobs``).
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor]
    prompt_hidden_states: torch.Tensor | None = None
    prompt_aux_hidden_states: list[torch.Tensor] | None = None
    prompt_logprobs: list[PromptLogprobRows | None] | None = None


class ModelRunner:
    """Runs the target model's forwards over the paged KV pool.

    Args:
        model: a model from :mod:`structspec.models` (already on ``device``, in ``dtype``).
        model_config: its architecture.
        cache_config: KV pool sizing.
        device: where the model and the pool live.
        dtype: KV-cache dtype (the model's).
        use_cuda_graph: replay verify forwards from CUDA graphs (ignored off CUDA).
        cuda_graph_batch_sizes: batch-size buckets for the graphs; larger batches run eagerly.
        max_model_len: largest KV-length bucket (default: the model's
            ``max_position_embeddings``); longer sequences run eagerly.
        kernels: ``"torch"`` (reference ops) or ``"triton"`` (fused Triton kernels, CUDA): the
            resolved ``EngineConfig.kernels``, passed to ``model.set_kernels``; None = keep the
            model's current choice. Drafters read ``runner.kernels`` to pick the same.
        batch_invariant: ``EngineConfig.batch_invariant``: passed to ``model.set_kernels``
            with ``kernels="triton"`` (batch-invariant linears and attention, so verify and
            decode forwards give a token the same bits). Drafters do not copy it: they only
            propose, and the target's verify decides every emitted token.

    Verify outputs on CUDA with graphs are views of static graph buffers: valid until the next
    :meth:`verify` call. What follows a greedy graph-replayed verify (mask, selection, tree
    verification, KV compaction) is a second graph recording the function that the scheduler
    installs with :meth:`set_select_verify`; the runner itself knows neither the grammar nor
    the drafters.
    """

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        use_cuda_graph: bool = True,
        cuda_graph_batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        max_model_len: int | None = None,
        kernels: str | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        if batch_invariant and (kernels != "triton" or not hasattr(model, "set_kernels")):
            raise ValueError(f"batch_invariant=True needs kernels='triton' and a model with "
                             f"Triton kernels (got kernels={kernels!r}, "
                             f"{type(model).__name__})")
        if kernels is not None and hasattr(model, "set_kernels"):
            # before any graph capture bakes the implementation in
            model.set_kernels(kernels, batch_invariant=batch_invariant)
        #: the forward implementation in use, "torch" or "triton".
        self.kernels: str = kernels or getattr(model, "kernels", "torch")
        self.model_config = model_config
        self.device = device
        self.page_size = cache_config.page_size
        kv_bytes = (2 * model_config.num_hidden_layers * cache_config.total_pages
                    * cache_config.page_size * model_config.num_key_value_heads
                    * model_config.head_dim * torch.empty((), dtype=dtype).element_size())
        check_fits(kv_bytes, torch.device(device),
                   f"the KV cache ({cache_config.total_pages * cache_config.page_size} tokens)",
                   "lower kv_capacity_tokens (--kv-capacity-tokens)")
        self.kv_pool = KVPool(
            num_layers=model_config.num_hidden_layers,
            num_pages=cache_config.total_pages,
            page_size=cache_config.page_size,
            num_kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype=dtype,
            device=device,
        )
        #: decoder layers whose outputs drafters need (EAGLE-3 features); () = none.
        self.aux_hidden_layers: tuple[int, ...] = ()
        #: ``[num_slots, H * (1 + len(aux_hidden_layers))]`` final and aux hidden states of
        #: every prefilled position, by KV slot (:meth:`keep_prompt_features`); None = none
        self.prompt_features: torch.Tensor | None = None
        self._dtype = dtype
        on_cuda = device.type == "cuda"
        self.staging: Staging | None = Staging(device) if on_cuda else None
        self.graphs: VerifyGraphCache | None = None
        #: the post-forward select/verify function (:meth:`set_select_verify`)
        self.select_verify: SelectVerify | None = None
        #: CUDA graphs of small prefills (a prompt chunk; :mod:`.prefill_graph`)
        self.prefill_graphs: PrefillGraphCache | None = None
        if on_cuda and use_cuda_graph:
            self.graphs = VerifyGraphCache(
                model, self.kv_pool, page_size=self.page_size,
                max_model_len=max_model_len or model_config.max_position_embeddings,
                batch_sizes=cuda_graph_batch_sizes, device=device,
            )
            if not batch_invariant:
                # (batch-invariant mode keeps one prefill path: whether a step replays these
                # graphs depends on how many requests it prefills, and their attention rounds
                # differently from the eager prefill's)
                self.prefill_graphs = PrefillGraphCache(
                    model, self.kv_pool, page_size=self.page_size,
                    page_buckets=self.graphs.page_buckets, device=device)

    def set_select_verify(self, select_verify: SelectVerify, *, bitmask_width: int) -> None:
        """Install the function that the post-forward CUDA graphs record (the scheduler's
        mask application, target selection, tree verification and real-draft count; see
        :class:`~structspec.runner.cuda_graph.SelectVerify`) and the grammar bitmask width
        (int32 words per logits row) of their static bitmask input. Until it is called,
        :meth:`graph_bitmask` returns None (greedy batches then run the eager path) and
        :meth:`warmup_cuda_graphs` captures only the forwards."""
        self.select_verify = select_verify
        if self.graphs is not None:
            self.graphs.select_verify = select_verify
            self.graphs.bitmask_width = bitmask_width

    @property
    def use_cuda_graph(self) -> bool:
        """Whether verify forwards replay CUDA graphs."""
        return self.graphs is not None

    @property
    def vocab_size(self) -> int:
        """Width of the logits rows (may exceed the tokenizer's vocabulary)."""
        return self.model_config.vocab_size

    def keep_prompt_features(self) -> None:
        """Keep the target features of every prefilled position beside its KV, so that a
        prefill over cached KV can still hand a drafter the features of the cached prompt
        positions (EAGLE reads every prompt position's; see :class:`PrefillOutput`).

        Call after setting :attr:`aux_hidden_layers`. The store is indexed like the KV slots
        (a cached page's features live and are evicted with its KV): ``kv_pool.num_slots``
        rows of ``H * (1 + len(aux_hidden_layers))`` values in the KV dtype.

        Raises:
            MemoryError: it cannot fit on the device (naming ``--no-prefix-cache``).
        """
        width = self.model_config.hidden_size * (1 + len(self.aux_hidden_layers))
        num_bytes = (self.kv_pool.num_slots * width
                     * torch.empty((), dtype=self._dtype).element_size())
        check_fits(num_bytes, torch.device(self.device),
                   "the prefix cache's prompt feature store (EAGLE)",
                   "lower kv_capacity_tokens (--kv-capacity-tokens) or turn prefix caching "
                   "off (--no-prefix-cache)")
        self.prompt_features = torch.zeros((self.kv_pool.num_slots, width), dtype=self._dtype,
                                           device=self.device)

    @torch.inference_mode()
    def prefill(
        self, token_ids: Sequence[Sequence[int]], pages: Sequence[Sequence[int]],
        num_cached: Sequence[int] | None = None, *,
        gather_prompt_features: bool | None = None, logits_only: bool = False,
        prompt_logprobs: Sequence[PromptLogprobsSpec | None] | None = None,
    ) -> PrefillOutput:
        """Write the prompts' KV; return the last prompt tokens' logits and hidden states.

        Args:
            token_ids: per request, the whole prompt.
            pages: per request, pages covering its prompt.
            num_cached: per request, leading prompt tokens whose KV its pages already hold
                (a prefix-cache hit; ``< len(prompt)``): only the rest is computed, and the
                hidden states' row ``j`` is then position ``num_cached[b] + j``. None = 0.
                A chunk of a prompt (chunked prefill) is the same call: ``token_ids`` its
                prompt up to the chunk's end, ``num_cached`` the chunk's start.
            gather_prompt_features: fill ``PrefillOutput.prompt_hidden_states`` from the
                feature store (when the runner keeps one); None = when some
                ``num_cached`` is not 0. A later chunk of a prompt whose drafter already
                has the earlier positions' features passes False.
            logits_only: the caller reads only ``logits`` (no drafter reads target
                features): ``hidden_states`` may then come back ``[B, 0, H]``.
            prompt_logprobs: per request, the prompt positions to score
                (:class:`~structspec.runner.prompt_logprobs.PromptLogprobsSpec`: row ``j``
                of its computed part predicts ``target_ids[j]``) or None; None = none.
                When a request has one, the step runs the eager forward (the prefill graphs
                keep no per-position hidden states) and ``PrefillOutput.prompt_logprobs``
                holds the scores, on the device.

        On CUDA a step of few requests (:meth:`PrefillGraphCache.fits`) replays prefill graphs
        (:mod:`.prefill_graph`: ~20 ms of eager launches become a few replays): logits-only
        graphs, or feature graphs when the caller reads the hidden states or the runner keeps
        a feature store (``STRUCTSPEC_FEATURE_PREFILL_GRAPHS=0``: those run eagerly); the
        prompt features are then gathered from the store as on the eager path.
        """
        cached = list(num_cached) if num_cached is not None else [0] * len(token_ids)
        store = self.prompt_features
        if gather_prompt_features is None:
            gather_prompt_features = num_cached is not None and any(num_cached)
        graphs = self.prefill_graphs
        features = not logits_only or store is not None
        scored = prompt_logprobs is not None and any(s is not None for s in prompt_logprobs)
        if (graphs is not None and not scored
                and (prefill_graph.FEATURE_GRAPHS or not features)
                and graphs.fits(token_ids, cached)):
            return self._prefill_graphs(graphs, token_ids, pages, cached, features=features,
                                        gather=gather_prompt_features)
        fb = build_prefill_batch(token_ids, pages, page_size=self.page_size, device=self.device,
                                 num_cached=num_cached)
        out = self.model(fb, self.kv_pool, aux_hidden_layers=self.aux_hidden_layers)
        hidden = out.hidden_states.reshape(-1, out.hidden_states.shape[-1])
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        result = PrefillOutput(logits=logits, hidden_states=out.hidden_states,
                               aux_hidden_states=list(out.aux_hidden_states))
        if scored:
            assert prompt_logprobs is not None
            result.prompt_logprobs = self._score_prompts(
                out.hidden_states, prompt_logprobs,
                [len(t) - c for t, c in zip(token_ids, cached, strict=True)])
        if store is not None:
            # padding rows write the sink's slot 0, like their KV
            feats = torch.cat([out.hidden_states, *out.aux_hidden_states], dim=-1)
            store.index_copy_(0, fb.out_slots.reshape(-1),
                              feats.reshape(-1, feats.shape[-1]).to(store.dtype))
            if gather_prompt_features:
                # columns of kv_slots are prompt positions 0..L-1 (padding: slot 0)
                full = store[fb.kv_slots]
                h = out.hidden_states.shape[-1]
                result.prompt_hidden_states = full[..., :h]
                result.prompt_aux_hidden_states = list(full[..., h:].split(h, dim=-1))
        return result

    def _prefill_graphs(self, graphs: PrefillGraphCache, token_ids: Sequence[Sequence[int]],
                        pages: Sequence[Sequence[int]], cached: Sequence[int], *,
                        features: bool, gather: bool) -> PrefillOutput:
        """:meth:`prefill` through the prefill graphs, one request after the other. With
        ``features``, the outputs are those of the eager path (``hidden_states`` and each aux
        layer ``[B, Q, H]``, request ``b``'s row ``j`` = position ``cached[b] + j``, rows past
        its chunk padding); the feature store, when kept, gets every computed position, and
        with ``gather`` every prompt position's features are read back from it
        (``prompt_hidden_states``). The slots come from the host's page lists (one staged
        copy each) where the eager path has them in its batch. Padding rows here are zeros and
        store slot 0 is never written, where the eager path leaves junk rows and writes its
        padding into slot 0: consumers read a request's rows up to its length only."""
        aux_layers = self.aux_hidden_layers if features else None
        outs = [graphs.run(self.staging, t, p, c, aux_layers)  # type: ignore[arg-type]
                for t, p, c in zip(token_ids, pages, cached, strict=True)]
        logits = torch.cat([o.logits for o in outs]) if len(outs) > 1 else outs[0].logits
        h = self.model_config.hidden_size
        if not features:
            empty = logits.new_empty((len(token_ids), 0, h), dtype=self._dtype)
            return PrefillOutput(logits=logits, hidden_states=empty, aux_hidden_states=[])
        result = PrefillOutput(
            logits=logits, hidden_states=_pad_rows([o.hidden_states for o in outs]),  # type: ignore[misc]
            aux_hidden_states=[_pad_rows([o.aux_hidden_states[i] for o in outs])
                               for i in range(len(self.aux_hidden_layers))])
        store = self.prompt_features
        if store is None:
            return result
        slots = np.concatenate([self._kv_slots(p, c, len(t))
                                for t, p, c in zip(token_ids, pages, cached, strict=True)])
        rows = torch.cat([torch.cat([o.hidden_states, *o.aux_hidden_states], dim=-1)[0]
                          for o in outs])  # type: ignore[list-item]
        store.index_copy_(0, to_device(torch.from_numpy(slots), self.device, self.staging),
                          rows.to(store.dtype))
        if gather:
            # every prompt position 0..L-1 (padding: the sink's slot 0), after the store
            # above in stream order
            width = max(len(t) for t in token_ids)
            table = np.zeros((len(token_ids), width), dtype=np.int64)
            for b, (t, p) in enumerate(zip(token_ids, pages, strict=True)):
                table[b, : len(t)] = self._kv_slots(p, 0, len(t))
            full = store[to_device(torch.from_numpy(table), self.device, self.staging)]
            result.prompt_hidden_states = full[..., :h]
            result.prompt_aux_hidden_states = list(full[..., h:].split(h, dim=-1))
        return result

    def _score_prompts(self, hidden: torch.Tensor,
                       specs: Sequence[PromptLogprobsSpec | None],
                       computed: Sequence[int]) -> list[PromptLogprobRows | None]:
        """Score each request's prompt positions from the eager prefill's ``hidden [B, Q, H]``
        (request ``b``'s row ``j`` = its ``j``-th computed position; ``computed[b]`` rows
        are real).

        Raises:
            ValueError: a spec has more targets than its request computed rows.
        """
        scores: list[PromptLogprobRows | None] = []
        for b, spec in enumerate(specs):
            if spec is None:
                scores.append(None)
                continue
            n = len(spec.target_ids)
            if n > computed[b]:
                raise ValueError(f"request {b}: {n} prompt logprob targets for "
                                 f"{computed[b]} computed positions")
            targets_gpu = to_device(torch.tensor(list(spec.target_ids), dtype=torch.int64),
                                    self.device, self.staging)
            scores.append(score_prompt_rows(self.model.compute_logits, hidden[b, :n],
                                            targets_gpu, spec.top_k))
        return scores

    def _kv_slots(self, pages: Sequence[int], start: int, end: int) -> np.ndarray:
        """``int64 [end - start]`` KV slots of positions ``start..end-1`` over ``pages``."""
        pos = np.arange(start, end)
        return (np.asarray(pages, dtype=np.int64)[pos // self.page_size] * self.page_size
                + pos % self.page_size)

    @torch.inference_mode()
    def verify(
        self, tree: VerifyTree, seq_lens: Sequence[int],
        pages: Sequence[Sequence[int]] | PageRows,
    ) -> VerifyForwardOutput:
        """Run the target over every node of every tree (one forward).

        Args:
            tree: the batch's verify trees, ``[B, N]`` fields, on ``self.device`` (device
                drafters) or on the host (host drafters; staged through pinned buffers on CUDA).
            seq_lens: committed KV length per request (host ints).
            pages: per request, pages covering at least ``seq_len + N`` positions: lists, or
                the scheduler's :class:`~structspec.kvcache.page_table.PageRows` (gathered
                with one numpy indexing, no per-request work).

        On CUDA nothing here waits for the device: host inputs go through pinned buffers with
        non-blocking copies and the forward is a graph replay when a bucket fits.
        """
        n = tree.num_nodes
        need = -(-(max(seq_lens) + n) // self.page_size)
        if self.device.type != "cuda":
            if isinstance(pages, PageRows):
                table = torch.from_numpy(pages.take(need)).to(self.device)
            else:
                table = page_table_tensor([p[:need] for p in pages], self.device)
            seq_lens_t = torch.tensor(list(seq_lens), dtype=torch.int64).to(self.device)
            return self._verify_eager(tree, seq_lens_t, table)
        g = None
        if self.graphs is not None:
            g = self.graphs.lookup(len(seq_lens), n, need, self.aux_hidden_layers)
        if g is None:
            return self._verify_eager_cuda(tree, seq_lens, pages, need)
        self._stage_graph_inputs(g, tree, seq_lens, pages, need)
        self.graphs.ensure_captured(g)  # type: ignore[union-attr]
        g.replay()
        return self._graph_output(g, len(seq_lens))

    def _verify_eager(
        self, tree: VerifyTree, seq_lens_t: torch.Tensor, table: torch.Tensor
    ) -> VerifyForwardOutput:
        """Eager verify on device tensors (``tree`` and both tensors on ``self.device``)."""
        fb = build_verify_batch(tree, seq_lens_t, table, page_size=self.page_size)
        return self._forward_verify(fb, seq_lens_t, table)

    def _forward_verify(
        self, fb: ForwardBatch, seq_lens_t: torch.Tensor, table: torch.Tensor
    ) -> VerifyForwardOutput:
        out = self.model(fb, self.kv_pool, aux_hidden_layers=self.aux_hidden_layers)
        hidden = out.hidden_states
        logits = self.model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))
        return VerifyForwardOutput(logits=logits, seq_lens=seq_lens_t, page_table=table,
                                   hidden_states=hidden,
                                   aux_hidden_states=list(out.aux_hidden_states))

    def _verify_eager_cuda(
        self, tree: VerifyTree, seq_lens: Sequence[int],
        pages: Sequence[Sequence[int]] | PageRows, need: int,
    ) -> VerifyForwardOutput:
        """Eager verify on CUDA (no bucket fits, or graphs off); inputs staged without syncs:
        ``seq_lens | page_table [| tokens | depth]`` in one pinned int64 buffer and one H2D
        copy, a host tree's ancestor mask in a second."""
        assert self.staging is not None
        bsz, n = len(seq_lens), tree.num_nodes
        host_tree = tree.device.type == "cpu"
        ring = self.staging.ring(torch.int64)
        head = bsz * (1 + need)
        k = head + (2 * bsz * n if host_tree else 0)
        buf = ring.acquire(k)
        fill_seq_lens_and_pages(buf[:head].numpy(), seq_lens, pages, need, bsz)
        if host_tree:
            buf[head : head + bsz * n].view(bsz, n).copy_(tree.draft_tokens)
            buf[head + bsz * n : k].view(bsz, n).copy_(tree.depth)
        ints = torch.empty(k, dtype=torch.int64, device=self.device)
        ring.copy_to(buf, ints)
        seq_lens_t, table = ints[:bsz], ints[bsz:head].view(bsz, need)
        if host_tree:
            tokens = ints[head : head + bsz * n].view(bsz, n)
            depth = ints[head + bsz * n :].view(bsz, n)
            anc = self.staging.to_device(tree.ancestor_mask)
        else:
            tokens, depth, anc = tree.draft_tokens, tree.depth, tree.ancestor_mask
        fb = build_verify_batch_from_tensors(tokens, depth, anc, seq_lens_t, table,
                                             page_size=self.page_size)
        return self._forward_verify(fb, seq_lens_t, table)

    def _stage_graph_inputs(
        self, g: VerifyGraph, tree: VerifyTree, seq_lens: Sequence[int],
        pages: Sequence[Sequence[int]] | PageRows, need: int,
    ) -> None:
        """Fill ``g``'s static inputs for a batch of ``len(seq_lens) <= g.bsz`` requests.

        ``seq_lens | page_table`` (and a host tree's tokens/depth/parents) go in one pinned
        buffer and one non-blocking H2D copy; a host tree's ancestor mask in a second. A device
        tree is copied device to device into rows ``[:B]``; its dummy rows keep a valid earlier
        tree, harmless since their ``seq_len``/page rows are 0 (writes go to the sink page).
        All copies are on the current stream, ahead of the replay that reads them.
        """
        assert self.staging is not None
        bsz, n = len(seq_lens), g.num_nodes
        host_tree = tree.device.type == "cpu"
        ring = self.staging.ring(torch.int64)
        k = g.host_ints + (3 * g.bsz * n if host_tree else 0)
        buf = ring.acquire(k)
        fill_seq_lens_and_pages(buf[: g.host_ints].numpy(), seq_lens, pages, need, g.bsz,
                                width=g.pages)
        if host_tree:
            # filled through numpy views of the pinned buffers: a numpy slice assignment costs
            # ~1 us of host, a torch CPU one ~5 us (27 -> 11 us for these fills at batch 1,
            # 56 -> 18 us at batch 6 of 8 on a 2-core EPYC VM)
            fields = buf[g.host_ints : k].numpy().reshape(3, g.bsz, n)  # tokens|depth|parents
            fields[0, :bsz] = tree.draft_tokens.numpy()
            fields[1, :bsz] = tree.depth.numpy()
            fields[2, :bsz] = tree.parents.numpy()
            fields[:, bsz:] = 0
            ring.copy_to(buf, g.ints[:k])
            bring = self.staging.ring(torch.bool)
            anc = bring.acquire(g.bsz * n * n)
            anc_rows = anc.numpy().reshape(g.bsz, n, n)
            anc_rows[:bsz] = tree.ancestor_mask.numpy()
            anc_rows[bsz:] = np.eye(n, dtype=bool)
            bring.copy_to(anc, g.ancestor_mask)
        else:
            ring.copy_to(buf, g.ints[:k])
            g.draft_tokens[:bsz].copy_(tree.draft_tokens)
            g.depth[:bsz].copy_(tree.depth)
            g.parents[:bsz].copy_(tree.parents)
            g.ancestor_mask[:bsz].copy_(tree.ancestor_mask)

    def _graph_output(self, g: VerifyGraph, bsz: int) -> VerifyForwardOutput:
        """The first ``bsz`` real rows of ``g``'s static outputs (views, no copies)."""
        assert g.logits is not None and g.hidden is not None
        return VerifyForwardOutput(
            logits=g.logits[: bsz * g.num_nodes], seq_lens=g.seq_lens[:bsz],
            page_table=g.page_table[:bsz], hidden_states=g.hidden[:bsz],
            aux_hidden_states=[a[:bsz] for a in g.aux], graph=g,
        )

    @torch.inference_mode()
    def warmup_cuda_graphs(
        self, num_nodes: int, *, batch_sizes: Sequence[int] | None = None,
        kv_lens: Sequence[int] | None = None, penalty_table: PenaltyTable | None = None,
    ) -> int:
        """Capture verify graphs ahead of time (largest first), with dummy rows only (their
        writes go to the sink page), and their post graphs once :meth:`set_select_verify` was
        called. No-op without graphs.

        Args:
            num_nodes: tree size ``N`` the engine verifies with (1 = plain decode).
            batch_sizes: batch buckets to capture (default: all).
            kv_lens: KV lengths to capture buckets for (default: all buckets).
            penalty_table: also capture the post graphs that penalise (for batches with a
                penalised request; otherwise captured at their first use), reading this
                table (the scheduler's ``penalties.table``). Already captured forward
                graphs get the post graphs they lack.

        Returns:
            The number of forward graphs captured by this call.
        """
        if self.graphs is None:
            return 0
        bss = batch_sizes if batch_sizes is not None else self.graphs.batch_sizes
        pps = (self.graphs.page_buckets if kv_lens is None
               else [-(-L // self.page_size) for L in kv_lens])
        penalised = (False,) if penalty_table is None else (False, True)
        count = 0
        for bs in sorted(bss, reverse=True):
            for pp in sorted(pps, reverse=True):
                g = self.graphs.lookup(bs, num_nodes, pp, self.aux_hidden_layers)
                if g is None:
                    continue
                posts = [] if self.select_verify is None else [
                    (m, p) for p in penalised for m in (False, True) if (m, p) not in g.post_graphs]
                if g.captured and not posts:
                    continue
                # Dummy rows only (also in a graph a real step used): the post graphs' KV
                # moves stay in the sink page and count into penalty slot 0, never kept.
                g.reset_dummy()
                if not g.captured:
                    self.graphs.ensure_captured(g)
                    count += 1
                for masked, with_penalties in posts:
                    self.graphs.run_post(g, masked, None, (penalty_table, _neutral_slots)
                                         if with_penalties and penalty_table is not None
                                         else None)
        return count

    def graph_bitmask(self, fwd: VerifyForwardOutput) -> torch.Tensor | None:
        """The static ``[B_bucket * N, W]`` int32 device bitmask that :meth:`greedy_verify`
        applies for ``fwd`` (upload a step's tree bitmask into its first ``B * N`` rows), or
        None when ``fwd`` did not come from a CUDA graph or no select/verify function is
        installed (:meth:`set_select_verify`)."""
        if fwd.graph is None or self.graphs is None or self.select_verify is None:
            return None
        return self.graphs.post_inputs(fwd.graph)[0]

    @torch.inference_mode()
    def greedy_verify(
        self, fwd: VerifyForwardOutput, *, masked: bool,
        max_accept_cpu: torch.Tensor | None = None,
        penalties: tuple[PenaltyTable, Sequence[int]] | None = None,
        max_accept_pinned: torch.Tensor | None = None,
    ) -> tuple[VerifyResult, torch.Tensor]:
        """Greedy selection, tree verification and KV compaction for a graph-replayed
        ``fwd`` as one post-graph replay (see :mod:`structspec.runner.cuda_graph`).

        Equivalent to the installed select/verify function (:meth:`set_select_verify`) on
        ``fwd``'s logits and tree, then :meth:`commit_accepted_kv` (do not call the latter
        again).

        Args:
            fwd: the output of the :meth:`verify` just launched (``fwd.graph`` not None).
            masked: apply the bitmask already uploaded into :meth:`graph_bitmask`.
            max_accept_cpu: ``[B]`` host int cap on accepted drafts (a grammar walk timed
                out), or None.
            penalties: ``(table, slots)`` when a request of the batch has sampling
                penalties: the penalty table and each request's slot (host ints, 0 = none);
                the post graph variant that penalises each row for its tree path replays
                (captured at its first use). None = no penalties.
            max_accept_pinned: ``int64 [B]`` page-locked caps whose values the device reads
                when the copy runs (a deferred mask build's: written by the mask workers
                before their flags, which the bitmask upload the post graph waits for waits
                on); copied on every step. Not with ``max_accept_cpu``.

        Returns:
            ``(VerifyResult [B, N], num_real [B] int64 real drafts per request)``, views of
            static buffers valid until the next verify.

        Raises:
            ValueError: ``fwd`` was not produced by a CUDA graph, or no select/verify function
                is installed.
        """
        g = fwd.graph
        if g is None or self.graphs is None or self.staging is None:
            raise ValueError("greedy_verify needs a verify output replayed from a CUDA graph")
        if self.select_verify is None:
            raise ValueError("greedy_verify needs set_select_verify() first")
        bsz = fwd.seq_lens.shape[0]
        staged_cap = None
        if max_accept_pinned is not None:
            caps = max_accept_pinned

            def staged_cap(cap: torch.Tensor) -> None:
                upload_pinned(caps, cap.device, out=cap[:bsz])
        elif max_accept_cpu is not None:
            staging = self.staging
            host = max_accept_cpu.to(torch.int64)

            def staged_cap(cap: torch.Tensor) -> None:
                ring = staging.ring(torch.int64)
                ring.copy_to(ring.acquire(bsz).copy_(host), cap[:bsz])

        staged_penalties = None
        if penalties is not None:
            table, slot_list = penalties
            slots_host = list(slot_list) + [0] * (g.bsz - bsz)  # dummy rows: neutral slot 0
            staging = self.staging

            def stage_slots(slots: torch.Tensor) -> None:
                ring = staging.ring(torch.int64)
                buf = ring.acquire(g.bsz)
                buf.copy_(torch.tensor(slots_host, dtype=torch.int64))
                ring.copy_to(buf, slots)

            staged_penalties = (table, stage_slots)
        result, num_real = self.graphs.run_post(g, masked, staged_cap, staged_penalties)
        return VerifyResult(accept_tokens=result.accept_tokens[:bsz],
                            accept_len=result.accept_len[:bsz],
                            accept_nodes=result.accept_nodes[:bsz]), num_real[:bsz]

    @torch.inference_mode()
    def commit_accepted_kv(self, fwd: VerifyForwardOutput, result: VerifyResult) -> None:
        """Move each accepted path's KV to consecutive positions; rejected nodes' KV is left
        in slots past the new length, where the next step overwrites it."""
        compact_accepted_kv(self.kv_pool, result.accept_nodes, fwd.seq_lens, fwd.page_table,
                            page_size=self.page_size)


def _neutral_slots(slots: torch.Tensor) -> None:
    """Stage every row of a post graph's penalty-slot input to slot 0 (a warm-up's dummy
    rows: no penalties, nothing counted)."""
    slots.zero_()


def _pad_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Requests' ``[1, n_b, H]`` rows as one ``[B, max n_b, H]`` (zeros past each ``n_b``;
    no copy for one request)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.shape[1] for p in parts)
    out = parts[0].new_zeros((len(parts), width, parts[0].shape[2]))
    for b, p in enumerate(parts):
        out[b, : p.shape[1]] = p[0]
    return out
