"""The README's commands and examples run as written, on CPU, from a fresh copy of the checkout.

Each fenced shell block runs through ``bash -euo pipefail``, each Python block through
``python -``, in a copy of the checkout's files (``git ls-files``: no build outputs, caches or
anything else this machine added), so a block that writes files leaves the checkout alone. A
block the README marks ``skip`` is reported as skipped with the README's reason; the ``serve``
block's server is started once, on a free port, for the ``server`` blocks (tests/readme_blocks.py
describes the markers). Run it with ``python -m pytest -m slow tests/test_readme_examples.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.readme_blocks import SHELL_LANGS, CodeBlock, ReadmeFormatError, extract_blocks
from tests.server.server_proc import STARTUP_TIMEOUT_S, free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK_TIMEOUT_S = 600.0
OUTPUT_TAIL_CHARS = 6000

try:
    BLOCKS = extract_blocks(README.read_text(encoding="utf-8"))
    FORMAT_ERROR = ""
except ReadmeFormatError as exc:  # reported by test_readme_blocks_classified
    BLOCKS, FORMAT_ERROR = [], str(exc)
CODE_BLOCKS = [b for b in BLOCKS if b.is_code]


def test_readme_blocks_classified() -> None:
    """Every fence names its language; every marker parses; every skip gives its reason."""
    assert not FORMAT_ERROR, f"README.md: {FORMAT_ERROR}"
    assert any(b.mode == "run" for b in CODE_BLOCKS), "README.md: no runnable block found"
    for b in CODE_BLOCKS:
        assert b.mode != "skip" or b.reason, f"README.md line {b.line}: skip without a reason"



@pytest.mark.parametrize(("markdown", "message"), [
    ("```\nls\n```\n", "fence without a language"),
    ("```ruby\nputs 1\n```\n", "'ruby' is not one of"),
    ("```bash\nls\n", "never closed"),
    ("<!-- readme-test: skip -->\n```bash\nls\n```\n", "needs a reason"),
    ("<!-- readme-test: later -->\n```bash\nls\n```\n", "malformed readme-test marker"),
    ("<!-- readme-test: skip (x) -->\n\n```bash\nls\n```\n", "not directly before a fence"),
    ("<!-- readme-test: server -->\n```bash\nls\n```\n", "needs a 'serve' block"),
])
def test_extractor_refuses(markdown: str, message: str) -> None:
    """A block the check could not classify fails the default suite, naming its line."""
    with pytest.raises(ReadmeFormatError, match=message):
        extract_blocks(markdown)


def test_extractor_modes_and_port() -> None:
    """Markers set the mode; only the README port changes; console keeps its ``$`` lines."""
    blocks = extract_blocks(
        "<!-- readme-test: serve -->\n```bash\nstructspec serve --port 8000\n```\n"
        "<!-- readme-test: server -->\n```console\n$ curl localhost:8000/health\nok\n```\n"
        "```python\nprint(18000)\n```\n```text\na/\n```\n")
    assert [(b.line, b.lang, b.mode) for b in blocks] == [
        (2, "bash", "serve"), (6, "console", "server"), (10, "python", "run"),
        (13, "text", "skip")]
    assert blocks[0].script(4321) == "structspec serve --port 4321\n"
    assert blocks[1].script(4321) == "curl localhost:4321/health\n"
    assert blocks[2].script(4321) == "print(18000)\n"
    assert not blocks[3].is_code

@pytest.fixture(scope="session")
def readme_checkout() -> Iterator[Path]:
    """A copy of the checkout's tracked and untracked-but-not-ignored files (a fresh clone)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    root = Path(tempfile.mkdtemp(prefix="structspec-readme-"))
    for rel in filter(None, (f.decode() for f in files)):
        src = REPO / rel
        if src.is_file():  # a deleted-but-tracked file is listed too
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _block_env(checkout: Path) -> dict[str, str]:
    """This interpreter's environment, with the copy's ``structspec`` first on the import path.

    ``python`` and ``structspec`` resolve to the test's interpreter and its scripts (what
    ``.ci/run`` installed); ``PYTHONPATH`` makes both import the copy's package, as an editable
    install of a fresh clone would.
    """
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")]))
    return env


def _command(block: CodeBlock) -> list[str]:
    if block.lang in SHELL_LANGS:
        return ["bash", "-euo", "pipefail", "-s"]
    return [sys.executable, "-"]


def _run(cmd: list[str], script: str, cwd: Path) -> tuple[int, str]:
    """Run ``script`` on ``cmd``'s stdin in its own session; return (exit code, stdout + stderr).

    Raises:
        pytest.fail: still running after ``BLOCK_TIMEOUT_S`` (the whole session is killed, so a
            child the block started cannot hold the pipes open).
    """
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=cwd, env=_block_env(cwd),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(script.encode(), timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running after {BLOCK_TIMEOUT_S} s:\n{script}\n"
                    f"{out.decode(errors='replace')[-OUTPUT_TAIL_CHARS:]}")
    return proc.returncode, out.decode(errors="replace")


def _describe(block: CodeBlock, script: str) -> str:
    return f"README.md line {block.line} ({block.lang}):\n{script}"


@pytest.fixture(scope="session")
def readme_server(readme_checkout: Path) -> Iterator[int]:
    """Run the README's ``serve`` block on a free port until ``/health`` answers; yield the port.

    Raises:
        pytest.fail: the block exited or the server was not healthy after the startup timeout.
    """
    serve = next(b for b in BLOCKS if b.mode == "serve")
    port = free_port()
    script = serve.script(port)
    log = Path(tempfile.mkstemp(prefix="structspec-readme-serve-", suffix=".log")[1])
    with open(log, "wb") as f:
        proc = subprocess.Popen(_command(serve), stdin=subprocess.PIPE, stdout=f,
                                stderr=subprocess.STDOUT, cwd=readme_checkout,
                                env=_block_env(readme_checkout), start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(script.encode())
    proc.stdin.close()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{_describe(serve, script)}exited {proc.returncode} before serving:\n"
                            f"{log.read_text(errors='replace')[-OUTPUT_TAIL_CHARS:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # the port answers only once the engine is ready
            if time.monotonic() > deadline:
                pytest.fail(f"{_describe(serve, script)}not healthy after {STARTUP_TIMEOUT_S} s:\n"
                            f"{log.read_text(errors='replace')[-OUTPUT_TAIL_CHARS:]}")
            time.sleep(0.5)
        yield port
    finally:
        # bash may have forked the server: signal the whole session (graceful, then forced)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.parametrize("block", CODE_BLOCKS, ids=[f"line{b.line}-{b.lang}" for b in CODE_BLOCKS])
def test_readme_block(block: CodeBlock, readme_checkout: Path,
                      request: pytest.FixtureRequest) -> None:
    """The block exits 0 as written (a ``skip`` block is reported with the README's reason)."""
    if block.mode == "skip":
        pytest.skip(f"README.md line {block.line}: {block.reason}")
    if block.mode == "serve":
        request.getfixturevalue("readme_server")  # fails unless the block serves /health
        return
    port = request.getfixturevalue("readme_server") if block.mode == "server" else None
    script = block.script() if port is None else block.script(port)
    rc, out = _run(_command(block), script, readme_checkout)
    assert rc == 0, f"{_describe(block, script)}exited {rc}:\n{out[-OUTPUT_TAIL_CHARS:]}"
