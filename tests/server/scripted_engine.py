"""A scripted engine for the *real* engine process (``engine_main`` and its ``EngineLoop``,
the pipes, the ``EngineClient`` threads), without a model: it starts in well under a second
and imports no torch, so a test can kill and restart engine processes within seconds.

Each step sleeps ``tick_s`` and gives every running request one token (``"x"``, the
character-level ``FakeCodec``'s token 120) until its ``max_tokens``. Pass
``engine_factory=ScriptedEngine`` and a :class:`ScriptedConfig` to ``EngineClient``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from structspec.core import FinishReason, RequestOutput, SamplingParams, SpecMetrics

TOKEN = ord("x")


@dataclass(frozen=True)
class ScriptedConfig:
    """What the scripted engine is built from (sent to the child process as is)."""

    tick_s: float = 0.01
    max_model_len: int = 512
    vocab_size: int = 0x110000
    max_batch_size: int = 64


@dataclass
class _Running:
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    out: list[int] = field(default_factory=list)
    abort_reason: str | None = None


class ScriptedEngine:
    """What ``EngineLoop`` and ``engine_info`` use of an ``LLMEngine``."""

    def __init__(self, config: ScriptedConfig) -> None:
        self.tick_s = config.tick_s
        self.model_path = "/scripted/model"
        self.max_model_len = config.max_model_len
        self.model_config = SimpleNamespace(vocab_size=config.vocab_size)
        self.config = SimpleNamespace(
            device="cpu", dtype="float32", spec=SimpleNamespace(algorithm="none", tree_size=1),
            cache=SimpleNamespace(kv_capacity_tokens=4096),
            scheduler=SimpleNamespace(max_batch_size=config.max_batch_size))
        self.scheduler = SimpleNamespace(timer=SimpleNamespace(drain=lambda: []))
        self._running: dict[str, _Running] = {}

    def add_request(self, prompt: list[int], params: SamplingParams, *,
                    request_id: str, priority: int = 0) -> str:
        self._running[request_id] = _Running(list(prompt), params, time.perf_counter())
        return request_id

    def abort_request(self, request_id: str, reason: str = "aborted by client") -> bool:
        run = self._running.get(request_id)
        if run is None:
            return False
        run.abort_reason = reason
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.tick_s)
        outputs = []
        for rid, run in list(self._running.items()):
            if run.abort_reason is not None:
                del self._running[rid]
                outputs.append(self._output(rid, run, [], FinishReason.ABORT, run.abort_reason))
                continue
            run.out.append(TOKEN)
            done = len(run.out) >= run.params.max_tokens
            if done:
                del self._running[rid]
            outputs.append(self._output(rid, run, [TOKEN],
                                        FinishReason.LENGTH if done else None, None))
        return outputs

    def _output(self, rid: str, run: _Running, new: list[int], reason: FinishReason | None,
                error: str | None) -> RequestOutput:
        now = time.perf_counter()
        return RequestOutput(
            request_id=rid, prompt_token_ids=run.prompt_ids, token_ids=list(run.out),
            text="x" * len(run.out), finished=reason is not None, finish_reason=reason,
            error=error, new_token_ids=new, spec=SpecMetrics(verify_steps=len(run.out),
                                                             committed_tokens=len(run.out)),
            arrival_time=run.arrival, first_token_time=now if run.out else None,
            finish_time=now if reason is not None else None)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self._running), "kv_free_pages": 10, "kv_total_pages": 10}

    def close(self) -> None:
        self._running.clear()


def failing_engine(config: ScriptedConfig) -> ScriptedEngine:
    """An engine factory whose engine never loads (a restart that fails)."""
    raise RuntimeError("no model here")
