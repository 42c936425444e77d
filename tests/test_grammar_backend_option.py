"""``--grammar-backend`` / ``LLM(grammar_backend=...)`` / ``GrammarConfig.backend``: the
flag, the config check naming the option, and the per-backend /metrics counter."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from structspec.config import EngineConfig, GrammarConfig, resolve_engine_config
from structspec.engine_args import add_engine_args, engine_kwargs, flag_error


def test_flag_reaches_the_engine_options() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["grammar_backend"] == "xgrammar"
    for name in ("xgrammar", "llguidance", "auto"):
        args = parser.parse_args(["--grammar-backend", name])
        assert engine_kwargs(args)["grammar_backend"] == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--grammar-backend", "outlines"])


def test_config_check_names_the_option() -> None:
    assert GrammarConfig().backend == "xgrammar"
    with pytest.raises(ValueError, match="grammar_backend='outlines'") as info:
        resolve_engine_config(EngineConfig(device="cpu",
                                           grammar=GrammarConfig(backend="outlines")))
    assert flag_error(str(info.value)).startswith("--grammar-backend: ")


def test_metrics_count_requests_by_backend() -> None:
    pytest.importorskip("prometheus_client")
    from structspec.server.ipc import EngineDelta
    from structspec.server.metrics import ServerMetrics

    m = ServerMetrics()
    for backend in ("llguidance", "xgrammar", "llguidance", None):
        final = EngineDelta(request_id="r", finished=True, finish_reason="stop",
                            grammar_backend=backend)
        m.on_finished(SimpleNamespace(prompt_ids=[1], token_ids=[2], first_token_s=None,
                                      final=final), 0.1)
    text = m.render().decode()
    assert 'structspec_grammar_requests_total{backend="llguidance"} 2.0' in text
    assert 'structspec_grammar_requests_total{backend="xgrammar"} 1.0' in text


def test_server_choices_name_the_backend() -> None:
    """``choices[i].grammar_backend`` on chat and completion responses (absent without a
    grammar)."""
    pytest.importorskip("fastapi")
    from structspec.server import serving_chat, serving_completion
    from structspec.server.ipc import EngineDelta

    for backend in ("llguidance", None):
        final = EngineDelta(request_id="r", finished=True, finish_reason="stop",
                            grammar_backend=backend)
        c = SimpleNamespace(index=0, text="{}", logprobs=None, finish_reason="stop",
                            final=final)
        chat = serving_chat._choice(None, c, False, None)  # type: ignore[arg-type]
        completion = serving_completion._choice(None, c, False, "")  # type: ignore[arg-type]
        for out in (chat, completion):
            assert out.get("grammar_backend") == backend
