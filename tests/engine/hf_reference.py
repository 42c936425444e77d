"""A plain Hugging Face greedy decode, the reference of the engine's logit-changing options
(``min_tokens``, ``allowed_token_ids``): each step's float32 logits pass through a function of
the output so far, then the argmax is taken."""

from __future__ import annotations

from collections.abc import Callable

import torch


def hf_greedy(model_dir: str, prompt_ids: list[int], max_tokens: int,
              process: Callable[[torch.Tensor, list[int]], torch.Tensor],
              stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """Greedy output ids of the checkpoint in ``model_dir`` after ``prompt_ids``.

    Args:
        process: ``(logits [V] float32, output so far) -> logits`` before the argmax.
        stop_ids: ids that end the output (kept), besides ``max_tokens``.
    """
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].float()
            out.append(int(process(logits, out).argmax()))
            if out[-1] in stop_ids:
                break
    return out
