"""Draft heads that ship inside the package: the EAGLE-3 head trained for the default model.

``--speculative-algorithm eagle`` without ``--draft-model`` on the default model (no model
argument, or the default GGUF's own path) drafts with :data:`DEFAULT_MODEL_EAGLE_HEAD`; every
other target needs its head named. No torch import here: the engine config resolves it
before anything heavy loads.
"""

from __future__ import annotations

from pathlib import Path

from structspec.models.default_model import default_gguf_path

HEADS_DIR = Path(__file__).resolve().parent / "heads"
#: The EAGLE-3 head of SmolLM2-135M-Instruct (sglang/SpecForge layout, bfloat16, 10.2 MB;
#: it shares the target's embedding and lm_head, and drafts over the 16,384 rows its
#: ``draft_vocab.json`` names). How it was trained, and its accept lengths: its folder's
#: README.md and the top-level README, "The shipped EAGLE-3 head".
DEFAULT_MODEL_EAGLE_HEAD = HEADS_DIR / "smollm2-135m-instruct-eagle3"


def is_default_model(model: str | None) -> bool:
    """Whether ``model`` names the default model: None, or the default GGUF's own path.

    A converted copy elsewhere, or any other checkpoint, is not recognised (a head trained
    on one model's features drafts nonsense for another: output stays exact, speed drops).
    """
    if model is None:
        return True
    try:
        return Path(model).expanduser().resolve() == default_gguf_path().resolve()
    except (FileNotFoundError, OSError):
        return False


def default_eagle_head(model: str | None) -> str | None:
    """The shipped EAGLE head directory for ``model``, or None when none ships for it.

    Raises:
        FileNotFoundError: ``model`` is the default model but the head's files are missing
            from this installation (a broken install; reinstall the package).
    """
    if not is_default_model(model):
        return None
    for name in ("config.json", "model.safetensors"):
        if not (DEFAULT_MODEL_EAGLE_HEAD / name).is_file():
            raise FileNotFoundError(f"the shipped EAGLE head is incomplete: "
                                    f"{DEFAULT_MODEL_EAGLE_HEAD / name} is missing "
                                    f"(reinstall structspec)")
    return str(DEFAULT_MODEL_EAGLE_HEAD)
