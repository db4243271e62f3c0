"""Shared memory between pipeline stages, end to end (``docs/pipelines.md``, "Big arrays
through shared memory"): what the statistics count across a restart of the next stage.

The conftest's autouse fixture checks that no process, socket or segment is left."""

from __future__ import annotations

import os
import signal
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
