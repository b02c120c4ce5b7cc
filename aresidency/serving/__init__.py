"""Serving many models (or adapters) from one device budget: :class:`ModelPool`.

A server that hosts more models than its GPU holds must decide, request by request, which
models stay on the device, which are loaded, and which are streamed through, without going
over budget, losing a request or stalling the event loop. ``ModelPool(manager, "cuda:0")``
makes those choices on top of the manager, the controller and weight streaming::

    pool = ModelPool(manager, "cuda:0")
    pool.add("llama-a", model_a)                  # weights in pinned host memory
    pool.add("llama-b", model_b, checkpoint=path)  # or rebuilt from safetensors
    async with pool.use("llama-a", reserve="64MiB") as model:
        logits = await model(input_ids)

What it decides, for each request:

* **Its mode.** *Resident* when the whole model plus the request's ``reserve`` fit the
  budget: the model's missing groups (one per block, plus the tensors outside the blocks) are
  copied in and every group is held on the device for the request, so its calls copy
  nothing. *Streamed* when it cannot fit at all: the tensors outside the blocks, the blocks
  already there and the leading blocks that fit in room nobody else needs stay; the rest go
  through a prefetch window (as deep as the budget allows, at most the model's ``prefetch``).
  A request whose smallest streaming footprint (the tensors outside the blocks plus the
  largest block) plus its reserve exceed the budget fails at once, naming the bytes.
* **What leaves the device.** The pool asks its :class:`~aresidency.ResidencyController`
  for a decision: the request's groups on the device plus its reserve (and, for the decision
  only, the room the prefetch windows of streamed requests in flight may still need). The
  controller picks the evictions with the lowest expected cost of bringing them back: reload
  bytes times transfer time times how much their model is in demand (an exponentially
  decayed request rate, see :mod:`~aresidency.serving.demand`). Idle cold models go first,
  partially if that is enough; a hot model's blocks are the last to go; a model in use is
  never touched (its groups are held).
* **When.** Requests are admitted first come, first served: one at a time, the oldest
  decides and enters its decision (waiting, without blocking the loop, while only the
  requests in flight stand in its way); the ones behind it wait their turn, except a request
  that moves nothing (its model resident whole and in use, and not one whose requests the
  waiting head needs to see end: ``express_joins``), which joins at once. The decision is
  entered with ``manager.scope`` (so it also waits its turn behind any other tenant's
  scope, and is refused as stale if the state moved); the reserve is that scope's named
  ``MemoryReservation`` for the whole request. Requests for a model already on the device
  share it: no second copy.

Every admission is kept (``pool.decisions``, a :class:`PoolDecision` with the controller's
decision, the bytes loaded and evicted per model, the demand it weighed) and logged on the
``aresidency.serving`` logger; the transitions it caused are in ``manager.trace()`` under the
groups' names (``"<model>.block3"``). ``pool.stats()`` counts, per model, requests, hits,
loads, evictions, bytes copied, time waiting and the mode of the last request.

Correctness: the budget is the manager's (the pool only asks); a request cancelled while
waiting, while its model loads or in its body leaves no reservation, hold or transfer behind;
a model that fails to load fails only the requests that need it (the next one loads it
again); nothing waits for a copy on the loop. ``docs/serving.md`` is the user guide;
``examples/server_app.py`` a FastAPI server built on it.
"""

from .demand import DemandTracker, DemandView
from .entry import ModelStats, PooledStreamedModule
from .pool import ModelPool, PoolDecision, PooledModel

__all__ = [
    "DemandTracker",
    "DemandView",
    "ModelPool",
    "ModelStats",
    "PoolDecision",
    "PooledModel",
    "PooledStreamedModule",
]
