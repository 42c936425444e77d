"""Whether an output path can really be written: found out by writing, not by ``os.access``.

Root passes every ``os.access`` check, also on filesystems that refuse new files (``/sys``,
``/proc``, a read-only mount), so a command that asked ``os.access`` learnt that its output
could not be written only when it wrote it, after the model had loaded and the work was done
(``structspec generate --out-file``, ``structspec train-eagle --out``). Both probes here
write for real and leave nothing behind: neither creates the output itself nor truncates or
changes an existing file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def probe_dir_writable(directory: Path) -> None:
    """Create and remove an empty probe file (``.write-probe-*``) in ``directory``.

    Raises:
        OSError: a file cannot be created there (``strerror`` says why: permission, a
            read-only filesystem, no such directory, ...).
    """
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-"):
        pass


def probe_file_writable(path: Path) -> None:
    """Check that ``path`` can be opened for writing, without changing it: an existing file is
    opened for append (nothing is written; its contents stay), a new one is probed through
    its directory (:func:`probe_dir_writable`).

    Raises:
        OSError: it cannot be written (``strerror`` says why).
    """
    if path.exists():
        with open(path, "ab"):
            pass
    else:
        probe_dir_writable(path.parent)
