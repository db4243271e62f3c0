"""Payload codec: MessagePack bodies plus out-of-band buffers, arrays without copies.

``docs/wire.md`` section 2 is the normative description. A ZMQ message is ``[body,
*buffers]``: the body is one MessagePack value; a large array or buffer inside it is an
extension value that names a buffer by index, and the buffer travels as its own ZMQ frame,
sent with ``copy=False`` and received as a view on the frame.

Three extension types between a client and a stage, a fourth between two stages of a
pipeline, nothing else (the timestamp extension included):

* ext 1, an n-dimensional array: ``[dtype, shape, data]``, ``data`` inline ``bin`` or a
  buffer index; arrives as a read-only ``numpy.ndarray``.
* ext 2, ``bytes`` out of band: a buffer index; arrives as ``bytes``.
* ext 3, a ``memoryview`` / ``bytearray``: inline ``bin`` or a buffer index; arrives as a
  read-only ``memoryview``.
* ext 4, an n-dimensional array in shared memory (``[dtype, shape, name, generation,
  offset, nbytes]``): only between a pipeline's stages on one host (:mod:`._shm`); an
  :class:`Encoder` with a pool sends it, a :class:`Decoder` with ``shm=True`` takes it.

numpy is optional: it is imported only when a value is an array (sending) or an array
arrives (receiving). Without it, an arriving array is refused with a clear error.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence
from typing import Any, Final, cast

import msgspec
import zmq

from . import _shm
from ._shm import ShmPool
from ._statistics import LoadReport

__all__ = [
    "OOB_THRESHOLD",
    "Decoder",
    "Encoder",
    "Invalid",
    "check_encodable",
    "check_received",
    "encode_plain",
    "only_types",
    "prepare",
    "recover_head",
    "send_parts",
]

OOB_THRESHOLD: Final = 1024
"""Arrays and buffers of at least this many bytes travel out of band (their own frame)."""

EXT_NDARRAY: Final = 1
EXT_BYTES: Final = 2
EXT_BUFFER: Final = 3
EXT_SHM_ARRAY: Final = 4

# Array kinds that can cross the wire: bool, signed/unsigned int, float, complex,
# timedelta64, datetime64, bytes, str. Not object (O) nor structured/void (V).
_ARRAY_KINDS: Final = frozenset("biufcmMSU")

_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1
_MAX_DEPTH: Final = 64

# Values that are valid as they are (by exact type; bytes only below the threshold, which
# prepare() checks separately).
_SCALARS: Final = frozenset({type(None), bool, float, str})
FLAT_TYPES: Final = frozenset({type(None), bool, int, float, str})
"""Exact types of a payload that needs no conversion beyond msgspec's own int range check."""

ENCODE_ERRORS: Final = (TypeError, ValueError, OverflowError, msgspec.EncodeError)
"""What msgspec raises for a value it cannot encode (a lone surrogate: UnicodeEncodeError,
an int out of range: OverflowError)."""


def only_types(items: list[Any], allowed: frozenset[Any]) -> bool:
    """Whether the exact type of every item of *items* is in *allowed* (no subclasses: msgspec
    refuses a subclass of ``str``). In C; ~7 ns an item when every item has the type of the
    first, the common case (one count over the types, which compares by identity), against
    ~12 ns for ``set(map(type, items)) <= allowed``, which mixed types still take. Both
    sides use it: the client on ``add_many()`` pairs, the stage on every step's columns
    (three of these per step, on 2,000 outputs in the burst benchmark)."""
    types = list(map(type, items))
    if not types:
        return True
    first = types[0]
    if first in allowed and types.count(first) == len(types):
        return True
    return set(types) <= allowed


def encode_plain(msg: object, what: str) -> bytes:
    """msgpack of a value of plain wire types (no arrays, no buffers), as one ``bytes``.
    Raises :class:`TypeError` if msgspec refuses it (a ``str`` with a lone surrogate is not
    UTF-8, an ``int`` is out of range, an array needs an :class:`Encoder`)."""
    try:
        return msgspec.msgpack.encode(msg)
    except ENCODE_ERRORS as exc:
        raise TypeError(f"{what} cannot be encoded: {exc}") from exc


class _Wrapped:
    """A buffer that prepare() marked for the encoder: ``kind`` is ``EXT_BYTES`` or
    ``EXT_BUFFER``, ``view`` a contiguous byte view of it."""

    __slots__ = ("kind", "view")

    def __init__(self, kind: int, view: memoryview) -> None:
        self.kind = kind
        self.view = view


class Invalid:
    """Left by a non-strict :class:`Decoder` where an extension value cannot be accepted,
    so that :func:`check_received` can report it, scoped to the request or call it is in."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Invalid({self.reason!r})"


def _numpy() -> Any:
    """The numpy module if it has been imported in this process, else ``None``: a value can
    only be an array if numpy is already loaded, so the check costs a dict lookup. A numpy
    that another thread is still importing (in ``sys.modules``, half initialized) is
    ``None`` too: a decoder then imports it, which waits for that import to finish."""
    np = sys.modules.get("numpy")
    if np is not None and getattr(getattr(np, "__spec__", None), "_initializing", False):
        return None
    return np


# -- sending --------------------------------------------------------------------------------


def check_encodable(value: object, what: str = "value") -> None:
    """Raise :class:`TypeError` unless *value* can cross the wire.

    Allowed: ``None``, ``bool``, ``int`` (-2**63 .. 2**64-1), ``float``, ``str``, ``bytes``,
    ``bytearray``, ``memoryview``, ``numpy.ndarray`` (dtype kinds ``b i u f c m M S U``, any
    shape), numpy scalars (sent as their Python value), and ``list`` / ``tuple`` / ``dict``
    of those (dict keys: ``str``, ``int``, ``bytes``), nested at most 64 deep. Tuples arrive
    as lists. Anything else (a subclass of an allowed type, a dataclass, a set, an object
    array, ...) is refused, because msgpack would either fail or silently change it. The
    message names where the offending value sits. Never blocks; thread-safe.
    """
    if type(value) not in _SCALARS:
        prepare(value, what)


def prepare(value: object, what: str = "value") -> object:
    """Check *value* like :func:`check_encodable` and return it ready for :class:`Encoder`.

    Returns *value* itself when nothing needs converting (the common case). Otherwise a
    copy in which numpy scalars are Python values, arrays are C-contiguous, and buffers to
    send out of band (or as ext 3) are wrapped for the encoder; containers are copied only
    along the path to a converted value. Never blocks; thread-safe.
    """
    t = type(value)
    if t in _SCALARS:
        return value
    return _prepare(value, what, 0)


def _prepare(value: object, path: str, depth: int) -> object:
    t = type(value)
    if t in _SCALARS:
        return value
    if t is int:
        if not _INT_MIN <= cast(int, value) <= _INT_MAX:
            raise TypeError(f"{path}: int {value} is outside the msgpack range -2**63..2**64-1")
        return value
    if t is bytes:
        b = cast(bytes, value)
        if len(b) < OOB_THRESHOLD:
            return value
        return _Wrapped(EXT_BYTES, memoryview(b))
    if (t is list or t is tuple or t is dict) and depth >= _MAX_DEPTH:
        raise TypeError(f"{path}: nested deeper than {_MAX_DEPTH} levels")
    if t is list or t is tuple:
        seq = cast("Sequence[object]", value)
        out: list[object] | None = None
        for i, item in enumerate(seq):
            if type(item) in _SCALARS:
                continue
            new = _prepare(item, f"{path}[{i}]", depth + 1)
            if new is not item:
                if out is None:
                    out = list(seq)
                out[i] = new
        if out is not None:
            return out
        return value
    if t is dict:
        d = cast("dict[object, object]", value)
        changed: dict[object, object] | None = None
        for key, item in d.items():
            tk = type(key)
            if tk is int:
                if not _INT_MIN <= cast(int, key) <= _INT_MAX:
                    raise TypeError(
                        f"{path}: dict key {key} is outside the msgpack range -2**63..2**64-1"
                    )
            elif tk is not str and tk is not bytes:
                raise TypeError(
                    f"{path}: dict key {key!r} of type {tk.__name__} is not allowed "
                    f"on the wire (use str, int or bytes keys)"
                )
            if type(item) in _SCALARS:
                continue
            new = _prepare(item, f"{path}[{key!r}]", depth + 1)
            if new is not item:
                if changed is None:
                    changed = dict(d)
                changed[key] = new
        if changed is not None:
            return changed
        return value
    if t is memoryview or t is bytearray:
        return _wrap_buffer(cast("memoryview | bytearray", value), path)
    np = _numpy()
    if np is not None:
        if t is np.ndarray:
            return _prepare_array(np, value, path)
        if isinstance(value, np.generic):
            # datetime64/timedelta64: .item() would give an int for ns units, None for NaT;
            # void: a tuple for a structured scalar: a silently different value.
            if not isinstance(value, (np.datetime64, np.timedelta64, np.void)):
                item = cast(Any, value).item()
                # Not the numpy scalar back (longdouble) nor a complex: name the numpy type.
                if type(item) is not t and type(item) is not complex:
                    return _prepare(item, path, depth)
            raise TypeError(
                f"{path}: numpy scalar of type {t.__name__} is not wire-encodable "
                f"(send it inside an array, or convert it yourself)"
            )
        if isinstance(value, np.ndarray):  # np.memmap (np.load(mmap_mode=...)), masked, ...
            raise TypeError(
                f"{path}: {t.__module__}.{t.__qualname__} is not wire-encodable: a subclass of "
                f"numpy.ndarray; send a plain array, numpy.asarray(value) (what the subclass "
                f"adds, a mask for one, does not cross the wire)"
            )
    raise TypeError(
        f"{path}: {t.__module__}.{t.__qualname__} is not wire-encodable; the wire carries "
        f"None, bool, int, float, str, bytes, bytearray, memoryview, numpy arrays and "
        f"scalars, and list/tuple/dict of them (see docs/wire.md)"
    )


def _wrap_buffer(value: memoryview | bytearray, path: str) -> _Wrapped:
    try:
        view = memoryview(value)
    except ValueError as exc:  # a released memoryview
        raise TypeError(f"{path}: {exc}") from None
    if not view.c_contiguous:
        raise TypeError(f"{path}: a memoryview must be C-contiguous to cross the wire")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return _Wrapped(EXT_BUFFER, view)


def _prepare_array(np: Any, arr: Any, path: str) -> Any:
    if arr.dtype.kind not in _ARRAY_KINDS or arr.dtype.fields is not None:
        raise TypeError(
            f"{path}: numpy array of dtype {arr.dtype} cannot cross the wire (allowed kinds: "
            f"bool, int, uint, float, complex, timedelta64, datetime64, bytes, str)"
        )
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


class Encoder:
    """Encodes a prepared value into ``[body, *buffers]``. One per thread: it keeps a
    buffer list and msgspec's encoder keeps an internal buffer. With *shm* (a pipeline
    stage's :class:`~._shm.ShmPool`), an array of at least its threshold is copied into
    shared memory and sent as ext 4, when the pool has a slot for it."""

    __slots__ = ("_bufs", "_encode", "_header", "_shm", "_shm_threshold")

    def __init__(self, shm: ShmPool | None = None) -> None:
        self._shm = shm
        self._shm_threshold = shm.threshold if shm is not None else 1 << 62
        self._bufs: list[Any] = []
        self._encode = msgspec.msgpack.Encoder(enc_hook=self._hook).encode
        self._header = msgspec.msgpack.Encoder().encode

    def encode(self, obj: object) -> list[Any]:
        """``[body, *buffers]`` for *obj* (a prepared value, or an event/message built from
        prepared payloads). Buffers are zero-copy views: send them with ``copy=False`` and do
        not modify the arrays until sent. Raises what msgspec raises for a value it refuses
        (``OverflowError`` for an out-of-range int, ``TypeError``, ``UnicodeEncodeError``)."""
        bufs = self._bufs
        try:
            body = self._encode(obj)
        except BaseException:
            bufs.clear()
            raise
        if not bufs:
            return [body]
        parts: list[Any] = [body, *bufs]
        bufs.clear()
        return parts

    def _hook(self, obj: Any) -> Any:
        if type(obj) is LoadReport:  # aged as it is encoded (._statistics)
            return obj.wire()
        if type(obj) is _Wrapped:
            view = obj.view
            if obj.kind == EXT_BUFFER and view.nbytes < OOB_THRESHOLD:
                return msgspec.msgpack.Ext(EXT_BUFFER, self._header(view))
            self._bufs.append(view)
            return msgspec.msgpack.Ext(obj.kind, self._header(len(self._bufs) - 1))
        np = _numpy()
        if np is not None:
            if type(obj) is np.ndarray:
                return self._array(obj)
            if isinstance(obj, np.generic):  # an unprepared numpy scalar: be forgiving
                return obj.item()
        raise TypeError(f"{type(obj).__module__}.{type(obj).__qualname__} is not wire-encodable")

    def _array(self, arr: Any) -> msgspec.msgpack.Ext:
        dtype = arr.dtype
        if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None:
            raise TypeError(f"numpy array of dtype {dtype} cannot cross the wire")
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        shape = list(arr.shape)
        if arr.nbytes < OOB_THRESHOLD:
            return msgspec.msgpack.Ext(EXT_NDARRAY, self._header((dtype.str, shape, arr.tobytes())))
        if arr.nbytes >= self._shm_threshold:
            assert self._shm is not None
            head = self._shm.put(arr)
            if head is not None:
                return msgspec.msgpack.Ext(EXT_SHM_ARRAY, self._header(head))
        # A flat byte view: works for every allowed kind (memoryview refuses M/m) and 0-d.
        self._bufs.append(memoryview(arr.reshape(-1).view("u1")))
        return msgspec.msgpack.Ext(
            EXT_NDARRAY, self._header((dtype.str, shape, len(self._bufs) - 1))
        )


# -- receiving ------------------------------------------------------------------------------

_header_decode: Final = msgspec.msgpack.Decoder().decode


class Decoder:
    """Decodes ``[body, *buffers]`` (zmq frames, bytes or memoryviews) into Python values.

    One per thread (the buffers of the message being decoded are an attribute). With
    *strict*, an extension value that cannot be accepted fails the whole decode with
    :class:`msgspec.DecodeError`; without, it becomes an :class:`Invalid` marker that
    :func:`check_received` reports, so the stage can scope the error to one request. With
    *shm* (a stage's input side), an ext 4 array in shared memory is taken
    (:func:`._shm.read_array`) and :attr:`shm_bytes` says how many bytes of them the last
    message held (those it refused too: the sender counted them against its window);
    without, ext 4 is refused like any unknown extension.
    """

    __slots__ = ("_bufs", "_decode", "_shm", "_strict", "shm_bytes")

    def __init__(self, type: Any = Any, *, strict: bool, shm: bool = False) -> None:
        self._strict = strict
        self._shm = shm
        self.shm_bytes = 0
        self._bufs: Sequence[Any] = ()
        self._decode = msgspec.msgpack.Decoder(type, ext_hook=self._hook).decode

    def decode(self, parts: Sequence[Any]) -> Any:
        """Decode a message. *parts* are ``zmq.Frame`` objects (their ``buffer`` is used, so
        arrays are views on the frames), ``bytes`` or ``memoryview`` s. Raises
        :class:`msgspec.DecodeError` (also for a strict decoder's invalid extension)."""
        # msgspec reads the body through the buffer protocol, which a zmq.Frame has: no
        # memoryview to build (Frame.buffer costs ~0.2 µs).
        body = parts[0]
        self.shm_bytes = 0
        if len(parts) == 1:
            return self._decode(body)
        self._bufs = parts
        try:
            return self._decode(body)
        finally:
            self._bufs = ()

    def _hook(self, code: int, data: memoryview) -> Any:
        try:
            return self._ext(code, data)
        except _ExtError as exc:
            if self._strict:
                raise msgspec.DecodeError(str(exc)) from None
            return Invalid(str(exc))

    def _buffer(self, index: object) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self._bufs) - 1:
            # What it holds, briefly: the message goes back to the client (an error event).
            what = (
                f"msgpack extension {index.code}"
                if type(index) is msgspec.msgpack.Ext
                else f"{index!r:.100}"
            )
            raise _ExtError(f"reference to out-of-band buffer {what}, which is not there")
        return memoryview(_view(self._bufs[index + 1]))

    def _ext(self, code: int, data: memoryview) -> Any:
        try:
            head = _header_decode(data)
        except msgspec.DecodeError as exc:
            raise _ExtError(f"invalid data in msgpack extension {code}: {exc}") from None
        if code == EXT_NDARRAY:
            return self._array(head)
        if code == EXT_BYTES:
            return bytes(self._buffer(head))
        if code == EXT_BUFFER:
            if type(head) is bytes:
                return memoryview(head)
            return self._buffer(head).toreadonly()
        if code == EXT_SHM_ARRAY and self._shm:
            if type(head) is list and len(head) >= 6 and type(head[5]) is int:
                self.shm_bytes += head[5]  # the sender counted it: taken or refused
            try:
                return _shm.read_array(head)
            except _shm.ShmError as exc:
                raise _ExtError(str(exc)) from None
        raise _ExtError(f"msgpack extension type {code} is not allowed on the wire")

    def _array(self, head: object) -> Any:
        if (
            type(head) is not list
            or len(head) < 3
            or type(head[0]) is not str
            or type(head[1]) is not list
            or not all(type(n) is int and n >= 0 for n in head[1])
        ):
            raise _ExtError(f"invalid array header {head!r:.100}; expected [dtype, shape, data]")
        np = _numpy()
        if np is None:
            try:
                import numpy as np
            except ImportError:
                raise _ExtError(
                    "an array arrived, but numpy is not installed in this process"
                ) from None
        try:
            dtype = np.dtype(head[0])
        except Exception as exc:  # TypeError, SyntaxError ("1)"), a warning made an error
            raise _ExtError(f"invalid array dtype {head[0]!r:.100}: {exc!s:.200}") from None
        if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None:
            raise _ExtError(f"array dtype {head[0]!r:.100} is not allowed on the wire")
        data = head[2]
        buf = memoryview(data) if type(data) is bytes else self._buffer(data)
        shape = tuple(head[1])
        count = 1
        for n in shape:
            count *= n
        if buf.nbytes != count * dtype.itemsize:
            raise _ExtError(
                f"array of shape {shape} and dtype {dtype.str} needs "
                f"{count * dtype.itemsize} bytes, got {buf.nbytes}"
            )
        try:
            arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        except ValueError as exc:  # a zero itemsize, more than 64 dimensions, ...
            raise _ExtError(f"invalid array of shape {shape}, dtype {dtype.str}: {exc}") from None
        if arr.flags.writeable:  # inline data is a bytes object: already read-only
            arr.flags.writeable = False
        return arr


class _ExtError(Exception):
    pass


def _view(part: Any) -> Any:
    """A bytes-like view of one message part without copying it."""
    buffer = getattr(part, "buffer", None)  # zmq.Frame
    return part if buffer is None else buffer


def check_received(value: object, what: str = "value") -> None:
    """Raise :class:`ValueError` unless a decoded *value* is a valid wire value: no
    :class:`Invalid` marker, no ``datetime`` (the timestamp extension), dict keys only
    ``str``, ``int`` or ``bytes``, and lists and dicts nested at most 64 deep (as
    :func:`prepare` allows when sending). Scalars return at once. Thread-safe."""
    if type(value) in _RECEIVED_SCALARS:
        return
    _check_received(value, what, 0)


_RECEIVED_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})


def _check_received(value: object, path: str, depth: int) -> None:
    t = type(value)
    if t in _RECEIVED_SCALARS or t is memoryview:
        return
    if depth >= _MAX_DEPTH and (t is list or t is dict):
        raise ValueError(f"{path}: nested deeper than {_MAX_DEPTH} levels")
    if t is list:
        for i, item in enumerate(cast("list[object]", value)):
            if type(item) not in _RECEIVED_SCALARS:
                _check_received(item, f"{path}[{i}]", depth + 1)
        return
    if t is dict:
        for key, item in cast("dict[object, object]", value).items():
            tk = type(key)
            if tk is not str and tk is not int and tk is not bytes:
                raise ValueError(
                    f"{path}: map key {key!r} of type {_wire_type_name(key)} is not allowed "
                    f"(keys must be str, int or bin)"
                )
            if type(item) not in _RECEIVED_SCALARS:
                _check_received(item, f"{path}[{key!r}]", depth + 1)
        return
    if t is Invalid:
        raise ValueError(f"{path}: {cast(Invalid, value).reason}")
    if t is datetime.datetime:
        raise ValueError(
            f"{path}: msgpack extension type -1 (timestamp) is not allowed on the wire"
        )
    np = _numpy()
    if np is not None and t is np.ndarray:
        return
    raise ValueError(f"{path}: a value of type {t.__name__} is not allowed on the wire")


def _wire_type_name(key: object) -> str:
    if key is None:
        return "nil"
    return {bool: "bool", float: "float", tuple: "array", list: "array"}.get(
        type(key), type(key).__name__
    )


# -- recovering an id from a message that failed to decode ----------------------------------


def recover_head(body: bytes | memoryview) -> tuple[str | None, object]:
    """Best effort, for error reports: the tag (element 0, if a valid str) and element 1 of
    a body that is a msgpack array, if element 1 is an int, a str or an array of str (the
    ids of ``adds``). ``(None, None)`` when nothing can be read. Never raises; reads only
    the head of the body, so an invalid value further on does not matter."""
    try:
        r = _Reader(memoryview(body).cast("B") if type(body) is not bytes else body)
        n = r.array_len()
        if n is None or n < 1:
            return None, None
        tag = r.str_()
    except (IndexError, UnicodeDecodeError, ValueError, TypeError):
        return None, None
    if tag is None or n < 2:
        return tag, None
    try:
        return tag, r.head_value()
    except (IndexError, UnicodeDecodeError, ValueError, TypeError):
        return tag, None


class _Reader:
    """Just enough of a msgpack reader for :func:`recover_head`."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def _take(self, n: int) -> bytes:
        start = self.pos
        end = start + n
        if end > len(self.buf):
            raise IndexError("truncated")
        self.pos = end
        return bytes(self.buf[start:end])

    def _byte(self) -> int:
        b: int = self.buf[self.pos]
        self.pos += 1
        return b

    def array_len(self) -> int | None:
        b = self._byte()
        if 0x90 <= b <= 0x9F:
            return b & 0x0F
        if b == 0xDC:
            return int.from_bytes(self._take(2), "big")
        if b == 0xDD:
            return int.from_bytes(self._take(4), "big")
        self.pos -= 1
        return None

    def str_(self) -> str | None:
        b = self._byte()
        if 0xA0 <= b <= 0xBF:
            n = b & 0x1F
        elif b == 0xD9:
            n = self._byte()
        elif b == 0xDA:
            n = int.from_bytes(self._take(2), "big")
        elif b == 0xDB:
            n = int.from_bytes(self._take(4), "big")
        else:
            self.pos -= 1
            return None
        return self._take(n).decode("utf-8")  # UnicodeDecodeError: caught by the caller

    def int_(self) -> int | None:
        b = self._byte()
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        sizes = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
        size = sizes.get(b)
        if size is None:
            self.pos -= 1
            return None
        return int.from_bytes(self._take(size), "big", signed=b >= 0xD0)

    def head_value(self) -> object:
        value = self.int_()
        if value is not None:
            return value
        s = self.str_()
        if s is not None:
            return s
        n = self.array_len()
        if n is None:
            return None
        ids: list[str] = []
        for _ in range(n):
            s = self.str_()
            if s is None:
                return None
            ids.append(s)
        return ids


def send_parts(sock: zmq.Socket[Any], parts: list[Any], flags: int) -> None:
    """Send one message, ``[body, *buffers]``; the buffers without a copy. A lone body
    goes through ``send()``: ``send_multipart()`` costs ~0.6 µs more in pyzmq 27."""
    if len(parts) == 1:
        sock.send(parts[0], flags)
    else:
        sock.send_multipart(parts, flags, copy=False)
