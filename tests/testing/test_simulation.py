"""``SimulationConfig`` and ``simulated_manager``: the simulated machine of a test (a simulation
of CUDA devices in host memory), described in one checked value and started in one call."""

from __future__ import annotations

import math

import pytest
import torch

from aresidency.testing import SimulationConfig, simulated_manager

pytestmark = pytest.mark.anyio


# --- SimulationConfig ------------------------------------------------------------------------


def test_the_defaults_describe_two_unthrottled_devices_without_budgets():
    config = SimulationConfig()
    assert dict(config.budgets) == {}
    assert (config.devices, config.copy_gbps, config.staging_bytes) == (2, None, 0)
    assert (config.fail_transfer_at, config.oom_at_allocation) == (None, None)
    assert config.trace_capacity == 4096


def test_budgets_are_keyed_by_location_strings_in_exact_bytes():
    config = SimulationConfig({"cuda:0": "64MiB", "pinned-host": 1e9, "cuda:1": None})
    assert dict(config.budgets) == {
        "cuda:0": 64 << 20,
        "pinned-host": 1_000_000_000,
        "cuda:1": None,
    }
    with pytest.raises(TypeError):
        config.budgets["cuda:0"] = 1  # type: ignore[index]


def test_replace_changes_the_given_options_and_keeps_the_rest():
    config = SimulationConfig({"cuda:0": "1MiB"}, devices=1)
    changed = config.replace(copy_gbps=2, fail_transfer_at=3)
    assert (changed.devices, changed.copy_gbps, changed.fail_transfer_at) == (1, 2.0, 3)
    assert dict(changed.budgets) == {"cuda:0": 1 << 20}
    assert config.copy_gbps is None  # unchanged: configs are values


def test_equal_configs_are_equal_and_hash_alike():
    a = SimulationConfig({"cuda:0": "1MiB"}, copy_gbps=1)
    b = SimulationConfig({"cuda:0": 1 << 20}, copy_gbps=1.0)
    assert a == b and hash(a) == hash(b)
    assert a != a.replace(devices=3)


def test_its_repr_says_it_is_a_simulation_and_prints_sizes_like_torch():
    config = SimulationConfig({"cuda:0": "8GiB"}, copy_gbps=0.5, fail_transfer_at=2)
    assert repr(config) == (
        "<SimulationConfig (a simulation) 2 simulated device(s), copies 0.5 GB/s, "
        "budgets {cuda:0: 8192 MiB} fail_transfer_at=2>"
    )


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"budgets": ["cuda:0"]}, TypeError, r"budgets must be a mapping"),
        ({"budgets": {"cuda:0": "lots"}}, ValueError, r"budget for cuda:0 must be a byte count"),
        ({"budgets": {"gpu0": "1MiB"}}, ValueError, r"'gpu0'"),
        ({"devices": -1}, ValueError, r"devices \(the number of simulated CUDA devices\)"),
        ({"devices": True}, TypeError, r"devices .* got True"),
        ({"devices": 1.0}, TypeError, r"devices .* got 1\.0"),
        ({"copy_gbps": 0}, ValueError, r"copy_gbps must be a finite number of GB/s > 0"),
        ({"copy_gbps": math.inf}, ValueError, r"copy_gbps must be a finite number"),
        ({"copy_gbps": "fast"}, TypeError, r"copy_gbps must be a number of GB/s"),
        ({"fail_transfer_at": 0}, ValueError, r"fail_transfer_at \(the k-th transfer, from 1\)"),
        ({"oom_at_allocation": 1.5}, TypeError, r"oom_at_allocation"),
        ({"staging_bytes": "-1MiB"}, ValueError, r"staging_bytes must be a byte count"),
        ({"trace_capacity": -1}, ValueError, r"trace_capacity must be an int >= 0"),
        ({"budget": {}}, TypeError, r"unknown simulation option\(s\) 'budget': the options are"),
    ],
)
def test_a_bad_option_is_refused_naming_it(options, error, match):
    with pytest.raises(error, match=match):
        SimulationConfig().replace(**options)


# --- simulated_manager -----------------------------------------------------------------------


async def test_it_enters_a_manager_on_the_simulation_and_closes_it():
    async with simulated_manager(budgets={"cuda:0": "1MiB"}, devices=1, copy_gbps=4) as manager:
        assert manager.running
        assert "SIMULATION" in repr(manager.backend)
        assert manager.backend.device_count() == 1
        assert manager.backend.host_compute
        assert manager.snapshot().location("cuda:0").budget_bytes == 1 << 20
    assert not manager.running


async def test_a_config_and_options_combine_the_options_winning():
    config = SimulationConfig({"cuda:0": "1MiB"}, devices=3)
    async with simulated_manager(config, devices=1) as manager:
        assert manager.backend.device_count() == 1
        assert manager.snapshot().location("cuda:0").budget_bytes == 1 << 20


async def test_a_location_beyond_the_simulated_devices_is_refused():
    async with simulated_manager(devices=1) as manager:
        handle = manager.register(torch.ones(4), name="w")
        with pytest.raises(ValueError, match=r"cuda:1 does not exist on the simulated backend"):
            await manager.materialize(handle, "cuda:1")
    with pytest.raises(ValueError, match=r"cuda:3 does not exist"):
        async with simulated_manager(budgets={"cuda:3": "1MiB"}):
            pytest.fail("the manager started")


async def test_fail_transfer_at_fails_the_kth_transfer_of_the_code_under_test():
    async with simulated_manager(fail_transfer_at=2) as manager:
        a = manager.register(torch.ones(4), name="a", location="pinned-host")  # not a transfer
        b = manager.register(torch.ones(4), name="b", location="pinned-host")
        await manager.materialize(a, "cuda:0")  # the first transfer
        with pytest.raises(RuntimeError, match="injected transfer failure"):
            await manager.materialize(b, "cuda:0")  # the second
        await manager.materialize(b, "cuda:0")  # once only
        assert [str(loc) for loc in manager.snapshot().value(b).locations] == ["cuda:0"]


async def test_oom_at_allocation_makes_the_kth_allocation_fail_like_a_full_device():
    async with simulated_manager(oom_at_allocation=1) as manager:
        handle = manager.register(torch.ones(4), name="w")  # in place: no allocation
        with pytest.raises(torch.OutOfMemoryError, match=r"injected allocation failure"):
            await manager.materialize(handle, "cuda:0")
        assert [str(loc) for loc in manager.snapshot().value(handle).locations] == ["pageable-host"]


async def test_a_bad_config_is_refused_before_anything_starts():
    with pytest.raises(TypeError, match="simulated_manager takes a SimulationConfig"):
        async with simulated_manager({"devices": 1}):  # type: ignore[arg-type]
            pytest.fail("the manager started")
    with pytest.raises(TypeError, match="unknown simulation option"):
        async with simulated_manager(gpus=1):
            pytest.fail("the manager started")
