"""The EAGLE-3 head training loop: online target features, TTT loss, AdamW with warmup and
cosine decay, gradient clipping, resumable checkpoints, periodic export; on one process or on
``torchrun``'s N processes with ``DistributedDataParallel``.

The head is an :class:`~structspec.models.eagle_head.EagleHead` built from the same config the
loader builds for the exported checkpoint, so the trained module and the loaded one are the
same code. Its master weights are float32; on CUDA the forward runs under bf16 autocast.

Several processes (:mod:`structspec.training.distributed`): every rank holds the target and an
identical head; an optimizer step takes ``world_size * grad_accum`` batches of the shared
:class:`~structspec.training.batch_stream.BatchStream`, each rank computes the target features
and the TTT loss of its own ``grad_accum`` of them, and DDP averages the gradients, so the
step's gradient is the mean of its micro-batches' (the same as one process with
``grad_accum = world_size * grad_accum``). The LR schedule counts these global steps. Rank 0
alone writes the log, the checkpoints and the export, and decides when to stop.

Resumability: the checkpoint (``out/checkpoint/train_state.pt``) holds the head, the optimizer,
the LR schedule, the step, the batch stream's position (epoch, plan, position in it), and the
torch RNG states. Training itself draws no random numbers after the head's initialisation
(the data order comes from :func:`structspec.training.batching.plan_epoch`), so a resumed run
repeats the uninterrupted run's steps exactly.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from structspec.config import ModelConfig
from structspec.models.eagle_head import EagleHead, read_head_folder
from structspec.training.batch_stream import BatchStream, total_steps
from structspec.training.batching import collate, draft_vocabulary, plan_epoch, trainable
from structspec.training.distributed import DistContext, barrier, reduce_step
from structspec.training.export import eagle3_head_config, export_eagle3_head
from structspec.training.features import TargetFeatureExtractor, default_aux_layers
from structspec.training.sequences import TrainSequence
from structspec.training.train_config import (
    CHECKPOINT_FILE,
    EVAL_LOG_FILE,
    LOG_FILE,
    TrainEagleConfig,
)
from structspec.training.train_state import (
    Checkpoint,
    check_fingerprint,
    fingerprint,
    truncate_log,
)
from structspec.training.train_step import StepTotals, TTTLoss
from structspec.training.ttt import TTTForward, soft_targets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainResult:
    """What :func:`train_head` did.

    Attributes:
        head_dir: the exported head (``config.json`` + ``model.safetensors``).
        step: optimizer steps done in total (including those before a resume).
        total_steps: the schedule's length.
        last: the last step's log record (loss, per-step top-1 agreement, lr, tokens/s), or
            None when no step ran in this call.
        last_eval: the last evaluation's record (``step``, ``loss``, ``acc`` per TTT step,
            ``tokens``), or None when none ran in this call (no ``eval_sequences``, or a resumed
            run that had already evaluated its last step).
    """

    head_dir: Path
    step: int
    total_steps: int
    last: dict[str, Any] | None
    last_eval: dict[str, Any] | None = None


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / span)))


def eval_batches(seqs: list[TrainSequence], *, max_tokens: int, batch_tokens: int,
                 max_len: int) -> list[list[int]]:
    """The evaluation's batches (index lists into ``seqs``): the trainable sequences in order
    until ``max_tokens`` tokens (each counted truncated to ``max_len``; at least one sequence),
    packed like a training epoch (:func:`~structspec.training.batching.plan_epoch`, seed 0),
    so every evaluation reads the same rows."""
    chosen: list[int] = []
    total = 0
    for i, s in enumerate(seqs):
        if not trainable(s, max_len):
            continue
        n = min(len(s.token_ids), max_len)
        if chosen and total + n > max_tokens:
            break
        chosen.append(i)
        total += n
    lengths = [min(len(seqs[i].token_ids), max_len) for i in chosen]
    plan = plan_epoch(lengths, batch_tokens=batch_tokens, max_len=max_len, seed=0, epoch=0)
    return [[chosen[j] for j in batch] for batch in plan]


def _autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def build_head(cfg: TrainEagleConfig, target: nn.Module, target_config: ModelConfig,
               aux: tuple[int, ...], vocab_ids: torch.Tensor | None,
               device: torch.device) -> EagleHead:
    """A freshly initialised (seeded) float32 head on ``device``, in train mode.

    A reduced-vocabulary ``lm_head`` starts as the target's ``lm_head`` rows of its tokens.
    """
    head_cfg = eagle3_head_config(target_config, aux, cfg.draft_vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        head = EagleHead(head_cfg)
    if vocab_ids is not None:
        assert head.lm_head is not None
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight.detach()[vocab_ids.to(
                target.lm_head.weight.device)].float().cpu())
            head.d2t.copy_(vocab_ids)
    if cfg.init_from:
        init_from_export(head, cfg.init_from, target_config)
    head.to(device)
    head.rotary.reset_inv_freq()
    return head.train()


def init_from_export(head: EagleHead, path: str, target_config: ModelConfig) -> None:
    """Copy an exported EAGLE-3 head's weights (any dtype) into ``head`` (float32, CPU).

    Raises:
        FileNotFoundError: ``path`` has no config.json or weights.
        ValueError: the exported head's aux layers, vocabulary or shapes differ from the head
            this run trains (named, with both values).
    """
    src = Path(path).expanduser()
    try:  # the messages name the file or field; the prefix names the flag
        exported, tensors = read_head_folder(src, target_config)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"init_from: {e}") from None
    mine = head.config
    for name in ("aux_hidden_layers", "draft_vocab_size", "own_lm_head"):
        if getattr(exported, name) != getattr(mine, name):
            raise ValueError(f"init_from: {src} has {name}={getattr(exported, name)}, this run "
                             f"trains {name}={getattr(mine, name)}")
    head.load_tensors(tensors, source=f"init_from {src}")


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's option for "no buffer broadcast before each forward": ``forward_sync_buffers``
    where torch has it (2.13; ``broadcast_buffers`` warns there as deprecated), else
    ``broadcast_buffers`` (2.11). The head's buffers (``d2t``, rotary frequencies) are the
    same on every rank, so the one init-time sync the new option keeps changes nothing."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def train_head(cfg: TrainEagleConfig, target: nn.Module, target_config: ModelConfig,
               seqs: list[TrainSequence], *, device: torch.device, dtype: torch.dtype,
               dist_ctx: DistContext | None = None,
               eval_seqs: list[TrainSequence] | None = None) -> TrainResult:
    """Train (or, with ``cfg.resume``, continue training) an EAGLE-3 head on ``seqs`` and
    export it to ``cfg.out``.

    Args:
        target: the loaded target model (eval, no grads) on ``device`` in ``dtype``.
        seqs: the training sequences (those without a countable response row are skipped).
        device, dtype: the target's device and dtype (the head's autocast dtype).
        dist_ctx: this process's place in a ``torchrun`` job (default: one process). Every
            rank must pass the same ``cfg`` and ``seqs``.
        eval_seqs: sequences to evaluate on (``cfg.eval_every``; never trained on); rank 0
            alone evaluates and writes ``eval_log.jsonl``.

    Raises:
        ValueError: no sequence has a response to train on; a token id outside the target's
            vocabulary (training or eval sequences); eval sequences with no response to
            count; a ``resume`` checkpoint from a different run (the field is named).
        FileNotFoundError: ``resume`` without a checkpoint.
    """
    ctx = dist_ctx or DistContext()
    out = Path(cfg.out)
    vocab = target_config.vocab_size
    bad = next((i for i, s in enumerate(seqs) if s.token_ids and max(s.token_ids) >= vocab),
               None)
    if bad is not None:
        raise ValueError(f"sequences: sequence {bad} has a token id >= the target's vocab_size "
                         f"{vocab} (sequences from another model?)")
    seqs = [s for s in seqs if trainable(s, cfg.max_seq_len)]
    if not seqs:
        raise ValueError("sequences: no sequence has a response of 2+ tokens to train on")
    eval_plan: list[list[int]] = []
    if eval_seqs:
        if any(s.token_ids and max(s.token_ids) >= vocab for s in eval_seqs):
            raise ValueError(f"eval_sequences: a token id >= the target's vocab_size {vocab} "
                             "(sequences from another model?)")
        eval_plan = eval_batches(eval_seqs, max_tokens=cfg.eval_max_tokens,
                                 batch_tokens=cfg.batch_tokens, max_len=cfg.max_seq_len)
        if not eval_plan:
            raise ValueError("eval_sequences: no sequence has a response of 2+ tokens to "
                             "evaluate on")
    lengths = [min(len(s.token_ids), cfg.max_seq_len) for s in seqs]
    aux = cfg.aux_hidden_layers or default_aux_layers(target_config.num_hidden_layers)
    per_step = ctx.world * cfg.grad_accum
    total = total_steps(cfg.steps, cfg.epochs, lengths, batch_tokens=cfg.batch_tokens,
                        max_len=cfg.max_seq_len, seed=cfg.seed, batches_per_step=per_step)
    vocab_ids = (draft_vocabulary(seqs, cfg.draft_vocab_size, vocab, cfg.max_seq_len)
                 if cfg.draft_vocab_size else None)
    head = build_head(cfg, target, target_config, aux, vocab_ids, device)
    lm_w = head.lm_head.weight if head.lm_head is not None else target.lm_head.weight
    ttt = TTTForward(head, target.embed_tokens, lm_w, cfg.ttt_steps, cfg.ttt_attention)
    if cfg.compile:
        ttt.layer_step = torch.compile(ttt.layer_step, dynamic=True)  # type: ignore[method-assign]
    loss_module = TTTLoss(ttt, [cfg.ttt_decay**k for k in range(cfg.ttt_steps)])
    model: nn.Module = loss_module
    if ctx.world > 1:
        # every head parameter gets a gradient each micro-batch (ttt.py), so the fast path
        # (no unused-parameter search) holds; the head has no buffer that changes
        model = DistributedDataParallel(
            loss_module, device_ids=[device.index] if device.type == "cuda" else None,
            **_no_forward_buffer_sync())
    extractor = TargetFeatureExtractor(target, target_config, aux,
                                       max_batch_tokens=cfg.batch_tokens, device=device,
                                       dtype=dtype)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, total))
    ckpt = Checkpoint(out / CHECKPOINT_FILE)
    finger = fingerprint(cfg, seqs, aux, total, per_step)
    stream = BatchStream(lengths, batch_tokens=cfg.batch_tokens, max_len=cfg.max_seq_len,
                         seed=cfg.seed)
    step = 0
    log_path = out / LOG_FILE
    eval_log_path = out / EVAL_LOG_FILE
    if cfg.resume:
        state = ckpt.load()
        check_fingerprint(state["fingerprint"], finger)
        head.load_state_dict(state["head"])
        head.d2t.copy_(state["d2t"].to(device))
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = state["step"]
        stream.load(state)
        torch.set_rng_state(state["rng_cpu"])
        if device.type == "cuda" and state.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(state["rng_cuda"], device)
        if ctx.is_main:
            truncate_log(log_path, step)
            truncate_log(eval_log_path, step)
    elif ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        # a new run: an earlier run's evaluations must not sit beside its log
        if eval_plan:
            eval_log_path.write_text("")
        else:
            eval_log_path.unlink(missing_ok=True)
    # the step of the eval log's last record: a resumed run that has nothing left to train
    # does not evaluate the same weights again
    evaluated_step = _last_step(eval_log_path) if ctx.is_main and cfg.resume else None

    def save() -> None:
        ckpt.save({"head": head.state_dict(), "d2t": head.d2t.cpu(),
                   "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                   "step": step, **stream.state(),
                   "rng_cpu": torch.get_rng_state(),
                   "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda"
                   else None,
                   "fingerprint": finger})
        export_eagle3_head(head, out, target=target_config, dtype=DTYPES[cfg.export_dtype])

    def batch_inputs(batch: list[TrainSequence]) -> tuple[torch.Tensor, ...]:
        """A micro-batch's loss inputs: ``(ids, aux_hidden, lengths, num_prompt, probs,
        top1)`` (the target's ``[B, T, V]`` logits are dropped here: only the probabilities
        are kept)."""
        ids, lens, prompt = collate(batch, cfg.max_seq_len, device)
        feats = extractor(ids)
        targets = soft_targets(feats.logits, head.d2t if head.lm_head is not None else None)
        return ids, feats.aux_hidden, lens, prompt, targets.probs, targets.top1

    def evaluate() -> dict[str, Any]:
        """The TTT loss and top-1 agreement per TTT step on the eval batches (no gradient,
        the same autocast as training), appended to the eval log."""
        totals = StepTotals(cfg.ttt_steps, device)
        with torch.no_grad():
            for indices in eval_plan:
                batch = [eval_seqs[i] for i in indices]  # type: ignore[index]
                inputs = batch_inputs(batch)
                with _autocast(device, dtype):
                    loss, step_loss, correct, count = loss_module(*inputs)
                totals.add(loss, step_loss, correct, count, rows=len(batch),
                           tokens=int(inputs[2].sum()))
                del inputs
        rec = totals.record(totals.values, len(eval_plan))
        record = {"step": step, "loss": rec["loss"], "acc": rec["acc"],
                  "step_loss": rec["step_loss"], "rows": rec["rows"], "tokens": rec["tokens"]}
        with open(eval_log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return record

    # the statistics travel in the process group's collectives: on the GPU for NCCL
    stats_device = device if ctx.backend != "gloo" else torch.device("cpu")
    bar = _progress(cfg.progress and ctx.is_main, total, step)
    last: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None
    started = time.perf_counter()
    try:
        while step < total:
            t0 = time.perf_counter()
            totals = StepTotals(cfg.ttt_steps, stats_device)
            opt.zero_grad(set_to_none=True)
            mine = stream.take_step(ctx.world, ctx.rank, cfg.grad_accum)
            for m, indices in enumerate(mine):
                batch = [seqs[i] for i in indices]
                inputs = batch_inputs(batch)
                # gradients are all-reduced once per step, at its last micro-batch
                no_sync = (model.no_sync() if isinstance(model, DistributedDataParallel)
                           and m < len(mine) - 1 else contextlib.nullcontext())
                with no_sync:
                    with _autocast(device, dtype):
                        loss, step_loss, correct, count = model(*inputs)
                    (loss / len(mine)).backward()
                totals.add(loss.detach().to(stats_device), step_loss.to(stats_device),
                           correct.to(stats_device), count.to(stats_device),
                           rows=len(batch), tokens=int(inputs[2].sum()))
                # the next micro-batch's features must not sit beside these ([B*T, V'] probs)
                del loss, inputs
            grad_norm = (float(torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm))
                         if cfg.clip_grad_norm else 0.0)
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            step += 1
            stop = bool((cfg.stop_at_step and step >= cfg.stop_at_step) or (
                cfg.time_limit_s and time.perf_counter() - started >= cfg.time_limit_s))
            sums, stop = reduce_step(totals.values, stop, ctx)
            dt = time.perf_counter() - t0
            last = {"step": step, **totals.record(sums, per_step), "lr": lr,
                    "grad_norm": round(grad_norm, 4), "ttt_attention": ttt.attention_used}
            last["tokens_per_s"] = round(last["tokens"] / dt, 1)
            if device.type == "cuda":
                last["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if ctx.is_main:
                with open(log_path, "a") as f:
                    f.write(json.dumps(last) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}",
                                acc="/".join(f"{a:.2f}" for a in last["acc"]),
                                tok_s=f"{last['tokens_per_s']:.0f}")
            # evaluate before the checkpoint: a run killed between the two then resumes from
            # the previous checkpoint, whose truncated eval log this evaluation is not in
            if ctx.is_main and eval_plan and cfg.eval_every and step % cfg.eval_every == 0 \
                    and step < total and not stop:
                last_eval = evaluate()
            if ctx.is_main and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 \
                    and step < total:
                save()
            if stop:
                break
    finally:
        if bar is not None:
            bar.close()
    if ctx.is_main:
        if eval_plan and evaluated_step != step:
            last_eval = evaluate()
        save()
    barrier(ctx)  # every rank returns once the export is on disk
    return TrainResult(head_dir=out, step=step, total_steps=total, last=last,
                       last_eval=last_eval)


def _last_step(path: Path) -> int | None:
    """The ``step`` of the last record of the JSON-lines log ``path`` (None: no record)."""
    if not path.is_file():
        return None
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    return int(json.loads(lines[-1])["step"]) if lines else None


def _progress(enabled: bool, total: int, initial: int) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train-eagle", unit="step")
