"""CLI flags that reach the engine config: ``--kernels`` and ``--load-format``."""

from __future__ import annotations

import pytest

from structspec.cli import _engine_kwargs, build_parser


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_kernels_and_load_format_flags(command: str) -> None:
    from structspec.server.launch import build_engine_config

    extra = ["--prompt", "hi"] if command == "generate" else []
    parser = build_parser()
    args = parser.parse_args([command, *extra])
    kw = _engine_kwargs(args)
    assert kw["kernels"] == "auto" and kw["load_format"] == "auto"
    args = parser.parse_args([command, *extra, "--kernels", "torch", "--load-format", "dummy",
                              "--no-cuda-graph"])
    kw = _engine_kwargs(args)
    assert kw["kernels"] == "torch" and kw["load_format"] == "dummy"
    config = build_engine_config("some/dir", **kw)  # what `serve` hands the engine process
    assert (config.kernels, config.load_format, config.cuda_graph) == ("torch", "dummy", False)
    with pytest.raises(SystemExit):
        parser.parse_args([command, *extra, "--load-format", "random"])
    with pytest.raises(SystemExit):
        parser.parse_args([command, *extra, "--kernels", "cuda"])


def test_llm_passes_kernels_and_load_format(monkeypatch: pytest.MonkeyPatch) -> None:
    import structspec.llm as llm_mod

    seen = {}

    class FakeEngine:
        def __init__(self, config: object) -> None:
            seen["config"] = config

    monkeypatch.setattr(llm_mod, "LLMEngine", FakeEngine)
    llm_mod.LLM("x", kernels="torch", load_format="dummy", seed=5)
    config = seen["config"]
    assert (config.kernels, config.load_format, config.seed) == ("torch", "dummy", 5)
