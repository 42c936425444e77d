"""``python -m structspec`` = the ``structspec`` command."""

from structspec.cli import main

raise SystemExit(main())
