"""Adding a drafter touches one file: this test defines a toy drafter, registers it and runs it
end to end through :class:`structspec.LLM` (the config check and the engine take it from the
registry), then unregisters it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.speculative.base import Drafter, DraftRequest
from structspec.speculative.registry import (
    create_drafter,
    drafter_info,
    drafter_names,
    register_drafter,
    registered_drafter,
    unregister_drafter,
)

default_model = pytest.importorskip("structspec.models.default_model")

PROMPTS = ["Repeat exactly: go go go go go go go go go go",
           "Count from one to ten in words."]
MAX_TOKENS = 16


class RepeatLastDrafter(Drafter):
    """Proposes a chain that repeats the last committed token ``N - 1`` times (host tree)."""

    name = "toy"
    tree_on_host = True
    supports_grammar_overlap = True

    def __init__(self, num_nodes: int) -> None:
        super().__init__(num_nodes)
        #: proposes served (the engine really called this drafter).
        self.calls = 0

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """``[B, N]`` int64 CPU chains: node i (i >= 1) repeats node 0, parent ``i - 1``."""
        self.calls += 1
        last = torch.tensor([r.token_ids[-1] for r in reqs], dtype=torch.int64)
        tokens = last.unsqueeze(1).expand(len(reqs), self.num_nodes).contiguous()
        parents = torch.arange(-1, self.num_nodes - 1, dtype=torch.int64).expand(
            len(reqs), self.num_nodes).contiguous()
        return VerifyTree.from_parents(tokens, parents)


def create_toy_drafter(spec: Any, **context: Any) -> RepeatLastDrafter:
    """The registry factory: ``spec.num_draft_tokens`` nodes; the engine context is unused."""
    return RepeatLastDrafter(spec.num_draft_tokens)


@pytest.fixture
def toy_registered() -> Iterator[None]:
    with registered_drafter("toy", create_toy_drafter):
        yield
    assert "toy" not in drafter_names()


def _llm(**kw: Any) -> Any:
    from structspec import LLM

    try:
        default_model.resolve_model_path(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return LLM(device="cpu", dtype="float32", kv_capacity_tokens=2048, max_batch_size=2, **kw)


def test_toy_drafter_end_to_end_is_lossless(toy_registered: None) -> None:
    from structspec import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS)
    want = _llm().generate(PROMPTS, params)
    llm = _llm(speculative_algorithm="toy", num_draft_tokens=4)
    drafter = llm.engine.drafter
    assert isinstance(drafter, RepeatLastDrafter) and drafter.num_nodes == 4
    got = llm.generate(PROMPTS, params)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids  # greedy fp32: speculation is lossless
        assert g.finish_reason == w.finish_reason
    assert drafter.calls > 0
    assert sum(g.spec.verify_steps for g in got) > 0
    assert sum(g.spec.draft_tokens_proposed for g in got) > 0


def test_registry_lists_checks_and_unregisters() -> None:
    from structspec.config import EngineConfig, SpecConfig, resolve_engine_config

    assert drafter_names()[:4] == ("none", "ngram", "draft_model", "eagle")
    assert drafter_info("eagle").needs_draft_model and drafter_info("eagle").expands_tree
    assert not drafter_info("ngram").needs_draft_model
    plain = create_drafter(SpecConfig())  # "none", imported on first use
    assert plain.num_nodes == 1 and plain.aux_hidden_layers == ()
    assert plain.warmup_cuda_graphs() == 0  # optional hooks are base-class no-ops
    register_drafter("toy", create_toy_drafter)
    try:
        assert drafter_names()[-1] == "toy"
        with pytest.raises(ValueError, match="already registered"):
            register_drafter("toy", create_toy_drafter)
        config = resolve_engine_config(EngineConfig(device="cpu", spec=SpecConfig(algorithm="toy")))
        assert isinstance(create_drafter(config.spec), RepeatLastDrafter)
        with pytest.raises(ValueError, match="expected none, ngram, draft_model, eagle or toy"):
            resolve_engine_config(EngineConfig(device="cpu", spec=SpecConfig(algorithm="x")))
    finally:
        unregister_drafter("toy")
    assert "toy" not in drafter_names()
    with pytest.raises(ValueError, match="expected none, ngram, draft_model or eagle$"):
        resolve_engine_config(EngineConfig(device="cpu", spec=SpecConfig(algorithm="toy")))
    with pytest.raises(ValueError, match="unknown speculative_algorithm 'toy'"):
        create_drafter(SpecConfig(algorithm="toy"))
    with pytest.raises(KeyError):
        unregister_drafter("toy")
