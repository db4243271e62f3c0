"""``python -m enginecore top``: against live ``serve`` stages, as a script (``--once``) and
as the live view in a terminal (tmux: send keys, read the screen)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from enginecore import _top
from enginecore._top import StageRow, _print_once, render
from enginecore.stage import StageClient, StageObserver

from .conftest import Server, wait_until

pytestmark = pytest.mark.timeout(60)

TOP = [sys.executable, "-m", "enginecore", "top"]


def _free_address() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _cells(output: str, address: str) -> list[str]:
    """The cells of the table row of *address*."""
    for line in output.splitlines():
        if address in line:
            return [c.strip() for c in re.split("[│┃]", line.strip().strip("│┃"))]
    raise AssertionError(f"no row for {address} in:\n{output}")


COLUMNS = ["stage", "pid", "address", "health", "steps/s", "outputs/s", "running", "waiting"]
COLUMNS += ["queue", "step p50", "step p99", "backlog", "cut"]


class TestRender:
    def test_text_from_the_stages_is_printed_as_it_is_never_read_as_markup(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        # A Z85 key in an error ("[/*T6..]" read as a closing tag made rich raise: top died
        # with a MarkupError instead of saying why a CURVE stage refused it), an IPv6
        # address, a tag in an error: each printed as it is, with no style applied.
        error = "the stage refused this key: Ofv:3ESl[/*T6KDEaJGgpHhJwKfM>3]DPbhgQ6t[ [bold]x"
        pytest.importorskip("rich")
        rows = [StageRow("tcp://[::1]:5570", error=error), StageRow("ipc://[red]/in")]
        _print_once(render(rows, time.monotonic(), interval=1.0, live=False))
        out = "".join(capsys.readouterr().out.split())  # the caption may wrap
        assert "tcp://[::1]:5570" in out
        assert "ipc://[red]/in" in out
        assert "".join(error.split()) in out


class TestOnce:
    def test_a_busy_stage_beside_its_client(self, server: Server) -> None:
        with StageClient.connect(server.address) as client:
            stream = client.add("r1", 10**9)  # runs until aborted: steps all the time
            next(iter(stream))
            out = subprocess.run(
                [*TOP, server.address, "--once", "--interval", "0.3"],
                check=False,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            header = _cells(out.stdout, "address")
            assert header == COLUMNS
            row = dict(zip(header, _cells(out.stdout, server.address), strict=True))
            assert row["stage"] == "enginecore.stage.testing:scripted"
            assert row["pid"] == str(server.proc.pid)
            assert row["health"] == "ok"
            assert float(row["steps/s"].replace(",", "")) > 100
            assert float(row["outputs/s"].replace(",", "")) > 100
            assert row["running"] == "1"  # the engine reports no running: the live requests
            assert row["waiting"] == "-"
            assert row["queue"].isdigit()
            assert row["backlog"].isdigit()
            assert row["cut"] == "0"  # a stage that serves one client cuts none
            assert re.fullmatch(r"≤[\d.]+ m?s", row["step p50"]), row
            assert re.fullmatch(r"≤[\d.]+ m?s", row["step p99"]), row
            # The client's session was not touched: its request still runs, its calls work.
            assert client.call_utility("div", 1, 4) == 0.25
            assert client.health() == "ok"
            client.abort(["r1"])
            assert client.call_utility("num_requests") == 0

    def test_the_table_is_printed_when_the_second_answers_are_in(self, server: Server) -> None:
        # It slept one more interval first: past 2 s every stage read "stalled" (past 5 s
        # "dead"), its answer that old when shown.
        out = subprocess.run(
            [*TOP, server.address, "--once", "--interval", "2.5"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert _cells(out.stdout, server.address)[3] == "ok"
        # Piped: no line padded to the table's width (the title was).
        assert all(line == line.rstrip() for line in out.stdout.splitlines())

    def test_a_stage_silent_in_the_second_round_is_exit_1_and_named(
        self, server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        # It exited 0 when a stage answered the first round only (stopped, or killed, in
        # between), its row still "ok" from its first answer.
        pytest.importorskip("rich")
        real_sleep = time.sleep

        def stop_the_stage_then_sleep(seconds: float) -> None:  # between the two rounds
            os.kill(server.proc.pid, signal.SIGSTOP)
            real_sleep(seconds)

        clock = SimpleNamespace(monotonic=time.monotonic, sleep=stop_the_stage_then_sleep)
        monkeypatch.setattr(_top, "time", clock)
        try:
            code = _top.run([server.address], interval=0.5, once=True)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        out = capsys.readouterr().out
        assert code == 1
        assert _cells(out, server.address)[1] == str(server.proc.pid)  # its first answer
        assert "noanswertothesecondrequestwithin0.5s" in "".join(out.split())  # may wrap

    def test_an_unreachable_stage_is_shown_and_does_not_hold_up_the_others(
        self, server: Server
    ) -> None:
        nowhere = _free_address()
        started = time.monotonic()
        out = subprocess.run(
            [*TOP, nowhere, server.address, "--once", "--interval", "0.3"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert time.monotonic() - started < 10
        assert out.returncode == 1  # a stage did not answer
        assert _cells(out.stdout, nowhere)[3] == "unreachable"
        row = _cells(out.stdout, server.address)
        assert row[1] == str(server.proc.pid)
        assert row[3] == "ok"
        assert row[4] == "0.0"  # idle

    def test_without_rich_a_clear_error(self) -> None:
        code = (
            "import sys; sys.modules['rich'] = None\n"
            "from enginecore.__main__ import main\n"
            "sys.exit(main(['top', 'tcp://127.0.0.1:1', '--once']))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], check=False, capture_output=True, text=True
        )
        assert out.returncode == 2
        assert "needs rich: pip install 'enginecore[top]'" in out.stderr

    def test_the_live_view_without_a_terminal_says_so_and_exits(self) -> None:
        # Before: with stdout a pipe or a file, the live view drew nothing (rich's Live
        # shows nothing off a terminal) and ran until killed, silently.
        pytest.importorskip("rich")
        out = subprocess.run(
            [*TOP, "tcp://127.0.0.1:1", "--interval", "0.1"],
            check=False,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=30,
        )
        assert out.returncode == 2
        assert "needs a terminal" in out.stderr
        assert "--once" in out.stderr

    @pytest.mark.parametrize(
        ("address", "message"),
        [
            # An unreachable row and libzmq's "foo: Invalid argument" under it, exit 1.
            ("foo", "address must start with tcp:// or ipc://"),
            # libzmq took the port modulo 65536: 99999 read the stage on port 34463.
            ("tcp://127.0.0.1:99999", "a port is 1 to 65535"),
            ("tcp://::1:5570", "an IPv6 address goes in brackets: tcp://[::1]:5570"),
            ("tcp://127.0.0.1:*", "a port is 1 to 65535"),
        ],
    )
    def test_a_bad_address_is_a_usage_error(self, address: str, message: str) -> None:
        out = subprocess.run(
            [*TOP, address, "--once", "--interval", "0.1"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2, out.stderr
        assert message in out.stderr
        assert "unreachable" not in out.stdout

    @pytest.mark.parametrize("interval", ["0", "-1", "nan", "x"])
    def test_a_bad_interval_is_a_usage_error(self, interval: str) -> None:
        out = subprocess.run(
            [*TOP, "tcp://127.0.0.1:1", "--interval", interval],
            check=False,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2
        assert "--interval: must be a number of seconds > 0" in out.stderr  # "x" too: it
        assert "_positive_float" not in out.stderr  # named the private type function


class TestRows:
    def test_health_rates_and_quantiles_from_two_answers(self, server: Server) -> None:
        with StageClient.connect(server.address) as client, StageObserver(server.address) as obs:
            row = StageRow(server.address)
            assert row.health(0.0) == "unreachable"
            first = obs.stats()
            row.update(first, 100.0)
            assert row.window == "run"
            assert row.steps_per_s is None  # one answer: no rate yet
            client.add("r1", 50).collect(timeout=10)
            second = obs.stats()
            row.update(second, 101.0)
            assert row.window == "interval"
            assert row.steps_per_s is not None
            assert row.steps_per_s > 0
            assert row.p50 is not None
            assert row.p99 is not None
            assert row.p50 <= row.p99
            assert row.health(101.5) == "ok"
            assert row.health(103.5) == "stalled"
            assert row.health(106.5) == "dead"
            # A stage that answers, but whose watchdog saw a step run past step_timeout.
            row.update(dataclasses.replace(second, stalled=True), 107.0)
            assert row.health(107.5) == "stalled"


# -- the live view, in a terminal -------------------------------------------------------------


class Tmux:
    """A tmux server of this test's own (``-L``), with one detached session of a fixed
    size running *command*."""

    def __init__(self, command: str, width: int = 180, height: int = 20) -> None:
        self.socket = f"enginecore-top-{uuid.uuid4().hex[:8]}"
        env = {k: v for k, v in os.environ.items() if k != "TMUX"}
        self._run(
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            str(width),
            "-y",
            str(height),
            command,
            env=env,
        )

    def _run(self, *args: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            timeout=10,
            env=env,
            check=True,
        )
        return out.stdout

    def screen(self) -> str:
        return self._run("capture-pane", "-p", "-t", "top")

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", "top", *keys)

    def wait_for(self, pattern: str, timeout: float = 15.0) -> str:
        """The screen once *pattern* (a regex) shows on it."""
        seen = [""]

        def shows() -> bool:
            seen[0] = self.screen()
            return re.search(pattern, seen[0]) is not None

        assert wait_until(shows, timeout), f"{pattern!r} not on the screen:\n{seen[0]}"
        return seen[0]

    def pane(self, fmt: str) -> str:
        """A tmux format of the pane, e.g. ``#{alternate_on}``."""
        return self._run("display-message", "-p", "-t", "top", fmt).strip()

    def kill(self) -> None:
        # kill-server leaves the server's socket file behind (one per test in /tmp/tmux-UID).
        path = subprocess.run(
            ["tmux", "-L", self.socket, "display-message", "-p", "#{socket_path}"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        subprocess.run(
            ["tmux", "-L", self.socket, "kill-server"], check=False, capture_output=True, timeout=10
        )
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)


@pytest.fixture
def top_in_tmux(server: Server) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (.ci/run installs it with apt-get)")
    argv = [*TOP, server.address, "--interval", "0.3"]
    # The exit code stays on the screen after top has gone, with the terminal's modes
    # (TTY-icanon / TTY--icanon: whether top gave the terminal back as it found it).
    modes = "stty -a | tr ' ;' '\\n\\n' | grep -x -- '-\\?icanon\\|-\\?echo' | sed 's/^/TTY-/'"
    command = f"{shlex.join(argv)}; echo TOP-EXITED-$?; {modes}; sleep 60"
    tmux = Tmux(command)
    try:
        yield tmux
    finally:
        tmux.kill()


class TestLive:
    def test_shows_the_stage_follows_its_work_and_quits_on_q(
        self, server: Server, top_in_tmux: Tmux
    ) -> None:
        tmux = top_in_tmux
        screen = tmux.wait_for(r"enginecore\.stage\.testing:scripted.*│ ok .*│ +0\.0 ")
        assert "q quits" in screen
        assert str(server.proc.pid) in screen
        for column in ("steps/s", "outputs/s", "running", "queue", "step p50", "step p99"):
            assert column in screen
        with StageClient.connect(server.address) as client:
            stream = client.add("r1", 10**9)
            next(iter(stream))
            # Busy: a steps/s of thousands, one request running.
            busy = r"│ ok +│ +[\d,]{3,}(\.\d)? +│ +[\d,]{3,}(\.\d)? +│ +1 +│"
            tmux.wait_for(busy)
            client.abort(["r1"])
        tmux.keys("q")
        tmux.wait_for("TOP-EXITED-0")

    def test_an_interval_past_what_a_poll_can_wait_shows_and_quits_on_q(
        self, server: Server
    ) -> None:
        # An OverflowError traceback it was, from zmq's poll (milliseconds in a C int: an
        # interval past 24.8 days) or, past 292 years, from the sleep.
        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed (.ci/run installs it with apt-get)")
        argv = [*TOP, server.address, "--interval", "1e300"]
        tmux = Tmux(f"{shlex.join(argv)} 2>&1; echo TOP-EXITED-$?; sleep 60")
        try:
            tmux.wait_for(r"│ ok ")
            tmux.keys("q")
            screen = tmux.wait_for("TOP-EXITED-0")
            assert "Traceback" not in screen
        finally:
            tmux.kill()

    @pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
    def test_ctrl_c_or_sigterm_quits_cleanly_and_gives_the_terminal_back(
        self, top_in_tmux: Tmux, stop: str
    ) -> None:
        top_in_tmux.wait_for(r"│ ok ")
        if stop == "ctrl-c":
            top_in_tmux.keys("C-c")
        else:  # kill PID, timeout(1), a supervisor: top would die in cbreak mode, unechoed
            shell = int(top_in_tmux.pane("#{pane_pid}"))
            pids = subprocess.run(
                ["pgrep", "-P", str(shell)], capture_output=True, text=True, timeout=10, check=True
            ).stdout.split()
            assert len(pids) == 1, pids
            os.kill(int(pids[0]), signal.SIGTERM)
        screen = top_in_tmux.wait_for(r"TOP-EXITED-0(.|\n)*TTY-\S*echo")
        assert "Traceback" not in screen
        assert "TTY-icanon" in screen, screen
        assert "TTY-echo" in screen, screen
        assert top_in_tmux.pane("#{alternate_on} #{cursor_flag}") == "0 1"
