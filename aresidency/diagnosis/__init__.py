"""Every failure explained: ``diagnose``, dumps, a command line and a timeline.

==================  ========================================================================
``diagnose``        ``diagnose(error, manager=None)``: the troubleshooting walk for one error
``report``          ``DiagnosisReport`` and ``DiagnosisStep``: printable, JSON-able
``steps``           the steps in order (state, endpoint, budget, protection, decision,
                    staleness, partial execution, classification); one module each
``evidence``        what a manager shows at one moment; dump files (``manager.dump``)
``timeline``        the trace as a Chrome trace-event file (``manager.export_timeline``)
``cli``             ``python -m aresidency diagnose DUMP`` and ``... timeline DUMP OUT``
==================  ========================================================================

This package reads the public surface of the manager and the pure model only; ``rich`` (for
the command line's drawing) is optional and imported only when used.
"""

from .diagnose import build_report, diagnose, diagnose_dump
from .evidence import Evidence, Owner, collect, read_dump, write_dump
from .report import STEP_TITLES, DiagnosisReport, DiagnosisStep
from .timeline import timeline_document, write_timeline

__all__ = [
    "STEP_TITLES",
    "DiagnosisReport",
    "DiagnosisStep",
    "Evidence",
    "Owner",
    "build_report",
    "collect",
    "diagnose",
    "diagnose_dump",
    "read_dump",
    "timeline_document",
    "write_dump",
    "write_timeline",
]
