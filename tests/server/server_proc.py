"""Start a real ``python -m structspec serve`` process for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = float(os.environ.get("STRUCTSPEC_TEST_SERVER_TIMEOUT", "300"))
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerHandle:
    """A running server: its base URL, process and log file."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def health(self) -> dict[str, object]:
        return httpx.get(self.url + "/health", timeout=10).json()


def serve_command(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "structspec", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--dtype", "float32", *extra]


@contextmanager
def running_server(*extra: str, timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[ServerHandle]:
    """Start a server with ``extra`` CLI flags, wait for ``/health``, stop it at the end."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="structspec-serve-", suffix=".log")[1])
    with open(log, "wb") as f:
        proc = subprocess.Popen(serve_command(port, *extra), stdout=f, stderr=subprocess.STDOUT,
                                cwd=REPO, start_new_session=True)
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{handle.log_tail()}")
            try:
                if httpx.get(handle.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout_s} s:\n{handle.log_tail()}")
            time.sleep(0.5)
        yield handle
    finally:
        stop_server(proc)
        log.unlink(missing_ok=True)


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int | None:
    """SIGTERM (graceful), then SIGKILL the process group if it hangs; returns the code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode
