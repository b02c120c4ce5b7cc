"""The event-loop side, one job per module.

==================  ========================================================================
``manager``         ``ResidencyManager``: lifecycle and the public operations
``context``         ``Runtime``: the parts a running manager's operations share
``driver``          ``PhaseRun``: carries out one phase of a plan (the only driver)
``admission``       the FIFO queue of scopes (and direct operations) waiting for room
``reaper``          completed device work (transfers, reader events) becomes state
``scopes``          ``Scope``: a plan held for an ``async with`` block
``leases``          ``Lease`` (an active use) and ``Hold`` (protection without use)
``payloads``        the tensors behind materializations, and what transitions free
``signal``          ``ChangeSignal``: the one way to wait for the state to change
``pending``         ``PendingOperation``: what ``materialize_nowait`` returns
``sources``         where reconstructible values come from
``checkpoints``     reading safetensors checkpoints (single files and sharded ones)
==================  ========================================================================
"""

from .leases import Hold, Lease, LeaseWouldWait
from .manager import ResidencyManager
from .pending import PendingOperation
from .scopes import Scope
from .signal import ManagerClosedError
from .sources import CallableSource, SafetensorsSource, Source

__all__ = [
    "CallableSource",
    "Hold",
    "Lease",
    "LeaseWouldWait",
    "ManagerClosedError",
    "PendingOperation",
    "ResidencyManager",
    "SafetensorsSource",
    "Scope",
    "Source",
]
