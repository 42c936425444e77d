"""Target selection and tree verification after a forward: the one implementation.

:func:`select_verify` is the function the scheduler composes once (sampling penalties per tree
path + grammar mask application + target selection +
:func:`~structspec.draft_tree.verify.verify_paths` + the real-draft count + the penalised
requests' output counts) and hands to the runner (:meth:`ModelRunner.set_select_verify`),
whose post-forward CUDA graph records it for greedy graph-replayed verifies.
:class:`SelectVerifyPhase` runs the step's selection phase: that graph replay, or the same
function eagerly (sampling, eager forwards, prefill) with
:func:`~structspec.layers.sampler.sample_rows` as the selection; then the accepted KV is
compacted (the runner's) and the results start their way to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from structspec.core import stop_token_set
from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.verify import VerifyResult, verify_paths
from structspec.grammar.bitmask import apply_bitmask_
from structspec.grammar.tree_mask import GrammarMaskResult
from structspec.layers.bad_words import WordBan, ban_bad_words_
from structspec.layers.penalties import PenaltyInputs, apply_penalties_, count_accepted_
from structspec.layers.sampler import SamplingBatch, sample_rows
from structspec.layers.stop_ban import StopBan, ban_stop_tokens_
from structspec.runner.model_runner import ModelRunner, VerifyForwardOutput
from structspec.scheduler.logprobs import record_logprobs
from structspec.scheduler.penalty_slots import PenaltySlots
from structspec.scheduler.pending import PendingStep
from structspec.scheduler.request import Req
from structspec.staging import stack_to_device, to_device, upload_pinned


def select_verify(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    ancestor_mask: torch.Tensor,
    max_accept_drafts: torch.Tensor | None,
    penalties: PenaltyInputs | None = None,
    select: Callable[[torch.Tensor], torch.Tensor] | None = None,
    stop_ban: StopBan | None = None,
    word_ban: WordBan | None = None,
) -> tuple[VerifyResult, torch.Tensor]:
    """Penalise, mask, choose a target token per node row, verify the trees. No host sync.

    Args:
        logits: ``[B * N, V]`` float32 (row ``b * N + i`` = node i of request b), on the
            device; masked in place.
        bitmask: ``[B * N, W]`` int32 grammar bitmask on the same device, or None (no mask).
        draft_tokens, parents, depth: ``[B, N]`` int64 tree fields (see
            :class:`~structspec.draft_tree.layout.VerifyTree`).
        ancestor_mask: ``[B, N, N]`` bool.
        max_accept_drafts: ``[B]`` int64 cap on accepted drafts (a grammar walk timed out),
            or None.
        penalties: the step's penalty table and ``[B]`` slots (None: no request of the batch
            has penalties; nothing is done). Each row is penalised for its own tree path
            before the mask (:func:`~structspec.layers.penalties.apply_penalties_`), and the
            committed runs are counted into the slots after verification.
        select: ``[R, V] -> [R]`` int64 target per row; None = argmax (greedy; what the
            post-forward CUDA graph records).
        stop_ban: the requests still short of their ``min_tokens``: their stop tokens are
            banned at the rows below it, after the mask
            (:func:`~structspec.layers.stop_ban.ban_stop_tokens_`); None: none.
        word_ban: the requests' multi-token ``bad_words``: each row's matching words' last
            tokens are banned for its own path, after the mask
            (:func:`~structspec.layers.bad_words.ban_bad_words_`); None: none.

    Returns:
        ``(VerifyResult, num_real [B] int64 real, non-padding drafts per request)``. A
        request whose logits are not finite (NaN or inf after the mask: a model fault) gets
        ``accept_len`` 0, no committed token; the scheduler ends it with an error
        (docs/architecture.md, invariant 5) and the other rows are untouched.
    """
    if penalties is not None:
        apply_penalties_(logits, penalties, draft_tokens, ancestor_mask)
    if bitmask is not None:
        apply_bitmask_(logits, bitmask)
    if stop_ban is not None:
        ban_stop_tokens_(logits, depth, stop_ban)
    if word_ban is not None:
        ban_bad_words_(logits, draft_tokens, parents, depth, word_ban)
    bsz, n = draft_tokens.shape
    if select is None:
        targets = logits.argmax(dim=-1)
        # argmax takes a NaN as the largest value, so a row holding any NaN (or +inf, or
        # nothing but -inf) selects a non-finite logit: one gather finds them, not a pass
        # over the whole [B * N, V] logits.
        row_ok = torch.isfinite(logits.gather(1, targets.view(-1, 1))).view(bsz, n)
    else:
        # The same test on the row maxima (max propagates NaN; masked logits are -inf, so
        # "all finite" would not do). Sampling turns a NaN into NaN probabilities, which the
        # sampler refuses (CPU) or trips a device assert on (CUDA), failing the whole batch:
        # such rows are neutralized before sampling; their requests are dropped below.
        row_ok = torch.isfinite(logits.amax(dim=-1))
        logits.masked_fill_(~row_ok.view(-1, 1), 0.0)
        row_ok = row_ok.view(bsz, n)
    targets = (targets if select is None else select(logits)).view(bsz, n)
    result = verify_paths(draft_tokens, parents, depth, ancestor_mask, targets, max_accept_drafts)
    result.accept_len.mul_(row_ok.all(dim=1))  # 0: non-finite logits, nothing committed
    if penalties is not None:
        count_accepted_(penalties, result.accept_tokens, result.accept_len)
    num_real = (draft_tokens[:, 1:] >= 0).sum(dim=1)
    return result, num_real


@dataclass(frozen=True)
class Selection:
    """How a step's targets are chosen, decided before its mask is built.

    Attributes:
        sampling: per-row sampling parameters (device tensors unless all greedy).
        graph_bitmask: for a greedy batch whose verify forward was a CUDA-graph replay, the
            post graph's static ``[B_bucket * N, W]`` int32 bitmask (the mask build uploads
            straight into it); None = the eager path.
        stop_ban: the requests still short of their ``min_tokens`` (their steps take the
            eager path: the post graph does not ban), or None.
        word_ban: the requests' multi-token ``bad_words`` (eager path too), or None.
    """

    sampling: SamplingBatch
    graph_bitmask: torch.Tensor | None
    stop_ban: StopBan | None = None
    word_ban: WordBan | None = None


class SelectVerifyPhase:
    """Runs the selection phase of prefill and verify steps (see the module doc).

    Args:
        runner: the target runner (KV compaction, post-forward graphs, staging).
        penalties: the penalised requests' device state (their slots in the penalty table).
    """

    def __init__(self, runner: ModelRunner, penalties: PenaltySlots) -> None:
        self.runner = runner
        self.penalties = penalties
        self._pinned_pool: dict[tuple, torch.Tensor] = {}  # D2H buffers of PendingStep

    def prepare(self, reqs: Sequence[Req], num_nodes: int, device: torch.device,
                fwd: VerifyForwardOutput | None) -> Selection:
        """The step's :class:`Selection` (``fwd`` None for a prefill: always eager)."""
        sb = self._sampling_batch(reqs, num_nodes, device)
        stop_ban = self._stop_ban(reqs)
        word_ban = self._word_ban(reqs)
        graph_bitmask = None
        if fwd is not None and sb.all_greedy and stop_ban is None and word_ban is None:
            graph_bitmask = self.runner.graph_bitmask(fwd)
        return Selection(sb, graph_bitmask, stop_ban, word_ban)

    def launch(self, reqs: Sequence[Req], tree: VerifyTree, logits: torch.Tensor,
               fwd: VerifyForwardOutput | None, selection: Selection,
               mask: GrammarMaskResult | None) -> PendingStep:
        """Choose the targets under ``mask``, verify the trees, compact the accepted KV
        (verify steps); start the D2H copy of the results.

        A greedy graph-replayed verify runs all of it as one post-graph replay
        (:meth:`ModelRunner.greedy_verify`; a batch with a penalised request replays the
        post graph that also penalises, captured at its first use); other steps run
        :func:`select_verify` eagerly with :func:`sample_rows` as the selection, then
        :meth:`ModelRunner.commit_accepted_kv`.
        """
        n = tree.num_nodes
        cap_cpu = cap_pinned = None
        if mask is not None and mask.caps_pinned is not None:
            # a deferred build: the caps are known on the device only, after the workers'
            # flags (its rejected drafts are counted when it completes)
            cap_pinned = mask.caps_pinned
        elif mask is not None:
            if mask.truncated_requests:  # a tree walk timed out: bonus token only
                cap_cpu = mask.max_accept_cpu
            for req, rejected in zip(reqs, mask.rejected_by_grammar, strict=True):
                req.spec.draft_tokens_rejected_by_grammar += rejected
        if mask is not None:
            mask.wait_upload()  # a copy-stream upload lands before the kernels that read it
        graph_bitmask = selection.graph_bitmask
        slots = self.penalties.slots_of(reqs)
        if graph_bitmask is not None:
            assert fwd is not None
            if mask is not None and mask.bitmask_device.data_ptr() != graph_bitmask.data_ptr():
                graph_bitmask[: mask.bitmask_device.shape[0]].copy_(mask.bitmask_device)
            table = self.penalties.table
            result, num_real = self.runner.greedy_verify(
                fwd, masked=mask is not None, max_accept_cpu=cap_cpu,
                max_accept_pinned=cap_pinned,
                penalties=None if slots is None or table is None else (table, slots))
        else:
            tree_dev = self._tree_to_device(tree)
            cap = None if cap_cpu is None else self._to_device(cap_cpu.to(torch.int64))
            if cap_pinned is not None:  # read by the device after the workers' flags
                cap = upload_pinned(cap_pinned, logits.device)
            sb = selection.sampling
            result, num_real = select_verify(
                logits, None if mask is None else mask.bitmask_device, tree_dev.draft_tokens,
                tree_dev.parents, tree_dev.depth, tree_dev.ancestor_mask, cap,
                None if slots is None else self.penalties.inputs(slots),
                select=lambda rows: sample_rows(rows, sb, tree_dev.depth),
                stop_ban=selection.stop_ban, word_ban=selection.word_ban)
            if fwd is not None:
                self.runner.commit_accepted_kv(fwd, result)
        step = PendingStep.launch(result, num_real, self._pinned_pool)
        if any(r.params.logprobs is not None for r in reqs):
            step.on_wait = lambda runs: record_logprobs(
                reqs, logits.view(len(reqs), n, -1), result.accept_nodes, runs)
        return step

    def _stop_ban(self, reqs: Sequence[Req]) -> StopBan | None:
        """The step's :class:`StopBan`: the requests whose output is still shorter than their
        ``min_tokens`` and that have a stop token (one comparison per request when none is);
        their stop ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) staged in one
        copy."""
        rows = []
        for b, r in enumerate(reqs):
            short = r.params.min_tokens - len(r.output_ids)
            if short > 0:
                ids = stop_token_set(r.params, r.eos_token_ids)
                if ids:
                    rows.append((b, short, sorted(ids)))
        if not rows:
            return None
        width = max(len(ids) for _, _, ids in rows)
        host = torch.tensor([[b, short, *ids, *[ids[0]] * (width - len(ids))]
                             for b, short, ids in rows], dtype=torch.int64)
        dev = self._to_device(host)
        return StopBan(requests=dev[:, 0], until=dev[:, 1], tokens=dev[:, 2:])

    def _word_ban(self, reqs: Sequence[Req]) -> WordBan | None:
        """The step's :class:`WordBan`: the requests with multi-token ``bad_words``, each
        with its committed output (one check per request when none has any)."""
        entries = [(b, r.output_ids, r.bad_words.multi) for b, r in enumerate(reqs)
                   if r.bad_words is not None and r.bad_words.multi]
        return WordBan.build(entries, self._to_device) if entries else None

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Host tensor to the model device (pinned staging on CUDA; see :mod:`staging`)."""
        return to_device(host, self.runner.device, self.runner.staging)

    def _tree_to_device(self, tree: VerifyTree) -> VerifyTree:
        """A host tree on the model device: the five int64 fields in one staged copy, the bool
        ancestor mask in a second."""
        if tree.device == self.runner.device or tree.device.type != "cpu":
            return tree
        fields = ("draft_tokens", "parents", "depth", "next_token", "next_sibling")
        dev, staging = self.runner.device, self.runner.staging
        ints = stack_to_device([getattr(tree, f) for f in fields], dev, staging)
        return VerifyTree(**dict(zip(fields, ints, strict=True)),
                          ancestor_mask=to_device(tree.ancestor_mask, dev, staging))

    def _sampling_batch(self, reqs: Sequence[Req], n: int, device: torch.device) -> SamplingBatch:
        ps = [r.params for r in reqs]
        if all(p.temperature <= 0.0 for p in ps):  # SamplingParams.is_greedy, inlined
            # nothing but the flag is read: sample_rows returns the argmax first
            empty_f, empty_i = (torch.empty(0, dtype=torch.float32),
                                torch.empty(0, dtype=torch.int64))
            return SamplingBatch(temperature=empty_f, top_k=empty_i, top_p=empty_f,
                                 min_p=empty_f, rows_per_request=n, seeds=empty_i,
                                 starts=empty_i,
                                 all_greedy=True, use_top_k=False, use_top_p=False,
                                 use_min_p=False)

        def col(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return self._to_device(torch.tensor(values, dtype=dtype).repeat_interleave(n))

        # every request draws output position p with a uniform keyed by (its sampling seed,
        # p) (layers/keyed_sampling.py): each row's seed and its request's output length,
        # staged in one copy (the rows are all of them, in order)
        keyed = torch.tensor([[r.sampling_seed, len(r.output_ids)] for r in reqs],
                             dtype=torch.int64).repeat_interleave(n, dim=0)
        seeds, starts = self._to_device(keyed.T.contiguous())
        return SamplingBatch(
            temperature=col([p.temperature for p in ps], torch.float32),
            top_k=col([p.top_k for p in ps], torch.int64),
            top_p=col([p.top_p for p in ps], torch.float32),
            min_p=col([p.min_p for p in ps], torch.float32),
            rows_per_request=n,
            all_greedy=False,
            use_top_k=any(p.top_k > 0 for p in ps),
            use_top_p=any(p.top_p < 1.0 for p in ps),
            use_min_p=any(p.min_p > 0 for p in ps),
            top_k_max=max(p.top_k for p in ps) if all(p.top_k > 0 for p in ps) else 0,
            seeds=seeds, starts=starts,
        )
