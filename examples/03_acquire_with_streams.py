"""Explicit Example 3: use a value through a lease, ordered on a stream, never by host waits.

``manager.acquire(handle, location)`` never places a value: it hands out the tensor of a
materialization that already exists. On a CUDA location the lease's stream is ordered after
the copy that brought the data (on the device: the host does not wait), and leaving the lease
records a reader event on that stream, so the memory outlives the kernels that read it: the
manager's reaper collects the event before anything may free it. The low-level form
(``enter_nowait`` / ``exit_nowait(reader_events=...)``) is what a pipeline uses when it runs
its own streams. Runs on the GPU when there is one, otherwise on the simulated backend (a
simulation of CUDA devices made of host memory, whose "kernels" run on host threads in stream
order).

    python examples/03_acquire_with_streams.py
"""

from __future__ import annotations

import asyncio

import torch

from aresidency import Location, ResidencyManager, ResidencyUnavailableError

MiB = 1 << 20


async def main() -> None:
    async with ResidencyManager(budgets={"cuda:0": 64 * MiB}, backend="auto") as manager:
        backend = manager.backend
        note = " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {backend.name}{note if backend.host_compute else ''}")
        weight = manager.register(torch.eye(512) * 2, name="weight")

        # 1. acquire never places: the value is not on cuda:0 yet.
        try:
            manager.acquire(weight, "cuda:0")
        except ResidencyUnavailableError as error:
            print(f"acquire before materialize: {type(error).__name__}")

        # 2. Start the copy without waiting for it, then lease at once: the lease's stream
        #    waits for the copy on the device; the host goes on.
        pending = manager.materialize_nowait(weight, "cuda:0")
        stream = backend.current_stream(Location.parse("cuda:0"))  # the device's current stream
        x = torch.ones(512, 512)
        results: list[torch.Tensor] = []
        async with manager.acquire(weight, "cuda:0", stream=stream) as lease:
            # Work queued in the lease's stream order: on CUDA the kernels are enqueued now;
            # on the simulation they run on the stream's worker thread after the copy.
            w, device_x = lease.tensor, x.to(lease.tensor.device)  # (the lambda outlives the block)
            backend.run_in_stream_order(lease.stream, lambda: results.append(w @ device_x))
            done = backend.record_event(lease.stream)
        # Leaving the lease recorded a reader event: the materialization is protected until
        # the reaper sees it complete.
        record = manager.snapshot().value(weight).materialization("cuda:0")
        print(f"after the lease: use_count={record.use_count} (readers tracked by events)")
        await backend.wait(done)  # the task parks; the loop keeps running
        await pending
        print(f"result[0, 0] = {float(results[0][0, 0].cpu()):.1f} (twice the identity times ones)")

        # 3. The low-level form: enter without waiting, hand the stream's event back at exit.
        lease = manager.acquire(weight, "cuda:0", stream=stream, order_stream=False)
        lease.enter_nowait()  # raises LeaseWouldWait if the copy were not issued yet
        # With order_stream=False the consumer orders itself after lease.ready_event.
        if lease.ready_event is not None:
            backend.stream_wait(stream, lease.ready_event)
        w = lease.tensor
        backend.run_in_stream_order(stream, lambda: results.append(w.sum()))
        reader = backend.record_event(stream)
        lease.exit_nowait(reader_events=[reader])
        await backend.wait(reader)
        print(f"low-level lease read sum = {float(results[1].cpu()):.0f}")

        # 4. Moving it away frees cuda:0 once the reaper collected every reader event.
        await manager.move(weight, "pinned-host")
        used = manager.snapshot().location("cuda:0").used_bytes
        print(f"moved to pinned-host: cuda:0 used {used} B")


if __name__ == "__main__":
    asyncio.run(main())
