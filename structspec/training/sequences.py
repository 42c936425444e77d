"""Distilled training sequences (prompt ids + the target's response ids) and their file.

The file is one compressed ``.npz`` (``numpy.savez_compressed``, no pickled objects):

==================  ========  ===========  ===============================================
array               dtype     shape        meaning
==================  ========  ===========  ===============================================
``format_version``  int64     ()           :data:`FORMAT_VERSION`
``token_ids``       uint16/   [total]      every sequence's ids, concatenated (uint16
                    uint32                 when the largest id fits, else uint32)
``offsets``         int64     [n + 1]      sequence ``i`` is ids ``offsets[i]:offsets[i+1]``
``num_prompt``      int32     [n]          prompt tokens of each sequence
``source_codes``    uint8     [n]          index into ``source_names``
``source_names``    <U        [m]          the sources, e.g. ``sharegpt``
==================  ========  ===========  ===============================================

Measured: 12,000 sequences of 400 ShareGPT tokens (4.8 M ids, SmolLM2 tokenizer) take
5.4 MiB (18.3 MiB as raw int32); with ids past 65535 (uint32, e.g. Llama-3's 128k
vocabulary) 6.3 MiB. Writing or reading them takes ~2 s on one core.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: The sources of distilled sequences (see :mod:`structspec.training.prompts`). A sequence
#: may name another (e.g. ``synthetic`` for throughput runs on random ids).
SOURCES: tuple[str, ...] = ("sharegpt", "extraction", "schema", "sharegpt_later",
                            "sharegpt_held_out")
#: The source of sequences answered for held-out prompts: evaluation data, never trained on.
HELD_OUT_SOURCE = "sharegpt_held_out"

#: Version of the file layout (bumped on an incompatible change).
FORMAT_VERSION = 1

#: The arrays of a sequence file.
SEQUENCE_KEYS = ("format_version", "token_ids", "offsets", "num_prompt", "source_codes",
                 "source_names")


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence: the chat-templated prompt ids, then the ids the target model
    generated for it (its EOS included when it finished with ``stop``).

    Attributes:
        token_ids: prompt ids followed by response ids (a list is stored as a tuple).
        num_prompt_tokens: how many leading ids are the prompt; the loss applies to the
            positions ``>= num_prompt_tokens``. In ``[1, len(token_ids) - 1]``: a sequence has
            a prompt and at least one response token.
        source: where the prompt came from: one of :data:`SOURCES` for distilled sequences,
            any non-empty name otherwise.

    Raises:
        ValueError: ``num_prompt_tokens`` out of range or an empty ``source``, naming the
            field.
    """

    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
        n = len(self.token_ids)
        if not 1 <= self.num_prompt_tokens < n:
            raise ValueError(f"num_prompt_tokens must be in [1, len(token_ids) - 1] = "
                             f"[1, {n - 1}], got {self.num_prompt_tokens}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"source must be a non-empty string, got {self.source!r}")

    @property
    def num_response_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def save_sequences(path: Path, seqs: Sequence[TrainSequence]) -> None:
    """Write ``seqs`` to ``path`` (the layout of this module's docstring), atomically: a
    temporary file in the same folder is renamed over ``path``, so a crash never leaves a
    half-written file. ``path`` is used as given (no ``.npz`` is appended).

    Raises:
        ValueError: ``seqs`` is empty, holds a negative token id or one past 32 bits, or
            more than 255 distinct sources.
        OSError: the folder cannot be written.
    """
    path = Path(path)
    if not seqs:
        raise ValueError(f"{path}: no sequences to save")
    write_npz_atomic(path, sequence_arrays(path, seqs))


def sequence_arrays(path: Path, seqs: Sequence[TrainSequence]) -> dict[str, np.ndarray]:
    """The arrays of the file layout for ``seqs`` (empty arrays for no sequences); ``path``
    only names the file in errors.

    Raises:
        ValueError: a negative token id or one past 32 bits, or more than 255 distinct
            sources.
    """
    lengths = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64,
                      count=int(offsets[-1]))
    if ids.size and ids.min() < 0:
        raise ValueError(f"{path}: token id {int(ids.min())} is negative")
    if ids.size and ids.max() >= 2**32:
        raise ValueError(f"{path}: token id {int(ids.max())} does not fit 32 bits")
    narrow = ids.astype(np.uint16 if not ids.size or ids.max() < 2**16 else np.uint32)
    names = sorted({s.source for s in seqs})
    if len(names) > 255:
        raise ValueError(f"{path}: {len(names)} distinct sources; at most 255 fit")
    code_of = {name: i for i, name in enumerate(names)}
    codes = np.array([code_of[s.source] for s in seqs], dtype=np.uint8)
    return dict(format_version=np.int64(FORMAT_VERSION), token_ids=narrow, offsets=offsets,
                num_prompt=np.array([s.num_prompt_tokens for s in seqs], dtype=np.int32),
                source_codes=codes, source_names=np.array(names, dtype=str))


def write_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``numpy.savez_compressed`` of ``arrays`` into ``path`` through a temporary file in the
    same folder renamed over it: a reader (or a crash) never sees a half-written file.

    Raises:
        OSError: the folder cannot be written.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_sequences(path: Path) -> list[TrainSequence]:
    """Read a file written by :func:`save_sequences`.

    Returns:
        The sequences, in the order they were saved.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not such a file (not an ``.npz``, a missing or mistyped array,
            inconsistent offsets or prompt lengths, an unknown format version, an empty
            source name);
            the message names the path and what is wrong.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such sequence file")
    arrays = read_npz(path, SEQUENCE_KEYS, "training sequence file")
    return sequences_from_arrays(path, arrays)


def read_npz(path: Path, keys: Sequence[str], kind: str) -> dict[str, np.ndarray]:
    """The arrays ``keys`` of the ``.npz`` file ``path`` (others are ignored; no pickles).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not an ``.npz`` or lacks one of ``keys``; the message names
            the path and ``kind`` (what the file should be).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such {kind}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):
        # np.load would read it as a .npy or a pickle, and a text file's error advises
        # allow_pickle=True: say what the file is not instead
        raise ValueError(f"{path}: not a {kind} (not an .npz archive: no zip header)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in keys if k not in z.files]
            if missing:
                raise ValueError(f"{path}: not a {kind} (missing arrays {missing})")
            return {k: z[k] for k in keys}
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        # np.load reads a non-.npz file as .npy (or fails); a cut .npz fails in zipfile
        raise ValueError(f"{path}: not a {kind} ({type(e).__name__}: {e})") from e
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a {kind} ({e})") from e


def sequences_from_arrays(path: Path, a: dict[str, np.ndarray], *,
                          allow_empty: bool = False) -> list[TrainSequence]:
    """Check the arrays of :func:`sequence_arrays` (dtypes, consistency), then build the
    sequences; ``path`` only names the file in errors.

    Raises:
        ValueError: naming ``path`` and what is wrong (no sequences unless ``allow_empty``).
    """
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: corrupt training sequence file: {what}")

    if a["format_version"].shape != () or int(a["format_version"]) != FORMAT_VERSION:
        raise bad(f"format_version {a['format_version']!r}, expected {FORMAT_VERSION}")
    ids, offsets, num_prompt = a["token_ids"], a["offsets"], a["num_prompt"]
    codes, names = a["source_codes"], a["source_names"]
    if ids.dtype not in (np.uint16, np.uint32) or ids.ndim != 1:
        raise bad(f"token_ids has dtype {ids.dtype} and shape {ids.shape}")
    min_offsets = 1 if allow_empty else 2
    if offsets.dtype != np.int64 or offsets.ndim != 1 or len(offsets) < min_offsets:
        raise bad(f"offsets has dtype {offsets.dtype} and shape {offsets.shape}")
    n = len(offsets) - 1
    if offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 2):
        raise bad("offsets do not cut token_ids into sequences of >= 2 ids")
    for name, arr in (("num_prompt", num_prompt), ("source_codes", codes)):
        if arr.ndim != 1 or len(arr) != n or arr.dtype.kind not in "iu":
            raise bad(f"{name} has dtype {arr.dtype} and shape {arr.shape}; {n} sequences")
    if names.dtype.kind != "U" or names.ndim != 1 or not all(names):
        raise bad(f"source_names {names.tolist()!r} are not non-empty strings")
    if np.any(codes >= len(names)):
        raise bad(f"a source code is >= {len(names)}")
    lengths = np.diff(offsets)
    if np.any(num_prompt < 1) or np.any(num_prompt >= lengths):
        raise bad("a prompt length is not in [1, sequence length - 1]")
    flat = ids.tolist()
    sources = [str(names[c]) for c in codes.tolist()]
    bounds = offsets.tolist()
    return [TrainSequence(tuple(flat[bounds[i]:bounds[i + 1]]), int(num_prompt[i]), sources[i])
            for i in range(n)]
