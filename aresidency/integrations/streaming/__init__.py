"""Layer-by-layer weight streaming: run an ``nn.Module`` whose weights do not fit a GPU budget.

``stream_module(manager, module, device="cuda:0", prefetch=2)`` packs the tensors (parameters and
buffers) of each *block* of ``module`` into one flat byte buffer and registers it with the
manager as one REPLICABLE value: either kept in host memory (``host="pinned-host"`` or
``"pageable-host"``; the module's own parameters then become views of that managed host copy, so
host memory is not doubled), or rebuilt from a safetensors checkpoint each time
(``checkpoint=path``; the module may then live on the ``meta`` device). ``await streamed(x)``
runs the module as usual. Weights in pinned host memory stream through a *ring* (the default,
``ring=None``; :mod:`.ring`): one reservation per call admits ``prefetch + 1`` device buffers,
and the thread running the blocks enqueues each block's copy into a buffer itself, after the
previous user's reader event on the device, as a hand-written double buffer does, with no
event loop work per block. Otherwise (``ring=False``, pageable host memory, checkpoints) the
blocks stream as managed values, block by block:

* the copies of the next ``prefetch`` blocks are started with
  :meth:`~aresidency.ResidencyManager.materialize_nowait` (the budget is charged at once and the
  host-to-device copy is enqueued on the manager's copy stream; the host waits for nothing), as
  far as the ``device`` budget allows, in block order;
* block ``i`` runs on the compute stream (the caller's current stream at call time, or
  ``stream=``) under a lease, which makes that stream wait *on the device* for the copy;
* when block ``i`` has been enqueued its lease exits (an event is recorded on the compute stream)
  and its GPU replica is released in the background: the release waits for that event (the
  reaper sees it complete; nothing synchronizes) and then frees the budget, which starts the next
  prefetch. The host copy stays, so nothing is ever copied back.

Budgets that remember (``keep_resident=True``, the default): when the ``device`` budget holds
more than the tensors outside the blocks plus the prefetch window, the groups that fit stay on
the device between calls (the tensors outside the blocks first, then blocks spread evenly over
the call order, so that the copies of the others overlap their compute), and a call copies only
the rest (a model that fits the budget whole stays whole: no room is left for a window no call
would use); :meth:`StreamedModule.residency` says which and why. Blocks already on the device do
not count in the prefetch window: copies run ahead over them.

Hugging Face models: a ``transformers`` causal LM (``LlamaForCausalLM`` and the like: embedding,
an ``nn.ModuleList`` of decoder layers, norm and head) streams as any module, its keyword
arguments passed through (``input_ids=``, ``attention_mask=``, the KV cache, ``use_cache=``);
``await streamed.generate(...)`` runs its ``generate`` with streamed weights, the prefetch window
wrapping around from one forward pass to the next; its ``from_pretrained`` checkpoint (a sharded
safetensors directory or its index) can be given as ``checkpoint=`` for a model built on the
``meta`` device.

One block's tensors form one value, so a block costs one copy, one lease, one event and one
release whatever its number of parameters (a many-parameter block would otherwise pay per tensor
in both Python overhead and small-copy bandwidth: docs/performance.md, 44.6 GB/s at 4 MB against
55 GB/s for large copies). Inside the flat buffer each tensor starts on a 512-byte boundary (the
CUDA caching allocator's granularity) and keeps its strides, so kernels see the same alignment and
layout as for a tensor of its own and give bit-identical results. An ``expand()``ed parameter or
buffer (stride 0 along a dimension) keeps its stride 0: only its memory is packed, copied and
charged, and its view on the device is expanded as the module's own (with a checkpoint, which
stores every tensor dense, it is read and laid out dense).

Blocks are found as: the children of an ``nn.Sequential``; otherwise the ``nn.ModuleList`` of
``module`` holding the most parameter and buffer bytes (ties: the first); or ``blocks=`` given
explicitly. Tensors of ``module`` outside the blocks (embeddings, final norm, head) form one
*resident* group, materialized at the start of each call and released at its end (or kept, see
above).

How a call runs:

* ``nn.Sequential`` (no ``blocks=``): the blocks are run one after the other on the event loop,
  awaiting only when a block's weights are not admitted yet.
* any other module: ``module(*args, **kwargs)`` (or ``module.generate(...)``) runs in a worker
  thread (one per streamed module); forward hooks on the blocks take each block's leased weights
  and hand the block back after it ran. In the common case (the block's copy already issued)
  that crosses no thread and awaits nothing: the loop prepared the lease ahead, and takes the
  blocks handed back in batches when one of the pipeline's own operations completes (waking
  the loop itself only when none is in flight). The caller's grad mode, inference mode,
  autocast state and stream are carried into that thread, and it runs in a copy of the
  caller's context (its context variables), as ``asyncio.to_thread`` does.
* the simulated backend (``backend="sim"``): its ``cuda:N`` tensors live in host memory and
  blocks run on the CPU. An ``nn.Sequential``'s blocks are submitted to the simulated compute
  stream, so they run after their copies and before their releases exactly as kernels would
  (a read after release would see the simulation's poison); in the worker thread a block
  starts once its copy has landed. Leases, events and releases are the same as on a GPU.

During a call the module's parameters and buffers are replaced by the leased device tensors
(``module._parameters[name] = tensor``, the way ``torch.func.functional_call`` does it) just for
the block's forward, and put back right after, so the module never points at freed device
memory. Inference only: a call with grad mode enabled and an input that requires grad is
refused (autograd would keep the weights past their release). Calls on one streamed module are
serialized; do not run the module elsewhere while a call is in flight. A call made with
``call_threadsafe`` from inside another streamed call's forward is nested in it (see
:mod:`.nesting`): refused at once when it could only wait for that call, cancelled with it.

Failures and the end: a block that raises, or a cancelled call, exits every lease and releases
every replica (in the background; :meth:`StreamedModule.drain` waits for them). A failed copy
fails the call when it is known by then (always on the simulated backend, which waits for its
blocks); one still in flight when a CUDA call returns is raised by ``drain``. ``aclose`` gives
the module its own host tensors back and discards the values.
"""

from __future__ import annotations

from .module import HostKind, StreamedModule, stream_module
from .packing import find_blocks

__all__ = ["HostKind", "StreamedModule", "find_blocks", "stream_module"]
