"""The Hugging Face architecture names structspec runs (``config.json`` ``architectures[0]``).

A leaf module (it imports nothing from structspec): :mod:`structspec.config` checks a
checkpoint's architecture against it while parsing ``config.json``, and
:mod:`structspec.models.registry` maps each name to its model class. Reading the names from
the registry made ``config -> models.registry -> models.llama -> config`` an import cycle.
"""

from __future__ import annotations

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
"""Architectures :func:`structspec.models.registry.get_model_class` has a class for."""
