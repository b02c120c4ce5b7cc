"""Integrations built on the residency manager.

``stream_module`` / ``StreamedModule``: layer-by-layer weight streaming of an ``nn.Module``
through a device budget (see :mod:`aresidency.integrations.streaming`).
"""

from .streaming import StreamedModule, find_blocks, stream_module

__all__ = ["StreamedModule", "find_blocks", "stream_module"]
