"""Command-line checks of ``--model``, ``--speculative-algorithm`` and ``--draft-model``,
before any model loads (``structspec generate`` and ``structspec serve``).

The engine's own config check (:func:`structspec.config.resolve_engine_config`) speaks the
Python API's words (``speculative_algorithm='eagle' needs draft_model=PATH``) and the loaders
report a wrong path by the file they missed (``.../config.json: not found``). Here the same
mistakes are refused with the flags the user typed: a ``--draft-model`` the drafter does not
read, a missing one, a path that is not what the drafter loads, and a missing ``--model``
(reported first: it is the first thing a run needs). No torch import: this runs before the
heavy imports.
"""

from __future__ import annotations

from pathlib import Path

from structspec.models.shipped_heads import default_eagle_head
from structspec.speculative.registry import drafter_info, drafter_names

#: What an EAGLE head on disk is, for the messages (the sglang / SpecForge export layout).
EAGLE_HEAD_LAYOUT = ("an EAGLE-3 head is a directory with config.json and model.safetensors "
                     "(the sglang/SpecForge layout, as `structspec train-eagle` writes)")


def check_model_and_draft_flags(model: str | None, algorithm: str, draft_model: str | None,
                                load_format: str = "auto") -> None:
    """Refuse a ``--model`` / ``--speculative-algorithm`` / ``--draft-model`` combination that
    cannot run, naming the flags.

    Args:
        model: ``--model`` (None: the default model).
        algorithm: ``--speculative-algorithm`` (a registered drafter name).
        draft_model: ``--draft-model`` (None: not given).
        load_format: ``--load-format``; ``dummy`` builds a draft model's weights from its
            config.json alone, so its weight files are not required.

    Raises:
        ValueError: starting with the flag at fault (``--model: no such file or directory
            'x'``, ``--draft-model: ...``, ``--speculative-algorithm eagle needs
            --draft-model DIR ...``).
    """
    if model is not None and not Path(model).expanduser().exists():
        raise ValueError(f"--model: no such file or directory {model!r} (a Hugging Face "
                         "model directory or a .gguf file)")
    if algorithm not in drafter_names():
        return  # argparse's choices refuse it; the engine's check names it for the Python API
    info = drafter_info(algorithm)
    readers = [n for n in drafter_names() if drafter_info(n).needs_draft_model]
    if draft_model is not None and not info.needs_draft_model:
        raise ValueError(f"--draft-model is not used by --speculative-algorithm {algorithm}: "
                         f"give --speculative-algorithm {' or '.join(readers)} to draft with "
                         "it, or leave --draft-model out")
    if not info.needs_draft_model:
        return
    if draft_model is None:
        if info.eagle_head and default_eagle_head(model) is not None:
            return  # the head shipped for the default model
        raise ValueError(f"--speculative-algorithm {algorithm} needs --draft-model "
                         f"{_what_to_give(algorithm, info.eagle_head)}")
    _check_draft_path(algorithm, info.eagle_head, Path(draft_model).expanduser(), draft_model,
                      load_format)


def _what_to_give(algorithm: str, eagle_head: bool) -> str:
    if eagle_head:
        return (f"DIR: {EAGLE_HEAD_LAYOUT}; a trained head ships only for the default model, "
                "SmolLM2-135M-Instruct")
    if algorithm == "draft_model":
        return ("PATH: a smaller model with the target's vocabulary (a Hugging Face model "
                "directory or a .gguf file)")
    return "PATH"


def _check_draft_path(algorithm: str, eagle_head: bool, path: Path, shown: str,
                      load_format: str) -> None:
    """Refuse a ``--draft-model`` path the drafter cannot load (see
    :func:`check_model_and_draft_flags`); ``eagle_head``: the drafter reads an EAGLE head."""
    if not path.exists():
        raise ValueError(f"--draft-model: no such file or directory {shown!r}")
    if eagle_head:
        if not path.is_dir():
            raise ValueError(f"--draft-model: {shown!r} is a file; {EAGLE_HEAD_LAYOUT}")
        if not (path / "config.json").is_file():
            raise ValueError(f"--draft-model: {shown!r} has no config.json; "
                             f"{EAGLE_HEAD_LAYOUT}")
        if not _has_weights(path):
            raise ValueError(f"--draft-model: {shown!r} has no weights (model.safetensors); "
                             f"{EAGLE_HEAD_LAYOUT}")
        return
    if algorithm == "draft_model" and path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--draft-model: {shown!r} has no config.json (a draft model is "
                             "a Hugging Face model directory or a .gguf file)")
        if load_format != "dummy" and not any(path.glob("*.safetensors")):
            raise ValueError(f"--draft-model: {shown!r} has no weights (*.safetensors); give "
                             "a checkpoint with its weights, or --load-format dummy for "
                             "random ones")


def _has_weights(path: Path) -> bool:
    """Whether an EAGLE head directory has weights the head loader reads."""
    return any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file()
