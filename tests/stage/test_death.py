"""Death is never silent: every waiter and every later call raises EngineDeadError.

Run through both clients (``stage_client`` / ``launch`` fixtures: ``[sync]``, ``[async]``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback

import pytest

from enginecore.stage import EngineDeadError, Fatal, StageClient
from enginecore.stage._session import EXIT_READ_MAX_S

from .conftest import SCRIPTED, Launch


class TestFatal:
    def test_step_error_is_engine_dead_with_the_fatal_repr(self, stage_client: StageClient) -> None:
        stream = stage_client.add("r", 10_000_000)
        stream.get(5)
        stage_client.call_utility("fail_next_step", timeout=5)
        with pytest.raises(EngineDeadError) as info:
            stream.collect(timeout=5)
        err = info.value
        assert err.fatal == "RuntimeError('scripted step failure')"
        assert err.exit_code == 1
        assert "exited with code 1" in str(err)
        assert "RuntimeError('scripted step failure')" in str(err)
        # Later calls fail the same way, at once.
        with pytest.raises(EngineDeadError) as later:
            stage_client.call_utility("echo")
        assert later.value is err
        with pytest.raises(EngineDeadError):
            stage_client.add("x", 1)
        # The fatal event itself reached the client before the process exited.
        events = []
        with pytest.raises(EngineDeadError):  # noqa: PT012 - the stream ends by raising
            while True:
                events.append(stage_client.get_event(5))
        assert events[-1] == Fatal("RuntimeError('scripted step failure')")
        assert stage_client.shutdown() == 1

    def test_an_add_error_other_than_request_rejected_is_fatal(
        self, stage_client: StageClient
    ) -> None:
        live = stage_client.add("live", 10_000_000)
        live.get(5)
        stage_client.call_utility("fail_next_add", timeout=5)
        doomed = stage_client.add("doomed", 3)
        for stream in (doomed, live):
            with pytest.raises(EngineDeadError) as info:
                stream.collect(timeout=5)
            assert info.value.fatal == "RuntimeError('scripted add failure')"
            assert info.value.exit_code == 1
        assert stage_client.shutdown() == 1

    def test_system_exit_in_step_is_fatal_with_a_nonzero_exit_code(
        self, stage_client: StageClient
    ) -> None:
        # SystemExit(0) from the engine is a fatal error of the loop, not a clean shutdown:
        # the loop emits its fatal event and re-raises; the stage must still exit non-zero.
        stage_client.call_utility("system_exit_next_step", 0, timeout=5)
        with pytest.raises(EngineDeadError) as info:
            stage_client.call_utility("echo", timeout=5)
        assert info.value.fatal == "SystemExit(0)"
        assert info.value.exit_code == 1
        assert stage_client.shutdown() == 1

    def test_a_process_that_lingers_after_its_fatal_error_fails_waiters_anyway(
        self, stage_client: StageClient
    ) -> None:
        stage_client.call_utility("linger", 30, timeout=5)  # a non-daemon thread: exit will hang
        stream = stage_client.add("r", 10_000_000)
        stream.get(5)
        stage_client.call_utility("fail_next_step", timeout=5)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="has not exited") as info:
            stream.collect(timeout=5)
        assert time.monotonic() - started < 2.0
        assert info.value.fatal == "RuntimeError('scripted step failure')"
        assert info.value.exit_code is None
        # shutdown() still ends it: SIGTERM is ignored once the loop has ended (a second
        # stop signal must not turn a clean exit into -15), so SIGKILL, a second later.
        assert stage_client.shutdown(timeout=0.1) == -signal.SIGKILL


class TestProcessDeath:
    @pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
    def test_killed_mid_stream_fails_all_waiters_once_its_backlog_is_read(
        self, stage_client: StageClient, sig: signal.Signals
    ) -> None:
        # The stream runs flat out: what it sent before the kill is read first, for up to
        # EXIT_READ_MAX_S on a loaded machine (docs/stage.md, "Death is never silent"), and
        # then every waiter fails, the utility calls long before their 10 s sleep is over.
        stream = stage_client.add("r", 1_000_000_000)
        stream.get(5)
        pending = [stage_client.call_utility_future("sleep", 10) for _ in range(3)]
        os.kill(stage_client.pid, sig)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"killed by {sig.name}") as info:
            stream.collect(timeout=30)
        for future in pending:
            with pytest.raises(EngineDeadError):
                future.result(30)
        assert time.monotonic() - killed_at < EXIT_READ_MAX_S + 2.0
        assert info.value.exit_code == -sig
        assert info.value.fatal is None
        with pytest.raises(EngineDeadError):
            stage_client.call_utility("echo")
        assert stage_client.shutdown() == -sig

    def test_one_error_raised_by_many_streams_and_calls_keeps_its_traceback_short(
        self, stage_client: StageClient
    ) -> None:
        # A death ends every stream with one error object, and every later call raises it
        # again: raised as is, it would grow by the raising frames each time (and keep
        # their locals alive), 40 streams and 20 calls later a traceback of hundreds.
        streams = [stage_client.add(f"r{i}", 1_000_000_000) for i in range(40)]
        streams[0].get(5)
        os.kill(stage_client.pid, signal.SIGKILL)
        errors: list[BaseException] = []
        for stream in streams + streams[:5]:  # an ended stream raises it again when read
            with pytest.raises(EngineDeadError) as info:
                stream.collect(timeout=5)
            errors.append(info.value)
        for _ in range(20):
            with pytest.raises(EngineDeadError) as info:
                stage_client.call_utility("echo")
            errors.append(info.value)
        assert all(e is errors[0] for e in errors)
        depth = len(traceback.extract_tb(errors[-1].__traceback__))
        assert depth < 20, traceback.format_tb(errors[-1].__traceback__)[:3]
        stage_client.shutdown()

    def test_os_exit_in_the_engine(self, stage_client: StageClient) -> None:
        with pytest.raises(EngineDeadError, match="exited with code 7") as info:
            stage_client.call_utility("exit", 7, timeout=5)
        assert info.value.exit_code == 7

    def test_iterator_waiting_without_timeout_is_woken(self, stage_client: StageClient) -> None:
        stream = stage_client.add("r", 1_000_000_000)
        stream.get(5)
        os.kill(stage_client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            for _ in stream:  # plain blocking iteration: must not hang
                pass

    def test_sigterm_from_elsewhere_is_a_clean_exit_but_still_dead(
        self, stage_client: StageClient
    ) -> None:
        stream = stage_client.add("r", 1_000_000_000)
        stream.get(5)
        os.kill(stage_client.pid, signal.SIGTERM)
        with pytest.raises(EngineDeadError, match="not at this client's request") as info:
            stream.collect(timeout=5)
        assert info.value.exit_code == 0

    def test_more_sigterms_during_the_teardown_keep_the_exit_code(
        self, stage_client: StageClient
    ) -> None:
        # The default action came back when the loop ended: a SIGTERM landing in the
        # teardown (kill sends several; so does a supervisor that retries) ended the stage
        # with -15 instead of its clean exit (8 of 8 tries).
        stream = stage_client.add("r", 1_000_000_000)
        stream.get(5)  # the loop runs: its handler is in place
        pid = stage_client.pid
        assert pid is not None
        sent = 0
        while True:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                break  # reaped: it ended
            sent += 1
            time.sleep(0.0005)
            if sent > 20_000:  # 10 s
                raise AssertionError("the stage did not stop")
            with contextlib.suppress(EngineDeadError):
                if stage_client.health() == "dead":
                    break
        with pytest.raises(EngineDeadError) as info:
            stream.collect(timeout=10)
        assert info.value.exit_code == 0, sent

    def test_dead_stage_then_close_keeps_the_dead_error(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as info:
            client.call_utility("sleep", 5, timeout=5)
        assert client.shutdown() == -signal.SIGKILL
        with pytest.raises(EngineDeadError) as later:
            client.add("r", 1)
        assert later.value is info.value

    def test_an_event_reader_is_woken_by_the_death(self, stage_client: StageClient) -> None:
        stage_client.call_utility_future("exit", 3)
        with pytest.raises(EngineDeadError, match="exited with code 3"):  # noqa: PT012
            while True:
                stage_client.get_events(5)
