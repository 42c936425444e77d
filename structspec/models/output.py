"""The result of one model forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ModelOutput:
    """Hidden states of one forward (``B``, ``Q`` as in the :class:`ForwardBatch`).

    Attributes:
        hidden_states: ``[B, Q, H]`` after the final RMSNorm, model dtype/device; feed selected
            rows ``[R, H]`` to ``compute_logits``.
        aux_hidden_states: one ``[B, Q, H]`` tensor per index in ``aux_hidden_layers`` (same
            order): the output of that decoder layer (residual stream), before the final norm.
    """

    hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor] = field(default_factory=list)
