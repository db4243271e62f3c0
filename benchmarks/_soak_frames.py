"""The invalid frames of the stage soak, written by hand as a client in another language
could get them wrong (``docs/wire.md``), grouped by what the stage must answer:

- :data:`SCOPED_ADD`: an ``add`` whose request id can be read (``wire.md`` section 6), so
  exactly one ``["error", req_id, "invalid message ..."]`` for it;
- :data:`SCOPED_ADDS`: an ``adds`` whose ids can be read: one error per id if the message
  itself is invalid, only for the bad items otherwise (the others are applied);
- :data:`UNSCOPED`: nothing can be read (not MessagePack, not an array, no tag, an unknown
  tag, an id of the wrong type): exactly one ``["error", nil, ...]`` per frame;
- :data:`SCOPED_CALL`: a ``utility`` whose call id can be read: exactly one failed answer,
  ``["utility", call_id, nil, "ProtocolError(...)"]``;
- :data:`BAD_HELLO`: an invalid ``hello``: exactly one ``reject`` on the input socket.

Each builder returns the ZMQ message's parts (a body, then out-of-band buffers).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Final

import msgspec

__all__ = ["BAD_HELLO", "SCOPED_ADD", "SCOPED_ADDS", "SCOPED_CALL", "UNSCOPED", "deep"]

Parts = list[bytes]

_E = msgspec.msgpack.encode
_X = msgspec.msgpack.Ext
_BAD_STR: Final = b"\xa2\xff\xfe"  # a 2-byte MessagePack str that is not UTF-8
_TIMESTAMP: Final = _X(-1, b"\0\0\0\0")


def deep(depth: int) -> list[Any]:
    """A list nested *depth* levels deep."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _array(header: Any) -> Any:
    return _X(1, _E(header))


def _add(rid: str, data: Any, *buffers: bytes) -> Parts:
    return [_E(["add", rid, data]), *buffers]


def _add_raw_data(rid: str, data: bytes) -> Parts:
    return [b"\x93" + _E("add") + _E(rid) + data]


SCOPED_ADD: Final[dict[str, Callable[[str], Parts]]] = {
    "ext_timestamp": lambda rid: _add(rid, _TIMESTAMP),
    "ext_unknown_type": lambda rid: _add(rid, _X(5, b"x")),
    "ext_array_not_msgpack": lambda rid: _add(rid, _X(1, b"\xc1")),
    "ext_bytes_no_buffer": lambda rid: _add(rid, _X(2, _E(3))),
    "ext_buffer_no_buffer": lambda rid: _add(rid, _X(3, _E(1))),
    "key_float": lambda rid: _add(rid, {1.5: 1}),
    "key_nil": lambda rid: _add(rid, {None: 1}),
    "key_bool": lambda rid: _add(rid, {True: 1}),
    "key_array": lambda rid: _add_raw_data(rid, b"\x81\x91\x01\x01"),  # {[1]: 1}
    "data_not_utf8": lambda rid: _add_raw_data(rid, _BAD_STR),
    "nested_not_utf8": lambda rid: _add_raw_data(rid, b"\x91\x81\xa1k" + _BAD_STR),
    "data_too_deep": lambda rid: _add(rid, deep(100)),
    "array_wrong_length": lambda rid: _add(rid, _array(["<f4", [4], b"\0" * 15])),
    "array_object_dtype": lambda rid: _add(rid, _array(["|O", [1], b"\0" * 8])),
    "array_structured_dtype": lambda rid: _add(rid, _array(["|V8", [1], b"\0" * 8])),
    "array_bad_dtype": lambda rid: _add(rid, _array(["nonsense", [1], b"\0"])),
    "array_negative_shape": lambda rid: _add(rid, _array(["<f4", [-1], b""])),
    "array_no_buffer": lambda rid: _add(rid, _array(["<f4", [4], 0])),
    "array_oob_wrong_length": lambda rid: _add(rid, _array(["<f4", [4], 0]), b"\0" * 15),
    "array_short_header": lambda rid: _add(rid, _array(["<f4", [4]])),
    "missing_data": lambda rid: [_E(["add", rid])],
    "truncated": lambda rid: [_E(["add", rid, [1, 2, 3, "abcdefgh"]])[:-4]],
}

# (parts, ids that get an error, valid items that are applied)
AddsFrame = tuple[Parts, list[str], list[tuple[str, int]]]

SCOPED_ADDS: Final[dict[str, Callable[[list[str]], AddsFrame]]] = {
    "adds_length_mismatch": lambda ids: ([_E(["adds", ids[:2], [1]])], ids[:2], []),
    "adds_truncated": lambda ids: ([_E(["adds", ids[:2], [1, 2]])[:-1]], ids[:2], []),
    "adds_data_not_list": lambda ids: ([_E(["adds", ids[:2], "xy"])], ids[:2], []),
    "adds_one_bad_item": lambda ids: (
        [_E(["adds", ids[:3], [2, _TIMESTAMP, 3]])],
        [ids[1]],
        [(ids[0], 2), (ids[2], 3)],
    ),
}


def _garbage(rng: random.Random) -> Parts:
    # 0xc1 is never used in MessagePack: whatever follows, nothing can be read.
    return [b"\xc1" + rng.randbytes(rng.randrange(64))]


UNSCOPED: Final[dict[str, Callable[[random.Random], Parts]]] = {
    "not_msgpack": _garbage,
    "empty_body": lambda rng: [b""],
    "truncated_tag": lambda rng: [b"\x93\xa3ad"],
    "int_body": lambda rng: [_E(7)],
    "str_body": lambda rng: [_E("add")],
    "map_body": lambda rng: [_E({"add": "x"})],
    "empty_array": lambda rng: [_E([])],
    "unknown_tag": lambda rng: [_E(["frobnicate", "x", 1])],
    "tag_not_str": lambda rng: [_E([1, "x", 3])],
    "add_id_int": lambda rng: [_E(["add", 5, 3])],
    "add_id_nil": lambda rng: [_E(["add", None, 3])],
    "add_id_not_utf8": lambda rng: [b"\x93" + _E("add") + _BAD_STR + _E(3)],
    "adds_ids_not_str": lambda rng: [_E(["adds", [1, 2], [1, 2]])],
    "adds_no_ids_mismatch": lambda rng: [_E(["adds", [], [1]])],
    "abort_not_list": lambda rng: [_E(["abort", "nobody"])],
    "utility_id_str": lambda rng: [_E(["utility", "7", "div", []])],
    "ping_seq_str": lambda rng: [_E(["ping", "x"])],
}

SCOPED_CALL: Final[dict[str, Callable[[int], Parts]]] = {
    "utility_bad_args": lambda cid: [_E(["utility", cid, "div", [_TIMESTAMP]])],
    "utility_name_int": lambda cid: [_E(["utility", cid, 5, []])],
    "utility_args_not_list": lambda cid: [_E(["utility", cid, "div", 5])],
}

BAD_HELLO: Final[dict[str, Callable[[], Parts]]] = {
    "hello_version_str": lambda: [_E(["hello", "2", "x"])],
    "hello_version_99": lambda: [_E(["hello", 99, "x"])],
    "hello_short": lambda: [_E(["hello"])],
    "hello_name_not_utf8": lambda: [b"\x93" + _E("hello") + _E(2) + _BAD_STR],
}
