"""Engine options that are refused up front, and the context length the KV cache can hold."""

from __future__ import annotations

import gc

import pytest

from structspec.config import (
    EngineConfig,
    GrammarConfig,
    SchedulerConfig,
    SpecConfig,
    resolve_engine_config,
)


@pytest.mark.parametrize("value", [-5, 0])
def test_max_model_len_below_one_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        resolve_engine_config(EngineConfig(device="cpu", max_model_len=value))


@pytest.mark.parametrize(("depth", "topk", "field"), [
    (0, 2, "speculative_depth=0"), (4, 0, "speculative_topk=0"), (65, 2, "speculative_depth=65"),
    (4, 100_000, "speculative_topk=100000")])
def test_bad_draft_tree_shape_is_refused_before_loading(depth: int, topk: int,
                                                        field: str) -> None:
    spec = SpecConfig(algorithm="draft_model", draft_model="/nonexistent", depth=depth,
                      topk=topk)
    with pytest.raises(ValueError, match=field):
        resolve_engine_config(EngineConfig(device="cpu", spec=spec))


@pytest.mark.parametrize("value", [1, 129, 100_000])
def test_tree_size_outside_2_to_128_is_refused(value: int) -> None:
    spec = SpecConfig(algorithm="ngram", num_draft_tokens=value)
    with pytest.raises(ValueError, match=f"num_draft_tokens={value}"):
        resolve_engine_config(EngineConfig(device="cpu", spec=spec))


def test_largest_tree_size_is_accepted() -> None:
    spec = SpecConfig(algorithm="ngram", num_draft_tokens=128)
    assert resolve_engine_config(EngineConfig(device="cpu", spec=spec)).spec.num_draft_tokens == 128


@pytest.mark.parametrize("value", [-1, "2", 2.5, True, 10_000])
def test_bad_grammar_workers_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="grammar_workers"):
        resolve_engine_config(EngineConfig(
            device="cpu", grammar=GrammarConfig(mask_build_workers=value)))  # type: ignore[arg-type]


def test_context_is_capped_by_the_kv_cache() -> None:
    """A 512-token KV cache cannot hold the model's 8k context: the engine advertises what one
    request with its draft tree fits, so a request without a token limit still runs."""
    from structspec import LLM, SamplingParams

    llm = LLM(device="cpu", dtype="float32", kv_capacity_tokens=512,
              speculative_algorithm="ngram", num_draft_tokens=8)
    try:
        limit = llm.engine.max_model_len
        assert limit == 512 - 8  # 32 pages of 16 slots, minus the tree's scratch
        out = llm.generate("Count from one to five.", SamplingParams(max_tokens=10**9))[0]
        assert out.error is None and out.finish_reason.value in ("stop", "length")
    finally:
        del llm
        gc.collect()


def test_max_model_len_rule() -> None:
    """None is the model's context length; an explicit value up to it is kept; above it is
    refused naming both numbers (vLLM's rule: it used to be capped silently)."""
    from structspec.config import check_max_model_len

    assert check_max_model_len(None, 8192) == 8192
    assert check_max_model_len(8192, 8192) == 8192 and check_max_model_len(100, 8192) == 100
    with pytest.raises(ValueError, match=r"^max_model_len=8193 is greater than the model's "
                                         r"context length \(8192 tokens"):
        check_max_model_len(8193, 8192)


def test_max_model_len_above_the_models_is_refused_before_the_weights_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import structspec.engine.build as engine_mod
    from structspec import LLM

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights loaded before max_model_len was checked")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    with pytest.raises(ValueError) as e:
        LLM(device="cpu", max_model_len=10**12)
    assert str(e.value).startswith(f"max_model_len={10**12} is greater than")
    assert "8192" in str(e.value)  # SmolLM2's max_position_embeddings


def test_cli_max_model_len_above_the_models_exits_2_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    from structspec.cli import main

    rc = main(["generate", "--device", "cpu", "--prompt", "hi", "--max-model-len",
               str(10**12)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"structspec generate: --max-model-len: max_model_len={10**12} ")
    assert "(8192 tokens" in err


def test_explicit_max_model_len_the_kv_cache_cannot_hold_is_lowered_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """Allowed by the model but not by a 512-token KV cache: lowered (as the default is),
    with a warning naming both numbers, not refused."""
    from structspec import LLM

    with caplog.at_level("WARNING", logger="structspec.engine.build"):
        llm = LLM(device="cpu", dtype="float32", kv_capacity_tokens=512, max_model_len=4096)
    try:
        assert llm.engine.max_model_len == 511  # 32 pages of 16 slots, minus one tree node
        assert any("max_model_len 4096 lowered to 511" in r.getMessage() for r in caplog.records)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize(("device", "cores", "expected"),
                         [("cuda", 16, 8), ("cuda:1", 64, 8), ("cuda", 6, 3), ("cuda", 3, 0),
                          ("cpu", 16, 0)])
def test_grammar_workers_auto(monkeypatch: pytest.MonkeyPatch, device: str, cores: int,
                              expected: int) -> None:
    """None (the default) = min(8, cores // 2) worker processes on CUDA, none below 4 cores
    or on CPU; resolve_engine_config writes the number into the config."""
    import os

    from structspec.config import default_grammar_workers

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert default_grammar_workers(device) == expected
    assert GrammarConfig().mask_build_workers is None
    resolved = resolve_engine_config(EngineConfig(device="cpu"))
    assert resolved.grammar.mask_build_workers == 0


@pytest.mark.parametrize("value", [-1.0, 0, float("nan"), float("inf"), "30", True])
def test_bad_grammar_compile_timeout_is_refused(value: object) -> None:
    """A negative timeout failed every grammar as "exceeded 0s"; NaN switched the limit off."""
    with pytest.raises(ValueError, match="grammar_compile_timeout_s="):
        resolve_engine_config(EngineConfig(
            device="cpu", grammar=GrammarConfig(compile_timeout_s=value)))  # type: ignore[arg-type]
    resolve_engine_config(EngineConfig(device="cpu", grammar=GrammarConfig(compile_timeout_s=0.5)))


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_batch_invariant_needs_the_triton_kernels(kernels: str) -> None:
    """On CPU ``auto`` resolves to the torch reference, which has no batch-invariant mode."""
    resolve_engine_config(EngineConfig(device="cpu", kernels=kernels))  # fine without it
    with pytest.raises(ValueError, match=r"^batch_invariant=True needs the Triton kernels"):
        resolve_engine_config(EngineConfig(device="cpu", kernels=kernels, batch_invariant=True))


@pytest.mark.parametrize("field", ["batch_invariant", "cuda_graph", "overlap"])
@pytest.mark.parametrize("value", ["false", 1, None])
def test_switches_must_be_booleans(field: str, value: object) -> None:
    """``batch_invariant="false"`` is truthy: it used to turn the (slow) mode on, and None was
    kept as is; every on/off option is now checked for a bool."""
    from structspec.config import SchedulerConfig

    config = (EngineConfig(device="cpu", scheduler=SchedulerConfig(overlap=value))
              if field == "overlap" else EngineConfig(device="cpu", **{field: value}))
    with pytest.raises(ValueError, match=f"^{field}={value!r}: expected True or False"):
        resolve_engine_config(config)  # type: ignore[arg-type]


def test_serve_refuses_a_bad_engine_option_before_spawning(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --batch-invariant`` on CPU exits 2 naming the flag, as ``generate`` does, and
    spawns no engine process (it used to exit 1 after the engine failed to start)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from structspec.cli import main
    from structspec.server import engine_client

    def no_spawn(self: object) -> None:
        raise AssertionError("an engine process was spawned")

    monkeypatch.setattr(engine_client.EngineClient, "spawn", no_spawn)
    rc = main(["serve", "--device", "cpu", "--port", "0", "--batch-invariant"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("structspec serve: --batch-invariant: batch_invariant=True needs"), err


def test_cli_batch_invariant_on_cpu_exits_2_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    from structspec.cli import main

    rc = main(["generate", "--device", "cpu", "--prompt", "hi", "--batch-invariant"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("structspec generate: --batch-invariant: batch_invariant=True needs")


@pytest.mark.parametrize("field, value", [
    ("max_schema_properties", 0), ("max_grammar_bytes", -1), ("num_compile_threads", 0),
    ("max_regex_repeat", 2.5), ("num_small_compile_workers", -1), ("small_lane_slice_s", 0),
])
def test_bad_grammar_limits_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"GrammarConfig.{field}="):
        resolve_engine_config(EngineConfig(device="cpu", grammar=GrammarConfig(**{field: value})))


def test_eagle_without_a_head_uses_the_shipped_one_on_the_default_model_only(tmp_path) -> None:
    from structspec.models.shipped_heads import DEFAULT_MODEL_EAGLE_HEAD

    spec = SpecConfig(algorithm="eagle")
    resolved = resolve_engine_config(EngineConfig(device="cpu", spec=spec))
    assert resolved.spec.draft_model == str(DEFAULT_MODEL_EAGLE_HEAD)
    assert (DEFAULT_MODEL_EAGLE_HEAD / "model.safetensors").stat().st_size < 20 * 2**20
    # a head named explicitly wins
    named = SpecConfig(algorithm="eagle", draft_model=str(tmp_path))
    assert resolve_engine_config(EngineConfig(device="cpu", spec=named)).spec.draft_model \
        == str(tmp_path)
    # another target has no shipped head: refused before anything loads, naming the option
    with pytest.raises(ValueError, match="needs draft_model=PATH.*ships only for the default"):
        resolve_engine_config(EngineConfig(model=str(tmp_path), device="cpu", spec=spec))


@pytest.mark.parametrize(("max_batch_size", "value", "resolved"),
                         [(256, None, 32), (16, None, 2), (7, None, 1), (64, 5, 5)])
def test_min_prefill_batch_auto_and_explicit(max_batch_size: int, value: int | None,
                                             resolved: int) -> None:
    sched = SchedulerConfig(max_batch_size=max_batch_size, min_prefill_batch=value)
    config = resolve_engine_config(EngineConfig(device="cpu", scheduler=sched))
    assert config.scheduler.min_prefill_batch == resolved


@pytest.mark.parametrize("value", [0, -1, "4", 2.5, True])
def test_bad_min_prefill_batch_is_refused(value: object) -> None:
    sched = SchedulerConfig(min_prefill_batch=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_prefill_batch"):
        resolve_engine_config(EngineConfig(device="cpu", scheduler=sched))


@pytest.mark.parametrize("algorithm", ["eagle", "draft_model"])
def test_a_missing_draft_model_path_is_refused_naming_it(algorithm: str) -> None:
    """Before the target loads (the loader's FileNotFoundError named only a config.json)."""
    spec = SpecConfig(algorithm=algorithm, draft_model="/nonexistent/head")
    with pytest.raises(ValueError, match="draft_model='/nonexistent/head': no such file"):
        resolve_engine_config(EngineConfig(device="cpu", spec=spec))
