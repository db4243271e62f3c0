"""Shared memory between pipeline stages, end to end (``docs/pipelines.md``, "Big arrays
through shared memory"): what the statistics count across a restart of the next stage, and
that the segments of a pipeline killed with its stages do not outlive the next launch.

The conftest's autouse fixture checks that no process, socket or segment is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from enginecore.stage import PipelineStage, RestartPolicy, StageHealth, _shm

from .conftest import wait_until
from .pipelines import Launch, launcher

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"
T = "enginecore.stage.testing"
MIB = 1 << 20

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not _shm.available(), reason="needs /dev/shm (Linux)"),
]

FAST = RestartPolicy(first_delay=0.05, max_delay=0.05)


@pytest.fixture
def launch(no_leftovers: str) -> Iterator[Launch]:
    with launcher("sync") as launch_:
        yield launch_


def _shm_numbers(pipe: Any, stage: str) -> dict[str, float]:
    engine = pipe.stats()[stage].engine
    return {k: v for k, v in engine.items() if k.startswith("shm_")}


def test_the_producers_counters_go_on_across_a_restart_of_the_next_stage(launch: Any) -> None:
    """``shm_sent``, ``shm_sent_bytes``, ``shm_fallbacks`` and ``shm_retired`` count in
    all, as ``edge_sent`` does: the new pool of slots made for the restarted next stage
    does not start them again from zero."""
    pipe = launch(
        [
            PipelineStage(COUNTDOWN, name="a", edge=f"{T}:to_array"),
            PipelineStage(RELAY, name="b", restart=FAST),
        ]
    )

    def run(tag: str) -> None:
        for i in range(2):
            outputs = pipe.add(f"{tag}{i}", 3).collect(timeout=30)
            assert [float(x[0]) for x in outputs] == [2.0, 1.0, 0.0]

    run("before")  # 6 arrays of 1 MiB, each through a slot
    assert wait_until(lambda: _shm_numbers(pipe, "a")["shm_sent"] == 6, 10)
    os.kill(pipe.call_utility("b", "pid"), signal.SIGKILL)
    assert wait_until(lambda: pipe.restarts["b"] == 1 and pipe.health()["b"] == StageHealth.OK, 30)
    run("after")
    assert wait_until(lambda: _shm_numbers(pipe, "a")["shm_sent"] >= 12, 10)
    numbers = _shm_numbers(pipe, "a")
    assert numbers["shm_sent"] == 12, numbers
    assert numbers["shm_sent_bytes"] == 12 * MIB, numbers
    assert numbers["shm_fallbacks"] == 0, numbers
    assert wait_until(lambda: _shm_numbers(pipe, "b")["shm_taken"] == 6, 10)  # the new one's


def test_an_array_of_every_kind_crosses_shared_memory_unchanged(launch: Any) -> None:
    """Every allowed dtype kind, byte order and layout, through a slot (``shm_threshold``
    at 1 KiB, the smallest array that leaves the message): equal, same dtype and shape,
    read-only."""
    arrays = {
        "bool": np.ones(5000, dtype=bool),
        "f2": np.arange(1000, dtype=np.float16),
        "c16": np.arange(1000, dtype=np.complex128) * 1j,
        "M8": np.arange(1000).astype("datetime64[ns]"),
        "m8": np.arange(1000).astype("timedelta64[us]"),
        "big-endian": np.arange(1000, dtype=">f4"),
        "S": np.array([b"abc"] * 1000),
        "U": np.array(["hello"] * 1000),
        "transposed": np.arange(12000, dtype=np.float32).reshape(100, 120).T,
        "reversed": np.arange(1000, dtype=np.float64)[::-1],
        "0-d": np.array(b"x" * 2000, dtype="S2000"),
    }
    pipe = launch(
        [
            PipelineStage(f"{T}:echo", name="a", shm_threshold=1024),
            PipelineStage(RELAY, name="b"),
        ]
    )
    (back,) = pipe.add("r", arrays).collect(timeout=30)
    for key, sent in arrays.items():
        got = back[key]
        assert (got.dtype, got.shape) == (sent.dtype, sent.shape), key
        assert got.tobytes() == sent.tobytes(), key
        assert not got.flags.writeable, key
    assert wait_until(lambda: _shm_numbers(pipe, "a")["shm_sent"] == len(arrays), 10)
    sent_bytes = sum(a.nbytes for a in arrays.values())
    assert _shm_numbers(pipe, "a")["shm_sent_bytes"] == sent_bytes


@pytest.mark.parametrize("what", ["window", "window_bytes", "shm_threshold", "shm_pool_bytes"])
def test_an_int_parameter_too_big_to_reach_the_stage_is_refused_at_once(what: str) -> None:
    """Not at launch, as a stage's ``factory kwargs[...]`` that the user never wrote."""
    too_big: Any = 2**63
    with pytest.raises(ValueError, match=rf"^{what} must be an int >= 1 .*below 2\*\*63"):
        PipelineStage(COUNTDOWN, **{what: too_big})
    PipelineStage(COUNTDOWN, **{what: too_big - 1})


def test_a_lease_out_of_range_says_its_range() -> None:
    with pytest.raises(ValueError, match=r"shm_lease must be seconds > 0 \(below 1e6\)"):
        PipelineStage(COUNTDOWN, shm_lease=1e6)


_KILLED_WITH_ITS_STAGES = """
import sys
import numpy as np
from enginecore.stage import Pipeline, PipelineStage
T = "enginecore.stage.testing"
pipe = Pipeline.launch([PipelineStage(f"{T}:echo"), PipelineStage(f"{T}:relay")])
pipe.add("r", np.ones(2**20, np.uint8)).collect(timeout=30)  # through a slot, kept
print(*(pipe.client(s).pid for s in pipe.stages), flush=True)
sys.stdin.read()
"""


def _dead(pid: int) -> bool:
    """Whether every thread of *pid* has exited (so its files are closed, its locks gone):
    a zombie leader's other threads may still be exiting, its files open."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return False
    except OSError:
        return True  # gone (or going)
    return True


def test_the_segments_of_a_pipeline_killed_with_its_stages_go_at_the_next_launch(
    no_leftovers: str,
) -> None:
    """A SIGKILL of the whole process group (parent and stages, as the OOM killer may take
    them) leaves nobody to unlink the producing stage's slots; the next pipeline launched
    on the host finds their lock free (no producer of theirs lives) and unlinks them."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with subprocess.Popen(
        [sys.executable, "-c", _KILLED_WITH_ITS_STAGES],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the stages too
        env=env,
    ) as child:
        try:
            assert child.stdout is not None
            stages = [int(pid) for pid in child.stdout.readline().split()]
            assert len(stages) == 2, stages
            prefix = f"enginecore-{child.pid}-"
            assert len(_shm.segments(prefix)) == 1  # the slot the array went through
            live = _shm.pipeline_prefix()  # another launch, while it lives: nothing is swept
            assert live.startswith(f"enginecore-{os.getpid()}-")
            assert len(_shm.segments(prefix)) == 1
        finally:
            os.killpg(child.pid, signal.SIGKILL)
    assert wait_until(lambda: all(_dead(pid) for pid in stages), 30)
    assert len(_shm.segments(prefix)) == 1  # nobody survived to unlink it
    _shm.pipeline_prefix()  # the next launch
    assert _shm.segments(prefix) == []
    assert [n for n in os.listdir(_shm.SHM_DIR) if f"-{child.pid}-" in n] == []  # its lock
