"""``structspec train-eagle``: the subcommand's flags and its runner (registered by
:mod:`structspec.cli`). Imports nothing heavy at module level: ``structspec --help`` stays
fast."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from typing import Any

from structspec.training.train_config import STAGES, TTT_ATTENTION, TrainEagleConfig

#: TrainEagleConfig field -> the flag that sets it (for error messages).
FLAG_OF_FIELD = {f.name: "--" + f.name.replace("_", "-") for f in fields(TrainEagleConfig)}
FLAG_OF_FIELD["time_limit_s"] = "--time-limit"
FLAG_OF_FIELD["data_time_limit_s"] = "--data-time-limit"


def add_train_eagle_parser(sub: Any, formatter_class: type[argparse.HelpFormatter]) -> None:
    """Add the ``train-eagle`` subcommand to ``sub`` (an argparse subparsers object)."""
    d = TrainEagleConfig(out="")
    p = sub.add_parser(
        "train-eagle", help="train an EAGLE-3 draft head for a model by self-distillation",
        description="Generate training data with the model itself, then train an EAGLE-3 head "
                    "(one decoder layer over three target layers' features, training-time "
                    "test) and write it in the sglang/SpecForge layout; use it with "
                    "--speculative-algorithm eagle --draft-model OUT. Exit status: 0 ok, "
                    "1 a --data-parallel rank crashed, 2 bad command line or input.",
        formatter_class=formatter_class)
    p.add_argument("--out", required=True, help="output directory (head, sequences, "
                                                "checkpoint, log)")
    p.add_argument("--model", default=None, help="target checkpoint (HF directory or .gguf; "
                                                 "default: SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="dummy: seeded random target weights from config.json alone "
                        "(throughput sizing)")
    p.add_argument("--stage", choices=STAGES, default=d.stage,
                   help="data: generate the sequences; train: train on them; all: both")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                   help="target dtype and head autocast dtype (auto: bfloat16 on CUDA)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of data, order and init")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("data stage")
    g.add_argument("--sequences", default=None, nargs="+", metavar="FILE",
                   help="train on these prebuilt sequences files (concatenated) instead of "
                        "OUT/sequences.npz (skips the data stage)")
    g.add_argument("--num-sharegpt", type=int, default=d.num_sharegpt,
                   help="ShareGPT conversation prompts")
    g.add_argument("--num-sharegpt-later", type=int, default=d.num_sharegpt_later,
                   help="later human turns of the train-side ShareGPT conversations, each "
                        "sent alone")
    g.add_argument("--num-sharegpt-held-out", type=int, default=d.num_sharegpt_held_out,
                   help="held-out ShareGPT first turns (an evaluation file for "
                        "--eval-sequences; never trained on; with the other prompt counts 0)")
    g.add_argument("--num-extraction", type=int, default=d.num_extraction,
                   help="JSON extraction prompts")
    g.add_argument("--num-schema", type=int, default=d.num_schema,
                   help="JSON Schema prompts")
    g.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="response length limit of the generation")
    g.add_argument("--gen-batch-size", type=int, default=d.gen_batch_size,
                   help="requests generated at once")
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help="generation temperature (0 = greedy)")
    g.add_argument("--data-time-limit", type=float, default=d.data_time_limit_s,
                   metavar="SECONDS",
                   help="add no prompt after this many seconds from the data stage's start "
                        "(model load included), drop the requests in flight, save and exit 0 "
                        "(0: no limit); --resume continues. Sequences are saved as they come "
                        "(OUT/sequences.part-*.npz) and merged into OUT/sequences.npz")
    g.add_argument("--data-parallel", type=int, default=d.data_parallel, metavar="N",
                   help="N engine processes, round-robin over the visible CUDA devices (N above "
                        "the GPU count shares GPUs: a small, host-bound target answers faster "
                        "with 2-4 engines per GPU; all on the CPU with --device cpu); process R answers the prompts whose index is R modulo "
                        "N and saves its own shards; the time limit, SIGTERM and --resume "
                        "hold for all, and the shards are merged into OUT/sequences.npz")
    t = p.add_argument_group("train stage")
    t.add_argument("--steps", type=int, default=d.steps,
                   help="optimizer steps (0: --epochs passes over the data)")
    t.add_argument("--epochs", type=int, default=d.epochs, help="passes when --steps is 0")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW decay")
    t.add_argument("--batch-tokens", type=int, default=d.batch_tokens,
                   help="padded tokens per batch (rows x width) of one process")
    t.add_argument("--grad-accum", type=int, default=d.grad_accum, metavar="N",
                   help="batches each process accumulates per optimizer step; a step's global "
                        "batch is WORLD_SIZE x N x --batch-tokens. Several GPUs: torchrun "
                        "--nproc-per-node G -m structspec train-eagle --stage train ...")
    t.add_argument("--max-seq-len", type=int, default=d.max_seq_len,
                   help="longest row; longer sequences are truncated")
    t.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                   help="training-time-test steps unrolled")
    t.add_argument("--ttt-decay", type=float, default=d.ttt_decay,
                   help="loss weight of TTT step k is decay**k")
    t.add_argument("--ttt-attention", choices=TTT_ATTENTION, default=d.ttt_attention,
                   help="TTT attention form (same result): split = causal SDPA + the diagonal "
                        "keys merged exactly; dense = masked SDPA over all steps' keys "
                        "(reference, K^2 T^2 scores); auto = split, checked against dense on "
                        "the first batch on CUDA (falls back to dense with a warning)")
    t.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="LR warmup steps")
    t.add_argument("--clip-grad-norm", type=float, default=d.clip_grad_norm,
                   help="gradient clipping norm (0: off)")
    t.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="checkpoint and export every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true",
                   help="data: skip the prompts OUT's saved shards hold (same data options); "
                        "train: continue from OUT's checkpoint (same data and options)")
    t.add_argument("--init-from", default=d.init_from, metavar="HEAD_DIR",
                   help="start from an exported EAGLE-3 head's weights (fine-tune: new data or "
                        "more steps, fresh optimizer and schedule) instead of a random init")
    t.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size,
                   help="0: share the target's lm_head (full vocabulary); N: the head's own "
                        "lm_head over the N most frequent response tokens (d2t/t2d maps)")
    t.add_argument("--aux-hidden-layers", type=int, nargs=3, default=None,
                   metavar=("LOW", "MID", "HIGH"),
                   help="target layers of the feature (default: 1, L/2-1, L-4)")
    t.add_argument("--export-dtype", default=d.export_dtype,
                   choices=["bfloat16", "float16", "float32"], help="dtype of the written head")
    t.add_argument("--compile", action="store_true", help="torch.compile the head's TTT step")
    t.add_argument("--stop-at-step", type=int, default=d.stop_at_step,
                   help="stop (checkpoint + export) at this step; --resume continues")
    t.add_argument("--time-limit", type=float, default=d.time_limit_s,
                   help="stop (checkpoint + export) after this many seconds of training")
    t.add_argument("--eval-sequences", default=None, nargs="+", metavar="FILE",
                   help="evaluate the head on these sequences (never trained on; e.g. a data "
                        "stage of --num-sharegpt-held-out prompts): loss and top-1 agreement "
                        "per TTT step in OUT/eval_log.jsonl")
    t.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="evaluate every N steps and at the end (0: at the end only; needs "
                        "--eval-sequences)")
    t.add_argument("--eval-max-tokens", type=int, default=d.eval_max_tokens,
                   help="tokens of the eval files read, in order (the same at every "
                        "evaluation)")


def config_from_args(args: argparse.Namespace) -> TrainEagleConfig:
    """The :class:`TrainEagleConfig` of parsed ``train-eagle`` flags."""
    return TrainEagleConfig(
        out=args.out, model=args.model, load_format=args.load_format, stage=args.stage,
        sequences=tuple(args.sequences) if args.sequences else None,
        num_sharegpt=args.num_sharegpt, num_extraction=args.num_extraction,
        num_schema=args.num_schema, num_sharegpt_later=args.num_sharegpt_later,
        num_sharegpt_held_out=args.num_sharegpt_held_out,
        eval_sequences=tuple(args.eval_sequences) if args.eval_sequences else None,
        eval_every=args.eval_every, eval_max_tokens=args.eval_max_tokens,
        max_tokens=args.max_tokens,
        gen_batch_size=args.gen_batch_size, temperature=args.temperature,
        data_time_limit_s=args.data_time_limit, data_parallel=args.data_parallel,
        steps=args.steps, grad_accum=args.grad_accum,
        epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay,
        batch_tokens=args.batch_tokens, max_seq_len=args.max_seq_len, ttt_steps=args.ttt_steps,
        ttt_decay=args.ttt_decay, ttt_attention=args.ttt_attention,
        warmup_steps=args.warmup_steps,
        clip_grad_norm=args.clip_grad_norm, seed=args.seed,
        checkpoint_every=args.checkpoint_every, resume=args.resume, init_from=args.init_from,
        draft_vocab_size=args.draft_vocab_size,
        aux_hidden_layers=tuple(args.aux_hidden_layers) if args.aux_hidden_layers else None,
        device=args.device, dtype=args.dtype, export_dtype=args.export_dtype,
        compile=args.compile, stop_at_step=args.stop_at_step, time_limit_s=args.time_limit,
        progress=not args.no_progress,
    )


def _flag_error(message: str) -> str:
    """``message`` prefixed with the flag of its leading field (``ttt_steps=0: ...`` ->
    ``--ttt-steps: ttt_steps=0: ...``)."""
    field = message.split("=", 1)[0].split(":", 1)[0].strip()
    flag = FLAG_OF_FIELD.get(field)
    return f"{flag}: {message}" if flag else message


def cmd_train_eagle(args: argparse.Namespace) -> int:
    """Run ``structspec train-eagle``; 0 on success, 2 on a bad option or input (the error
    names the flag), 1 when a ``--data-parallel`` rank crashed."""
    from structspec.training.data_parallel import DataRankError
    from structspec.training.distributed import launched_world_size
    from structspec.training.train_eagle import train_eagle

    try:
        path = train_eagle(config_from_args(args))
    except (ValueError, FileNotFoundError, MemoryError) as e:
        print(f"structspec train-eagle: {_flag_error(str(e))}", file=sys.stderr)
        return 2
    except DataRankError as e:  # its traceback went to stderr with the rank's prefix
        print(f"structspec train-eagle: {e}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") == "0":  # under torchrun: one line, not one per rank
        print(path)
    if launched_world_size() > 1:
        # A torchrun rank whose run finished: every rank passed the export barrier and the
        # process group is destroyed. Leave without the interpreter's teardown: there a
        # c10d/gloo thread still owned by module state can reach std::terminate ("terminate
        # called without an active exception", SIGABRT; 1 run in 15 under load on a 2-core
        # machine), and torchrun would then report the finished run as failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
