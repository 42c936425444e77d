"""The README's editable install works from any folder (issue 23): pip's default editable
install is an import hook consulted after the current directory, so a folder holding the
checkout (``structspec/``, no ``__init__.py``) shadowed the package as an empty namespace
package (``ImportError: cannot import name 'LLM' from 'structspec' (unknown location)``).
``--config-settings editable_mode=compat`` installs a path entry instead, which wins."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPAT = "--config-settings editable_mode=compat"


def test_every_editable_install_command_uses_compat_mode() -> None:
    """README.md and .ci/run install the checkout the same way."""
    for path in (ROOT / "README.md", ROOT / ".ci" / "run"):
        commands = re.findall(r"pip install -e [^&`]*", path.read_text())
        assert commands, path
        assert all(COMPAT in c for c in commands), (path, commands)


def test_ci_runs_the_readme_test_command() -> None:
    """CI (.ci/run) runs exactly the README's "Run the tests" command, workers included."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Run the tests:", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [block.strip()]
    assert "-n 2" in block  # the suite's time budget assumes its two workers


@pytest.mark.slow
def test_compat_editable_install_imports_from_a_folder_holding_the_checkout(
        tmp_path: Path) -> None:
    """Install this checkout (compat mode) into a fresh venv, then ``from structspec import
    LLM`` with the current directory holding a ``structspec/`` folder without
    ``__init__.py``, as the parent folder of a clone does."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "-e", str(ROOT), *COMPAT.split()],
                   check=True, timeout=300, capture_output=True)
    (tmp_path / "structspec").mkdir()  # the clone's own folder, as seen from its parent
    proc = subprocess.run([str(python), "-c", "import structspec; from structspec import LLM; "
                           "print(structspec.__file__)"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == ROOT / "structspec" / "__init__.py"
