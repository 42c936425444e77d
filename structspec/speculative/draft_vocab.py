"""A frequency-ranked draft vocabulary for EAGLE heads that share the target's ``lm_head``.

Such a head (the one shipped for the default model) projects every drafted position onto the
target's whole vocabulary (49,152 rows for SmolLM2), and that projection is most of a head
forward: on the 2-core CPU host it took 5.0 ms of a one-row propose step against 2.2 ms for
the 16,384 most frequent tokens (``Fp16Linear`` both, measured in one process). Drafting only
over the tokens the target actually emits loses little: the 16,384 most frequent tokens of the
target's own greedy responses (3.75M tokens of the EAGLE training data) cover 99.6% of them.
The target still verifies over its full vocabulary, so outputs do not change (lossless); a
draft simply cannot propose a token outside the set. Source: FR-Spec (Zhao et al., 2025,
"FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling", arXiv:2502.14856); EAGLE-3's own ``d2t`` map is the same idea for heads trained
with a reduced ``lm_head``.

The set lives beside the head, ``draft_vocab.json`` (``{"token_ids": [...ascending...],
"coverage": ...}``; not a ``.safetensors`` file, which the head loader would read as
weights), built from train-eagle sequence data by
``python -m structspec.speculative.draft_vocab``. ``SpecConfig.draft_vocab`` (``auto``: use
the head's file when it has one; ``full``: never) selects it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from structspec.layers.linear import linear_fp32_out
from structspec.layers.quant_linear import Fp16Linear

DRAFT_VOCAB_FILE = "draft_vocab.json"
DRAFT_VOCAB_MODES = ("auto", "full")


def frequent_tokens(token_ids: np.ndarray, *, vocab_size: int, size: int) -> np.ndarray:
    """The ``size`` most frequent ids of ``token_ids`` (ties: the lower id), ascending.

    Args:
        token_ids: any integer array of token ids in ``[0, vocab_size)``.
        vocab_size: the target's vocabulary size.
        size: how many ids to keep (``1 <= size <= vocab_size``); ids never seen fill the set
            in id order when fewer than ``size`` distinct ids occur.

    Returns:
        ``[size]`` int64, ascending.

    Raises:
        ValueError: ``size`` out of range, or an id outside the vocabulary.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"size={size}: expected 1..{vocab_size}")
    ids = np.asarray(token_ids).reshape(-1).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    counts = np.bincount(ids, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id
    return np.sort(order[:size]).astype(np.int64)


def save_draft_vocab(head_dir: str | Path, token_ids: np.ndarray | torch.Tensor,
                     **metadata: object) -> Path:
    """Write ``token_ids`` (ascending, unique) as the head's draft vocabulary, with
    ``metadata`` (e.g. its coverage) beside them; returns the file's path."""
    ids = [int(t) for t in np.asarray(token_ids).reshape(-1)]
    path = Path(head_dir) / DRAFT_VOCAB_FILE
    path.write_text(json.dumps({**metadata, "token_ids": ids}, separators=(",", ":")) + "\n")
    return path


def load_draft_vocab(head_dir: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The head's draft vocabulary, or None when it has none.

    Returns:
        ``[K]`` int64 (CPU) target token ids, ascending.

    Raises:
        ValueError: the file is not JSON with a non-empty ascending list ``token_ids`` of
            ids of this vocabulary (naming the file).
    """
    path = Path(head_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    problem = f"{path}: expected JSON with 'token_ids', ascending unique ids in [0, {vocab_size})"
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{problem}; not valid JSON ({e})") from None
    raw = data.get("token_ids") if isinstance(data, dict) else None
    # torch.tensor(..., dtype=int64) would truncate 1.5 to 1 and take true as 1: a file
    # holding anything but JSON integers is corrupt, not a vocabulary
    if not isinstance(raw, list) or not all(type(t) is int for t in raw):
        raise ValueError(f"{problem}; 'token_ids' is not a list of integers")
    if not raw:
        raise ValueError(f"{problem}; 'token_ids' is empty")
    try:
        ids = torch.tensor(raw, dtype=torch.int64)
    except (RuntimeError, ValueError, OverflowError) as e:  # an integer past 64 bits
        raise ValueError(f"{problem}; {e}") from None
    out_of_range = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if out_of_range.numel():
        i = int(out_of_range[0])
        raise ValueError(f"{problem}; token_ids[{i}] = {int(ids[i])} is outside the vocabulary")
    unordered = (ids[1:] <= ids[:-1]).nonzero()
    if unordered.numel():
        i = int(unordered[0]) + 1
        raise ValueError(f"{problem}; token_ids[{i}] = {int(ids[i])} does not exceed "
                         f"token_ids[{i - 1}] = {int(ids[i - 1])}")
    return ids


class ReducedLmHead(nn.Module):
    """The target's ``lm_head`` restricted to the draft vocabulary's rows.

    Args:
        weight: the target's float ``lm_head`` weight ``[V, H]`` (its tied embedding).
        token_ids: ``[K]`` int64 draft vocabulary (target ids).
        packed_fp16: pack the rows as the CPU's :class:`Fp16Linear` (what a quantized
            target's own ``lm_head`` is); else keep them in ``weight``'s dtype and device.
    """

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, *,
                 packed_fp16: bool) -> None:
        super().__init__()
        rows = weight.detach()[token_ids.to(weight.device)].contiguous()
        self.packed: Fp16Linear | None = Fp16Linear.from_float(rows) if packed_fp16 else None
        self.register_buffer("weight", None if packed_fp16 else rows)
        #: ``"triton"``: the skinny GEMV kernel where it applies (:meth:`set_kernels`)
        self.kernels = "torch"

    def set_kernels(self, kernels: str) -> None:
        """``"triton"``: the projection runs :func:`structspec.kernels.gemv.linear` (the
        target's skinny GEMV for forwards of at most 16 rows, float32 out: one launch where
        cuBLAS plus a cast were two); ``"torch"``: :func:`linear_fp32_out`."""
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> logits ``[..., K]`` float32 (``x``'s device); on CUDA the GEMM's
        float32 accumulator, never rounded to ``x``'s dtype (as the target's LM head)."""
        if self.packed is not None:
            return self.packed(x.float())
        if self.kernels == "triton":
            from structspec.kernels.gemv import linear

            return linear(x, self.weight, out_dtype=torch.float32)
        return linear_fp32_out(x, self.weight)


def reduced_lm_head(target_model: nn.Module, token_ids: torch.Tensor) -> ReducedLmHead | None:
    """A :class:`ReducedLmHead` over ``target_model``'s ``lm_head``, or None when its float
    weight is gone (an untied ``lm_head`` quantized in place: nothing to take rows from)."""
    lm_head = target_model.lm_head
    if isinstance(lm_head, nn.Linear):
        weight = lm_head.weight
    elif getattr(target_model.config, "tie_word_embeddings", False):
        weight = target_model.embed_tokens.weight  # the quantized head's float source
    else:
        return None
    return ReducedLmHead(weight, token_ids, packed_fp16=isinstance(lm_head, Fp16Linear))


def _response_tokens(paths: Sequence[str]) -> np.ndarray:
    """Every response token (after each sequence's prompt) of train-eagle sequence files."""
    parts = []
    for p in paths:
        with np.load(p) as d:
            tokens, offsets, num_prompt = d["token_ids"], d["offsets"], d["num_prompt"]
        for i in range(len(num_prompt)):
            parts.append(tokens[offsets[i] + num_prompt[i] : offsets[i + 1]])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m structspec.speculative.draft_vocab --data SEQ.npz ... --head HEAD_DIR``.

    Raises:
        SystemExit: 2 with a usage message naming the argument, for a bad argument or data
            file (missing, not an ``.npz``, lacking ``token_ids`` / ``offsets`` /
            ``num_prompt``, or ids outside ``--vocab-size``).
    """
    ap = argparse.ArgumentParser(
        prog="python -m structspec.speculative.draft_vocab",
        description="Write an EAGLE head's draft vocabulary: the most frequent response "
                    "tokens of train-eagle sequence data (token_ids / offsets / num_prompt).")
    ap.add_argument("--data", nargs="+", required=True, help="sequence .npz files")
    ap.add_argument("--head", required=True, help="the head directory to write into")
    ap.add_argument("--vocab-size", type=int, required=True, help="the target's vocabulary")
    ap.add_argument("--size", type=int, default=16384, help="tokens kept (default 16384)")
    args = ap.parse_args(argv)
    if args.vocab_size < 1:
        ap.error(f"--vocab-size {args.vocab_size}: expected a positive vocabulary size")
    if not 1 <= args.size <= args.vocab_size:
        ap.error(f"--size {args.size}: expected 1..{args.vocab_size} (--vocab-size)")
    if not Path(args.head).is_dir():
        ap.error(f"--head {args.head}: not a directory")
    try:
        tokens = _response_tokens(args.data)
    except (OSError, ValueError, KeyError, IndexError) as e:
        # a missing file, not an .npz, or one without token_ids / offsets / num_prompt
        ap.error(f"--data: {e}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= args.vocab_size):
        ap.error(f"--data: token ids outside [0, {args.vocab_size}) (--vocab-size)")
    ids = frequent_tokens(tokens, vocab_size=args.vocab_size, size=args.size)
    counts = np.bincount(tokens.astype(np.int64), minlength=args.vocab_size)
    coverage = counts[ids].sum() / max(1, counts.sum())
    path = save_draft_vocab(args.head, ids, size=args.size, response_tokens=int(tokens.size),
                            coverage=round(float(coverage), 5),
                            data=[Path(p).name for p in args.data])
    print(f"draft_vocab size={args.size} response_tokens={tokens.size} "
          f"coverage={coverage:.4f} -> {path}")


if __name__ == "__main__":
    main()
