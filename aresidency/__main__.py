"""``python -m aresidency``: the command-line tools (see :mod:`aresidency.diagnosis.cli`)."""

from __future__ import annotations

from .diagnosis.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
