"""Death is never silent: every waiter and every later call raises EngineDeadError."""

from __future__ import annotations

import os
import signal
import time

import pytest

from enginecore.stage import EngineDeadError, Fatal, StageClient

from .conftest import SCRIPTED


class TestFatal:
    def test_step_error_is_engine_dead_with_the_fatal_repr(self, client: StageClient) -> None:
        stream = client.add("r", 10_000_000)
        stream.get(5)
        client.call_utility("fail_next_step", timeout=5)
        with pytest.raises(EngineDeadError) as info:
            stream.collect(timeout=5)
        err = info.value
        assert err.fatal == "RuntimeError('scripted step failure')"
        assert err.exit_code == 1
        assert "exited with code 1" in str(err)
        assert "RuntimeError('scripted step failure')" in str(err)
        # Later calls fail the same way, at once.
        with pytest.raises(EngineDeadError) as later:
            client.call_utility("echo")
        assert later.value is err
        with pytest.raises(EngineDeadError):
            client.add("x", 1)
        # The fatal event itself reached the client before the process exited.
        events = []
        with pytest.raises(EngineDeadError):  # noqa: PT012 - the stream ends by raising
            while True:
                events.append(client.get_event(5))
        assert events[-1] == Fatal("RuntimeError('scripted step failure')")
        assert client.shutdown() == 1

    def test_system_exit_in_step_is_fatal_with_a_nonzero_exit_code(
        self, client: StageClient
    ) -> None:
        # SystemExit(0) from the engine is a fatal error of the loop, not a clean shutdown:
        # the loop emits its fatal event and re-raises; the stage must still exit non-zero.
        client.call_utility("system_exit_next_step", 0, timeout=5)
        with pytest.raises(EngineDeadError) as info:
            client.call_utility("echo", timeout=5)
        assert info.value.fatal == "SystemExit(0)"
        assert info.value.exit_code == 1
        assert client.shutdown() == 1

    def test_a_process_that_lingers_after_its_fatal_error_fails_waiters_anyway(
        self, client: StageClient
    ) -> None:
        client.call_utility("linger", 30, timeout=5)  # a non-daemon thread: exit will hang
        stream = client.add("r", 10_000_000)
        stream.get(5)
        client.call_utility("fail_next_step", timeout=5)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="has not exited") as info:
            stream.collect(timeout=5)
        assert time.monotonic() - started < 2.0
        assert info.value.fatal == "RuntimeError('scripted step failure')"
        assert info.value.exit_code is None
        # shutdown() still ends it: SIGTERM (the loop's handler is gone by now) kills it.
        assert client.shutdown(timeout=0.1) == -signal.SIGTERM


class TestProcessDeath:
    @pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
    def test_killed_mid_stream_fails_all_waiters_within_1s(
        self, client: StageClient, sig: signal.Signals
    ) -> None:
        stream = client.add("r", 1_000_000_000)
        stream.get(5)
        pending = [client.call_utility_future("sleep", 10) for _ in range(3)]
        os.kill(client.pid, sig)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"killed by {sig.name}") as info:
            stream.collect(timeout=5)
        for future in pending:
            with pytest.raises(EngineDeadError):
                future.result(5)
        assert time.monotonic() - killed_at < 1.0
        assert info.value.exit_code == -sig
        assert info.value.fatal is None
        with pytest.raises(EngineDeadError):
            client.call_utility("echo")
        assert client.shutdown() == -sig

    def test_os_exit_in_the_engine(self, client: StageClient) -> None:
        with pytest.raises(EngineDeadError, match="exited with code 7") as info:
            client.call_utility("exit", 7, timeout=5)
        assert info.value.exit_code == 7

    def test_iterator_waiting_without_timeout_is_woken(self, client: StageClient) -> None:
        stream = client.add("r", 1_000_000_000)
        stream.get(5)
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            for _ in stream:  # plain blocking iteration: must not hang
                pass

    def test_sigterm_from_elsewhere_is_a_clean_exit_but_still_dead(
        self, client: StageClient
    ) -> None:
        stream = client.add("r", 1_000_000_000)
        stream.get(5)
        os.kill(client.pid, signal.SIGTERM)
        with pytest.raises(EngineDeadError, match="not at this client's request") as info:
            stream.collect(timeout=5)
        assert info.value.exit_code == 0

    def test_dead_stage_then_close_keeps_the_dead_error(self) -> None:
        with StageClient.launch(SCRIPTED) as client:
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                client.call_utility("sleep", 5, timeout=5)
        with pytest.raises(EngineDeadError):
            client.add("r", 1)
