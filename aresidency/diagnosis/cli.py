"""``python -m aresidency``: read the evidence ``manager.dump`` wrote.

* ``python -m aresidency diagnose DUMP`` prints the diagnosis report of the dumped error (the
  report ``aresidency.diagnose(error, manager)`` gives), drawn with ``rich`` when it is
  installed (``pip install aresidency[diagnose]``), as plain text otherwise or with
  ``--plain``; ``--json`` prints ``report.to_dict()`` instead.
* ``python -m aresidency timeline DUMP OUT`` writes the dump's trace as a Chrome trace-event
  file for Perfetto or chrome://tracing (what ``manager.export_timeline`` writes).

Exit status: 0 on success, 2 for a file that cannot be read as a dump or an output that cannot
be written (the message says why), 1 when the reader of the output went away before its end
(``... | head``: no traceback, as a shell tool stops).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from .diagnose import build_report
from .evidence import read_dump
from .timeline import DISABLED, write_timeline

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aresidency",
        description="Read the evidence a ResidencyManager dumped (manager.dump).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    diagnose = commands.add_parser("diagnose", help="print the diagnosis report of a dump")
    diagnose.add_argument("dump", help="a JSON file written by manager.dump")
    output = diagnose.add_mutually_exclusive_group()
    output.add_argument("--plain", action="store_true", help="plain text, even with rich")
    output.add_argument("--json", action="store_true", help="the report as JSON")
    timeline = commands.add_parser("timeline", help="write a dump's trace as a Chrome trace")
    timeline.add_argument("dump", help="a JSON file written by manager.dump")
    timeline.add_argument("out", help="where to write the trace-event JSON")
    return parser


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    out = stdout if stdout is not None else sys.stdout
    args = _parser().parse_args(argv)
    try:
        return _run(args, out)
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly. Python would report the broken pipe
        # again when it flushes stdout at exit, so stdout is pointed at devnull first.
        if out is sys.stdout:
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
        return 1


def _run(args: argparse.Namespace, out: TextIO) -> int:
    try:
        error, evidence = read_dump(args.dump)
    except (OSError, ValueError) as failure:
        print(f"aresidency: cannot read {args.dump}: {failure}", file=sys.stderr)
        return 2
    if args.command == "timeline":
        try:
            path = write_timeline(args.out, evidence.trace, evidence.snapshot)
        except OSError as failure:
            print(f"aresidency: cannot write {args.out}: {failure}", file=sys.stderr)
            return 2
        print(f"wrote {path} ({len(evidence.trace.transitions)} transitions)", file=out)
        if not evidence.trace.enabled:
            print(f"note: {DISABLED}", file=out)
        return 0
    try:
        report = build_report(error, evidence)
    except (KeyError, TypeError, ValueError, AttributeError) as failure:
        print(
            f"aresidency: cannot read {args.dump}: its error record is not well-formed "
            f"({type(failure).__name__}: {failure})",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=1), file=out)
        return 0
    if not args.plain:
        try:
            from rich.console import Console
        except ImportError:
            pass
        else:
            report.render(Console(file=out))
            return 0
    print(str(report), file=out)
    return 0
