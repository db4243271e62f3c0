"""Load-aware routing against real shared stages (``serve --max-clients``): what a pool makes
of another client's requests in a replica's load report, through both pools (``[sync]``
StagePool, ``[async]`` AsyncStagePool behind test_pool's blocking adapter)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from enginecore.stage import StageClient

from . import test_pool
from .conftest import Server, wait_until
from .test_pool import Open

DEVICE = "enginecore.stage.testing:device"

pytestmark = pytest.mark.timeout(90)

pools = test_pool.pools  # the fixture: StagePool's and AsyncStagePool's, closed afterwards


@pytest.fixture
def connect(pools: tuple[Open, Open]) -> Open:
    """``connect(addresses, **kwargs)``: StagePool's or AsyncStagePool's (behind the
    adapter), closed afterwards (test_pool's ``pools``)."""
    return pools[1]


def _shared(step_s: float) -> Server:
    return Server(
        "--engine", DEVICE, "--kwargs", json.dumps({"step_s": step_s}),
        "--bind", "tcp://127.0.0.1:*", "--max-clients", "2",
    )  # fmt: skip


def test_a_shared_replicas_old_report_still_counts_the_other_clients_requests(
    connect: Any,
) -> None:
    """A shared stage in a step longer than a second sends no report meanwhile: its last
    one, with another client's 10 requests in it, ages past a second. The pool must still
    count those 10, not take the replica for an empty one and send it every request."""
    slow, fast = _shared(3.0), _shared(0.005)
    try:
        with StageClient.connect(slow.address) as other:
            streams = [other.add(f"o{i}", 10**6) for i in range(10)]
            pool = connect([slow.address, fast.address])
            busy = pool.replicas[0]

            def others_seen() -> bool:
                load = busy.load()
                return load is not None and load.live == 10

            assert wait_until(others_seen, 30), busy.load()
            seen = busy.load()
            assert seen is not None

            def aged() -> bool:  # older than the pool's former 1 s report expiry
                load = busy.load()
                return load is not None and load.age > 1.2

            assert wait_until(aged, 10), busy.load()
            # Routed on the old report (the next one comes as the 3 s step ends).
            mine = pool.add_many([(f"m{i}", 10**6) for i in range(4)])
            placed = Counter(s.replica.name for s in mine)
            assert placed == {pool.replicas[1].name: 4}, (placed, busy.load(), seen)
            assert pool.add("m4", 10**6).replica.name == pool.replicas[1].name
            pool.abort([s.req_id for s in mine] + ["m4"])
            other.abort([s.req_id for s in streams])
    finally:
        assert slow.stop() == 0
        assert fast.stop() == 0
