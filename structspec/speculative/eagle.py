"""EAGLE drafter: a one-layer head over the target's features drafts an EAGLE-2 tree.

Sources: EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", arXiv:2401.15077), EAGLE-2 (Li et al., 2024, arXiv:2406.16858: dynamic draft
trees, see :mod:`structspec.speculative.expansion`), EAGLE-3 (Li et al., 2025, "EAGLE-3:
Scaling up Inference Acceleration of Large Language Models via Training-Time Test",
arXiv:2503.01840). The head network, its checkpoint formats (EAGLE-1/2 and EAGLE-3) and its
loader live beside the other models, in :mod:`structspec.models.eagle_head`.

Committed entries (see :mod:`structspec.speculative.draft_batches`): head entry ``p`` pairs
token ``x_{p+1}`` with target feature ``f_p`` (the target hidden state at position ``p``, which
predicted ``x_{p+1}``), at rotary position ``p``. With ``L`` history tokens the head holds
``L - 1`` entries; the output of the last one (``~f_{L-1}``) gives the root's children and is
fed, paired with each child token, to the first expansion step.

Target features arrive through :meth:`EagleDrafter.on_target_hidden`, which the scheduler calls
after every target prefill and verify forward (see its docstring) and which stores them on the
device in a slot-indexed buffer parallel to the head's KV pool: no host copies, no per-request
device ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from structspec.config import SpecConfig
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch
from structspec.models.eagle_head import EagleHead, load_eagle_head
from structspec.runner.keyed_graphs import KeyedGraphs
from structspec.speculative.base import DraftRequest
from structspec.speculative.draft_vocab import ReducedLmHead, load_draft_vocab, reduced_lm_head
from structspec.speculative.tree_drafter import (
    DraftReqState,
    TreeDrafter,
    default_draft_pages,
    target_graph_max_len,
    target_graph_options,
)


class EagleDrafter(TreeDrafter):
    """EAGLE-2 tree drafting with an EAGLE-1/2 or EAGLE-3 head over the target's features.

    Needs the scheduler to call :meth:`on_target_hidden` after every target prefill and
    verify forward, with the target forwards run with ``aux_hidden_layers =
    self.aux_hidden_layers`` (empty for EAGLE-1/2). A request whose features have not arrived
    is proposed as root + padding.

    Args:
        spec: ``draft_model`` = the head directory, ``num_draft_tokens``, ``depth``, ``topk``.
        target: the target :class:`~structspec.runner.model_runner.ModelRunner` (its
            ``model.embed_tokens``, ``model.compute_logits``, ``model_config``, ``page_size``,
            ``kv_pool.num_pages`` are used).
        device, dtype: where and in which dtype the head, its KV and the features live.
        num_pages: head KV pool pages (default: the target's plus ``max_batch_size``
            requests' scratch pages).
        max_batch_size: used only for the default ``num_pages``.
        head: an already built head (tests) instead of loading ``spec.draft_model``.
        use_cuda_graph: replay proposes from CUDA graphs (CUDA only, and only when the target
            uses graphs too; see :func:`~structspec.speculative.tree_drafter.target_graph_options`).
        cuda_graph_batch_sizes: graph batch buckets (default: the target's).
    """

    name = "eagle"

    def __init__(
        self,
        spec: SpecConfig,
        *,
        target: Any,
        device: torch.device | str,
        dtype: torch.dtype,
        num_pages: int | None = None,
        max_batch_size: int = 64,
        head: EagleHead | None = None,
        use_cuda_graph: bool = True,
        cuda_graph_batch_sizes: Sequence[int] | None = None,
    ) -> None:
        device = torch.device(device)
        if head is None:
            if not spec.draft_model:
                raise ValueError("speculative_algorithm='eagle' needs draft_model=PATH "
                                 "(an EAGLE head directory)")
            head = load_eagle_head(spec.draft_model, target.model_config, device=device,
                                   dtype=dtype)
        if getattr(target, "kernels", None) == "triton":
            # the target's fused kernels for the head too: a draft forward's few rows make its
            # time the count of kernel launches
            # the rotary table covers the positions the engine serves: its graphs' longest
            # sequence when it has graphs, else the model's (a 1M-token model's full table
            # would hold ~0.5 GB for a drafter that never sees such positions)
            served = target_graph_max_len(target)
            head.set_kernels("triton", max_positions=served if served is not None else
                             int(target.model_config.max_position_embeddings))
        self.head = head
        self.target_model = target.model
        page_size = int(target.page_size)
        if num_pages is None:
            num_pages = default_draft_pages(spec, target, max_batch_size)
        lc = head.config.layer
        pool = KVPool(num_layers=head.num_layers, num_pages=num_pages, page_size=page_size,
                      num_kv_heads=lc.num_key_value_heads, head_dim=lc.head_dim, dtype=dtype,
                      device=device)
        super().__init__(spec, pool, device=device,
                         **target_graph_options(target, use_cuda_graph, cuda_graph_batch_sizes))
        #: ``[num_slots, H]`` stored (projected) target feature of each position, indexed
        #: like the head's KV slots.
        self.features = torch.zeros((pool.num_slots, lc.hidden_size), dtype=dtype, device=device)
        #: target decoder layers the target forwards must return (EAGLE-3), else ().
        self.aux_hidden_layers: tuple[int, ...] = head.config.aux_hidden_layers
        # a head with its own (reduced-vocabulary) lm_head maps draft ids to target ids; one
        # that shares the target's lm_head drafts target ids directly, or the ids of its
        # draft vocabulary when it ships one (draft_vocab.py: the projection is most of a
        # head forward)
        self.vocab_map = head.d2t if head.lm_head is not None else None
        #: the target's lm_head over the draft vocabulary's rows, or None (full vocabulary)
        self.reduced_lm_head: ReducedLmHead | None = None
        if head.lm_head is None and spec.draft_vocab == "auto" and spec.draft_model:
            ids = load_draft_vocab(spec.draft_model, target.model_config.vocab_size)
            if ids is not None:
                self.reduced_lm_head = reduced_lm_head(self.target_model, ids)
                if self.reduced_lm_head is not None:
                    self.reduced_lm_head.set_kernels(head.kernels)
                    self.vocab_map = ids.to(device)
        self._prev_out: torch.Tensor | None = None
        #: graphs of the feature store after a verify (CUDA graphs on), else None: its
        #: inputs are the verify graphs' static outputs, so its ~8 launches (~0.5 ms of host
        #: at batch 1 on the H200 host) replay as one (runner/keyed_graphs.py)
        self.store_graphs: KeyedGraphs[None] | None = None
        if self.graphs is not None and self.staging is not None:
            self.store_graphs = KeyedGraphs(self._store_graphable, self.device,
                                            self.staging.ring(torch.int64))
        #: request id -> the ``seq_len`` of a verify whose features were stored before its
        #: accepted counts were known (``num_rows=None``), until :meth:`commit_target_hidden`
        self._uncommitted: dict[str, int] = {}

    # -- the hook ----------------------------------------------------------------------------

    @torch.inference_mode()
    def on_target_hidden(
        self,
        reqs: Sequence[DraftRequest],
        hidden_states: torch.Tensor,
        rows: torch.Tensor | None,
        num_rows: Sequence[int] | None,
        aux_hidden_states: Sequence[torch.Tensor] = (),
    ) -> None:
        """Store the target features of newly committed positions (no host syncs).

        Request ``b``'s ``j``-th stored feature (``j < num_rows[b]``) is that of position
        ``reqs[b].seq_len + j``, taken from query row ``rows[b, j]`` of the target forward.

        * after a prefill of prompts at positions ``0..P-1``: ``DraftRequest(id, prompt, 0)``,
          ``rows=None`` (row j = position j), ``num_rows = [P_b]``;
        * after a verify: the ``DraftRequest`` of that step (``seq_len`` = committed KV length
          before the verify, node 0's position), ``rows = VerifyResult.accept_nodes`` (``[B, N]``,
          node 0 then the accepted drafts), ``num_rows = accept_len`` as host ints (the
          committed run length, bonus included: its last node's row predicted the bonus);
        * or the same before the verify's results reach the host: ``num_rows=None`` stores
          every column of ``rows`` (positions ``seq_len .. seq_len + R - 1``; past the
          accepted run a column is -1 and stores node 0's feature, never read: a feature
          counts only once :meth:`commit_target_hidden` gives the run lengths, and the next
          verify's store overwrites those positions). The scheduler queues this right behind
          the verify's post graph, so its launches hide under the forward instead of leaving
          the GPU idle while the host commits.

        Args:
            hidden_states: ``[B, Q, H]`` final (post-norm) target hidden states (EAGLE-1/2).
            rows: ``[B, R]`` int64 query row per stored position (device), or None.
            num_rows: host ints, valid entries of ``rows[b]``; None: not known yet (above).
            aux_hidden_states: the forward's ``ModelOutput.aux_hidden_states`` for
                ``self.aux_hidden_layers`` (EAGLE-3; each ``[B, Q, H]``).

        Raises:
            ValueError: EAGLE-3 head but the aux layers are missing; ``num_rows=None``
                without ``rows``.
        """
        early = num_rows is None
        if num_rows is None:
            if rows is None:
                raise ValueError("on_target_hidden(num_rows=None) needs rows (a verify's "
                                 "accept_nodes)")
            num_rows = [int(rows.shape[1])] * len(reqs)
        bsz = hidden_states.shape[0]
        if self.head.config.version == 3:
            if len(aux_hidden_states) != len(self.aux_hidden_layers):
                raise ValueError(f"EAGLE-3 head needs the target's aux hidden states of layers "
                                 f"{self.aux_hidden_layers}; got {len(aux_hidden_states)}")
            sources: tuple[torch.Tensor, ...] = tuple(aux_hidden_states)
        else:
            sources = (hidden_states,)
        width = max(num_rows, default=0)
        if width == 0:
            return
        # The destination slots are host bookkeeping, in numpy: a few small arrays per step
        # (torch's per-op overhead on host tensors cost more than the work, on the critical
        # path of every batch-1 step)
        seq = np.empty(bsz, dtype=np.int64)
        count = np.array(num_rows, dtype=np.int64)  # a copy: rows dropped below are zeroed
        for b, r in enumerate(reqs):
            st = self.state(r.request_id)
            end = r.seq_len + num_rows[b]
            seq[b] = r.seq_len
            if not self.ensure_capacity(st, end + self.scratch + 1) or r.seq_len > st.feat_len:
                count[b] = 0  # no room, or a gap in the features: never drafted
                self._uncommitted.pop(r.request_id, None)
            elif early:
                # (the room for all R positions, at most one page more than the run needs:
                # the draft pool holds the target's pages plus every request's scratch)
                self._uncommitted[r.request_id] = r.seq_len
            else:
                st.feat_len = max(st.feat_len, end)
        page_rows = self.page_rows([r.request_id for r in reqs])
        table = page_rows.take(self.page_table.width(page_rows.rows.tolist()))
        col = np.arange(width)
        valid = col < count[:, None]
        pos = np.where(valid, seq[:, None] + col, 0)
        pages = np.take_along_axis(table, pos // self.page_size, axis=1)
        slots = np.where(valid, pages * self.page_size + pos % self.page_size, 0)
        if self.store_graphs is not None and early and rows is not None:
            self.store_graphs.run((*sources, rows), slots.reshape(-1))
            return
        if rows is None:
            rows = torch.arange(width, device=hidden_states.device).expand(bsz, width)
        self._store_features(sources, rows[:, :width],
                             self._to_device(torch.from_numpy(slots.reshape(-1))))

    def _store_graphable(self, *inputs: torch.Tensor) -> None:
        """:meth:`_store_features` with flat arguments ``(*sources, rows, slots)``."""
        self._store_features(inputs[:-2], inputs[-2], inputs[-1])

    def _store_features(self, sources: Sequence[torch.Tensor], rows: torch.Tensor,
                        slots: torch.Tensor) -> None:
        """The device half of :meth:`on_target_hidden` (no host syncs; graph-capturable):
        ``features[slots] = project_target(cat(sources)[b, rows[b, j]])``.

        Args:
            sources: ``[B, Q, H]`` each, concatenated on the last dimension.
            rows: ``[B, R]`` int64 query rows (``-1`` reads row 0).
            slots: ``[B * R]`` int64 destination slots (device; 0 = the sink).
        """
        feats = torch.cat(list(sources), dim=-1) if len(sources) > 1 else sources[0]
        bsz, width = rows.shape
        gathered = torch.gather(feats, 1, rows.clamp(min=0).unsqueeze(2).expand(
            bsz, width, feats.shape[2]))
        stored = self.head.project_target(gathered.to(self.features.dtype))
        self.features.index_copy_(0, slots, stored.reshape(-1, stored.shape[-1]))

    def commit_target_hidden(self, reqs: Sequence[DraftRequest],
                             num_rows: Sequence[int]) -> None:
        """The run lengths of a verify whose features :meth:`on_target_hidden` stored with
        ``num_rows=None``: request ``b``'s features now count up to position
        ``seq_len + num_rows[b]`` exactly (the positions past it hold rejected nodes' rows).
        Requests stored without room, or with a gap, stay as they were."""
        for r, n in zip(reqs, num_rows, strict=True):
            seq_len = self._uncommitted.pop(r.request_id, None)
            st = self.states.get(r.request_id)
            if seq_len is not None and st is not None:
                st.feat_len = seq_len + n

    def release(self, request_id: str) -> None:
        """:meth:`TreeDrafter.release`, and any features stored but not committed."""
        self._uncommitted.pop(request_id, None)
        super().release(request_id)

    # -- TreeDrafter interface ---------------------------------------------------------------

    def num_entries(self, req: DraftRequest) -> int:
        """``len(token_ids) - 1``: entry p pairs ``token_ids[p + 1]`` with feature ``f_p``."""
        return len(req.token_ids) - 1

    def entry_tokens(self, req: DraftRequest, start: int, end: int) -> list[int]:
        """Entry p's input token is ``token_ids[p + 1]``."""
        return list(req.token_ids[start + 1 : end + 1])

    def ready(self, req: DraftRequest, state: DraftReqState, num_entries: int) -> bool:
        """Drafted only once every entry's target feature has been stored."""
        return num_entries >= 1 and state.feat_len >= num_entries

    def _logp(self, out: torch.Tensor) -> torch.Tensor:
        """Head output ``[..., H]`` -> float32 log-probs over the draft vocabulary."""
        x = self.head.final_norm(out)
        if self.head.lm_head is not None:
            logits = F.linear(x, self.head.lm_head.weight).float()
        elif self.reduced_lm_head is not None:
            logits = self.reduced_lm_head(x)
        else:
            logits = self.target_model.compute_logits(x.reshape(-1, x.shape[-1])).view(
                *x.shape[:-1], -1)
        return torch.log_softmax(logits, dim=-1)

    def extend_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Catch-up over stored features; returns root log-probs ``[b, V']`` and the last
        rows' outputs ``[b, H]`` (the root's fed-back feature)."""
        feats = self.features[fb.out_slots]  # entry p's feature lives at position p's slot
        embeds = self.target_model.embed_tokens(fb.input_ids)
        out = self.head(fb, self.kv_pool, embeds, feats)
        assert fb.logits_indices is not None
        last = out.reshape(-1, out.shape[-1])[fb.logits_indices]
        return self._logp(last), last

    def step_forward(
        self, fb: ForwardBatch, parent: torch.Tensor, root_state: torch.Tensor | None, step: int
    ) -> torch.Tensor:
        """Frontier forward: each node pairs its token with its parent's head output."""
        bsz, k = fb.input_ids.shape
        if step == 1:
            assert root_state is not None
            feats = root_state.unsqueeze(1).expand(bsz, k, root_state.shape[-1])
        else:
            assert self._prev_out is not None
            prev = self._prev_out
            feats = torch.gather(prev, 1, parent.unsqueeze(2).expand(bsz, k, prev.shape[-1]))
        embeds = self.target_model.embed_tokens(fb.input_ids)
        out = self.head(fb, self.kv_pool, embeds, feats)
        self._prev_out = out
        return self._logp(out)


def create_eagle_drafter(
    spec: SpecConfig, *, target: Any, device: torch.device | str, dtype: torch.dtype,
    max_batch_size: int = 64, **context: Any,
) -> EagleDrafter:
    """Registry factory of ``"eagle"`` (:mod:`structspec.speculative.registry`): the head is
    read from ``spec.draft_model``; the engine's ``load_format`` and ``seed`` do not apply
    (``context`` is ignored)."""
    return EagleDrafter(spec, target=target, device=device, dtype=dtype,
                        max_batch_size=max_batch_size)
