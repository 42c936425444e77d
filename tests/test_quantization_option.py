"""``--quantization`` / ``LLM(quantization=...)`` / ``EngineConfig.quantization``: resolution,
refusals naming the option, and the flag reaching every entry point."""

from __future__ import annotations

import argparse

import pytest

from structspec.config import (
    AUTO_CPU_QUANTIZATION,
    EngineConfig,
    resolve_engine_config,
    resolve_quantization,
)
from structspec.engine_args import add_engine_args, engine_kwargs, flag_error


@pytest.mark.parametrize(("value", "device", "dtype", "want"), [
    ("auto", "cpu", "auto", AUTO_CPU_QUANTIZATION),
    ("auto", "cpu", "float32", "none"),  # an explicit dtype keeps that dtype's weights
    ("auto", "cuda", "auto", "none"),
    ("none", "cpu", "auto", "none"),
    ("int8", "cpu", "float32", "int8"),
    ("int4", "cpu", "auto", "int4"),
])
def test_resolution(value: str, device: str, dtype: str, want: str) -> None:
    resolved_dtype = "float32" if device == "cpu" else "bfloat16"
    got = resolve_quantization(value, device=device, dtype_requested=dtype,
                               dtype=resolved_dtype if dtype == "auto" else dtype)
    assert got == want


def test_refusals_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"^quantization='int3': expected auto, none, int8"):
        resolve_quantization("int3", device="cpu", dtype_requested="auto", dtype="float32")
    with pytest.raises(ValueError, match=r"^quantization='int8' is for the CPU.*--quantization "
                                         r"none"):
        resolve_quantization("int8", device="cuda:0", dtype_requested="auto", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"^quantization='int4' needs dtype float32 on CPU"):
        resolve_quantization("int4", device="cpu", dtype_requested="bfloat16", dtype="bfloat16")
    msg = "quantization='int3': expected auto, none, int8 or int4"
    assert flag_error(msg).startswith("--quantization: ")


def test_engine_config_resolves_auto_on_cpu() -> None:
    assert EngineConfig().quantization == "auto"
    cfg = resolve_engine_config(EngineConfig(device="cpu"))
    assert cfg.quantization == AUTO_CPU_QUANTIZATION
    cfg = resolve_engine_config(EngineConfig(device="cpu", dtype="float32"))
    assert cfg.quantization == "none"
    with pytest.raises(ValueError, match="^quantization="):
        resolve_engine_config(EngineConfig(device="cpu", quantization="fp8"))


def test_flag_reaches_llm_and_serve_config(monkeypatch: pytest.MonkeyPatch) -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).quantization == "auto"
    kw = engine_kwargs(p.parse_args(["--quantization", "int8"]))
    assert kw["quantization"] == "int8"
    from structspec.server.launch import build_engine_config

    assert build_engine_config(None, **kw).quantization == "int8"
    import structspec.llm as llm_mod

    seen = {}

    class FakeEngine:
        def __init__(self, config: EngineConfig) -> None:
            seen["config"] = config

    monkeypatch.setattr(llm_mod, "LLMEngine", FakeEngine)
    llm_mod.LLM("x", quantization="int4")
    assert seen["config"].quantization == "int4"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "q4"])
