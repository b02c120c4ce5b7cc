"""The pytest plugin, as a user meets it: small test files run through pytest (``pytester``),
with the plugin loaded the way users get it, through its ``pytest11`` entry point.

Each inner run turns pytest-asyncio off (``-p no:asyncio``) unless the test is about living
beside it, and runs anyio's plugin, which runs the async tests and the plugin's fixtures. The
inner tests run on asyncio alone (a conftest fixes ``anyio_backend``; anyio's own default runs
each test on every loop it finds) unless a test is about choosing the loop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest_plugins = ["pytester"]

ANYIO_ONLY = ("-p", "no:asyncio", "-p", "no:cacheprovider")

ONE_LOOP = """
import pytest as _pytest

@_pytest.fixture
def anyio_backend():
    return "asyncio"
"""


def run(
    pytester: pytest.Pytester, source: str, *args: str, conftest: str = "", one_loop: bool = True
) -> pytest.RunResult:
    """Run ``source`` as ``test_inner.py`` (beside ``conftest``) through pytest."""
    pytester.makepyfile(test_inner=textwrap.dedent(source))
    text = textwrap.dedent(conftest) + (ONE_LOOP if one_loop else "")
    if text:
        pytester.makeconftest(text)
    return pytester.runpytest(*ANYIO_ONLY, *args)


# --- loading ---------------------------------------------------------------------------------


USES_THE_FIXTURE = """
    import pytest

    pytestmark = pytest.mark.anyio

    async def test_it(residency_manager):
        assert residency_manager.running
"""


def test_the_plugin_is_loaded_through_its_entry_point(pytester):
    result = run(pytester, USES_THE_FIXTURE)  # no conftest, no pytest_plugins
    result.assert_outcomes(passed=1)


def test_the_plugin_can_be_turned_off(pytester):
    result = run(pytester, USES_THE_FIXTURE, "-p", "no:aresidency")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'residency_manager' not found*"])


def test_the_markers_are_registered_for_strict_markers(pytester):
    result = pytester.runpytest(*ANYIO_ONLY, "--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.residency(**options): *simulation of CUDA devices*budgets, devices, "
            "copy_gbps, fail_transfer_at, oom_at_allocation, staging_bytes, trace_capacity",
            "@pytest.mark.allow_loop_stall(seconds=None): *",
        ]
    )


# --- residency_manager and its configuration -------------------------------------------------


def test_the_fixture_is_a_running_manager_on_the_simulation_with_the_defaults(pytester):
    result = run(
        pytester,
        """
        import pytest
        from aresidency import ResidencyManager

        pytestmark = pytest.mark.anyio

        async def test_defaults(residency_manager):
            assert isinstance(residency_manager, ResidencyManager)
            assert "SIMULATION" in repr(residency_manager.backend)
            assert residency_manager.backend.device_count() == 2
            assert residency_manager.backend.copy_gbps is None
            budgets = [r.budget_bytes for r in residency_manager.snapshot().locations.values()]
            assert budgets == [None, None, None, None]

        async def test_each_test_gets_its_own(residency_manager):
            assert residency_manager.state_version == 0
            residency_manager.set_budget("cuda:0", "1MiB")
        """,
    )
    result.assert_outcomes(passed=2)


def test_markers_configure_the_simulation_the_closest_winning(pytester):
    result = run(
        pytester,
        """
        import pytest

        pytestmark = [
            pytest.mark.anyio,
            pytest.mark.residency(budgets={"cuda:0": "1MiB"}, devices=1, copy_gbps=2),
        ]

        async def test_module_marker(residency_manager):
            assert residency_manager.snapshot().location("cuda:0").budget_bytes == 1 << 20
            assert residency_manager.backend.device_count() == 1
            assert residency_manager.backend.copy_gbps == 2.0

        @pytest.mark.residency(budgets={"pinned-host": "2GB"}, copy_gbps=0.5)
        async def test_function_marker_replaces_options(residency_manager):
            snapshot = residency_manager.snapshot()
            assert snapshot.location("pinned-host").budget_bytes == 2_000_000_000
            assert snapshot.location("cuda:0").budget_bytes is None  # budgets replaced whole
            assert residency_manager.backend.device_count() == 1  # kept from the module
            assert residency_manager.backend.copy_gbps == 0.5

        class TestClass:
            pytestmark = pytest.mark.residency(devices=3)

            async def test_class_marker(self, residency_manager):
                assert residency_manager.backend.device_count() == 3
        """,
    )
    result.assert_outcomes(passed=3)


def test_indirect_parametrization_configures_each_run(pytester):
    result = run(
        pytester,
        """
        import pytest
        from aresidency.testing import SimulationConfig

        pytestmark = pytest.mark.anyio

        @pytest.mark.residency(budgets={"cuda:0": "1MiB"})
        @pytest.mark.parametrize(
            ("residency_manager", "devices"),
            [({"devices": 1}, 1), (SimulationConfig(devices=3), 3)],
            indirect=["residency_manager"],
        )
        async def test_devices(residency_manager, devices, residency_config):
            assert residency_manager.backend.device_count() == devices
            assert residency_config.devices == devices  # what the manager was made with

        @pytest.mark.parametrize("residency_config", [{"copy_gbps": 8}], indirect=True)
        async def test_config_parametrized(residency_manager, residency_config):
            assert residency_config.copy_gbps == 8.0
            assert residency_manager.backend.copy_gbps == 8.0
        """,
    )
    result.assert_outcomes(passed=3)


def test_a_conftest_sets_a_directorys_defaults_by_overriding_residency_defaults(pytester):
    result = run(
        pytester,
        """
        import pytest

        pytestmark = pytest.mark.anyio

        async def test_uses_the_projects_defaults(residency_manager):
            assert residency_manager.backend.device_count() == 1
            assert residency_manager.snapshot().location("cuda:0").budget_bytes == 4 << 20

        @pytest.mark.residency(copy_gbps=3)
        async def test_markers_still_apply_on_top(residency_manager):
            assert residency_manager.backend.device_count() == 1
            assert residency_manager.backend.copy_gbps == 3.0
        """,
        conftest="""
        import pytest
        from aresidency.testing import SimulationConfig

        @pytest.fixture
        def residency_defaults():
            return SimulationConfig({"cuda:0": "4MiB"}, devices=1)
        """,
    )
    result.assert_outcomes(passed=2)


def test_fault_injection_options_fail_the_first_transfer_and_allocation(pytester):
    result = run(
        pytester,
        """
        import pytest
        import torch

        pytestmark = pytest.mark.anyio

        @pytest.mark.residency(fail_transfer_at=1)
        async def test_transfer(residency_manager):
            h = residency_manager.register(torch.ones(4), name="w")
            with pytest.raises(RuntimeError, match="injected transfer failure"):
                await residency_manager.materialize(h, "cuda:0")

        @pytest.mark.residency(oom_at_allocation=1)
        async def test_allocation(residency_manager):
            h = residency_manager.register(torch.ones(4), name="w")
            with pytest.raises(torch.OutOfMemoryError):
                await residency_manager.materialize(h, "cuda:0")
        """,
    )
    result.assert_outcomes(passed=2)


def test_an_unknown_or_bad_marker_option_is_an_error_naming_it(pytester):
    result = run(
        pytester,
        """
        import pytest

        pytestmark = pytest.mark.anyio

        @pytest.mark.residency(budget={"cuda:0": "1MiB"})
        async def test_typo(residency_manager):
            pass

        @pytest.mark.residency(budgets={"cuda:0": "1 MiBs"})
        async def test_bad_size(residency_manager):
            pass

        @pytest.mark.residency({"devices": 1})
        async def test_positional(residency_manager):
            pass
        """,
    )
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(
        [
            "*unknown simulation option(s) 'budget': the options are budgets, devices, *",
            "*budget for cuda:0 must be a byte count*unknown unit 'MiBs'*",
            "*@pytest.mark.residency takes keyword options only*",
        ]
    )


def test_each_test_runs_on_the_loops_anyio_backend_chooses(pytester):
    result = run(
        pytester,
        """
        import sniffio
        import pytest

        pytestmark = pytest.mark.anyio

        @pytest.fixture(params=["asyncio", "trio"])
        def anyio_backend(request):
            return request.param

        async def test_loop(residency_manager, anyio_backend):
            assert sniffio.current_async_library() == anyio_backend
            residency_manager.check_thread()  # the manager lives on the test's loop
        """,
        one_loop=False,
    )
    result.assert_outcomes(passed=2)


# --- beside pytest-asyncio, and misuse -------------------------------------------------------


def test_anyio_tests_use_the_fixtures_beside_pytest_asyncio_in_strict_mode(pytester):
    pytest.importorskip("pytest_asyncio")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest(ONE_LOOP)
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import pytest

            @pytest.mark.anyio
            async def test_anyio(residency_manager):
                assert residency_manager.running

            @pytest.mark.asyncio
            async def test_asyncio(residency_manager):
                pass

            def test_sync(residency_manager):
                pass
            """
        )
    )
    result = pytester.runpytest("-p", "no:cacheprovider")  # pytest-asyncio loaded: strict mode
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*RuntimeError: residency_manager runs on anyio's event loop, so the test must too: "
            "mark it pytest.mark.anyio (not pytest.mark.asyncio)*",
            "*RuntimeError: residency_manager is an async fixture for async tests*",
        ]
    )


# --- the loop-stall guard --------------------------------------------------------------------


BLOCKS = """
    import time
    import anyio
    import pytest

    pytestmark = pytest.mark.anyio

    async def test_blocks(loop_stall_guard):
        time.sleep(0.3)

    async def test_awaits(loop_stall_guard):
        await anyio.sleep(0.3)
"""


def test_the_guard_fails_a_test_that_blocks_its_loop_and_passes_one_that_awaits(pytester):
    result = run(pytester, BLOCKS)
    result.assert_outcomes(passed=2, errors=1)  # the blocking test passes, then its teardown
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_blocks*",
            "*the event loop was blocked for * ms (at most 100 ms allowed)*",
        ]
    )
    # What the kernel said was not the loop's fault is reported too (a sleep: next to none).
    result.stdout.re_match_lines([r".*Not counted in that stall: \d+ ms the process's threads.*"])


NAMES_ITS_STALL = """
    import time
    import pytest

    pytestmark = pytest.mark.anyio

    def helper_that_blocks():
        time.sleep(0.3)  # the blocking line

    async def test_blocks(loop_stall_guard):
        helper_that_blocks()
"""


def test_the_guard_shows_what_the_loop_ran_while_it_was_blocked(pytester):
    result = run(pytester, NAMES_ITS_STALL)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*the event loop was blocked for * ms (at most 100 ms allowed)*",
            "The loop's thread 50 ms into that stall, innermost last:",
            "*test_inner.py:10 in test_blocks",
            "    helper_that_blocks()",
            "*test_inner.py:7 in helper_that_blocks",
            "    time.sleep(0.3)  # the blocking line",
        ]
    )
    # The runner's and the loop's own frames are left out.
    assert "_pytest" not in result.stdout.str().split("innermost last:")[1].split("=====")[0]


KEEPS_NO_FRAME = """
    import gc
    import time
    import weakref
    import pytest

    pytestmark = pytest.mark.anyio

    class Payload:
        pass

    def blocks_holding(payload):
        time.sleep(0.4)  # the watchdog looks at this frame while it blocks

    @pytest.mark.allow_loop_stall(0.5)
    async def test_a_stalled_frame_s_locals_die_with_it(loop_stall_guard):
        payload = Payload()
        alive = weakref.ref(payload)
        blocks_holding(payload)
        del payload
        assert not gc.isenabled()  # (the guard pauses collection: only references count)
        assert alive() is None, "a frame the watchdog looked at still holds the payload"
"""


def test_the_watchdog_keeps_no_frame_of_the_loop_s_thread(pytester):
    result = run(pytester, KEEPS_NO_FRAME)
    result.assert_outcomes(passed=1)


FIRST_IMPORTS = """
    import sys
    import time
    import pytest

    pytestmark = pytest.mark.anyio

    async def test_imports_a_module_that_takes_long_to_load(loop_stall_guard):
        import slow_to_load  # its first import takes 0.3 s: start-up, not counted

        assert slow_to_load.READY

    async def test_imports_it_again_and_blocks(loop_stall_guard):
        import slow_to_load  # loaded already: free

        time.sleep(0.3)  # counted
"""


def test_a_module_s_first_import_is_not_counted_as_the_loop_blocked(pytester):
    pytester.makepyfile(slow_to_load="import time\ntime.sleep(0.3)\nREADY = True\n")
    pytester.syspathinsert()
    result = run(pytester, FIRST_IMPORTS)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_imports_it_again_and_blocks*",
            "*the event loop was blocked for * ms*",
        ]
    )
    assert "ERROR at teardown of test_imports_a_module_that_takes" not in result.stdout.str()
    # The wrapper is gone after the tests: builtins.__import__ is Python's own again.
    import builtins

    assert builtins.__import__.__module__ == "builtins"


ALLOWS_SECONDS = """
    import time
    import pytest

    pytestmark = pytest.mark.anyio

    @pytest.mark.allow_loop_stall(0.6)
    async def test_within(loop_stall_guard):
        time.sleep(0.3)

    @pytest.mark.allow_loop_stall(seconds=0.2)
    async def test_past(loop_stall_guard):
        time.sleep(0.4)

    @pytest.mark.allow_loop_stall("soon")
    async def test_bad(loop_stall_guard):
        pass
"""


def test_allow_loop_stall_with_seconds_changes_the_limit_of_one_test(pytester):
    result = run(pytester, ALLOWS_SECONDS)
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_past*",
            "*the event loop was blocked for * ms (at most 200 ms allowed)*",
            "*ERROR at setup of test_bad*",
            "*allow_loop_stall(seconds) needs a number of seconds > 0, such as 0.5; got 'soon'*",
        ]
    )


CONTENDED = """
import hashlib, os, subprocess, sys, threading, time
from aresidency.testing.guard import RunQueueClock

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one CPU for this process
clock = RunQueueClock()
start = clock()
time.sleep(0.2)  # blocked, not waiting for a CPU
slept = clock() - start
# Two processes that spin on the same CPU (they inherit the affinity)
rivals = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
try:
    time.sleep(0.2)  # the rivals are running
    start, wall = clock(), time.perf_counter()
    while time.perf_counter() - wall < 0.3:  # ready to run, sharing the CPU with the rivals
        pass
    contended = clock() - start

    def hash_for(seconds):  # hashlib lets go of the interpreter lock on large data
        data, wall = bytes(1 << 20), time.perf_counter()
        while time.perf_counter() - wall < seconds:
            hashlib.sha256(data).digest()

    helper = threading.Thread(target=hash_for, args=(0.6,))
    helper.start()
    start = clock()
    time.sleep(0.35)  # this thread sleeps; the helper shares the CPU with the rivals
    other = clock() - start  # read while the helper runs (an ended thread's wait is lost)
    helper.join()
finally:
    for rival in rivals:
        rival.kill()
        rival.wait()
print(f"{slept:.4f} {contended:.4f} {other:.4f}")
"""


@pytest.mark.skipif(
    not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")
    or not hasattr(os, "sched_setaffinity"),
    reason="needs Linux's per-thread scheduler statistics",
)
def test_the_guard_does_not_count_waiting_for_a_cpu_but_does_count_sleeping() -> None:
    # A subprocess, so that pinning it to one CPU leaves this one alone.
    done = subprocess.run(
        [sys.executable, "-c", CONTENDED], capture_output=True, text=True, check=True, timeout=60
    )
    slept, contended, other = (float(x) for x in done.stdout.split())
    assert slept < 0.05  # a blocking sleep still counts as the loop blocked
    assert contended > 0.15  # about two thirds of 0.3 s went to the rivals (a third ran)
    assert other > 0.1  # another Python thread's wait counts too (it may hold the lock)


def fake_stat(path, steal: tuple[int, int]) -> None:
    """A ``/proc/stat`` of two CPUs whose steal (the eighth number) is ``steal`` ticks."""
    lines = [f"cpu  100 0 100 1000 0 0 0 {sum(steal)} 0 0"]
    lines += [f"cpu{i} 50 0 50 500 0 0 0 {ticks} 0 0" for i, ticks in enumerate(steal)]
    path.write_text("\n".join([*lines, "intr 1 2 3", "ctxt 10", ""]))


@pytest.mark.skipif(
    not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
    reason="needs Linux's per-thread scheduler statistics",
)
def test_the_guard_does_not_count_steal_while_the_loop_ran_but_does_while_it_slept(tmp_path):
    """Steal time (a hypervisor taking the guest's CPU) is read from a stand-in ``/proc/stat``:
    the most one CPU lost counts, capped by what the loop's thread ran meanwhile."""
    from aresidency.testing.guard import RunQueueClock

    stat = tmp_path / "stat"
    tick = 1 / os.sysconf("SC_CLK_TCK")
    fake_stat(stat, (10, 10))
    clock = RunQueueClock(stat_path=str(stat))
    # The same clock without steal figures: the run-queue waits alone, taken out of each
    # reading below so that a loaded machine (threads waiting for a CPU) changes nothing.
    waits = RunQueueClock(stat_path=str(tmp_path / "absent"))
    try:
        start, waited = clock(), waits()
        cpu = time.thread_time()
        while time.thread_time() - cpu < 0.3:  # the loop's thread runs: 0.3 s on a CPU
            pass
        fake_stat(stat, (10 + 2, 10 + 8))  # cpu1 lost 8 ticks, cpu0 2
        waited = waits() - waited
        ran = clock() - start - waited
        assert 8 * tick - 0.005 <= ran < 8 * tick + 0.05  # the most one CPU lost

        start, waited = clock(), waits()
        time.sleep(0.3)  # the loop's thread sleeps: it did not lose a CPU
        fake_stat(stat, (12 + 20, 18 + 20))
        waited = waits() - waited
        slept = clock() - start - waited
        assert slept < 0.02
    finally:
        clock.close()
        waits.close()


def test_torch_is_warmed_up_before_the_first_guarded_test_of_a_fresh_process(pytester):
    """In a process of its own (where nothing ran torch before): the guard ran torch's
    start-up before its first test, and a test it does not guard finds it not run."""
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import pytest
            from aresidency.testing import guard

            def test_unguarded_first():
                assert not guard._warmed

            @pytest.mark.anyio
            async def test_guarded(loop_stall_guard):
                assert guard._warmed
            """
        )
    )
    pytester.makeconftest(ONE_LOOP)
    result = pytester.runpytest_subprocess(*ANYIO_ONLY)
    result.assert_outcomes(passed=2)


def test_the_warm_up_draws_nothing_from_torchs_generators(monkeypatch):
    import torch

    from aresidency.testing import guard

    monkeypatch.setattr(guard, "_warmed", False)
    before = torch.random.get_rng_state()
    guard.warm_torch()
    assert guard._warmed
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_guard_requested_by_a_module_spares_what_is_marked_and_a_run_without_it(
    pytester, monkeypatch
):
    """The fixture requested directly (a module's ``usefixtures``) honours the marker and
    ``NO_LOOP_GUARD`` too, as its failure message advises."""
    source = """
        import time
        import pytest

        pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("loop_stall_guard")]

        @pytest.mark.allow_loop_stall
        async def test_blocks_on_purpose():
            time.sleep(0.3)

        async def test_blocks():
            time.sleep(0.3)
    """
    result = run(pytester, source)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_blocks *"])
    monkeypatch.setenv("NO_LOOP_GUARD", "1")
    run(pytester, source).assert_outcomes(passed=2)


def test_the_allowed_stall_is_set_by_an_ini_option(pytester):
    pytester.makeini("[pytest]\nresidency_max_loop_stall = 1.0\n")
    result = run(pytester, BLOCKS)
    result.assert_outcomes(passed=2)


def test_a_bad_allowed_stall_is_a_usage_error(pytester):
    pytester.makeini("[pytest]\nresidency_max_loop_stall = soon\n")
    result = run(pytester, BLOCKS)
    result.stdout.fnmatch_lines(
        ["*residency_max_loop_stall must be a number of seconds > 0, such as 0.1; got 'soon'*"]
    )
    assert result.ret != 0


def test_no_loop_guard_in_the_environment_turns_the_autouse_guard_off(pytester, monkeypatch):
    monkeypatch.setenv("NO_LOOP_GUARD", "1")
    result = run(
        pytester,
        """
        import time
        import pytest

        pytestmark = pytest.mark.anyio

        async def test_blocks():
            time.sleep(0.3)
        """,
        conftest="from aresidency.testing import loop_never_blocked\n",
    )
    result.assert_outcomes(passed=1)


def test_loop_never_blocked_guards_every_async_test_of_its_directory(pytester):
    result = run(
        pytester,
        """
        import time
        import pytest

        @pytest.mark.anyio
        async def test_blocks():
            time.sleep(0.3)

        @pytest.mark.anyio
        @pytest.mark.allow_loop_stall
        async def test_blocks_on_purpose():
            time.sleep(0.3)

        def test_sync_tests_are_left_alone():
            time.sleep(0.3)
        """,
        conftest="from aresidency.testing import loop_never_blocked\n",
    )
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_blocks *"])
