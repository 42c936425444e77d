"""Prometheus metrics of the server (``GET /metrics``, prometheus-client text format).

Each :class:`ServerMetrics` owns its own registry, so several apps can live in one process
(tests). Latency and TTFT are measured in the front end, from the arrival of the HTTP request
to the first / last token reaching it: what a client sees, minus the network. Queue gauges
come from the engine after every step. Speculative counters follow vLLM's definitions; the
gauges ``structspec_spec_accept_length`` (committed tokens per verify step, bonus included)
and ``structspec_spec_accept_rate`` (accepted / proposed draft tokens) are cumulative since
start, like sglang's. Prompt and generated tokens are counted as they are processed, as
vLLM counts them (a prompt when its first token arrives, generated tokens as each step's
delta arrives), so that the periodic stats line (:mod:`structspec.server.stats_log`) reads
its throughput off these counters while long requests are still running.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from structspec.core import SpecMetrics
from structspec.server.ipc import EngineDelta, EngineStats


class FinishedChoice(Protocol):
    """What the metrics read of one response choice (``server.generation.ChoiceState``; a
    protocol here so that this module does not import the generation module back)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def first_token_s(self) -> float | None: ...

    @property
    def final(self) -> EngineDelta | None: ...


LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_MS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 25.0, 50.0, 100.0)
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Every metric the server exports; see the module docstring."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "structspec_"
        self.requests = Counter(p + "requests", "Engine requests finished, by finish reason "
                                "(stop, length, abort, rejected = refused before running)",
                                ["finish_reason"], registry=r)
        self.http_errors = Counter(p + "http_errors", "HTTP error responses by status code",
                                   ["status"], registry=r)
        self.latency = Histogram(p + "e2e_request_latency_seconds",
                                 "Arrival of the HTTP request to the request's last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Arrival of the HTTP request to its first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed (counted "
                                     "when the request's first token arrives)", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens",
                                         "Generated tokens, counted as they arrive", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests decoding in the engine",
                             registry=r)
        self.waiting = Gauge(p + "num_requests_waiting",
                             "Requests waiting for a batch slot / KV pages", registry=r)
        self.grammar_queue = Gauge(p + "num_requests_waiting_grammar",
                                   "Requests waiting for their grammar to compile", registry=r)
        self.prefilling = Gauge(p + "num_requests_prefilling",
                                "Requests part-way through a chunked prefill (admitted, no "
                                "token yet)", registry=r)
        self.inflight = Gauge(p + "num_requests_inflight",
                              "Engine requests the front end is waiting on", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV pages in use",
                              registry=r)
        self.prefix_cache_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens of admitted requests (prefix cache "
            "lookups, in tokens)", registry=r)
        self.prefix_cache_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache",
            registry=r)
        self.prefix_cache_hit_rate = Gauge(
            p + "prefix_cache_hit_rate", "Prefix cache hits / queries in tokens, since the "
            "engine started", registry=r)
        self._prefix_seen = (0, 0)  # (queried, hit) tokens already counted
        self.preemptions = Counter(
            p + "preemptions", "Running requests preempted (their KV freed, recomputed on "
            "resume) when the KV cache ran out or a higher-priority request needed room",
            registry=r)
        self._preemptions_seen = 0  # engine preemptions already counted
        self.grammar_compile = Histogram(p + "grammar_compile_seconds",
                                         "Grammar compile time: submission to the compiled grammar's "
                                         "arrival (queue wait, worker compile, engine rebuild)",
                                         buckets=COMPILE_BUCKETS, registry=r)
        self.grammar_compile_timeouts = Counter(
            p + "grammar_compile_timeouts",
            "Grammar compiles stopped at their time limit (worker killed; code "
            "grammar_too_complex)", registry=r)
        self.grammar_requests = Counter(
            p + "grammar_requests", "Finished constrained requests by the grammar backend that "
            "enforced them (xgrammar, llguidance)", ["backend"], registry=r)
        self.spec_verify_steps = Counter(p + "spec_verify_steps",
                                         "Verify steps of finished requests", registry=r)
        self.spec_draft_tokens = Counter(p + "spec_draft_tokens",
                                         "Draft tokens proposed", registry=r)
        self.spec_accepted_tokens = Counter(p + "spec_accepted_tokens",
                                            "Draft tokens accepted", registry=r)
        self.spec_grammar_rejected = Counter(p + "spec_draft_tokens_rejected_by_grammar",
                                             "Draft tokens the grammar mask ruled out",
                                             registry=r)
        self.spec_committed_tokens = Counter(p + "spec_committed_tokens",
                                             "Tokens committed by verify steps", registry=r)
        self.spec_accept_length = Gauge(p + "spec_accept_length",
                                        "Committed tokens per verify step (cumulative)",
                                        registry=r)
        self.spec_accept_rate = Gauge(p + "spec_accept_rate",
                                      "Accepted / proposed draft tokens (cumulative)",
                                      registry=r)
        self.spec_steps_without_draft = Counter(
            p + "spec_steps_without_draft", "Verify steps of finished requests run as a plain "
            "decode row although a drafter is on (adaptive tree sizing: drafting would not "
            "pay; or nothing to propose)", registry=r)
        self.spec_requests_drafting = Gauge(
            p + "spec_requests_drafting", "Requests the drafter proposed a tree for in the "
            "latest verify step", registry=r)
        self.spec_requests_plain = Gauge(
            p + "spec_requests_plain", "Requests verified as a plain decode row (no draft) in "
            "the latest verify step", registry=r)
        self.spec_tree_nodes = Histogram(
            p + "verify_step_tree_nodes", "Draft-tree size N (node 0 included) of a verify "
            "step", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.spec_accept_length_hist = Histogram(
            p + "spec_request_accept_length", "Per-request committed tokens per verify step",
            buckets=ACCEPT_BUCKETS, registry=r)
        def step_ms(name: str, doc: str) -> Histogram:
            """A per-verify-step timing histogram (milliseconds)."""
            return Histogram(p + name, doc, buckets=STEP_MS_BUCKETS, registry=r)

        self.step_wall = step_ms("verify_step_ms", "Host wall time of a verify step")
        self.step_gpu_busy = step_ms("verify_step_gpu_busy_ms",
                                     "GPU busy time of a verify step (CUDA events)")
        self.step_gpu_idle = step_ms(
            "verify_step_gpu_idle_gap_ms",
            "GPU idle gap before a verify step (previous step's end to this step's start)")
        self.step_grammar_stall = step_ms(
            "verify_step_grammar_stall_ms",
            "GPU time between the verify forward's end and the grammar mask's arrival")
        self.step_pool_send = step_ms(
            "verify_step_mask_worker_send_ms",
            "Host time sending a verify step's tree-mask build to the grammar worker processes")
        self.step_pool_worker = step_ms(
            "verify_step_mask_worker_busiest_ms",
            "Busiest grammar worker's time per verify step (message received to reply sent)")
        self.step_pool_last_reply = step_ms(
            "verify_step_mask_worker_last_reply_ms",
            "Time from a verify step's first message to the grammar workers to the last "
            "worker's reply (above the busiest worker's time: the workers' wake-up)")
        self.step_pool_read = step_ms(
            "verify_step_mask_worker_read_ms",
            "Time from a verify step's first message to the grammar workers to the engine "
            "having read every reply")
        self.step_cpu = Counter(p + "verify_step_cpu_ms", "Host time of verify steps by phase "
                                "(draft, launch, barrier, mask, text, wait, commit)",
                                ["phase"], registry=r)
        self.ready = Gauge(p + "engine_ready", "1 while the engine serves requests",
                           registry=r)
        self._spec_total = SpecMetrics()

    # ------------------------------------------------------------------ events

    def on_engine_stats(self, stats: EngineStats) -> None:
        """Queue gauges after an engine step."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.grammar_queue.set(stats.num_waiting_grammar)
        self.prefilling.set(stats.num_prefilling)
        if stats.kv_usage is not None:
            self.kv_usage.set(stats.kv_usage)
        queried, hit = stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens
        seen_q, seen_h = self._prefix_seen
        if queried < seen_q or hit < seen_h:  # a restarted engine counts from 0 again
            seen_q = seen_h = 0
        if queried > seen_q:
            self.prefix_cache_queries.inc(queried - seen_q)
            self.prefix_cache_hits.inc(hit - seen_h)
            self._prefix_seen = (queried, hit)
            self.prefix_cache_hit_rate.set(hit / queried)
        if stats.num_preemptions < self._preemptions_seen:  # a restarted engine: from 0
            self._preemptions_seen = 0
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        for s in stats.grammar_compile_s:
            self.grammar_compile.observe(s)
        if stats.grammar_compile_timeouts:
            self.grammar_compile_timeouts.inc(stats.grammar_compile_timeouts)
        if stats.steps:
            self.spec_requests_drafting.set(stats.steps[-1].num_drafting)
            self.spec_requests_plain.set(stats.steps[-1].num_plain)
        for step in stats.steps:
            self.step_wall.observe(step.wall_ms)
            self.spec_tree_nodes.observe(step.num_nodes)
            for phase, ms in step.cpu_ms.items():
                self.step_cpu.labels(phase=phase).inc(ms)
            if step.gpu_busy_ms is not None:
                self.step_gpu_busy.observe(step.gpu_busy_ms)
            if step.gpu_idle_before_ms is not None:
                self.step_gpu_idle.observe(step.gpu_idle_before_ms)
            if step.gpu_grammar_stall_ms is not None:
                self.step_grammar_stall.observe(step.gpu_grammar_stall_ms)
            if step.pool_send_ms is not None and step.pool_worker_max_ms is not None:
                self.step_pool_send.observe(step.pool_send_ms)
                self.step_pool_worker.observe(step.pool_worker_max_ms)
            if step.pool_last_reply_ms is not None and step.pool_read_ms is not None:
                self.step_pool_last_reply.observe(step.pool_last_reply_ms)
                self.step_pool_read.observe(step.pool_read_ms)

    def on_tokens(self, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        """Tokens an engine delta brought: ``num_prompt_tokens`` with a request's first token
        (its prompt was processed), the delta's new tokens."""
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generated_tokens:
            self.generation_tokens.inc(num_generated_tokens)

    def on_finished(self, choice: FinishedChoice, elapsed_s: float) -> None:
        """Record one finished engine request (``elapsed_s`` since the HTTP request; its
        tokens were counted by :meth:`on_tokens` as they came)."""
        final = choice.final
        assert final is not None
        reason = "rejected" if (final.error and not choice.token_ids) else final.finish_reason
        self.requests.labels(finish_reason=reason or "abort").inc()
        if final.grammar_backend is not None:
            self.grammar_requests.labels(backend=final.grammar_backend).inc()
        if choice.token_ids:
            self.latency.observe(elapsed_s)
        if choice.first_token_s is not None:
            self.ttft.observe(choice.first_token_s)
        spec = final.spec
        if spec is not None and spec.verify_steps:
            self.spec_verify_steps.inc(spec.verify_steps)
            self.spec_draft_tokens.inc(spec.draft_tokens_proposed)
            self.spec_accepted_tokens.inc(spec.draft_tokens_accepted)
            self.spec_grammar_rejected.inc(spec.draft_tokens_rejected_by_grammar)
            self.spec_committed_tokens.inc(spec.committed_tokens)
            self.spec_steps_without_draft.inc(spec.steps_without_draft)
            self.spec_accept_length_hist.observe(spec.accept_length)
            self._spec_total.add(spec)
            self.spec_accept_length.set(self._spec_total.accept_length)
            self.spec_accept_rate.set(self._spec_total.accept_rate)

    def on_abandoned(self, choice: FinishedChoice) -> None:
        """An unfinished request was aborted by the front end (client gone, error); its
        tokens so far were counted by :meth:`on_tokens`."""
        self.requests.labels(finish_reason="abort").inc()

    def on_http_error(self, status: int) -> None:
        """An error response was sent."""
        self.http_errors.labels(status=str(status)).inc()

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
