"""Fixtures for the stage-process tests: real processes, real sockets, nothing left behind.

Every test runs with ``tempfile.tempdir`` pointed at a private, short directory (ipc socket
paths must fit in 107 bytes), and afterwards asserts that no child process of the test
process is left (running or unreaped) and that no ipc directory or socket file is left.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from enginecore.stage import StageClient

SCRIPTED = "enginecore.stage.testing:scripted"
COUNTDOWN = "enginecore.stage.testing:countdown"


def child_pids() -> dict[int, str]:
    """Children of this process (running or zombie), pid -> command line, except the
    multiprocessing resource tracker, which spawn starts once per interpreter on purpose."""
    me = os.getpid()
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and "resource_tracker" not in cmdline:
            found[int(entry)] = cmdline
    return found


def pid_gone(pid: int) -> bool:
    """Whether *pid* no longer runs (absent, or a zombie waiting for a reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_until(predicate: object, timeout: float) -> bool:
    """Poll *predicate* (a callable) until true or *timeout*; for process-table checks,
    where no event exists to wait on."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():  # type: ignore[operator]
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Private temp dir for ipc sockets; after the test, no child and no socket file left."""
    before = set(child_pids())
    private = tempfile.mkdtemp(prefix="ecT", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", private)
    try:
        yield private
        leftover_children = {pid: cmd for pid, cmd in child_pids().items() if pid not in before}
        leftover_files = [
            os.path.join(root, name)
            for root, dirs, files in os.walk(private)
            for name in dirs + files
        ]
        assert not leftover_children, f"child processes left behind: {leftover_children}"
        assert not leftover_files, f"ipc files or dirs left behind: {leftover_files}"
    finally:
        shutil.rmtree(private, ignore_errors=True)


@pytest.fixture
def client(no_leftovers: str) -> Iterator[StageClient]:
    """A launched ScriptedEngine stage with the ordered event stream on."""
    with StageClient.launch(SCRIPTED, ordered_events=True, startup_timeout=30) as c:
        yield c


class Server:
    """A headless ``python -m enginecore serve`` subprocess."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "enginecore", "serve", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the ready line; EOF if it failed to start
        match = re.search(r"listening on (\S+)", line)
        if match is None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()
            raise AssertionError(f"serve did not start: {line!r}")
        self.address = match.group(1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()
        return code


@pytest.fixture
def server(no_leftovers: str) -> Iterator[Server]:
    """A headless stage serving ScriptedEngine on a free loopback TCP port."""
    srv = Server("--engine", SCRIPTED, "--bind", "tcp://127.0.0.1:*", "--session-timeout", "1")
    try:
        yield srv
    finally:
        srv.stop()
