"""shutdown_on_signals: signal safety (rule 10), proven in real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from enginecore import CountdownEngine, EngineCoreLoop, shutdown_on_signals

# The loop runs on the main thread, as in a stage process. On its first step the engine takes
# input_queue.mutex and signals its own process *while holding it*: Python then runs the
# handler on this same thread, inside the `with` block. A handler that calls Queue.put()
# blocks forever on the non-reentrant mutex its own thread holds.
_UNDER_MUTEX = textwrap.dedent(
    """
    import json, os, signal, sys
    from enginecore import Add, CountdownEngine, EngineCoreLoop, Wakeup, shutdown_on_signals

    events = []
    class Engine(CountdownEngine):
        def step(self):
            with loop.input_queue.mutex:
                os.kill(os.getpid(), signal.SIG{sig})
                for _ in range(10_000):  # bytecodes: the handler runs in here
                    pass
            return super().step()

    class Pipelined(Engine):  # the pipelined loop: the step runs in launch()
        def launch(self):
            return self.step()
        def collect(self, handle):
            return handle

    loop = EngineCoreLoop(Pipelined() if sys.argv[2] == "pipelined" else Engine(), events.append)
    loop.input_queue.put(Add("a", 1_000_000))
    if sys.argv[1] == "naive":
        signal.signal(signal.SIG{sig}, lambda *_: loop.input_queue.put(Wakeup()))
        loop.run()
    else:
        with shutdown_on_signals(loop):
            loop.run()
    print(json.dumps(events[-1]))
    """
)

# The loop idles on the main thread, blocked in get(); the parent sends the signal.
_IDLE = textwrap.dedent(
    """
    import json, sys
    from enginecore import CountdownEngine, EngineCoreLoop, shutdown_on_signals

    class Pipelined(CountdownEngine):  # the pipelined loop
        def launch(self):
            return self.step()
        def collect(self, handle):
            return handle

    events = []
    engine = Pipelined() if sys.argv[1] == "pipelined" else CountdownEngine()
    loop = EngineCoreLoop(engine, events.append)
    with shutdown_on_signals(loop):
        print("ready", flush=True)
        loop.run()
    print(json.dumps(events))
    """
)


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


FORMS = pytest.mark.parametrize("form", ["step", "pipelined"])
"""Both loops: the step() one, and the pipelined one (``docs/contract.md``, rule 12)."""


class TestSignalUnderQueueMutex:
    @FORMS
    @pytest.mark.parametrize("sig", ["TERM", "INT"])
    def test_signal_while_the_loop_thread_holds_the_queue_mutex_shuts_down(
        self, sig: str, form: str
    ) -> None:
        proc = subprocess.run(
            _python(_UNDER_MUTEX.format(sig=sig), "safe", form),
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == ["shutdown"]

    @pytest.mark.slow
    def test_control_a_queue_put_handler_deadlocks_in_the_same_situation(self) -> None:
        """Shows the scenario above really puts the handler under the mutex."""
        proc = subprocess.Popen(
            _python(_UNDER_MUTEX.format(sig="TERM"), "naive", "step"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=3)
        finally:
            proc.kill()
            proc.communicate()


class TestSignalWhileIdle:
    @FORMS
    @pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
    def test_signal_wakes_a_loop_blocked_in_get(self, sig: signal.Signals, form: str) -> None:
        proc = subprocess.Popen(
            _python(_IDLE, form), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=10)
        finally:
            proc.kill()
            proc.communicate()
        assert proc.returncode == 0, err
        assert json.loads(out) == [["shutdown"]]


class TestHandlerInstallation:
    def test_previous_handlers_are_restored_on_exit(self) -> None:
        def mine(signum: int, frame: object) -> None:
            pass

        old = signal.signal(signal.SIGTERM, mine)
        try:
            loop = EngineCoreLoop(CountdownEngine(), lambda e: None)
            with shutdown_on_signals(loop):
                assert signal.getsignal(signal.SIGTERM) is not mine
            assert signal.getsignal(signal.SIGTERM) is mine
            with pytest.raises(RuntimeError), shutdown_on_signals(loop):
                raise RuntimeError("the block failed")
            assert signal.getsignal(signal.SIGTERM) is mine
        finally:
            signal.signal(signal.SIGTERM, old)

    def test_handler_requests_shutdown(self) -> None:
        loop = EngineCoreLoop(CountdownEngine(), lambda e: None)
        with shutdown_on_signals(loop, [signal.SIGUSR1]):
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):  # let the handler run
                if loop.shutdown_requested:
                    break
        assert loop.shutdown_requested

    def test_outside_the_main_thread_raises_a_clear_error(self) -> None:
        loop = EngineCoreLoop(CountdownEngine(), lambda e: None)
        errors: list[BaseException] = []

        def enter() -> None:
            try:
                with shutdown_on_signals(loop):
                    pass
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=enter)
        t.start()
        t.join()
        assert len(errors) == 1
        assert isinstance(errors[0], ValueError)
        assert "main thread" in str(errors[0])

    def test_a_signal_listed_twice_is_still_restored_on_exit(self) -> None:
        def mine(signum: int, frame: object) -> None:
            pass

        old = signal.signal(signal.SIGUSR1, mine)
        try:
            loop = EngineCoreLoop(CountdownEngine(), lambda e: None)
            with shutdown_on_signals(loop, [signal.SIGUSR1, signal.SIGUSR2, int(signal.SIGUSR1)]):
                assert signal.getsignal(signal.SIGUSR1) is not mine
            # Not the block's own handler, which the second install had taken for "previous".
            assert signal.getsignal(signal.SIGUSR1) is mine
        finally:
            signal.signal(signal.SIGUSR1, old)

    @pytest.mark.parametrize(
        ("loop_given", "signals", "error", "match"),
        [
            (False, [signal.SIGUSR1], TypeError, "loop must have a request_shutdown"),
            (True, signal.SIGUSR1, TypeError, "signals must be an iterable.*got Signals"),
            (True, 10, TypeError, "signals must be an iterable.*got int"),
            (True, [signal.SIGUSR1, "SIGTERM"], TypeError, "signals must hold signal.*'SIGTERM'"),
            (True, [signal.SIGUSR1, True], TypeError, "signals must hold signal.*True"),
            (True, [signal.SIGUSR1, signal.SIGKILL], ValueError, "SIGKILL"),
            (True, [signal.SIGUSR1, 100_000], ValueError, "100000"),
        ],
        ids=["no-loop", "one-signal", "one-int", "a-name", "a-bool", "sigkill", "out-of-range"],
    )
    def test_bad_arguments_raise_a_clear_error_and_leave_the_handlers_alone(
        self, loop_given: bool, signals: Any, error: type[Exception], match: str
    ) -> None:
        def mine(signum: int, frame: object) -> None:
            pass

        loop: Any = EngineCoreLoop(CountdownEngine(), lambda e: None) if loop_given else None
        old = signal.signal(signal.SIGUSR1, mine)
        try:
            with pytest.raises(error, match=match), shutdown_on_signals(loop, signals):
                pytest.fail("the block must not run")
            assert signal.getsignal(signal.SIGUSR1) is mine
        finally:
            signal.signal(signal.SIGUSR1, old)
