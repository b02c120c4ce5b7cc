"""Device backends: where tensors are allocated, copied and synchronized.

``CudaBackend`` drives real GPUs through torch CUDA streams and events; ``SimBackend`` is a
SIMULATION of CUDA devices in host memory for machines without a GPU. Both implement
:class:`~aresidency.backends.base.Backend`; only the runtime calls them.
"""

from .base import Backend, DeviceEvent, FaultInjector, Transfer
from .cuda import CopyStreams, CudaBackend
from .sim import SimBackend, SimDeviceStreams, SimEvent, SimStream, is_poisoned, poison_
from .staging import PinnedAllocator, StagingPool
from .waiter import STRATEGIES, EventWaiter, HostEvent, hostfunc_available

__all__ = [
    "STRATEGIES",
    "Backend",
    "CopyStreams",
    "CudaBackend",
    "DeviceEvent",
    "EventWaiter",
    "FaultInjector",
    "HostEvent",
    "PinnedAllocator",
    "SimBackend",
    "SimDeviceStreams",
    "SimEvent",
    "SimStream",
    "StagingPool",
    "Transfer",
    "hostfunc_available",
    "is_poisoned",
    "poison_",
]
