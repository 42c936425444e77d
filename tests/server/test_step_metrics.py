"""Verify-step timings reach /metrics: host phases as counters, GPU times as histograms."""

from __future__ import annotations

from structspec.scheduler.step_record import StepRecord
from structspec.server.ipc import EngineStats
from structspec.server.metrics import ServerMetrics


def test_step_records_become_metrics() -> None:
    m = ServerMetrics()
    gpu = StepRecord(4, 8, 4, wall_ms=3.0, cpu_ms={"draft": 0.5, "mask": 1.25},
                     gpu_draft_ms=0.0, gpu_forward_ms=2.0, gpu_grammar_stall_ms=0.25,
                     gpu_post_ms=0.75, gpu_idle_before_ms=0.5, pool_workers=2,
                     pool_send_ms=0.125, pool_worker_max_ms=0.375, pool_first_start_ms=0.0625,
                     pool_last_reply_ms=0.5, pool_read_ms=0.75)
    cpu = StepRecord(1, 1, 0, wall_ms=7.0, cpu_ms={"launch": 6.0})  # no GPU fields on CPU
    m.on_engine_stats(EngineStats(steps=(gpu, cpu)))
    text = m.render().decode()
    assert 'structspec_verify_step_ms_count 2.0' in text
    assert 'structspec_verify_step_cpu_ms_total{phase="mask"} 1.25' in text
    assert 'structspec_verify_step_cpu_ms_total{phase="launch"} 6.0' in text
    assert 'structspec_verify_step_gpu_busy_ms_count 1.0' in text
    assert 'structspec_verify_step_gpu_busy_ms_sum 2.5' in text  # 2.0 + 0.75 - 0.25
    assert 'structspec_verify_step_gpu_idle_gap_ms_sum 0.5' in text
    assert 'structspec_verify_step_grammar_stall_ms_sum 0.25' in text
    # mask worker pool timings: only the step that used the pool
    assert 'structspec_verify_step_mask_worker_send_ms_count 1.0' in text
    assert 'structspec_verify_step_mask_worker_send_ms_sum 0.125' in text
    assert 'structspec_verify_step_mask_worker_busiest_ms_sum 0.375' in text
    assert 'structspec_verify_step_mask_worker_last_reply_ms_sum 0.5' in text
    assert 'structspec_verify_step_mask_worker_read_ms_sum 0.75' in text
    assert 'structspec_verify_step_mask_worker_read_ms_count 1.0' in text


def test_prefix_cache_counters_become_metrics() -> None:
    """The engine's cumulative prefix-cache token counters become counters and a hit rate."""
    m = ServerMetrics()
    m.on_engine_stats(EngineStats(prefix_cache_queried_tokens=100, prefix_cache_hit_tokens=40))
    m.on_engine_stats(EngineStats(prefix_cache_queried_tokens=200, prefix_cache_hit_tokens=120))
    text = m.render().decode()
    assert 'structspec_prefix_cache_queries_total 200.0' in text
    assert 'structspec_prefix_cache_hits_total 120.0' in text
    assert 'structspec_prefix_cache_hit_rate 0.6' in text


def test_preemptions_become_a_counter() -> None:
    """The engine's cumulative preemption count becomes ``structspec_preemptions_total``;
    a restarted engine (its count back at 0) adds to it rather than being lost."""
    m = ServerMetrics()
    m.on_engine_stats(EngineStats(num_preemptions=3))
    m.on_engine_stats(EngineStats(num_preemptions=5))
    assert 'structspec_preemptions_total 5.0' in m.render().decode()
    m.on_engine_stats(EngineStats(num_preemptions=2))  # the engine process restarted
    assert 'structspec_preemptions_total 7.0' in m.render().decode()


def test_prefilling_requests_become_a_gauge() -> None:
    """Requests part-way through a chunked prefill (admitted, no token yet) are counted apart
    from the running and waiting ones, and reach /health's counters too."""
    m = ServerMetrics()
    stats = EngineStats(num_running=2, num_prefilling=1)
    m.on_engine_stats(stats)
    assert 'structspec_num_requests_prefilling 1.0' in m.render().decode()
    assert stats.as_dict()["num_prefilling"] == 1
