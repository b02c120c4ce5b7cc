"""The event-loop side: manager, scopes, leases, holds, admission, reaping, sources."""

from .leases import Hold, Lease
from .manager import ResidencyManager, Scope
from .sources import CallableSource, SafetensorsSource, Source

__all__ = [
    "CallableSource",
    "Hold",
    "Lease",
    "ResidencyManager",
    "SafetensorsSource",
    "Scope",
    "Source",
]
