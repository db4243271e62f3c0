"""Shared memory between a pipeline's stages (``_shm``), in one process: a producer's
:class:`ShmPool` and a consumer's :class:`ShmReader` on the same ``/dev/shm`` segments, as
two stages use them (``docs/pipelines.md``, "Big arrays through shared memory").

The rules under test: a payload arrives equal, read-only and without a copy; a slot is
rewritten only after the consumer released the generation in it (every reference to the
array gone), so no array the consumer holds ever changes; a payload read after its lease
expired, or whose slot was retired or rewritten, is refused with ``SharedMemoryLeaseExpired``;
the consumer renews the lease of what it holds; the pool stays within its bytes and falls
back (counted) when no slot is free; unlinking by prefix leaves nothing. A hypothesis state
machine interleaves puts, takes, drops and checks. The stage processes' side is in
``test_stage_pipeline.py`` (``TestSharedMemory``)."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from enginecore.stage import _codec, _shm
from enginecore.stage._shm import EXPIRED, ShmError, ShmPool, ShmReader

from .conftest import wait_until

pytestmark = pytest.mark.skipif(not _shm.available(), reason="needs /dev/shm (Linux)")

MIB = 1 << 20


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh segment prefix; after the test, none of its segments is left."""
    pipeline = _shm.pipeline_prefix()
    p = _shm.stage_prefix(pipeline, 0)
    try:
        yield p
    finally:
        left = _shm.unlink_prefix(p)
        assert left == [], f"segments left behind: {left}"
        locks = [n for n in os.listdir(_shm.SHM_DIR) if n.startswith(f".{pipeline}")]
        _shm.unlink_prefix(pipeline)
        assert locks == [], f"lock files left behind: {locks}"


def _pool(prefix: str, *, max_bytes: int = 8 * MIB, lease: float = 10.0) -> ShmPool:
    return ShmPool(prefix, threshold=MIB, max_bytes=max_bytes, lease=lease)


def _array(value: float, n: int = MIB // 4) -> Any:
    return np.full(n, value, dtype=np.float32)


def _mapped_here(prefix: str) -> list[str]:
    """The segments of *prefix* this process maps now (unlinked or not)."""
    with open("/proc/self/maps") as f:
        names = {
            line.split("/dev/shm/", 1)[1].split()[0] for line in f if f"/dev/shm/{prefix}" in line
        }
    return sorted(names)


class TestPoolAndReader:
    def test_a_payload_arrives_equal_read_only_and_on_the_slot(self, prefix: str) -> None:
        pool, reader = _pool(prefix), ShmReader(prefix)
        sent = np.arange(MIB // 8, dtype=np.float64).reshape(256, -1)
        head = pool.put(sent)
        assert head is not None
        assert head[:2] == ["<f8", [256, MIB // 8 // 256]]
        assert pool.commit() == sent.nbytes
        got = reader.array(head)
        assert np.array_equal(got, sent)
        assert got.dtype == sent.dtype
        assert not got.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            got[0, 0] = 1
        assert _shm.segments(prefix) == [head[2]]
        pool.close()
        assert _shm.segments(prefix) == []
        assert np.array_equal(got, sent)  # the mapping outlives the name

    def test_below_the_threshold_nothing_goes_through_shared_memory(self, prefix: str) -> None:
        pool = _pool(prefix)
        assert pool.put(np.zeros(MIB - 1, dtype=np.uint8)) is None
        assert pool.fallbacks == 0
        assert _shm.segments(prefix) == []

    def test_a_slot_is_reused_only_after_every_view_of_its_array_is_gone(self, prefix: str) -> None:
        pool, reader = _pool(prefix), ShmReader(prefix)
        first = pool.put(_array(1.0))
        assert first is not None
        held = reader.array(first)
        view = held[10:20]  # a view keeps the lease too
        del held
        second = pool.put(_array(2.0))  # the first slot is held: a second one
        assert second is not None
        assert second[2] != first[2]
        assert np.all(view == 1.0)
        del view
        gc.collect()
        third = pool.put(_array(3.0))  # released: the first slot again, next generation
        assert third is not None
        assert third[2] == first[2]
        assert third[3] == first[3] + 1
        assert pool.created == 2
        pool.close()

    def test_a_read_of_a_rewritten_slot_fails_and_never_returns_its_new_data(
        self, prefix: str
    ) -> None:
        pool, reader = _pool(prefix), ShmReader(prefix)
        old = pool.put(_array(1.0))
        assert old is not None
        reader.array(old)  # taken and dropped at once: released
        gc.collect()
        new = pool.put(_array(2.0))
        assert new is not None
        assert new[2] == old[2]
        with pytest.raises(ShmError, match=f"{EXPIRED}: .* holds generation 2, not 1"):
            reader.array(old)
        assert np.all(reader.array(new) == 2.0)
        pool.close()

    def test_a_read_after_the_lease_expired_fails(self, prefix: str) -> None:
        pool, reader = _pool(prefix, lease=0.05), ShmReader(prefix)
        head = pool.put(_array(1.0))
        assert head is not None
        time.sleep(0.1)  # the lease is what is under test: let it run out
        with pytest.raises(ShmError, match=f"{EXPIRED}: the lease .* expired .* before"):
            reader.array(head)
        assert reader.expired == 1
        pool.close()

    def test_an_expired_slot_is_retired_never_rewritten(self, prefix: str) -> None:
        pool = _pool(prefix, lease=0.05)
        reader = ShmReader(prefix)
        head = pool.put(_array(1.0))
        assert head is not None
        held = reader.array(head)
        reader.close()  # the consumer stops renewing (frozen, or gone)
        time.sleep(0.1)
        again = pool.put(_array(2.0))
        assert again is not None
        assert again[2] != head[2]
        assert pool.retired == 1
        assert _shm.segments(prefix) == [again[2]]
        assert np.all(held == 1.0)  # what the consumer took stays as it was
        with pytest.raises(ShmError, match=EXPIRED):
            ShmReader(prefix).array(head)  # the name is gone
        pool.close()

    def test_the_consumer_renews_the_lease_of_what_it_holds(self, prefix: str) -> None:
        pool, reader = _pool(prefix, lease=0.2), ShmReader(prefix)
        head = pool.put(_array(1.0))
        assert head is not None
        held = reader.array(head)
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:  # three leases: renewed by the keeper thread
            time.sleep(0.05)
        assert pool.put(_array(2.0)) is not None
        assert pool.retired == 0
        assert pool.created == 2
        assert np.all(held == 1.0)
        del held
        assert wait_until(lambda: reader.held == 0, 5)
        reader.close()
        pool.close()

    def test_the_keeper_sleeps_while_the_consumer_holds_nothing(self, prefix: str) -> None:
        """A short lease (allowed: any number of seconds > 0) once had the keeper thread
        wake every quarter of it for as long as the stage lived, idle or not: with a tiny
        one, a busy CPU. It renews only while an array is held; with none, it sleeps until
        one is taken."""
        pool, reader = _pool(prefix, lease=0.04), ShmReader(prefix)  # a round per 10 ms
        try:
            head = pool.put(_array(1.0))
            assert head is not None
            held = reader.array(head)
            assert wait_until(lambda: reader.rounds >= 3, 10)  # renewing what it holds
            del held
            assert wait_until(lambda: reader.held == 0, 5)
            time.sleep(0.05)  # the keeper's round in progress, if any, ends
            rounds = reader.rounds
            time.sleep(0.5)  # idle: ~50 rounds before, none now (a count, not a time)
            assert reader.rounds <= rounds + 1, reader.rounds - rounds
            again = pool.put(_array(2.0))  # the slot was released: reused
            assert again is not None
            assert again[2] == head[2]
            held = reader.array(again)
            assert wait_until(lambda: reader.rounds >= rounds + 3, 10)  # awake again
            assert np.all(held == 2.0)
            del held
        finally:
            reader.close()
            pool.close()

    def test_a_consumer_that_only_refuses_lets_go_of_retired_slots(self, prefix: str) -> None:
        """A refused payload is never released, so the producer retires its slot and makes
        another: the consumer, whose keeper never ran (it took nothing), does not keep
        every retired slot it ever mapped (their memory, unlinked, but mapped)."""
        pool, reader = _pool(prefix, lease=0.001), ShmReader(prefix)
        try:
            for i in range(10):
                head = pool.put(_array(float(i)))
                assert head is not None
                pool.commit()
                time.sleep(0.005)  # the lease runs out before the consumer reads the payload
                with pytest.raises(ShmError, match=EXPIRED):
                    reader.array(head)
            assert pool.retired == 9
            assert reader.mapped <= 2, reader.mapped
            assert len(_mapped_here(prefix)) <= 2
        finally:
            pool.close()

    def test_the_pool_stays_within_its_bytes_and_falls_back_counted(self, prefix: str) -> None:
        pool, reader = _pool(prefix, max_bytes=2 * MIB), ShmReader(prefix)
        heads = [pool.put(_array(float(i))) for i in range(3)]
        assert heads[2] is None
        assert pool.fallbacks == 1
        held = [reader.array(h) for h in heads[:2]]
        assert pool.stats()["shm_slot_bytes"] == 2 * MIB
        assert [float(a[0]) for a in held] == [0.0, 1.0]
        pool.close()

    def test_a_free_slot_too_small_makes_room_for_a_bigger_payload(self, prefix: str) -> None:
        pool, reader = _pool(prefix, max_bytes=3 * MIB), ShmReader(prefix)
        small = pool.put(_array(1.0))
        assert small is not None
        reader.array(small)
        gc.collect()
        big = pool.put(_array(2.0, n=3 * MIB // 4))
        assert big is not None
        assert _shm.segments(prefix) == [big[2]]
        assert np.all(reader.array(big) == 2.0)
        pool.close()

    def test_a_payload_that_cannot_fit_leaves_the_free_slots_alone(self, prefix: str) -> None:
        # Bigger than the pool, or than what the held slots leave of it: it goes on ZeroMQ,
        # and the free slots stay for the next payloads (no slot made again, no page
        # faults on a fresh one).
        pool, reader = _pool(prefix, max_bytes=3 * MIB), ShmReader(prefix)
        free = [pool.put(_array(float(i))) for i in range(2)]
        assert all(h is not None for h in free)
        for head in free:
            reader.array(head)
        gc.collect()  # both released: free
        held = reader.array(pool.put(_array(9.0)))  # one held, one free
        assert pool.put(_array(3.0, n=4 * MIB // 4)) is None  # bigger than the pool
        assert pool.put(_array(3.0, n=3 * MIB // 4)) is None  # more than the held slot leaves
        assert pool.fallbacks == 2
        assert pool.stats()["shm_slots"] == 2
        assert pool.put(_array(4.0)) is not None  # the free slot, kept
        assert pool.created == 2
        assert float(held[0]) == 9.0
        pool.close()

    def test_abandoned_payloads_free_their_slots(self, prefix: str) -> None:
        pool = _pool(prefix, max_bytes=MIB)
        assert pool.put(_array(1.0)) is not None
        pool.abandon()
        assert pool.put(_array(2.0)) is not None
        assert pool.created == 1
        pool.close()

    def test_when_the_other_stage_dies_each_side_lets_go_of_its_mappings(self, prefix: str) -> None:
        # The consumer's upstream died: it maps none of its slots again, and an array it
        # still holds stays valid (numpy holds its mapping) until it dies. The producer's
        # downstream died: its pool unlinks and unmaps every slot and takes no array again.
        pool, reader = _pool(prefix), ShmReader(prefix)
        heads = [pool.put(_array(float(i))) for i in range(2)]
        pool.commit()
        kept = reader.array(heads[0])
        assert reader.mapped == 1
        reader.upstream_gone()
        assert reader.mapped == 0
        with pytest.raises(ShmError, match=f"{EXPIRED}: .* its stage died"):
            reader.array(heads[1])
        assert float(kept[0]) == 0.0  # still readable: its own mapping
        pool.close()
        assert _shm.segments(prefix) == []
        assert _mapped_here(prefix) == [f"{prefix}0"]  # only through `kept`
        del kept
        gc.collect()
        assert _mapped_here(prefix) == []
        assert pool.put(_array(1.0)) is None
        assert pool.stats()["shm_slots"] == 0

    def test_a_pool_holds_its_pipeline_lock_while_it_has_slots(self, prefix: str) -> None:
        """A sweep (the next launch's) never unlinks the slots of a live producer; the last
        producer of a pipeline to close takes the lock file with it."""
        pipeline = prefix[: -len("0-")]
        lock = f".{pipeline}lock"
        pool = _pool(prefix)
        assert lock not in os.listdir(_shm.SHM_DIR)  # no slot yet: no lock
        assert pool.put(_array(1.0)) is not None
        pool.commit()
        assert lock in os.listdir(_shm.SHM_DIR)
        assert _shm.sweep_stale(pipeline) == []
        assert _shm.pipeline_prefix() != pipeline  # a launch sweeps: not this one
        assert len(_shm.segments(prefix)) == 1
        pool.close()
        assert _shm.segments(prefix) == []
        assert lock not in os.listdir(_shm.SHM_DIR)

    def test_the_last_producer_to_close_unlinks_what_dead_ones_left(self, prefix: str) -> None:
        """Stage 0 dies (its lock goes with its process; here, its descriptor closed) and
        leaves its slots; stage 1, the pipeline's last producer, unlinks them as it closes."""
        pipeline = prefix[: -len("0-")]
        dead, last = _pool(prefix), _pool(_shm.stage_prefix(pipeline, 1))
        assert dead.put(_array(1.0)) is not None
        assert last.put(_array(2.0)) is not None
        dead._unlock()  # killed: the kernel drops its lock (its descriptor closed), and
        # nobody unlinks its slots
        assert len(_shm.segments(pipeline)) == 2
        assert _shm.sweep_stale(pipeline) == []  # stage 1 lives: nothing is swept
        last.close()
        assert _shm.segments(pipeline) == []

    def test_a_pool_that_cannot_hold_the_lock_makes_no_slot(
        self, prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Its slots could be swept under it: its arrays go on ZeroMQ, counted."""

        def fail(pipeline: str) -> int:
            raise OSError("no")

        monkeypatch.setattr(_shm, "_hold", fail)
        pool = _pool(prefix)
        assert pool.put(_array(1.0)) is None
        assert pool.fallbacks == 1
        assert _shm.segments(prefix) == []
        pool.close()

    @pytest.mark.parametrize(
        ("head", "why"),
        [
            ("x", "invalid shared-memory array"),
            (["<f4", [4], "/etc/passwd", 1, 64, 16], "not the previous stage's"),
            (["<f4", [4], "{p}x", 1, 64, 16], "not the previous stage's"),
            (["|O", [4], "{p}0", 1, 64, 32], "not allowed on the wire"),
            (["<f4", [4], "{p}0", 1, 64, 15], "needs 16 bytes, got 15"),
            (["<f4", [4], "{p}9", 1, 64, 16], f"{EXPIRED}: .* is gone"),
        ],
    )
    def test_invalid_references_are_refused(self, prefix: str, head: Any, why: str) -> None:
        if isinstance(head, list):
            head = [h.format(p=prefix) if isinstance(h, str) else h for h in head]
        with pytest.raises(ShmError, match=why):
            ShmReader(prefix).array(head)

    def test_a_segment_that_is_not_a_slot_is_refused(self, prefix: str) -> None:
        path = os.path.join(_shm.SHM_DIR, f"{prefix}7")
        with open(path, "wb") as f:
            f.write(b"\0" * 128)
        try:
            with pytest.raises(ShmError, match="is not a slot"):
                ShmReader(prefix).array(["|u1", [8], f"{prefix}7", 1, 64, 8])
        finally:
            os.unlink(path)

    def test_unlink_prefix_unlinks_only_that_prefix(self, prefix: str) -> None:
        other = _shm.stage_prefix(prefix[: -len("0-")], 1)
        a, b = _pool(prefix), _pool(other)
        assert a.put(_array(1.0)) is not None
        assert b.put(_array(1.0)) is not None
        assert len(_shm.unlink_prefix(prefix)) == 1
        assert _shm.segments(prefix) == []
        assert len(_shm.segments(other)) == 1
        a.close()
        b.close()


class TestCodec:
    def test_an_encoder_with_a_pool_sends_big_arrays_as_ext_4(self, prefix: str) -> None:
        pool = _pool(prefix)
        _shm.configure_reader(prefix)
        try:
            big, small = _array(5.0), np.arange(10)
            parts = _codec.Encoder(pool).encode(["pipe", [1], ["r"], [{"a": big, "b": small}]])
            assert len(parts) == 1  # no out-of-band frame: the big array is in a slot
            decoder = _codec.Decoder(strict=False, shm=True)
            msg = decoder.decode(parts)
            assert np.array_equal(msg[3][0]["a"], big)
            assert np.array_equal(msg[3][0]["b"], small)
            assert decoder.shm_bytes == big.nbytes
            # A decoder without shm (the client's) refuses ext 4 as an unknown extension.
            plain = _codec.Decoder(strict=False).decode(parts)
            assert isinstance(plain[3][0]["a"], _codec.Invalid)
        finally:
            _shm._reader = None
            pool.close()

    def test_a_stage_that_takes_no_shared_memory_refuses_it(self, prefix: str) -> None:
        pool = _pool(prefix)
        parts = _codec.Encoder(pool).encode([_array(1.0)])
        got = _codec.Decoder(strict=False, shm=True).decode(parts)
        assert isinstance(got[0], _codec.Invalid)
        assert "takes none" in got[0].reason
        pool.close()


class PoolModel(RuleBasedStateMachine):
    """Puts, takes and drops in any order, through a small pool: every array the consumer
    holds keeps the value it was sent with, every payload sent and not yet taken can be
    taken, and the pool stays within its bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.prefix = _shm.stage_prefix(_shm.pipeline_prefix(), 0)
        self.pool = ShmPool(self.prefix, threshold=MIB, max_bytes=4 * MIB, lease=60.0)
        self.reader = ShmReader(self.prefix)
        self.sent: list[tuple[list[Any], float]] = []  # sent, not taken yet
        self.held: list[tuple[Any, float]] = []
        self.value = 0.0

    @rule(size=st.sampled_from([MIB // 4, MIB // 2, 3 * MIB // 8]))
    def put(self, size: int) -> None:
        self.value += 1
        head = self.pool.put(_array(self.value, size))
        self.pool.commit()
        if head is not None:
            self.sent.append((head, self.value))

    @precondition(lambda self: self.sent)
    @rule(i=st.integers(0, 100))
    def take(self, i: int) -> None:
        head, value = self.sent.pop(i % len(self.sent))
        self.held.append((self.reader.array(head), value))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def drop(self, i: int) -> None:
        self.held.pop(i % len(self.held))

    @invariant()
    def held_arrays_keep_their_values(self) -> None:
        for arr, value in self.held:
            assert arr[0] == value
            assert arr[-1] == value

    @invariant()
    def the_pool_stays_within_its_bytes(self) -> None:
        assert self.pool.stats()["shm_slot_bytes"] <= 4 * MIB

    def teardown(self) -> None:
        self.held.clear()
        self.reader.close()
        self.pool.close()
        assert _shm.unlink_prefix(self.prefix) == []


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
