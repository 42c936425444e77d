"""The one configuration of ``structspec train-eagle`` / :func:`structspec.training.train_eagle.
train_eagle` (no torch import: the CLI builds it before anything heavy loads)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

Stage = Literal["data", "train", "all"]
STAGES: tuple[str, ...] = ("data", "train", "all")
#: forms of the TTT attention (:mod:`structspec.training.ttt_attention`).
TTT_ATTENTION: tuple[str, ...] = ("auto", "dense", "split")
#: the sequences file that the data stage writes into ``out`` (and the train stage reads when
#: no ``sequences`` file is given).
SEQUENCES_FILE = "sequences.npz"
#: the trainer's resumable state, under ``out``.
CHECKPOINT_FILE = "checkpoint/train_state.pt"
#: one JSON record per optimizer step, under ``out``.
LOG_FILE = "train_log.jsonl"
#: one JSON record per evaluation on ``eval_sequences``, under ``out``.
EVAL_LOG_FILE = "eval_log.jsonl"


@dataclass(frozen=True)
class TrainEagleConfig:
    """Everything one ``train-eagle`` run needs.

    Attributes:
        out: output directory: the trained head (``config.json``, ``model.safetensors``: pass
            it as ``--draft-model``), the sequences file of the data stage, the checkpoint and
            the training log.
        model: target checkpoint (HF directory or .gguf); None = the default model.
        load_format: ``auto`` reads the target's weights; ``dummy`` builds seeded random ones
            from config.json alone (throughput sizing without the weights at hand).
        stage: ``data`` (generate the sequences file), ``train`` (train from it) or ``all``.
        sequences: prebuilt sequences file(s) to train on, concatenated in order (default:
            ``out/sequences.npz``): one path or a tuple of paths.
        num_sharegpt, num_extraction, num_schema: prompts of each kind the data stage builds.
        num_sharegpt_later: later human turns of train-side ShareGPT conversations, each sent
            alone (:func:`~structspec.training.prompts.sharegpt_later_turn_prompts`).
        num_sharegpt_held_out: held-out ShareGPT first turns (the last first): a data stage of
            these alone writes an evaluation file for ``eval_sequences``; the train stage
            refuses them as training data.
        max_tokens: response length limit of the data stage's generation.
        gen_batch_size: requests the data stage generates at once.
        temperature: sampling temperature of the data stage (0 = greedy).
        data_time_limit_s: the data stage adds no prompt after this many seconds from its
            start (model load included), aborts the requests in flight, saves and returns
            (0 = no limit); ``resume`` continues it.
        data_parallel: engine processes of the data stage, round-robin over the visible CUDA
            devices (more processes than devices share them; all on the CPU with ``device="cpu"``); process R answers the prompts whose index is R
            modulo N (:mod:`structspec.training.data_parallel`). 1 = one engine in this
            process.
        steps: optimizer steps (0 = ``epochs`` passes over the sequences).
        epochs: passes over the sequences when ``steps`` is 0.
        lr: peak learning rate (AdamW), reached after ``warmup_steps``, then cosine to 0.
        weight_decay: AdamW weight decay.
        batch_tokens: padded tokens per batch (rows x width): one micro-batch of one process.
        grad_accum: micro-batches each training process accumulates per optimizer step. One
            step takes ``world_size * grad_accum`` batches of the epoch's plan (world_size:
            the ``torchrun`` processes, 1 without), so its global batch is that many times
            ``batch_tokens``; the loss is the mean of the micro-batches' mean losses.
        max_seq_len: longest row; longer sequences are truncated.
        ttt_steps: unrolled training-time-test steps K.
        ttt_decay: weight of step k's loss is ``ttt_decay ** k``.
        ttt_attention: form of the TTT attention (same result): ``split`` (a causal SDPA
            plus the diagonal keys, merged exactly: memory linear in the width), ``dense``
            (masked SDPA over every step's keys: the reference, ``K^2 T^2`` scores) or
            ``auto`` (``split``; on CUDA checked against ``dense`` on the first batch, falling
            back to ``dense`` with a warning).
        warmup_steps: linear warmup steps.
        clip_grad_norm: gradient clipping norm (0 = off).
        seed: seed of the head's initialisation, the data order and the prompt set.
        checkpoint_every: save the resumable checkpoint (and export the head) every N steps
            (0 = only at the end).
        resume: the data stage skips the prompts its saved shards in ``out`` hold (same data
            options, else refused naming the option); the train stage continues from
            ``out``'s checkpoint (same data and options).
        init_from: train stage only: an exported EAGLE-3 head directory whose weights the head
            starts from instead of a random init (fine-tuning on new data or for more steps; a
            fresh optimizer and LR schedule). Its aux layers and vocabulary must match.
        draft_vocab_size: 0 = the head shares the target's lm_head (full vocabulary, nothing
            extra to ship); N = its own lm_head over the N most frequent response tokens
            (``d2t`` / ``t2d`` maps; ~N*H*2 more bytes in bf16).
        aux_hidden_layers: target layers of the feature (default EAGLE-3's ``(1, L//2-1, L-4)``).
        device: ``auto`` (cuda when available), ``cpu``, ``cuda``, ``cuda:N``.
        dtype: target model dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32``,
            ``bfloat16``; the head's master weights stay float32 and its forward runs under
            autocast in this dtype.
        export_dtype: dtype of the exported head weights.
        compile: wrap the head's TTT layer step in ``torch.compile``.
        stop_at_step: stop (checkpoint + export) once this step is reached (0 = no); the
            schedule still spans ``steps``, so a later ``resume`` continues it.
        time_limit_s: stop (checkpoint + export) after this many seconds of training (0 = no).
        eval_sequences: sequences file(s) the head is evaluated on, never trained on (e.g. a
            data stage of ``num_sharegpt_held_out`` prompts alone): the TTT loss and top-1
            agreement per TTT step with no gradient, logged to ``eval_log.jsonl``; None = no
            evaluation.
        eval_every: evaluate every N optimizer steps and at the end (0 = at the end only).
        eval_max_tokens: the evaluation reads the eval files' sequences in order up to this
            many tokens (each truncated to ``max_seq_len``), the same ones at every
            evaluation.
        progress: show tqdm bars.
    """

    out: str
    model: str | None = None
    load_format: str = "auto"
    stage: Stage = "all"
    sequences: str | tuple[str, ...] | None = None
    num_sharegpt: int = 2000
    num_extraction: int = 500
    num_schema: int = 500
    num_sharegpt_later: int = 0
    num_sharegpt_held_out: int = 0
    max_tokens: int = 512
    gen_batch_size: int = 64
    temperature: float = 0.0
    data_time_limit_s: float = 0.0
    data_parallel: int = 1
    steps: int = 0
    epochs: int = 3
    lr: float = 3e-4
    weight_decay: float = 0.0
    batch_tokens: int = 16384
    grad_accum: int = 1
    max_seq_len: int = 2048
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    ttt_attention: str = "auto"
    warmup_steps: int = 50
    clip_grad_norm: float = 0.5
    seed: int = 0
    checkpoint_every: int = 200
    resume: bool = False
    init_from: str = ""
    draft_vocab_size: int = 0
    aux_hidden_layers: tuple[int, ...] | None = None
    device: str = "auto"
    dtype: str = "auto"
    export_dtype: str = "bfloat16"
    compile: bool = False
    stop_at_step: int = 0
    time_limit_s: float = 0.0
    eval_sequences: str | tuple[str, ...] | None = None
    eval_every: int = 0
    eval_max_tokens: int = 131072
    progress: bool = True

    def validate(self) -> None:
        """Check every field's range.

        Raises:
            ValueError: the first bad field, named (``ttt_steps=0: must be >= 1``).
        """
        if not self.out:
            raise ValueError("out: an output directory is required")
        for name in ("sequences", "eval_sequences"):
            paths = getattr(self, name)
            if isinstance(paths, tuple) and (
                    not paths or not all(isinstance(p, str) and p for p in paths)):
                raise ValueError(f"{name}={paths!r}: expected one or more file paths")
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r}: expected one of {', '.join(STAGES)}")
        if self.ttt_attention not in TTT_ATTENTION:
            raise ValueError(f"ttt_attention={self.ttt_attention!r}: expected one of "
                             f"{', '.join(TTT_ATTENTION)}")
        positive = ("max_tokens", "gen_batch_size", "batch_tokens", "max_seq_len", "ttt_steps",
                    "data_parallel", "grad_accum", "eval_max_tokens")
        non_negative = ("num_sharegpt", "num_extraction", "num_schema", "num_sharegpt_later",
                        "num_sharegpt_held_out", "eval_every", "steps", "epochs",
                        "warmup_steps", "checkpoint_every", "draft_vocab_size", "stop_at_step",
                        "seed")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in positive and v < 1:
                raise ValueError(f"{f.name}={v}: must be >= 1")
            if f.name in non_negative and v < 0:
                raise ValueError(f"{f.name}={v}: must be >= 0")
        if self.max_seq_len < 3:
            raise ValueError(f"max_seq_len={self.max_seq_len}: must be >= 3")
        if self.batch_tokens < self.max_seq_len:
            raise ValueError(f"batch_tokens={self.batch_tokens}: must be >= max_seq_len "
                             f"({self.max_seq_len})")
        if self.steps == 0 and self.epochs == 0:
            raise ValueError("steps=0 and epochs=0: nothing to train")
        for name in ("lr", "ttt_decay"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        for name in ("weight_decay", "clip_grad_norm", "time_limit_s", "temperature",
                     "data_time_limit_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r}: expected auto or dummy")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: expected auto, float32 or bfloat16")
        if self.export_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"export_dtype={self.export_dtype!r}: expected float32, bfloat16 "
                             f"or float16")
        if self.aux_hidden_layers is not None and len(self.aux_hidden_layers) != 3:
            raise ValueError(f"aux_hidden_layers={self.aux_hidden_layers}: EAGLE-3 needs "
                             f"exactly 3 layers")
        if self.eval_every and not self.eval_sequences:
            raise ValueError(f"eval_every={self.eval_every}: there is nothing to evaluate "
                             f"without eval_sequences")
        if self.init_from and self.resume:
            raise ValueError("init_from: a resumed run continues from its checkpoint; use "
                             "init_from only to start a new run")

    def to_json(self) -> str:
        """The config as a JSON object (what a data rank process is started with)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainEagleConfig:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: ``text`` is not such an object (an unknown or missing field).
        """
        d: dict[str, Any] = json.loads(text)
        if not isinstance(d, dict) or set(d) - {f.name for f in fields(cls)}:
            raise ValueError(f"not a TrainEagleConfig: {text[:200]!r}")
        for name in ("sequences", "eval_sequences"):
            if isinstance(d.get(name), list):
                d[name] = tuple(d[name])
        if d.get("aux_hidden_layers") is not None:
            d["aux_hidden_layers"] = tuple(d["aux_hidden_layers"])
        return cls(**d)
