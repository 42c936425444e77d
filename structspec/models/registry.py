"""Model classes by Hugging Face architecture name (``config.json`` ``architectures[0]``)."""

from __future__ import annotations

from structspec.models.architectures import SUPPORTED_ARCHITECTURES

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class"]


def get_model_class(arch: str) -> type:
    """Return the ``nn.Module`` class implementing HF architecture ``arch``.

    The class is constructed as ``cls(config: ModelConfig)``.

    Raises:
        ValueError: ``arch`` is not in :data:`SUPPORTED_ARCHITECTURES` (message lists them).
    """
    from structspec.models import llama  # lazy: config parsing must not import torch.nn code

    classes: dict[str, type] = {
        "LlamaForCausalLM": llama.LlamaForCausalLM,
        "Qwen2ForCausalLM": llama.Qwen2ForCausalLM,
        "Qwen3ForCausalLM": llama.Qwen3ForCausalLM,
    }
    if arch not in classes:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(classes))}"
        )
    return classes[arch]
