"""Shared memory for big arrays between a pipeline's stages on one host: :class:`ShmPool`
(the producing stage) and :class:`ShmReader` (the consuming stage).

``docs/wire.md`` section 8 and ``docs/pipelines.md`` ("Big arrays through shared memory")
describe it; in short:

- **Slots.** A producing stage keeps a pool of *slots*, each a file in ``/dev/shm`` that it
  created and mapped (``mmap``, no :mod:`multiprocessing.shared_memory`, so Python's
  resource tracker has nothing to say about them), named ``<stage prefix><n>``: the
  pipeline's prefix (the parent's pid and a random token), the stage's index, a number
  never used twice. A numpy array of at least the threshold is copied into a free slot and
  travels as an ext 4 value, ``[dtype, shape, name, generation, offset, nbytes]``, instead of
  a ZeroMQ frame. A slot is reused for later payloads, so the page faults of a new mapping
  are paid once per slot, not per payload.
- **The header** of a slot (its first :data:`HEADER_BYTES`) holds int64 fields that both
  sides read and write: the generation of the payload in it (the producer bumps it on each
  reuse), the lease's deadline (``time.monotonic_ns()``, one clock for every process of the
  host), the generation the consumer released, whether the producer retired the slot, and
  the lease's length.
- **The lease.** The producer writes a payload with a lease of ``lease`` seconds. The
  consuming stage takes it when it decodes the ``pipe`` message: it checks that the slot
  is not retired, that the generation is the one named and that the lease has not expired,
  renews it, and checks again (the producer may have retired the slot meanwhile). Then the
  payload is a read-only numpy array **on the slot's memory**, no copy. A thread of the
  consumer's renews the lease of every array it holds, every quarter of the lease, for as
  long as the array (or any view of it) is alive; when the last reference is gone the
  consumer releases that generation. A payload whose lease had expired (it waited longer
  than the lease before the consumer read it: the consumer was frozen or overloaded) is
  refused: an error for its request, never the data.
- **Never stale.** The producer rewrites a slot only after the consumer released the
  generation in it. A slot whose lease expired unreleased is *retired*: marked so, unlinked,
  and never written again (a consumer that still maps it keeps reading the payload it
  took). So no array the consumer holds ever changes under it.
- **No segment outlives its stage.** A stage unlinks its slots when it exits; the parent's
  pipeline unlinks every segment of a stage it saw die (its prefix) and of the whole
  pipeline at shutdown. A producing stage killed together with its parent leaves its slots
  to the next launch on the host: each producer holds a shared lock on its pipeline's lock
  file while it has slots, and a pipeline whose lock is free has no producer alive
  (:func:`sweep_stale`).

Linux only (``/dev/shm``); elsewhere the pipeline keeps every payload on ZeroMQ.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, Final

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_POOL_BYTES",
    "DEFAULT_THRESHOLD",
    "EXPIRED",
    "HEADER_BYTES",
    "ShmError",
    "ShmPool",
    "ShmReader",
    "available",
    "configure_reader",
    "link_prefix",
    "pipeline_prefix",
    "read_array",
    "segments",
    "stage_prefix",
    "sweep_stale",
    "unlink_prefix",
    "upstream_gone",
]

logger = logging.getLogger("enginecore.stage")

SHM_DIR: Final = "/dev/shm"
HEADER_BYTES: Final = 64
"""The header at the start of every slot: eight int64 fields (module docstring)."""

DEFAULT_THRESHOLD: Final = 1 << 20
"""Arrays of at least this many bytes go through shared memory (1 MiB)."""

DEFAULT_POOL_BYTES: Final = 256 << 20
"""The most bytes of slots a producing stage keeps (256 MiB)."""

DEFAULT_LEASE: Final = 10.0
"""Seconds a payload's lease lasts without renewal."""

EXPIRED: Final = "SharedMemoryLeaseExpired"
"""The name the error for a payload whose lease expired starts with."""

_MAGIC: Final = 0x314D485343450001  # "ECSHM1", version 1
# The int64 fields of the header.
_H_MAGIC: Final = 0
_H_GEN: Final = 1  # the generation of the payload in the slot (producer)
_H_LEASE_UNTIL: Final = 2  # monotonic_ns deadline of the lease (producer, consumer renews)
_H_RELEASED: Final = 3  # the generation the consumer released (consumer)
_H_RETIRED: Final = 4  # 1: never written again, unlinked (producer)
_H_LEASE_NS: Final = 5  # the lease's length (producer)
_H_CAPACITY: Final = 6  # bytes after the header (producer)

_ROUND: Final = 1 << 20  # slot capacities are multiples of this


class ShmError(Exception):
    """A shared-memory payload cannot be taken (its message says why)."""


def available() -> bool:
    """Whether this host has ``/dev/shm`` (Linux)."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR)


def pipeline_prefix() -> str:
    """A prefix for the segments of a new pipeline: unique on the host. First, the
    segments of pipelines none of whose producing stages lives any more are unlinked
    (:func:`sweep_stale`): those of a pipeline killed with its stages."""
    sweep_stale()
    return f"enginecore-{os.getpid()}-{secrets.token_hex(4)}-"


# -- who may sweep: a lock file per pipeline -------------------------------------------------
#
# A stage unlinks its slots when it exits, and the parent those of a stage it saw die; but a
# producing stage killed together with its parent (SIGKILL of the process group, the OOM
# killer) leaves nobody to. So every process that creates slots holds a shared flock(2) on
# its pipeline's lock file, ``/dev/shm/.<pipeline prefix>lock``, from before it creates the
# first until it has unlinked its own (ShmPool.close). The kernel drops the lock of a
# process that dies, however it dies. A lock file that anyone can lock exclusively thus
# belongs to a pipeline none of whose producers lives: every segment of that pipeline is
# garbage, and whoever finds it so (the next launch on the host, or the last producer of the
# pipeline as it closes) unlinks them and the lock file. Never a live pipeline's: a lock is
# the kernel's, across processes and pid namespaces that share /dev/shm, unlike a pid. A
# pool that cannot hold the lock creates no slot (its arrays go on ZeroMQ); segments with no
# lock file at all (an older build's) are never touched.

_PIPELINE: Final = re.compile(r"enginecore-[0-9]+-[0-9a-f]+-")
_LOCK_SUFFIX: Final = "lock"


def _lock_name(pipeline: str) -> str:
    return f".{pipeline}{_LOCK_SUFFIX}"


def _pipeline_of(prefix: str) -> str | None:
    """The pipeline prefix that *prefix* (a stage's or a link's) starts with, or ``None``."""
    match = _PIPELINE.match(prefix)
    return match.group(0) if match else None


def _same_file(fd: int, path: str) -> bool:
    """Whether *path* still names the file open at *fd* (not unlinked, not replaced)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _hold(pipeline: str) -> int:
    """A file descriptor holding a shared lock on *pipeline*'s lock file (made if need be);
    ``OSError`` if it cannot be had."""
    path = os.path.join(SHM_DIR, _lock_name(pipeline))
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # a sweeper unlinked it meanwhile: lock the new one
    raise OSError(f"cannot lock {path}")


def _sweep(pipeline: str, fd: int) -> list[str]:
    """*fd* is *pipeline*'s lock file: if no producer holds it, unlink the pipeline's
    segments and the lock file; the segments unlinked. Closes *fd*."""
    path = os.path.join(SHM_DIR, _lock_name(pipeline))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # a producer of the pipeline lives
        if not _same_file(fd, path):
            return []  # swept by another meanwhile
        gone = _unlink(segments(pipeline))
        with contextlib.suppress(OSError):
            os.unlink(path)  # last: a producer that waits for the lock then makes another
        return gone
    finally:
        os.close(fd)


def sweep_stale(prefix: str = "enginecore-") -> list[str]:
    """Unlink the segments (and the lock files) of every pipeline whose prefix starts with
    *prefix* and none of whose producing stages lives; the segments unlinked."""
    gone: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return gone
    for name in names:
        if not name.startswith("." + prefix) or not name.endswith(_LOCK_SUFFIX):
            continue
        pipeline = _pipeline_of(name[1 : -len(_LOCK_SUFFIX)])
        if pipeline is None or _lock_name(pipeline) != name:
            continue
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except OSError:
            continue  # gone, or another user's
        gone += _sweep(pipeline, fd)
    return gone


def stage_prefix(prefix: str, index: int) -> str:
    """The prefix of the segments of stage *index* of the pipeline *prefix*."""
    return f"{prefix}{index}-"


def link_prefix(prefix: str, index: int, consumer: int | str, producer: int | str) -> str:
    """The prefix of the segments that replica *producer* of stage *index* keeps for
    replica *consumer* of the next stage, on an edge into or out of a replica pool (or a
    stage that restarts): one pool of slots per link, named consumer first, so that the
    consumer's reader takes ``stage_prefix(prefix, index) + f"{consumer}-"`` and a dead
    consumer's slots are one prefix. Either may be a :func:`._edge.slot_token` (``"1.2"``:
    replica 1, started a third time), so that a restarted process's names never collide
    with its dead predecessor's."""
    return f"{prefix}{index}-{consumer}-{producer}-"


def _producer_token(token: str) -> bool:
    """Whether *token* names a producer in a link's slot name: ``<replica>`` or
    ``<replica>.<generation>`` (:func:`._edge.slot_token`)."""
    replica, _, generation = token.partition(".")
    return replica.isdigit() and (not generation or generation.isdigit())


def unlink_producer(prefix: str, producer: str) -> list[str]:
    """Unlink the per-link slots of *prefix* (a stage's, :func:`stage_prefix`) that the
    producer *producer* (a :func:`._edge.slot_token`) made, whatever their consumer: a
    dead process's own slots on an edge into or out of a replica pool."""
    return _unlink(
        name for name in segments(prefix) if _producer_of(name[len(prefix) :]) == producer
    )


def _producer_of(rest: str) -> str | None:
    """The producer token of a per-link slot's name after its stage prefix
    (``<consumer>-<producer>-<n>``), or ``None`` for another name."""
    parts = rest.split("-")
    return parts[1] if len(parts) == 3 else None


def segments(prefix: str) -> list[str]:
    """The names in ``/dev/shm`` that start with *prefix*."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with *prefix*; the names unlinked. A mapping
    that a live process still holds stays valid until it drops it. The lock files of the
    pipelines whose prefix starts with *prefix* go too, if no producer holds them."""
    gone = _unlink(segments(prefix))
    sweep_stale(prefix)
    return gone


def _unlink(names: Iterable[str]) -> list[str]:
    """Unlink each of *names* in ``/dev/shm``; those unlinked (one already gone is not)."""
    gone: list[str] = []
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        gone.append(name)
    return gone


def _header(mm: mmap.mmap) -> Any:
    import numpy as np

    return np.frombuffer(mm, np.int64, 8, 0)


class _Slot:
    __slots__ = ("capacity", "data", "gen", "header", "mm", "name")

    def __init__(self, name: str, mm: mmap.mmap, capacity: int) -> None:
        import numpy as np

        self.name = name
        self.mm = mm
        self.capacity = capacity
        self.header = _header(mm)
        self.data = np.frombuffer(mm, np.uint8, capacity, HEADER_BYTES)
        self.gen = 0


class ShmPool:
    """The producing stage's slots (module docstring). *prefix*: the stage's segment prefix
    (:func:`stage_prefix`); *threshold*: the smallest array it takes; *max_bytes*: the most
    bytes of slots it keeps; *lease*: seconds. One thread (the stage's loop)."""

    def __init__(self, prefix: str, *, threshold: int, max_bytes: int, lease: float) -> None:
        self.prefix = prefix
        self.threshold = threshold
        self._max_bytes = max_bytes
        self._lease_ns = max(1, int(lease * 1e9))
        self._slots: list[_Slot] = []
        self._total = 0  # bytes of slots
        self._seq = 0
        self._pending: list[tuple[_Slot, int]] = []  # written since the last commit
        self._pending_bytes = 0
        self.sent = 0
        self.sent_bytes = 0
        self.fallbacks = 0  # arrays that went on ZeroMQ for want of a slot
        self.retired = 0  # slots whose lease expired unreleased
        self.created = 0
        self.closed = False
        self._pipeline = _pipeline_of(prefix)
        self._lock: int | None = None  # the shared lock on the pipeline's lock file
        self._unlock: weakref.finalize[..., Any]

    def put(self, arr: Any) -> list[Any] | None:
        """Copy the C-contiguous array *arr* into a free slot and return the ext 4 data that
        names it, or ``None`` (below the threshold, or no slot free within the pool's
        bytes: it goes on ZeroMQ, counted in :attr:`fallbacks`)."""
        import numpy as np

        nbytes = int(arr.nbytes)
        if nbytes < self.threshold or self.closed:
            return None
        slot = self._acquire(nbytes)
        if slot is None:
            self.fallbacks += 1
            return None
        gen = slot.gen + 1
        slot.gen = gen
        header = slot.header
        header[_H_GEN] = gen  # first: a consumer that still read generation gen - 1 ...
        header[_H_LEASE_UNTIL] = time.monotonic_ns() + self._lease_ns
        np.copyto(slot.data[:nbytes], arr.reshape(-1).view(np.uint8))  # ... released it
        self._pending.append((slot, gen))
        self._pending_bytes += nbytes
        return [arr.dtype.str, list(arr.shape), slot.name, gen, HEADER_BYTES, nbytes]

    def commit(self) -> int:
        """The payloads written since the last call were sent: their bytes."""
        nbytes = self._pending_bytes
        self.sent += len(self._pending)
        self.sent_bytes += nbytes
        self._pending.clear()
        self._pending_bytes = 0
        return nbytes

    def abandon(self) -> None:
        """The payloads written since the last :meth:`commit` were not sent (their message
        failed to encode): their slots are free again."""
        for slot, gen in self._pending:
            slot.header[_H_RELEASED] = gen
        self._pending.clear()
        self._pending_bytes = 0

    def _acquire(self, nbytes: int) -> _Slot | None:
        now = time.monotonic_ns()
        best: _Slot | None = None
        free: list[_Slot] = []
        expired: list[_Slot] = []
        for slot in self._slots:
            header = slot.header
            if header[_H_RELEASED] != slot.gen:  # held by the consumer
                if header[_H_LEASE_UNTIL] < now:
                    expired.append(slot)
                continue
            free.append(slot)
            if slot.capacity >= nbytes and (best is None or slot.capacity < best.capacity):
                best = slot
        for slot in expired:
            self._retire(slot)
            self.retired += 1
        if best is not None:
            return best
        capacity = -(-nbytes // _ROUND) * _ROUND
        if self._total - sum(s.capacity for s in free) + capacity > self._max_bytes:
            return None  # no room even without every free slot: keep them for the next
        free.sort(key=lambda s: s.capacity)
        while self._total + capacity > self._max_bytes:
            if not free:
                return None
            self._retire(free.pop(0))  # a free slot too small: make room
        return self._create(capacity)

    def _create(self, capacity: int) -> _Slot | None:
        if self._lock is None and self._pipeline is not None:
            try:
                self._lock = _hold(self._pipeline)
            except OSError:
                return None  # unprotected, it could be swept: the payload goes on ZeroMQ
            # A pool dropped without close() does not keep its pipeline unsweepable. (Not
            # at exit, where the descriptor goes with the process, and close() may come
            # later, from an atexit callback of the stage's.)
            self._unlock = weakref.finalize(self, os.close, self._lock)
            self._unlock.atexit = False
        name = f"{self.prefix}{self._seq}"
        self._seq += 1
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            # Allocated now, not on first touch: a full /dev/shm is an error here (the
            # payload goes on ZeroMQ), not a SIGBUS when the payload is written.
            os.posix_fallocate(fd, 0, HEADER_BYTES + capacity)
            mm = mmap.mmap(fd, HEADER_BYTES + capacity)
        except OSError:
            os.close(fd)
            os.unlink(path)
            return None
        os.close(fd)
        slot = _Slot(name, mm, capacity)
        header = slot.header
        header[_H_LEASE_NS] = self._lease_ns
        header[_H_CAPACITY] = capacity
        header[_H_MAGIC] = _MAGIC
        self._slots.append(slot)
        self._total += capacity
        self.created += 1
        return slot

    def _retire(self, slot: _Slot) -> None:
        """Never write *slot* again: mark it, unlink it, forget it (a consumer that maps it
        keeps what it took)."""
        slot.header[_H_RETIRED] = 1
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, slot.name))
        self._slots.remove(slot)
        self._total -= slot.capacity

    def stats(self) -> dict[str, float]:
        """``shm_sent``, ``shm_sent_bytes``, ``shm_fallbacks``, ``shm_slots``,
        ``shm_slot_bytes``, ``shm_retired``."""
        return {
            "shm_sent": self.sent,
            "shm_sent_bytes": self.sent_bytes,
            "shm_fallbacks": self.fallbacks,
            "shm_slots": len(self._slots),
            "shm_slot_bytes": self._total,
            "shm_retired": self.retired,
        }

    def carry_counts(self, old: ShmPool) -> None:
        """Go on counting from *old*'s counters (``shm_sent``, ``shm_sent_bytes``,
        ``shm_fallbacks``, ``shm_retired``): this pool replaces it on a link to a next stage
        started again, and the stage's numbers count in all, as ``edge_sent`` does."""
        self.sent += old.sent
        self.sent_bytes += old.sent_bytes
        self.fallbacks += old.fallbacks
        self.retired += old.retired

    def close(self) -> None:
        """Unlink every slot and let go of its mapping: at exit, or when the next stage
        died (no slot it held can be released any more). Idempotent; :meth:`put` takes no
        array after it."""
        self.closed = True
        for slot in self._slots:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, slot.name))
        # The slots' numpy views are the only references to their mappings: dropping them
        # unmaps them, and the memory returns once the other side's mapping is gone too.
        self._slots.clear()
        self._pending.clear()
        self._pending_bytes = 0
        self._total = 0
        lock, self._lock = self._lock, None
        # (The descriptor is still ours unless the finalizer closed it: then never again.)
        if lock is not None and self._pipeline is not None and self._unlock.detach():
            # The last producer of the pipeline to close (the others died, killed with
            # the parent perhaps) unlinks what they left, and the lock file.
            _sweep(self._pipeline, lock)


class _Mapped:
    __slots__ = ("header", "mm")

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.header = _header(mm)


class ShmReader:
    """The consuming stage's side (module docstring): takes the payloads of segments whose
    name starts with *prefix* (the previous stage's), keeps each slot mapped for the next
    payload in it, and renews the lease of every array it handed out while that array lives,
    on a thread of its own. :meth:`array` is called by the input side's decoder."""

    def __init__(self, prefix: str, pooled: bool = False) -> None:
        self.prefix = prefix
        # An edge into or out of a replica pool: names are <prefix><producer>-<n>, and a
        # producer that died is refused (gone_producers) while the others are still taken.
        self.pooled = pooled
        self.gone_producers: set[str] = set()
        self._maps: dict[str, _Mapped] = {}
        self._maps_lock = threading.Lock()
        # Leases held: a key per array handed out -> (header, generation, lease_ns). The
        # array's finalizer removes it (from whatever thread drops the last reference).
        self._held: dict[int, tuple[Any, int, int]] = {}
        self._keys = iter(range(1 << 62))
        self._period = DEFAULT_LEASE / 4
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        # Set when an array is handed out: the keeper sleeps on it while it holds nothing,
        # so an idle stage's keeper never wakes, whatever the lease (a tiny one would have
        # it wake thousands of times a second for nothing).
        self._busy = threading.Event()
        self.rounds = 0  # the keeper's renewal rounds (tests: none while nothing is held)
        self.taken = 0
        self.expired = 0  # refused: lease expired, slot retired, gone or rewritten
        self.gone = False  # the previous stage died (gone()): no more mappings

    def array(self, head: object) -> Any:
        """The read-only numpy array that the ext 4 data *head* names, on the slot's memory,
        its lease held while it lives; :class:`ShmError` if it cannot be taken (its lease
        expired, the slot is gone or retired, the data is invalid)."""
        if (
            type(head) is not list
            or len(head) < 6
            or type(head[0]) is not str
            or type(head[1]) is not list
            or not all(type(n) is int and n >= 0 for n in head[1])
            or type(head[2]) is not str
            or not all(type(v) is int and v >= 0 for v in head[3:6])
        ):
            raise ShmError(
                f"invalid shared-memory array {head!r:.100}; expected "
                f"[dtype, shape, name, generation, offset, nbytes]"
            )
        dtype_str, shape_list, name, gen, offset, nbytes = head[:6]
        if not self._theirs(name):
            raise ShmError(f"shared-memory segment {name!r} is not the previous stage's")
        try:
            import numpy as np
        except ImportError:
            raise ShmError("an array arrived, but numpy is not installed in this process") from None
        try:
            dtype = np.dtype(dtype_str)
        except Exception as exc:
            raise ShmError(f"invalid array dtype {dtype_str!r}: {exc}") from None
        shape = tuple(shape_list)
        count = 1
        for n in shape:
            count *= n
        if dtype.kind not in "biufcmMSU" or dtype.fields is not None:
            raise ShmError(f"array dtype {dtype_str!r} is not allowed on the wire")
        if count * dtype.itemsize != nbytes:
            raise ShmError(
                f"array of shape {shape} and dtype {dtype.str} needs "
                f"{count * dtype.itemsize} bytes, got {nbytes}"
            )
        mapped = self._mapped(name, gen)
        header = mapped.header
        if offset < HEADER_BYTES or offset + nbytes > len(mapped.mm):
            raise ShmError(f"shared-memory array outside its segment {name!r}")
        now = time.monotonic_ns()
        until = int(header[_H_LEASE_UNTIL])
        self._check(name, header, gen, until, now)
        lease_ns = int(header[_H_LEASE_NS])
        header[_H_LEASE_UNTIL] = now + lease_ns
        # Again: the producer may have retired the slot between the check and the renewal
        # (it never rewrites it, but the lease is gone).
        self._check(name, header, gen, until, now)
        try:
            arr = np.frombuffer(mapped.mm, np.uint8, nbytes, offset)
        except ValueError as exc:
            raise ShmError(f"invalid shared-memory array in {name!r}: {exc}") from None
        arr.flags.writeable = False
        key = next(self._keys)
        self._held[key] = (header, gen, lease_ns)
        # Every view of it keeps `arr` (numpy's base) alive: the lease ends with the last.
        weakref.finalize(arr, self._release, key, header, gen)
        self.taken += 1
        self._start_keeper(lease_ns)
        self._busy.set()
        try:
            return arr.view(dtype).reshape(shape)
        except ValueError as exc:  # a zero itemsize, more than 64 dimensions, ...
            raise ShmError(f"invalid array of shape {shape}, dtype {dtype.str}: {exc}") from None

    def _theirs(self, name: str) -> bool:
        """Whether *name* is a slot of the previous stage's, kept for this one."""
        if not name.startswith(self.prefix):
            return False
        rest = name[len(self.prefix) :]
        if not self.pooled:
            return rest.isdigit()
        producer, _, n = rest.partition("-")
        return _producer_token(producer) and n.isdigit()

    def _check(self, name: str, header: Any, gen: int, until: int, now: int) -> None:
        if header[_H_RETIRED]:
            self.expired += 1
            raise ShmError(
                f"{EXPIRED}: the lease on shared-memory segment {name!r} (generation {gen}) "
                f"expired; the producer retired the segment"
            )
        if header[_H_GEN] != gen:
            self.expired += 1
            raise ShmError(
                f"{EXPIRED}: shared-memory segment {name!r} holds generation "
                f"{int(header[_H_GEN])}, not {gen}"
            )
        if until < now:
            self.expired += 1
            raise ShmError(
                f"{EXPIRED}: the lease on shared-memory segment {name!r} (generation {gen}) "
                f"expired {(now - until) / 1e9:.3f} s before the stage read it"
            )

    def _mapped(self, name: str, gen: int) -> _Mapped:
        with self._maps_lock:
            if self.gone or (
                self.gone_producers
                and name[len(self.prefix) :].split("-", maxsplit=1)[0] in self.gone_producers
            ):
                self.expired += 1
                raise ShmError(
                    f"{EXPIRED}: shared-memory segment {name!r} (generation {gen}) is gone: "
                    f"its stage died"
                )
            mapped = self._maps.get(name)
            if mapped is not None and not mapped.header[_H_RETIRED]:
                return mapped
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            except OSError as exc:
                self.expired += 1
                raise ShmError(
                    f"{EXPIRED}: shared-memory segment {name!r} (generation {gen}) is gone: "
                    f"its lease expired, or its stage exited ({exc.strerror})"
                ) from None
            try:
                size = os.fstat(fd).st_size
                if size < HEADER_BYTES:
                    raise ShmError(f"shared-memory segment {name!r} is not a slot")
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            mapped = _Mapped(mm)
            if mapped.header[_H_MAGIC] != _MAGIC:
                raise ShmError(f"shared-memory segment {name!r} is not a slot")
            # A new slot: the producer may have retired others meanwhile (a refused payload
            # is never released, so its slot is retired): let go of their mappings now,
            # not only in the keeper's rounds, which run only while an array is held.
            self._forget_retired()
            self._maps[name] = mapped
            return mapped

    def _forget_retired(self) -> None:
        """Drop the mappings of retired slots (under ``_maps_lock``): never written again,
        their memory goes when the last array on it does."""
        for name in [n for n, m in self._maps.items() if m.header[_H_RETIRED]]:
            del self._maps[name]

    def _release(self, key: int, header: Any, gen: int) -> None:
        """The last reference to an array is gone: release its generation (any thread)."""
        self._held.pop(key, None)
        if header[_H_GEN] == gen:
            header[_H_RELEASED] = gen

    def _start_keeper(self, lease_ns: int) -> None:
        self._period = min(self._period, lease_ns / 4e9)
        if self._keeper is None:
            self._keeper = threading.Thread(
                target=self._keep, name="enginecore-shm-lease", daemon=True
            )
            self._keeper.start()

    def _keep(self) -> None:
        """Renew every lease held, a quarter lease apart, while any is held; forget
        retired slots. With nothing held, sleep until an array is handed out."""
        while not self._stop.wait(self._period):
            if not self._held:
                self._busy.clear()
                if not self._held:  # (an array handed out after the clear sets it again)
                    self._busy.wait()
                    continue  # renew a full period after it was taken, as below
            self.rounds += 1
            try:
                self.renew()
            except Exception:  # a bug: say so, and keep renewing the others
                logger.exception("enginecore: renewing shared-memory leases failed")

    def renew(self) -> None:
        """Renew every lease held that has not expired; drop the mappings of retired slots
        (their memory goes when the last array on it does)."""
        now = time.monotonic_ns()
        for header, gen, lease_ns in list(self._held.values()):
            if header[_H_GEN] == gen and header[_H_LEASE_UNTIL] >= now:
                header[_H_LEASE_UNTIL] = now + lease_ns
        with self._maps_lock:
            self._forget_retired()

    def upstream_gone(self, producer: int | str | None = None) -> None:
        """The previous stage died: let go of the mappings of its slots, and map none
        again. An array still alive keeps its slot's memory (numpy holds the mapping)
        until it dies; the slots' names are unlinked by the parent. *producer* (a pooled
        edge): only that replica of the previous stage died; the others' slots are still
        taken (an ``int``, or its :func:`._edge.slot_token`: a restarted producer's new
        slots are taken again)."""
        with self._maps_lock:
            if producer is None or not self.pooled:
                self.gone = True
                self._maps.clear()
                return
            key = str(producer)
            self.gone_producers.add(key)
            mine = self.prefix + key + "-"
            for name in [n for n in self._maps if n.startswith(mine)]:
                del self._maps[name]

    @property
    def mapped(self) -> int:
        """Slots of the previous stage mapped for their next payload."""
        return len(self._maps)

    @property
    def held(self) -> int:
        """Arrays handed out and still alive."""
        return len(self._held)

    def close(self) -> None:
        """Stop renewing (at exit)."""
        self._stop.set()
        self._busy.set()


_reader: ShmReader | None = None


def configure_reader(prefix: str, pooled: bool = False) -> ShmReader:
    """This process takes shared-memory payloads from segments whose names start with
    *prefix* (a pipeline's stage whose previous stage may send them): its reader.
    *pooled*: an edge into or out of a replica pool (names ``<prefix><producer>-<n>``)."""
    global _reader
    _reader = ShmReader(prefix, pooled)
    return _reader


def upstream_gone(producer: int | str | None = None) -> None:
    """The input side heard that the previous stage (its replica *producer*, of a pool)
    died: this process's reader, if it has one, lets go of its slots
    (:meth:`ShmReader.upstream_gone`)."""
    if _reader is not None:
        _reader.upstream_gone(producer)


def read_array(head: object) -> Any:
    """The input side's decoder's hook for ext 4 (:meth:`ShmReader.array`)."""
    reader = _reader
    if reader is None:
        raise ShmError("a shared-memory array arrived, but this stage takes none")
    return reader.array(head)
