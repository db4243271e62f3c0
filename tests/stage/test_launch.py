"""Launching: the startup handshake, its failures, and the no-orphan guarantee."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, cast

import pytest

from enginecore.stage import StageStartupError
from enginecore.stage._launch import Launched, kill_and_clean_async

from .conftest import COUNTDOWN, Launch, child_pids, pid_gone, wait_until


class TestStartup:
    """The startup's failures, through both clients (``launch``: the blocking client, and
    the asyncio one, whose launch awaits the stage on the event loop): the same errors."""

    def test_failing_factory_reports_the_child_traceback(self, launch: Launch) -> None:
        with pytest.raises(StageStartupError) as info:
            launch("enginecore.stage.testing:failing_factory", kwargs={"message": "no model here"})
        err = info.value
        assert "RuntimeError('no model here')" in str(err)
        assert err.child_traceback is not None
        assert "Traceback (most recent call last)" in err.child_traceback
        assert "failing_factory" in err.child_traceback
        assert err.child_traceback in str(err)
        assert err.exit_code == 1

    def test_a_factory_exception_whose_repr_raises_is_still_reported(self, launch: Launch) -> None:
        with pytest.raises(StageStartupError) as info:
            launch("enginecore.stage.testing:failing_factory", kwargs={"unprintable": True})
        assert "_Unprintable(<repr() raised RuntimeError: no repr>)" in str(info.value)
        assert info.value.child_traceback is not None
        assert info.value.exit_code == 1

    def test_a_bad_startup_timeout_is_refused_before_any_process_starts(
        self, launch: Launch
    ) -> None:
        # Before, 0, -1 and NaN spawned the stage and killed it, the error blaming the
        # stage ("did not report ready within 0 s"), and "5" failed in an addition.
        for bad in (0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="startup_timeout must be a number of seconds"):
                launch(COUNTDOWN, startup_timeout=bad)
        for wrong in ("5", True, None):
            with pytest.raises(TypeError, match="startup_timeout must be a number of seconds"):
                launch(COUNTDOWN, startup_timeout=wrong)

    def test_kwargs_that_are_not_a_mapping_are_refused(self, launch: Launch) -> None:
        # Before: "cannot convert dictionary update sequence element #0 to a sequence".
        with pytest.raises(TypeError, match="factory kwargs must be a dict, got list"):
            launch(COUNTDOWN, kwargs=[("n", 1)])

    def test_missing_module_is_a_startup_error(self, launch: Launch) -> None:
        with pytest.raises(StageStartupError, match="ModuleNotFoundError"):
            launch("no_such_module_anywhere:factory")

    def test_factory_returning_a_non_engine_is_a_startup_error(self, launch: Launch) -> None:
        with pytest.raises(StageStartupError, match=r"does not implement the enginecore\.Engine"):
            launch("builtins:dict")

    def test_child_exiting_during_startup_is_an_error_not_a_hang(self, launch: Launch) -> None:
        start = time.monotonic()
        with pytest.raises(StageStartupError, match="exited with code 3 during startup") as info:
            launch("enginecore.stage.testing:exiting_factory", kwargs={"code": 3})
        assert info.value.exit_code == 3
        assert time.monotonic() - start < 10

    def test_child_killed_during_startup_is_an_error(self, launch: Launch) -> None:
        with pytest.raises(StageStartupError, match="killed by SIGKILL during startup") as info:
            launch("enginecore.stage.testing:killed_factory")
        assert info.value.exit_code == -signal.SIGKILL

    def test_startup_timeout_kills_the_child(self, launch: Launch) -> None:
        start = time.monotonic()
        with pytest.raises(StageStartupError, match=r"did not report ready within 0.5 s"):
            launch(
                "enginecore.stage.testing:sleeping_factory",
                kwargs={"seconds": 60},
                startup_timeout=0.5,
            )
        assert time.monotonic() - start < 5

    @pytest.mark.parametrize(
        "factory",
        [
            "enginecore.stage.testing.countdown",
            # These started a process that failed as a StageStartupError.
            "enginecore.stage.testing:countdown:x",
            ".testing:countdown",
            "enginecore.stage.testing:",
            "enginecore..testing:countdown",
            "enginecore.stage.testing:count-down",
        ],
    )
    def test_malformed_factory_string_is_refused_before_starting(
        self, launch: Launch, factory: str, no_leftovers: str
    ) -> None:
        with pytest.raises(ValueError, match=r"pkg\.module:factory"):
            launch(factory)

    @pytest.mark.parametrize("value", [object(), "x\ud800", 2**64])
    def test_unencodable_factory_kwargs_are_refused(self, launch: Launch, value: object) -> None:
        with pytest.raises(TypeError, match="factory kwargs"):
            launch(COUNTDOWN, kwargs={"x": value})

    def test_pid_is_the_stage_process(self, launch: Launch) -> None:
        with launch(COUNTDOWN) as client:
            assert client.pid != os.getpid()
            assert not pid_gone(client.pid)
        assert pid_gone(client.pid)


_HARNESS = """
import sys, time
from enginecore.stage import StageClient
client = StageClient.launch("enginecore.stage.testing:countdown")
stream = client.add("r", 10**9)
next(stream)
print(client.pid, client.address, flush=True)
time.sleep(60)
"""


_FORKING_HARNESS = """
import os, sys, time
from enginecore.stage import StageClient
client = StageClient.launch("enginecore.stage.testing:countdown")
worker = os.fork()
if worker == 0:
    if sys.argv[1] == "exit":
        sys.exit(0)  # a forked worker ending normally: its atexit hooks run
    time.sleep(60)
    os._exit(0)
if sys.argv[1] == "exit":
    os.waitpid(worker, 0)
    print(client.call_utility("div", 1, 2, timeout=5), client.shutdown(), flush=True)
else:
    print(client.pid, worker, flush=True)
    time.sleep(60)
"""


class TestFork:
    """A parent that forks (a worker pool, say) after launching keeps its stage to itself."""

    def test_forked_child_exiting_normally_leaves_the_parents_stage_running(
        self, no_leftovers: str
    ) -> None:
        env = dict(os.environ, TMPDIR=no_leftovers)
        done = subprocess.run(
            [sys.executable, "-c", _FORKING_HARNESS, "exit"],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.stdout.split() == ["0.5", "0"], done.stderr

    def test_stage_exits_after_parent_sigkill_while_a_forked_child_lives(
        self, no_leftovers: str
    ) -> None:
        env = dict(os.environ, TMPDIR=no_leftovers)
        harness = subprocess.Popen(
            [sys.executable, "-c", _FORKING_HARNESS, "sleep"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        worker = None
        try:
            assert harness.stdout is not None
            stage_text, worker_text = harness.stdout.readline().split()
            stage_pid, worker = int(stage_text), int(worker_text)
            harness.send_signal(signal.SIGKILL)
            harness.wait()
            # The worker still holds copies of the parent's fds; the stage must not wait for it.
            assert wait_until(lambda: pid_gone(stage_pid), 2.0), "stage outlived its parent"
        finally:
            if worker is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)
            if harness.poll() is None:
                harness.kill()
                harness.wait()
            assert harness.stdout is not None
            harness.stdout.close()


class TestNoOrphans:
    def test_stage_exits_within_2s_after_the_parent_is_sigkilled(self, no_leftovers: str) -> None:
        env = dict(os.environ, TMPDIR=no_leftovers)
        harness = subprocess.Popen(
            [sys.executable, "-c", _HARNESS], stdout=subprocess.PIPE, text=True, env=env
        )
        try:
            assert harness.stdout is not None
            pid_text, address = harness.stdout.readline().split()
            stage_pid = int(pid_text)
            assert not pid_gone(stage_pid)
            harness.send_signal(signal.SIGKILL)
            harness.wait()
            killed_at = time.monotonic()
            assert wait_until(lambda: pid_gone(stage_pid), 2.0), "stage outlived its parent"
            assert time.monotonic() - killed_at < 2.0
            ipc_dir = os.path.dirname(address.removeprefix("ipc://"))
            assert wait_until(lambda: not os.path.exists(ipc_dir), 1.0)
        finally:
            if harness.poll() is None:
                harness.kill()
                harness.wait()
            assert harness.stdout is not None
            harness.stdout.close()


_NEVER_CLOSED = """
import sys
from enginecore.stage import Pipeline, StageClient, StagePool

kind = sys.argv[1]
if kind == "client":
    used = StageClient.launch("enginecore:CountdownEngine")
    pids = [used.pid]
elif kind == "pipeline":
    used = Pipeline.launch(["enginecore:CountdownEngine", "enginecore.stage.testing:relay"])
    pids = [used.client(name).pid for name in used.stages]
else:
    used = StagePool.launch("enginecore:CountdownEngine", replicas=2, restart=kind == "restart")
    pids = [r.pid for r in used.replicas]
assert used.add("a", 2).collect(timeout=30) == [1, 0]
print(*pids, flush=True)
raise RuntimeError("the program's own bug")
"""


class TestNeverClosed:
    @pytest.mark.parametrize("kind", ["client", "pool", "restart", "pipeline"])
    def test_a_program_that_ends_without_closing_stops_its_stages_quietly(
        self, kind: str, no_leftovers: str
    ) -> None:
        # The interpreter's exit stops the stages of a client, pool or pipeline never
        # closed. A pool or pipeline then logged each stage as gone ("it shut down, but not
        # at this client's request"), and a pool with restart=True began to restart them.
        env = dict(os.environ, TMPDIR=no_leftovers)
        done = subprocess.run(
            [sys.executable, "-c", _NEVER_CLOSED, kind],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert done.returncode == 1, done.stderr
        assert done.stderr.rstrip().endswith("RuntimeError: the program's own bug")
        assert "enginecore" not in done.stderr.split("Traceback", 1)[0]
        assert "enginecore:" not in done.stderr, done.stderr
        pids = [int(p) for p in done.stdout.split()]
        assert len(pids) == (1 if kind == "client" else 2)
        assert all(wait_until(lambda p=p: pid_gone(p), 5) for p in pids)


class TestTcpListen:
    """A launched stage that listens on TCP with CURVE (``_launch.TcpListen``: a pipeline's
    local stage after a stage on Ray): its parent's key admitted from the start, others
    only once the parent says so over the death pipe, and refused again once removed."""

    def test_the_parent_admits_keys_over_the_pipe_and_removes_them(self, no_leftovers: str) -> None:
        import zmq

        from enginecore.stage import CurveKeys, StageClient
        from enginecore.stage._curve import ServerCurve
        from enginecore.stage._launch import Launched, TcpListen

        from .raw import RawClient, refused_handshake

        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        server = ServerCurve(server_public, server_secret, frozenset([public]), "(test)")
        listen = TcpListen("127.0.0.1", server, CurveKeys(public, secret, server_public))
        options = {"name": "tcp", "listen": listen}
        client = StageClient._launch(COUNTDOWN, None, 30.0, False, options)
        try:
            launched = client._launched
            assert isinstance(launched, Launched)
            assert client.address.startswith("tcp://127.0.0.1:")
            assert client.add("r1", 2).collect(timeout=10) == [1, 0]  # the parent's own key
            peer_public, peer_secret = zmq.curve_keypair()
            peer = (peer_public, peer_secret, server_public)
            refused_handshake(client.address)  # NULL
            refused_handshake(client.address, curve=peer)  # a key not admitted
            assert launched.authorize([peer_public]) == 2  # the parent's and the peer's
            raw = RawClient(client.address, curve=CurveKeys(*peer))
            try:
                # Admitted: the stage itself answers (it takes one client, its parent).
                assert raw.hello()[2] == "another client is attached to this stage"
            finally:
                raw.close()
            with pytest.raises(RuntimeError, match="40-character Z85"):
                launched.authorize([b"not a key"])  # refused in the stage: nothing changed
            assert launched.authorize([]) == 1  # the peer's key removed again
            refused_handshake(client.address, curve=peer)
            assert client.add("r2", 2).collect(timeout=10) == [1, 0]
        finally:
            client.shutdown()
        with pytest.raises(Exception, match="gone"):
            launched.authorize([peer_public])

    def test_a_stage_on_ipc_takes_no_keys(self, client: Any) -> None:
        from enginecore.stage._launch import Launched

        launched = client._launched
        assert isinstance(launched, Launched)
        assert client.address.startswith("ipc://")
        with pytest.raises(ValueError, match="ipc"):
            launched.authorize([])

    def test_the_parent_s_own_key_must_be_admitted(self) -> None:
        import zmq

        from enginecore.stage import CurveKeys
        from enginecore.stage._curve import ServerCurve
        from enginecore.stage._launch import TcpListen

        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        server = ServerCurve(server_public, server_secret, frozenset(), "(test)")
        with pytest.raises(ValueError, match="own key"):
            TcpListen("127.0.0.1", server, CurveKeys(public, secret, server_public))


# A terminal's Ctrl-C: SIGINT to the whole process group (the harness is a session of its
# own), sent at a chosen point of the stage's spawn, once the child's Python has set up its
# own SIGINT handling (caught, ignored or blocked: /proc's Sig* masks), so that without the
# parent's care it lands while the child imports. The harness catches its KeyboardInterrupt
# and waits a while for the stage to be gone, all of its stderr kept.
_CTRL_C_HARNESS = """
import asyncio, os, signal, sys, time
import multiprocessing.process as mp, multiprocessing.util as mu
from enginecore.stage import AsyncStageClient, AsyncStagePool, StageClient, StagePool

where, form, sig = sys.argv[1], sys.argv[2], sys.argv[3]
stage = []

def on_sigterm(signum, frame):  # what the benchmarks' run_main does
    raise KeyboardInterrupt

if sig == "TERM":
    signal.signal(signal.SIGTERM, on_sigterm)

def ctrl_c(pid):
    if sig == "TERM":  # to this process alone, as `timeout` or a cancelled CI job does
        os.kill(os.getpid(), signal.SIGTERM)
        return
    for _ in range(10000):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(ln.split(":\\t", 1) for ln in f.read().splitlines() if ":\\t" in ln)
        except OSError:
            break
        if (int(status["SigCgt"], 16) | int(status["SigIgn"], 16) | int(status["SigBlk"], 16)) & 2:
            break
        time.sleep(0.001)
    os.killpg(os.getpgid(0), signal.SIGINT)

if where == "spawned":  # inside Process.start(), the child started, its pid not yet kept
    spawnv = mu.spawnv_passfds
    def spawned(path, args, passfds):
        pid = spawnv(path, args, passfds)
        if "--multiprocessing-fork" in args:
            stage.append(pid)
            ctrl_c(pid)
        return pid
    mu.spawnv_passfds = spawned
else:  # just after Process.start() returned
    start = mp.BaseProcess.start
    def started(self):
        start(self)
        stage.append(self.pid)
        ctrl_c(self.pid)
    mp.BaseProcess.start = started

FACTORY = "enginecore.stage.testing:countdown"
try:
    if form == "sync":
        StageClient.launch(FACTORY).close()
    elif form == "pool":
        StagePool.launch(FACTORY, replicas=1).close()
    elif form == "async":
        asyncio.run(AsyncStageClient.launch(FACTORY))
    else:
        asyncio.run(AsyncStagePool.launch(FACTORY, replicas=1))
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
deadline = time.monotonic() + 5
while time.monotonic() < deadline and os.path.exists(f"/proc/{stage[0]}") and not open(
    f"/proc/{stage[0]}/stat"
).read().rsplit(")", 1)[1].split()[0] == "Z":
    time.sleep(0.01)
print("stage", stage[0], flush=True)
"""


class TestCtrlCDuringTheSpawn:
    """A Ctrl-C while a stage is being spawned: one clean KeyboardInterrupt in the parent,
    no traceback from the child (it starts with SIGINT blocked until it ignores it), and
    no stage left behind, whether the signal comes inside ``Process.start()`` or just
    after, for a client or a pool, blocking or asyncio. The same for a SIGTERM to the
    parent alone whose Python handler raises ``KeyboardInterrupt`` (the benchmarks'
    ``run_main``): inside the start it left the child reading half its start-up data (an
    ``EOFError`` traceback from the child, its pid never known to the parent)."""

    @pytest.mark.parametrize("form", ["sync", "async", "pool", "apool"])
    @pytest.mark.parametrize("where", ["spawned", "started"])
    @pytest.mark.parametrize("sig", ["INT", "TERM"])
    def test_one_keyboard_interrupt_in_the_parent_and_nothing_from_the_child(
        self, no_leftovers: str, where: str, form: str, sig: str
    ) -> None:
        env = dict(os.environ, TMPDIR=no_leftovers)
        done = subprocess.run(
            [sys.executable, "-c", _CTRL_C_HARNESS, where, form, sig],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=50,
            start_new_session=True,  # the Ctrl-C reaches this harness and its children only
        )
        lines = done.stdout.split()
        assert done.returncode == 0, done.stderr
        assert lines[0] == "KeyboardInterrupt", done.stdout
        assert "Traceback" not in done.stderr
        assert "KeyboardInterrupt" not in done.stderr
        assert pid_gone(int(lines[2])), "the stage outlived the interrupted launch"


def _fork_a_sentinel_holder(directory: str) -> None:
    """A stage's stand-in whose exit the parent's sentinel does not see at once: a
    grandchild (as an engine's worker would) keeps the sentinel pipe open until the file
    ``release`` appears."""
    if os.fork() == 0:
        while not os.path.exists(os.path.join(directory, "release")):
            time.sleep(0.01)
        os._exit(0)
    open(os.path.join(directory, "forked"), "w").close()
    time.sleep(60)


def test_a_kill_cancelled_before_the_exit_is_seen_still_reaps_after_the_loop_ends(
    no_leftovers: str,
) -> None:
    """``kill_and_clean_async`` cancelled before its event-loop reader saw the exit (as
    ``asyncio.run``'s end cancels it), the loop closed at once: the process is reaped
    and its ipc dir removed once it has exited, not at the interpreter's exit (a flaky
    pool test saw the zombie)."""
    directory = tempfile.mkdtemp(dir=no_leftovers)
    ipc_dir = tempfile.mkdtemp(dir=no_leftovers)
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(target=_fork_a_sentinel_holder, args=(directory,))
    process.start()
    conn, other = ctx.Pipe()
    other.close()
    launched = Launched(process, conn, ipc_dir, "ipc://unused", "holder")
    loop = asyncio.new_event_loop()
    try:
        assert wait_until(lambda: os.path.exists(os.path.join(directory, "forked")), 30)
        task = loop.create_task(kill_and_clean_async(launched))
        loop.run_until_complete(asyncio.sleep(0.05))  # killed; the sentinel is still open
        assert wait_until(lambda: pid_gone(cast(int, process.pid)), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            loop.run_until_complete(task)
    finally:
        loop.close()
        open(os.path.join(directory, "release"), "w").close()
    assert wait_until(lambda: process.pid not in child_pids(), 10), "left a zombie"
    assert wait_until(lambda: not os.path.exists(ipc_dir), 10), "left its ipc dir"
    shutil.rmtree(directory)
