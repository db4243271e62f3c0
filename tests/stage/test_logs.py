"""Stage logs: the stage's name and pid on its records, the default format, the level
(``launch(log_level=)``, ``serve --log-level``) and ``forward_logs``, against real stage
processes and real sockets."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator

import pytest

from enginecore.stage import EngineDeadError, StageClient, StageStartupError, _logs

from .conftest import SCRIPTED, Launch

# The default format of a stage record: time, level, stage[pid], logger: message.
_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def line_re(level: str, stage: str, pid: int, logger: str, message: str) -> re.Pattern[str]:
    fields = rf"{level} {re.escape(stage)}\[{pid}\] {re.escape(logger)}: {re.escape(message)}"
    return re.compile(rf"^{_TIME} {fields}$", re.MULTILINE)


class Records(logging.Handler):
    """A parent-side handler that keeps the records it gets and lets a test wait for one."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def wait_for(
        self, message: str, timeout: float = 10.0, prefix: bool = False
    ) -> logging.LogRecord:
        def matches(record: logging.LogRecord) -> bool:
            text = record.getMessage()
            return text.startswith(message) if prefix else text == message

        def find() -> logging.LogRecord | None:
            return next((r for r in self.records if matches(r)), None)

        with self._cond:
            if not self._cond.wait_for(lambda: find() is not None, timeout):
                seen = [r.getMessage() for r in self.records]
                raise AssertionError(f"no record {message!r} within {timeout} s; got {seen}")
            found = find()
            assert found is not None
            return found

    def messages(self) -> list[str]:
        with self._cond:
            return [r.getMessage() for r in self.records]


@pytest.fixture
def records() -> Iterator[Callable[[str], Records]]:
    """``records(logger_name)``: a :class:`Records` on that logger of this process, removed
    after the test."""
    attached: list[tuple[logging.Logger, Records]] = []

    def attach(name: str) -> Records:
        handler = Records()
        log = logging.getLogger(name)
        log.addHandler(handler)
        attached.append((log, handler))
        return handler

    yield attach
    for log, handler in attached:
        log.removeHandler(handler)


@pytest.fixture(autouse=True)
def log_thread_ends() -> Iterator[None]:
    """After each test (and after its clients closed): the parent's log thread, if one
    was started, ends by itself."""
    yield
    receiver = _logs._current
    if receiver is not None:
        assert_ends(receiver.thread)


def assert_ends(thread: threading.Thread, timeout: float = 10.0) -> None:
    """*thread* ends within *timeout* s; if not, the failure shows where it is stuck."""
    thread.join(timeout)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident or 0)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
        state = vars(_logs._current) if _logs._current is not None else None
        raise AssertionError(f"{thread.name} did not end; it is at:\n{stack}\n{state}")


def receiver_thread() -> threading.Thread:
    """The parent's log thread (there is one while a stage forwards its records)."""
    receiver = _logs._current
    assert receiver is not None
    return receiver.thread


class TestStageRecords:
    def test_records_carry_the_stage_name_and_pid(self, launch: Launch) -> None:
        client = launch(SCRIPTED, name="prefill-0")
        assert client.call_utility("record_fields") == ["prefill-0", client.pid]

    def test_the_stage_name_defaults_to_the_factory(self, launch: Launch) -> None:
        client = launch(SCRIPTED)
        assert client.call_utility("record_fields") == [SCRIPTED, client.pid]

    def test_records_go_to_stderr_with_time_level_stage_pid_and_logger(
        self, launch: Launch, capfd: pytest.CaptureFixture[str]
    ) -> None:
        client = launch(SCRIPTED, name="decode-1")
        # WARNING passes Python's default level. The utility returns after the handler wrote
        # (and flushed) the line, so it is in the captured stderr by then.
        assert client.call_utility("emit_log", "enginecore.test", logging.WARNING, "hello")
        err = capfd.readouterr().err
        assert line_re("WARNING", "decode-1", client.pid, "enginecore.test", "hello").search(err)

    def test_the_exception_text_follows_the_line(
        self, launch: Launch, capfd: pytest.CaptureFixture[str]
    ) -> None:
        client = launch(SCRIPTED, name="s")
        client.call_utility("emit_log", "enginecore.test", logging.ERROR, "it failed", True)
        err = capfd.readouterr().err
        match = line_re("ERROR", "s", client.pid, "enginecore.test", "it failed").search(err)
        assert match is not None
        assert err[match.end() :].lstrip("\n").startswith("Traceback (most recent call last):")
        assert "ValueError: scripted log error" in err


class TestLogLevel:
    def test_debug_shows_debug_records(
        self, launch: Launch, capfd: pytest.CaptureFixture[str]
    ) -> None:
        client = launch(SCRIPTED, name="s", log_level="DEBUG")
        assert client.call_utility("emit_log", "enginecore.test", logging.DEBUG, "fine detail")
        err = capfd.readouterr().err
        assert line_re("DEBUG", "s", client.pid, "enginecore.test", "fine detail").search(err)

    def test_warning_hides_info(self, launch: Launch, capfd: pytest.CaptureFixture[str]) -> None:
        client = launch(SCRIPTED, name="s", log_level=logging.WARNING)
        assert not client.call_utility("emit_log", "enginecore.test", logging.INFO, "chatter")
        assert client.call_utility("emit_log", "enginecore.test", logging.WARNING, "marker")
        err = capfd.readouterr().err
        assert "marker" in err
        assert "chatter" not in err

    def test_an_int_level_and_a_lower_case_name(self, launch: Launch) -> None:
        client = launch(SCRIPTED, log_level=15)
        assert client.call_utility("emit_log", "enginecore.test", 15, "level 15")
        assert not client.call_utility("emit_log", "enginecore.test", logging.DEBUG, "no")
        client = launch(SCRIPTED, log_level="info")
        assert client.call_utility("emit_log", "enginecore.test", logging.INFO, "yes")
        assert not client.call_utility("emit_log", "enginecore.test", logging.DEBUG, "no")

    @pytest.mark.parametrize(
        ("level", "error", "match"),
        [
            ("LOUD", ValueError, r"log_level must be a level name \(DEBUG, .*'LOUD'"),
            ("", ValueError, "log_level must be a level name"),
            (-1, ValueError, "log_level must be >= 0, got -1"),
            (1.5, TypeError, "log_level must be an int or a level name such as 'INFO', got float"),
            (True, TypeError, "got bool"),
        ],
    )
    def test_a_bad_level_is_refused_before_anything_starts(
        self, launch: Launch, level: object, error: type[Exception], match: str
    ) -> None:
        # no_leftovers (through the launch fixture) checks that nothing was started.
        with pytest.raises(error, match=match):
            launch(SCRIPTED, log_level=level)

    def test_bad_forward_logs_and_name_are_refused(self, launch: Launch) -> None:
        with pytest.raises(TypeError, match="forward_logs must be a bool, got str"):
            launch(SCRIPTED, forward_logs="yes")
        with pytest.raises(TypeError, match="name must be a str, got int"):
            launch(SCRIPTED, name=3)


class TestForwardLogs:
    def test_records_arrive_in_the_parent_logging_as_records(
        self,
        launch: Launch,
        records: Callable[[str], Records],
        capfd: pytest.CaptureFixture[str],
    ) -> None:
        got = records("enginecore.test")
        client = launch(SCRIPTED, name="fwd", log_level="INFO", forward_logs=True)
        client.call_utility("emit_log", "enginecore.test.fwd", logging.INFO, "hello parent")
        client.call_utility("emit_log", "enginecore.test", logging.DEBUG, "below the level")
        client.call_utility("emit_log", "enginecore.test", logging.ERROR, "it failed", True)
        info = got.wait_for("hello parent")
        error = got.wait_for("it failed")
        assert (info.name, info.levelno, info.levelname) == ("enginecore.test.fwd", 20, "INFO")
        assert (error.name, error.levelno, error.levelname) == ("enginecore.test", 40, "ERROR")
        for record in (info, error):
            assert record.stage == "fwd"  # type: ignore[attr-defined]
            assert record.process == client.pid
            assert record.processName == "fwd"  # launch(name=) names the process too
            assert record.funcName == "_emit_log"
            assert os.path.basename(record.pathname) == "testing.py"
        assert info.exc_text is None
        assert error.exc_text is not None
        assert error.exc_text.startswith("Traceback (most recent call last):")
        assert error.exc_text.rstrip().endswith("ValueError: scripted log error")
        # The parent's formatter shows the child's exception text, and its fields.
        text = logging.Formatter("%(levelname)s %(stage)s[%(process)d] %(message)s").format(error)
        assert text.startswith(f"ERROR fwd[{client.pid}] it failed\nTraceback")
        assert "below the level" not in got.messages()
        # Records are not written to the stage's stderr as well.
        assert "hello parent" not in capfd.readouterr().err

    def test_a_main_script_that_configures_logging_shows_each_record_once(self) -> None:
        # The documented example: basicConfig() at the top of the main script. A launched
        # stage is spawned, which imports that script again in the stage (as __mp_main__),
        # and so configured a handler there too: each forwarded record was written twice,
        # once by the stage itself and once by the parent.
        here = tempfile.mkdtemp(prefix="ecmain", dir="/tmp")  # not in the ipc dir checked
        script = os.path.join(here, "main.py")
        with open(script, "w") as f:
            f.write(
                "import logging, sys\n"
                "from enginecore.stage import StageClient\n"
                "logging.basicConfig(format='%(stage)s[%(process)d] %(message)s', "
                "stream=sys.stdout)\n"
                "if __name__ == '__main__':\n"
                f"    with StageClient.launch({SCRIPTED!r}, name='fwd', log_level='INFO',\n"
                "                            forward_logs=True, startup_timeout=30) as client:\n"
                "        client.call_utility('emit_log', 'enginecore.test', 20, 'hello once')\n"
                "        pid = client.pid\n"
                "    print('pid', pid)\n"
            )
        try:
            done = subprocess.run(
                [sys.executable, script], capture_output=True, text=True, timeout=60, check=False
            )
        finally:
            shutil.rmtree(here, ignore_errors=True)
        assert done.returncode == 0, done.stderr
        pid = done.stdout.split("pid ")[-1].strip()
        assert done.stdout.count(f"fwd[{pid}] hello once") == 1, done.stdout
        assert "hello once" not in done.stderr

    def test_the_stages_own_records_are_forwarded(
        self, launch: Launch, records: Callable[[str], Records]
    ) -> None:
        got = records("enginecore.stage")
        client = launch(SCRIPTED, name="slow", step_timeout=0.2, forward_logs=True)
        client.call_utility("stall_next_step", 0.6)
        record = got.wait_for("enginecore: the stalled step returned after", prefix=True)
        assert record.levelno == logging.WARNING
        assert record.process == client.pid
        assert record.stage == "slow"  # type: ignore[attr-defined]

    @pytest.mark.parametrize("raise_exceptions", [True, False])
    def test_a_parent_handler_that_raises_is_reported_as_logging_does(
        self,
        launch: Launch,
        records: Callable[[str], Records],
        capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
        raise_exceptions: bool,
    ) -> None:
        # A handler whose emit() raises (not calling handleError) neither ends the log
        # thread nor goes unseen: the error is on stderr as logging.Handler.handleError
        # writes it, unless logging.raiseExceptions is off (then silent, as there).
        monkeypatch.setattr(logging, "raiseExceptions", raise_exceptions)

        class Broken(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                raise RuntimeError("the broken handler")

        broken = Broken()
        logging.getLogger("enginecore.test.broken").addHandler(broken)
        try:
            got = records("enginecore.test")
            client = launch(SCRIPTED, name="fwd", log_level="INFO", forward_logs=True)
            client.call_utility("emit_log", "enginecore.test.broken", logging.INFO, "to it")
            client.call_utility("emit_log", "enginecore.test", logging.INFO, "after it")
            got.wait_for("after it")  # the thread goes on
            assert "to it" not in got.messages()  # its propagation stopped at the raise
            err = capfd.readouterr().err
        finally:
            logging.getLogger("enginecore.test.broken").removeHandler(broken)
        if raise_exceptions:
            assert "--- Logging error ---" in err
            assert "RuntimeError: the broken handler" in err
            assert f"forwarded from stage fwd (pid {client.pid})" in err
            assert "Message: 'to it'" in err
        else:
            assert "Logging error" not in err
            assert "broken handler" not in err

    def test_the_log_thread_ends_when_the_stage_ends(self, launch: Launch) -> None:
        client = launch(SCRIPTED, forward_logs=True)
        thread = receiver_thread()
        assert thread.is_alive()
        client.shutdown()
        assert_ends(thread)

    def test_one_log_thread_for_several_stages(
        self, launch: Launch, records: Callable[[str], Records]
    ) -> None:
        got = records("enginecore.test")
        first = launch(SCRIPTED, name="a", log_level="INFO", forward_logs=True)
        thread = receiver_thread()
        second = launch(SCRIPTED, name="b", log_level="INFO", forward_logs=True)
        assert receiver_thread() is thread  # one thread for both
        first.call_utility("emit_log", "enginecore.test", logging.INFO, "from a")
        second.call_utility("emit_log", "enginecore.test", logging.INFO, "from b")
        assert got.wait_for("from a").stage == "a"  # type: ignore[attr-defined]
        assert got.wait_for("from b").stage == "b"  # type: ignore[attr-defined]
        first.close()
        second.call_utility("emit_log", "enginecore.test", logging.INFO, "b still forwards")
        assert got.wait_for("b still forwards").process == second.pid
        second.close()
        assert_ends(thread)

    def test_a_killed_stage_releases_its_socket(self, launch: Launch) -> None:
        client = launch(SCRIPTED, forward_logs=True)
        thread = receiver_thread()
        with pytest.raises(EngineDeadError):
            client.call_utility("exit", 9, timeout=10)
        client.close()
        assert_ends(thread)  # no end message from the stage: the grace period ends it

    def test_a_failed_start_leaves_nothing(self, no_leftovers: str) -> None:
        with pytest.raises(StageStartupError, match="factory failed on purpose"):
            StageClient.launch(
                "enginecore.stage.testing:failing_factory",
                forward_logs=True,
                startup_timeout=30,
            )
        receiver = _logs._current
        if receiver is not None:
            assert_ends(receiver.thread)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_the_stage_forks_logs_to_stderr_not_nowhere(no_leftovers: str) -> None:
    """A forwarding stage's fork (an engine's ``fork`` multiprocessing worker) has no socket
    of its own: its records go to the stderr it shares with the stage, in the default
    format. Before: dropped, silently (not forwarded, not on stderr either)."""
    script = (
        "import logging, os, sys\n"
        "from enginecore.stage import _logs\n"
        "_logs.configure_stage('st-0', None, sys.argv[1])\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    logging.getLogger('worker').warning('from the fork')\n"
        "    sys.stderr.flush()\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(pid)\n"
    )
    address = f"ipc://{no_leftovers}/nobody"  # nothing binds it: the stage's records wait
    proc = subprocess.run(
        [sys.executable, "-c", script, address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    child = int(proc.stdout.split()[-1])
    assert line_re("WARNING", "st-0", child, "worker", "from the fork").search(proc.stderr), (
        proc.stderr
    )


def test_a_record_after_the_handler_closed_goes_to_stderr_not_nowhere(no_leftovers: str) -> None:
    """After ``logging.shutdown`` (the stage's exit: the parent has its end message), a
    record (a daemon thread's, an atexit hook's that ran late) cannot reach the parent; it
    goes to stderr in the default format. Before: dropped, silently."""
    script = (
        "import logging, os, sys\n"
        "from enginecore.stage import _logs\n"
        "_logs.configure_stage('st-1', None, sys.argv[1])\n"
        "logging.shutdown()\n"
        "logging.getLogger('late').warning('after the end')\n"
        "print(os.getpid())\n"
    )
    address = f"ipc://{no_leftovers}/nobody"
    proc = subprocess.run(
        [sys.executable, "-c", script, address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pid = int(proc.stdout.split()[-1])
    assert line_re("WARNING", "st-1", pid, "late", "after the end").search(proc.stderr), proc.stderr


def _record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, message, None, None)


def test_a_slow_parent_makes_the_stage_drop_records_and_count_them(
    no_leftovers: str, records: Callable[[str], Records]
) -> None:
    """The two halves in one process, on a real socket: while the parent's handler blocks,
    the child's emits never wait; they drop and count, and the parent logs the count."""
    warnings = records("enginecore.stage")
    ipc_dir = tempfile.mkdtemp(prefix="enginecore-")
    blocked, gate = threading.Event(), threading.Event()
    received: list[str] = []

    class Blocking(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "first":
                blocked.set()
                gate.wait(30)
            received.append(record.getMessage())

    log = logging.getLogger("enginecore.test.drops")
    log.propagate = False  # keep tens of thousands of records out of pytest's capture
    blocking = Blocking()
    log.addHandler(blocking)
    address, source = _logs.forward_to_parent(ipc_dir, "drops")
    thread = receiver_thread()
    handler = _logs.ForwardHandler(address, "drops")
    try:
        handler.emit(_record(log.name, "first"))
        assert blocked.wait(10)
        total = 60_000  # more than both queues and the socket buffers hold
        for i in range(total):
            handler.emit(_record(log.name, str(i)))
        assert handler.dropped > 0
        gate.set()
        handler.close()  # sends the end, which carries the count not yet reported
        assert_ends(thread)
    finally:
        gate.set()
        handler.close()
        source.release()
        log.removeHandler(blocking)
        log.propagate = True
        shutil.rmtree(ipc_dir, ignore_errors=True)
    assert received[0] == "first"
    assert len(received) + handler.dropped == total + 1
    assert source.dropped == handler.dropped
    reported = sum(
        int(m.split(" dropped ")[1].split()[0])
        for m in warnings.messages()
        if m.startswith("enginecore: stage drops ")
    )
    assert reported == handler.dropped


# -- serve --log-level -------------------------------------------------------------------------


_SERVE = (sys.executable, "-m", "enginecore", "serve", "--engine", SCRIPTED)


def _serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    """``serve`` with stdout and stderr piped, and its address, once it listens."""
    proc = subprocess.Popen(
        [*_SERVE, "--bind", "tcp://127.0.0.1:*", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.communicate()
        pytest.fail(f"serve did not start: {line!r}")
    match = re.search(r"listening on (\S+)", line)
    assert match is not None
    return proc, match.group(1)


def _stderr_until(proc: subprocess.Popen[str], marker: str) -> list[str]:
    """The stage's stderr lines, up to the one that contains *marker*."""
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"stderr ended without {marker!r}: {lines}")


class TestServeLogLevel:
    @pytest.mark.parametrize("args", [("--log-level", "DEBUG", "--name", "headless"), ()])
    def test_records_carry_name_and_pid_at_the_level(
        self, no_leftovers: str, args: tuple[str, ...]
    ) -> None:
        proc, address = _serve(*args)
        try:
            with StageClient.connect(address) as client:
                debug = client.call_utility("emit_log", "enginecore.test", 10, "debug", timeout=5)
                client.call_utility("emit_log", "enginecore.test", 30, "marker", timeout=5)
                fields = client.call_utility("record_fields", timeout=5)
            lines = _stderr_until(proc, "marker")
        finally:
            proc.terminate()
            proc.communicate(timeout=10)
        stage = "headless" if args else SCRIPTED
        assert fields == [stage, proc.pid]
        assert debug is bool(args)  # the default level is WARNING
        text = "\n".join(lines)
        assert line_re("WARNING", stage, proc.pid, "enginecore.test", "marker").search(text)
        shown = line_re("DEBUG", stage, proc.pid, "enginecore.test", "debug").search(text)
        assert (shown is not None) is bool(args)

    def test_warning_hides_info(self, no_leftovers: str) -> None:
        proc, address = _serve("--log-level", "warning")
        try:
            with StageClient.connect(address) as client:
                client.call_utility("emit_log", "enginecore.test", 20, "chatter", timeout=5)
                client.call_utility("emit_log", "enginecore.test", 30, "marker", timeout=5)
            lines = _stderr_until(proc, "marker")
        finally:
            proc.terminate()
            proc.communicate(timeout=10)
        assert not any("chatter" in line for line in lines)

    @pytest.mark.parametrize("level", ["LOUD", "-3", ""])
    def test_a_bad_level_is_a_usage_error(self, level: str) -> None:
        result = subprocess.run(
            [*_SERVE, "--log-level", level],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 2
        assert "--log-level" in result.stderr
        assert "must be DEBUG, INFO, WARNING, ERROR, CRITICAL or a number" in result.stderr
