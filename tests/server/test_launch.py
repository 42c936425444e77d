"""``structspec serve`` fails fast, with a clear message, on a taken port or a bad model."""

from __future__ import annotations

import socket
import subprocess
import time

from tests.server.server_proc import REPO, free_port, serve_command


def run(*extra: str, port: int | None = None, timeout: float = 120) -> tuple[int, str, float]:
    t = time.monotonic()
    p = subprocess.run(serve_command(port or free_port(), *extra), cwd=REPO, timeout=timeout,
                       capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t


def test_port_in_use_fails_before_loading() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, out, _ = run(port=s.getsockname()[1], timeout=60)
    assert code == 2
    assert "cannot listen on 127.0.0.1" in out and "in use" in out
    assert "starting the engine" not in out


def test_bad_model_path_is_reported_before_http_starts() -> None:
    """A missing --model is a bad command line: exit 2 before an engine process starts."""
    code, out, _ = run("--model", "/nonexistent/model-dir")
    assert code == 2
    assert "structspec serve: --model: no such file or directory '/nonexistent/model-dir'" in out
    assert "starting the engine" not in out
    assert "Uvicorn running" not in out and "Application startup" not in out


def test_max_model_len_above_the_models_is_reported_before_http_starts() -> None:
    """It used to be capped silently to the model's 8192 and served."""
    code, out, _ = run("--device", "cpu", "--max-model-len", str(10**12), timeout=90)
    assert code == 1
    assert f"the engine failed to start: ValueError: max_model_len={10**12} is greater" in out
    assert "(8192 tokens" in out
    assert "Uvicorn running" not in out and "Application startup" not in out
