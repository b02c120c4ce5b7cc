"""Weights written in place (``load_state_dict``, ``copy_`` under ``no_grad``) while a model is
in a ``ModelPool``, on the simulated backend (CUDA simulated in host memory).

The next request admitted after the write runs the new weights, whether the model is resident
(direct, shared or pipeline calls) or streamed; a call made while requests hold the stale
replicas is refused, never run on the old weights; a request that arrives meanwhile waits
until the model is idle. Outputs are compared bit for bit with the plain module on the CPU."""

from __future__ import annotations

import anyio
import pytest
import torch

from aresidency import ResidencyManager
from aresidency.serving import ModelPool

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import TOKENS, TOTAL

pytestmark = pytest.mark.anyio

# The pool's call paths on a resident model (shared calls, direct calls on the held replicas,
# the pipeline), and a streamed model (half the model's bytes).
CASES = {
    "resident, direct": (1.5, {}),
    "resident, shared": (1.5, {"shared_calls": True}),
    "resident, pipeline": (1.5, {"direct_calls": False}),
    "streamed": (0.5, {}),
}


def rewrite(module: TinyLM, seed: int) -> None:
    """Write other weights into ``module``'s own tensors (in place, as a fine-tuning step or a
    checkpoint reload does)."""
    with torch.no_grad():
        module.load_state_dict(TinyLM(seed=seed).state_dict())


@pytest.mark.parametrize("case", list(CASES))
async def test_the_next_request_after_an_in_place_write_runs_the_new_weights(case: str) -> None:
    factor, options = CASES[case]
    async with (
        ResidencyManager(budgets={"cuda:0": int(factor * TOTAL)}, backend="sim") as m,
        ModelPool(m, **options) as pool,
    ):
        module = TinyLM(seed=0)
        pool.add("a", module)
        with anyio.fail_after(10):
            for seed in (5, 6):  # written twice: each write is seen
                async with pool.use("a") as model:
                    assert torch.equal(await model(TOKENS), reference(module, TOKENS))
                    assert model.mode == ("streamed" if factor < 1 else "resident")
                rewrite(module, seed)
                expected = reference(module, TOKENS)
                async with pool.use("a") as model:
                    assert torch.equal(await model(TOKENS), expected)
                    assert torch.equal(await model(TOKENS), expected)
                # The model called directly (outside a request) sees the same weights.
                assert torch.equal(await pool.module("a")(TOKENS), expected)
        assert_nothing_leaked(m, pool)


@pytest.mark.parametrize("case", list(CASES))
async def test_a_call_while_requests_hold_the_stale_replicas_is_refused(case: str) -> None:
    factor, options = CASES[case]
    async with (
        ResidencyManager(budgets={"cuda:0": int(factor * TOTAL)}, backend="sim") as m,
        ModelPool(m, **options) as pool,
    ):
        module = TinyLM(seed=0)
        pool.add("a", module)
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                await model(TOKENS)
                rewrite(module, 5)
                with pytest.raises(RuntimeError, match="written in place while requests hold"):
                    await model(TOKENS)
            async with pool.use("a") as model:  # admitted after: copied again
                assert torch.equal(await model(TOKENS), reference(module, TOKENS))
        assert_nothing_leaked(m, pool)


async def test_a_request_arriving_after_the_write_waits_until_the_model_is_idle() -> None:
    async with (
        ResidencyManager(budgets={"cuda:0": int(1.5 * TOTAL)}, backend="sim") as m,
        ModelPool(m) as pool,
    ):
        module = TinyLM(seed=0)
        pool.add("a", module)
        old = reference(module, TOKENS)
        got: list[torch.Tensor] = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                async with pool.use("a") as first:
                    assert torch.equal(await first(TOKENS), old)
                    rewrite(module, 5)

                    async def second() -> None:
                        async with pool.use("a") as model:
                            got.append(await model(TOKENS))

                    tasks.start_soon(second)
                    await anyio.wait_all_tasks_blocked()
                    assert not got and pool.waiting == 1  # it did not join the stale replicas
                await anyio.wait_all_tasks_blocked()
        assert len(got) == 1 and torch.equal(got[0], reference(module, TOKENS))
        assert not torch.equal(got[0], old)
        assert_nothing_leaked(m, pool)


class _Counting(TinyLM):
    """A TinyLM whose second block's forward replaces a buffer with a new tensor at each call
    (as a dynamic RoPE replaces its ``inv_freq``): it counts its calls there."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.layers[1].register_buffer("calls", torch.zeros(4), persistent=False)
        self.layers[1].register_forward_pre_hook(_count)


def _count(block: torch.nn.Module, args: object) -> None:
    block.calls = block.calls + 1  # a new tensor in the buffer's place, not a write into it


async def test_a_call_after_the_forward_replaced_a_held_tensor_is_refused_saying_so() -> None:
    """Not "written in place": the message names the tensor the forward replaced and says to
    make the call in a new request, which runs the new value."""
    async with (
        ResidencyManager(budgets={"cuda:0": int(1.5 * TOTAL)}, backend="sim") as m,
        ModelPool(m) as pool,
    ):
        module = _Counting()
        pool.add("a", module)
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                assert model.mode == "resident"
                await model(TOKENS)
                with pytest.raises(RuntimeError) as caught:
                    await model(TOKENS)
            message = str(caught.value)
            assert "layers.1.calls" in message and "forward replaced" in message
            assert "written in place" not in message and "new request" in message
            async with pool.use("a") as model:  # runs the value the first call left
                await model(TOKENS)
            assert torch.equal(module.layers[1].calls, torch.ones(4))
        assert_nothing_leaked(m, pool)
    assert torch.equal(module.layers[1].calls, torch.full((4,), 2.0))  # kept at the pool's end
