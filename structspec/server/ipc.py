"""Messages between the front-end process and the engine process.

Everything here is a small picklable dataclass with no heavy imports, so both processes can
load it cheaply. Front end -> engine: :class:`AddRequest`, :class:`AbortRequest`,
:class:`Shutdown`. Engine -> front end: :class:`Ready` or :class:`InitFailed` once, then one
:class:`StepOutputs` per engine step (or per batch of rejected requests), and
:class:`Fatal` if the loop itself crashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from structspec.core import SamplingParams, SpecMetrics
from structspec.scheduler.step_record import StepRecord

PromptLogprobEntry = tuple[int, float, int, list[tuple[int, float]]]
"""One scored prompt position: ``(token_id, logprob, rank, [(id, logprob), ...] top-k)``."""

# --------------------------------------------------------------------------- front end -> engine


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue one engine request (already tokenized by the front end)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first (LLMEngine.add_request)


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Cancel one engine request (its final delta still comes back)."""

    request_id: str
    reason: str = "aborted by client"


@dataclass(frozen=True, slots=True)
class AbortAll:
    """Cancel every live request (graceful shutdown)."""

    reason: str = "server is shutting down"


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the loop and exit the engine process."""


# --------------------------------------------------------------------------- engine -> front end


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the front end needs to know about the loaded engine."""

    model_path: str
    max_model_len: int
    vocab_size: int
    device: str
    dtype: str
    speculative_algorithm: str
    num_draft_tokens: int
    kv_capacity_tokens: int
    max_batch_size: int
    pid: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Queue sizes and KV usage after an engine step (``LLMEngine.stats()``)."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_grammar: int = 0
    num_prefilling: int = 0  # admitted requests part-way through a chunked prefill
    kv_free_pages: int = 0
    kv_total_pages: int = 0
    # prefix cache, cumulative since the engine started: prompt tokens admitted / reused
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # running requests preempted since the engine started (KV ran out, or a higher priority)
    num_preemptions: int = 0
    grammar_compile_s: tuple[float, ...] = ()  # compile durations finished since the last one
    grammar_compile_timeouts: int = 0  # compiles stopped at their time limit since the last one
    steps: tuple[StepRecord, ...] = ()  # verify-step timings finished since the last one

    @property
    def kv_usage(self) -> float | None:
        """Fraction of KV pages in use (0 to 1); None before the engine reported its pool."""
        if not self.kv_total_pages:
            return None
        return 1.0 - self.kv_free_pages / self.kv_total_pages

    def as_dict(self) -> dict[str, int]:
        """The counters as a JSON-ready dict (``/health``)."""
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_waiting_grammar": self.num_waiting_grammar,
            "num_prefilling": self.num_prefilling,
            "kv_free_pages": self.kv_free_pages,
            "kv_total_pages": self.kv_total_pages,
        }


@dataclass(slots=True)
class EngineDelta:
    """What one engine request gained in one step (the front end detokenizes it).

    ``new_logprobs`` holds ``(token_id, logprob, [(id, logprob), ...])`` for each token of
    ``new_token_ids``. The fields under "final" are set only when ``finished``; ``text`` there
    is the engine's own decoded text, authoritative where a stop string cut a token.
    ``rejected`` marks a request refused before it ran (a bad input: HTTP 400).
    ``prompt_logprobs`` (``SamplingParams.prompt_logprobs``) comes once, in the first delta
    of the request: None at prompt position 0, then one :data:`PromptLogprobEntry` per
    position.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    finished: bool = False
    prompt_logprobs: list[PromptLogprobEntry | None] | None = None
    # final
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_param: str | None = None
    error_code: str | None = None  # e.g. grammar_too_complex (the HTTP error's code)
    rejected: bool = False
    text: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_completion_tokens: int = 0
    schema_valid: bool | None = None
    grammar_backend: str | None = None  # xgrammar / llguidance (constrained requests)
    spec: SpecMetrics | None = None
    engine_ttft_s: float | None = None
    engine_latency_s: float | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine loaded and is serving."""

    info: EngineInfo


@dataclass(frozen=True, slots=True)
class InitFailed:
    """The engine could not start; ``message`` is for the user, ``traceback`` for logs."""

    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """The deltas of one engine step plus the queue state after it."""

    deltas: list[EngineDelta]
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine loop crashed; every live request is lost."""

    message: str
    traceback: str


ToEngine = AddRequest | AbortRequest | AbortAll | Shutdown
FromEngine = Ready | InitFailed | StepOutputs | Fatal
