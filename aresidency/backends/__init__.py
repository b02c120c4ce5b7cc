"""Device backends: where tensors are allocated, copied and synchronized.

``CudaBackend`` drives real GPUs through torch CUDA streams and events; ``SimBackend`` is a
SIMULATION of CUDA devices in host memory for machines without a GPU. Both implement
:class:`~aresidency.backends.base.Backend`; only the runtime calls them. Completions reach the
event loop (asyncio, uvloop or trio) through a :class:`~aresidency.backends.bridge.LoopBridge`.
"""

from .base import (
    Backend,
    BackendClosedError,
    CopyRequest,
    DeviceEvent,
    FaultInjector,
    Transfer,
    TransferCancelledError,
)
from .bridge import LoopBridge, LoopClosedError
from .cuda import CopyStreams, CudaBackend
from .events import HostEvent
from .memory import POISON_BYTE, as_bytes, is_poisoned, poison_
from .pinned import PinnedAllocator
from .sim import SimBackend, SimDeviceStreams, SimEvent, SimStream
from .staging import StagingPool
from .waiter import STRATEGIES, EventWaiter, hostfunc_available

__all__ = [
    "POISON_BYTE",
    "STRATEGIES",
    "Backend",
    "BackendClosedError",
    "CopyRequest",
    "CopyStreams",
    "CudaBackend",
    "DeviceEvent",
    "EventWaiter",
    "FaultInjector",
    "HostEvent",
    "LoopBridge",
    "LoopClosedError",
    "PinnedAllocator",
    "SimBackend",
    "SimDeviceStreams",
    "SimEvent",
    "SimStream",
    "StagingPool",
    "Transfer",
    "TransferCancelledError",
    "as_bytes",
    "hostfunc_available",
    "is_poisoned",
    "poison_",
]
