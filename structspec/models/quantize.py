"""Swap a loaded model's linear layers for weight-only int8 / int4 ones (``--quantization``).

Quantization happens once, after the float32 weights are loaded (:func:`quantize_model`), on
CPU. Which layers: every linear of every decoder layer (q/k/v, o, gate/up, down); the LM head
per :class:`QuantizationPlan`; never the token embedding (a decode step reads one row of it
per token, so its bytes do not bound the step; it stays float32 and, with tied embeddings, is
still the float32 matrix the checkpoint had).

The choices, measured (SmolLM2-135M Q4_1 GGUF, 2-core AMD EPYC; benchmarks/quant_accuracy.py
and benchmarks/README.md, "CPU against llama.cpp (issue 22)"):

* ``int4`` uses groups of 32 - the GGUF's own Q4_1 block, whose 4-bit codes it holds exactly
  (:mod:`structspec.layers.quant_linear`): argmax agreement with float32 99.77% of 2599
  teacher-forced positions (50 prompts); groups of 64 re-round the codes: 90.3%. 128 does not
  divide SmolLM2's 576. ``int8`` (per output channel): 98.96%.
* the LM head (49152 x 576, a fifth of the float32 bytes) becomes :class:`Fp16Linear`: as
  accurate as a float32 head (99.77% with int4 layers either way) at half the bytes, and
  faster than int8 there (FBGEMM's fp16 GEMM, ~7 ms vs ~10 ms per 1-row call under load);
  an int8 head lowered int4's agreement to 99.08%, an int4 head to 96.6% (12 prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from structspec.layers.quant_linear import Fp16Linear, Int4Linear, Int8Linear, QuantizedLinear

__all__ = ["QUANTIZATION_MODES", "QuantizationPlan", "plan_for", "quantize_model",
           "quantized_weight_bytes"]

QUANTIZATION_MODES = ("none", "int8", "int4")
"""Resolved values of ``EngineConfig.quantization`` (``auto`` resolves to one of them)."""


@dataclass(frozen=True)
class QuantizationPlan:
    """How :func:`quantize_model` quantizes a model.

    Attributes:
        layers: ``"int8"`` or ``"int4"``: the decoder layers' linears.
        int4_group_size: input channels per int4 scale/offset (``layers == "int4"``).
        lm_head: ``"none"`` (float32), ``"fp16"``, ``"int8"`` or ``"int4"``.
    """

    layers: str
    int4_group_size: int = 32
    lm_head: str = "fp16"


def plan_for(mode: str) -> QuantizationPlan | None:
    """The plan of a resolved ``EngineConfig.quantization``: None for ``"none"``.

    Raises:
        ValueError: ``mode`` is not one of :data:`QUANTIZATION_MODES`.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization={mode!r}: expected one of {', '.join(QUANTIZATION_MODES)}")
    if mode == "none":
        return None
    return QuantizationPlan(layers=mode)


def _quantized(linear: nn.Linear, kind: str, group_size: int) -> QuantizedLinear:
    """``linear`` as an :class:`Int8Linear` / :class:`Int4Linear` (its float weight is left
    to the caller to drop)."""
    if kind == "int8":
        return Int8Linear.from_float(linear.weight, linear.bias)
    if kind == "fp16":
        return Fp16Linear.from_float(linear.weight, linear.bias)
    return Int4Linear.from_float(linear.weight, linear.bias, group_size=group_size)


@torch.no_grad()
def quantize_model(model: nn.Module, plan: QuantizationPlan) -> None:
    """Replace ``model``'s decoder linears (and per ``plan`` its LM head) in place.

    Args:
        model: a loaded :class:`~structspec.models.llama.LlamaForCausalLM` (or subclass) on
            the CPU, float32, with the torch reference kernels.
        plan: what to quantize and how.

    Raises:
        ValueError: the model is not on the CPU or not float32 (torch's packed kernels are
            CPU kernels and the layers keep float32 activations), or a layer's input size is
            not a multiple of the int4 group size (naming the layer).
    """
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"quantization={plan.layers!r} needs the model on the CPU in float32, "
                         f"got {p.device.type} {p.dtype}")
    for name, module in list(model.named_modules()):
        if ".self_attn" not in name and ".mlp" not in name:
            continue
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                try:
                    setattr(module, child_name, _quantized(child, plan.layers,
                                                           plan.int4_group_size))
                except ValueError as e:
                    raise ValueError(f"quantization={plan.layers!r}: {name}.{child_name}: {e}") \
                        from e
    if plan.lm_head != "none":
        lm_head = model.lm_head
        assert isinstance(lm_head, nn.Linear)
        # With tied embeddings this reads embed_tokens.weight, which stays float32.
        model.lm_head = _quantized(lm_head, plan.lm_head, plan.int4_group_size)


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes a forward streams for the linears (quantized layers' packed weights and scales,
    float linears' weights; the embedding excluded). For reports and benchmarks."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear | Int4Linear | Fp16Linear):
            total += module.weight_bytes()
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total
