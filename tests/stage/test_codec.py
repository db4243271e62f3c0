"""The payload codec (``_codec``) on its own: no processes, no sockets.

``docs/wire.md`` section 2 is the contract: what :func:`prepare` accepts and refuses, the
``[body, *buffers]`` layout with arrays and buffers of 1,024 bytes or more out of band,
read-only zero-copy views on receipt, the strict and the non-strict :class:`Decoder`,
:func:`check_received` and :func:`recover_head`.
"""

from __future__ import annotations

import collections
import datetime
import enum
import json
import math
import subprocess
import sys
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from enginecore.stage._codec import (
    OOB_THRESHOLD,
    Decoder,
    Encoder,
    Invalid,
    check_encodable,
    check_received,
    prepare,
    recover_head,
)

INT_MIN = -(2**63)
INT_MAX = 2**64 - 1

# -- helpers --------------------------------------------------------------------------------


def send(value: object) -> list[Any]:
    """The parts the Python implementation sends for *value*."""
    return Encoder().encode(prepare(value))


def receive(parts: list[Any], *, strict: bool = True) -> Any:
    return Decoder(strict=strict).decode(parts)


def round_trip(value: object) -> tuple[Any, list[Any]]:
    """What the other side decodes, and the parts that travelled."""
    parts = send(value)
    return receive(parts), parts


def ext(code: int, head: object) -> msgspec.msgpack.Ext:
    """An extension value whose ext data is the MessagePack encoding of *head*."""
    return msgspec.msgpack.Ext(code, msgspec.msgpack.encode(head))


def body(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


def nested_lists(levels: int, leaf: object = None) -> Any:
    """*levels* lists inside one another; the innermost holds *leaf* (or is empty)."""
    value: Any = [] if leaf is None else [leaf]
    for _ in range(levels - 1):
        value = [value]
    return value


def nested_dicts(levels: int) -> Any:
    value: Any = {}
    for _ in range(levels - 1):
        value = {"k": value}
    return value


def assert_arrived(sent: object, got: object) -> None:
    """*got* is what the wire promises for *sent*: arrays bit for bit, with their dtype and
    shape, read-only; tuples as lists; buffers as read-only memoryviews; numpy scalars as
    their Python value; NaN as NaN; and every type exact (``True`` is not ``1``)."""
    if isinstance(sent, np.ndarray):
        assert type(got) is np.ndarray
        assert got.dtype == sent.dtype
        assert got.dtype.str == sent.dtype.str
        assert got.shape == sent.shape
        assert got.flags.c_contiguous
        assert not got.flags.writeable
        assert got.tobytes() == np.ascontiguousarray(sent).tobytes()
    elif isinstance(sent, np.generic):
        assert_arrived(sent.item(), got)
    elif isinstance(sent, (list, tuple)):
        assert type(got) is list
        assert len(got) == len(sent)
        for s, g in zip(sent, got, strict=True):
            assert_arrived(s, g)
    elif isinstance(sent, dict):
        assert type(got) is dict
        assert list(got) == list(sent)
        assert [type(k) for k in got] == [type(k) for k in sent]
        for key, item in sent.items():
            assert_arrived(item, got[key])
    elif isinstance(sent, (bytearray, memoryview)):
        assert type(got) is memoryview
        assert got.readonly
        assert bytes(got) == bytes(sent)
    elif isinstance(sent, float):
        assert type(got) is float
        assert got == sent or (math.isnan(sent) and math.isnan(got))
    else:
        assert type(got) is type(sent)
        assert got == sent


def out_of_band(value: object) -> int:
    """How many buffer parts the Python sender uses for *value*."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes >= OOB_THRESHOLD)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return int(memoryview(value).nbytes >= OOB_THRESHOLD)
    if isinstance(value, (list, tuple)):
        return sum(out_of_band(v) for v in value)
    if isinstance(value, dict):
        return sum(out_of_band(v) for v in value.values())
    return 0


def as_array(value: object) -> npt.NDArray[Any]:
    assert type(value) is np.ndarray
    return value


def as_memoryview(value: object) -> memoryview:
    assert type(value) is memoryview
    return value


def byte_view(buffer: Any) -> npt.NDArray[np.uint8]:
    """A uint8 array on the memory of *buffer*, for ``np.shares_memory``."""
    return np.frombuffer(buffer, dtype=np.uint8)


# Every dtype the wire allows (kinds b i u f c m M S U), both byte orders where they exist.
DTYPES = [
    "|b1",
    "|i1",
    "<i2",
    ">i2",
    "<i4",
    ">i4",
    "<i8",
    ">i8",
    "|u1",
    "<u2",
    ">u2",
    "<u4",
    ">u4",
    "<u8",
    ">u8",
    "<f2",
    ">f2",
    "<f4",
    ">f4",
    "<f8",
    ">f8",
    np.dtype(np.longdouble).newbyteorder("<").str,
    "<c8",
    ">c8",
    "<c16",
    ">c16",
    "<m8[us]",
    ">m8[s]",
    "<M8[ns]",
    ">M8[ns]",
    "<M8[D]",
    "<M8",
    "|S4",
    "<U3",
    ">U3",
]


def sample(dtype: str, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """An array of *dtype* and *shape* whose elements differ from one another."""
    values = np.arange(math.prod(shape), dtype=np.int64) % 100
    if np.dtype(dtype).kind in "SU":
        return values.astype(str).astype(dtype).reshape(shape)
    return values.astype(dtype).reshape(shape)


# -- values the wire allows, for the properties ----------------------------------------------

ALLOWED_DTYPES = (
    hnp.boolean_dtypes()
    | hnp.integer_dtypes(endianness="?")
    | hnp.unsigned_integer_dtypes(endianness="?")
    | hnp.floating_dtypes(endianness="?", sizes=(16, 32, 64))
    | hnp.complex_number_dtypes(endianness="?")
    | hnp.datetime64_dtypes(endianness="?")
    | hnp.timedelta64_dtypes(endianness="?")
    | hnp.byte_string_dtypes(endianness="?", min_len=1, max_len=4)
    | hnp.unicode_string_dtypes(endianness="?", min_len=1, max_len=4)
)
small_arrays = hnp.arrays(
    ALLOWED_DTYPES, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
)
# Big enough to go out of band, whatever the item size.
large_arrays = hnp.arrays(ALLOWED_DTYPES, st.integers(OOB_THRESHOLD, OOB_THRESHOLD + 64))
arrays = st.tuples(small_arrays | large_arrays, st.booleans()).map(
    lambda a: a[0].T if a[1] else a[0]  # transposed: not C-contiguous when 2-d or more
)
numpy_scalars = (
    st.builds(np.float32, st.floats(width=32))
    | st.builds(np.float64, st.floats())
    | st.builds(np.int64, st.integers(-(2**63), 2**63 - 1))
    | st.builds(np.uint8, st.integers(0, 255))
    | st.builds(np.bool_, st.booleans())
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(INT_MIN, INT_MAX)
    | st.floats()
    | st.text()
    | st.binary(max_size=16)
    | st.binary(min_size=OOB_THRESHOLD, max_size=OOB_THRESHOLD + 16)
    | st.binary(max_size=16).map(bytearray)
    | numpy_scalars
    | arrays
)
keys = st.text(max_size=8) | st.integers(INT_MIN, INT_MAX) | st.binary(max_size=8)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(keys, children, max_size=4)
    ),
    max_leaves=12,
)


# -- sending: prepare / check_encodable -------------------------------------------------------


class TestPrepare:
    @pytest.mark.parametrize(
        "value",
        [
            None,
            True,
            0,
            INT_MIN,
            INT_MAX,
            1.5,
            "text",
            b"x" * (OOB_THRESHOLD - 1),
            [1, "a", [2.0, None]],
            (1, (2, 3)),
            {"a": [1], 2: {b"k": "v"}},
            np.arange(6).reshape(2, 3),
            [np.zeros(3), {"a": np.ones((2, 2))}],
        ],
        ids=repr,
    )
    def test_returns_the_value_itself_when_nothing_needs_converting(self, value: object) -> None:
        assert prepare(value) is value

    def test_copies_only_along_the_path_to_a_converted_value(self) -> None:
        kept = [1, [2, "x"]]
        sibling = {"s": (3, 4)}
        inner = [np.int64(5), "y"]
        original: dict[str, Any] = {"kept": kept, "path": {"inner": inner, "sibling": sibling}}
        out = prepare(original)
        assert isinstance(out, dict)
        assert out is not original
        assert out["kept"] is kept
        assert out["path"] is not original["path"]
        assert out["path"]["sibling"] is sibling
        assert out["path"]["inner"] == [5, "y"]
        assert type(out["path"]["inner"][0]) is int
        # The caller's value is untouched.
        assert type(inner[0]) is np.int64
        assert original["path"]["inner"] is inner

    def test_a_tuple_on_the_path_becomes_a_list_and_others_stay_tuples(self) -> None:
        untouched = (1, 2)
        out = prepare([untouched, (np.float32(0.5), "z")])
        assert isinstance(out, list)
        assert out[0] is untouched
        assert out[1] == [0.5, "z"]
        assert type(out[1]) is list

    @pytest.mark.parametrize(
        "make",
        [
            lambda a: a[:, ::2],
            lambda a: a.T,
            np.asfortranarray,
            lambda a: a[::-1],
        ],
        ids=["sliced", "transposed", "fortran", "reversed"],
    )
    def test_non_contiguous_arrays_become_c_contiguous_copies(self, make: Any) -> None:
        source = make(np.arange(12.0).reshape(3, 4))
        assert not source.flags.c_contiguous
        out = as_array(prepare([source])[0])  # type: ignore[index]
        assert out.flags.c_contiguous
        assert np.array_equal(out, source)
        assert not np.shares_memory(out, source)

    @pytest.mark.parametrize(
        ("value", "where"),
        [
            (np.array([object()], dtype=object), "value: numpy array of dtype object"),
            ([1, {"k": np.array([None, 1], dtype=object)}], "value[1]['k']: numpy array"),
            (np.zeros(2, dtype="i4,f8"), "value: numpy array of dtype [('f0'"),
            (np.zeros(2, dtype="V8"), "value: numpy array of dtype |V8"),
            ({"d": np.datetime64("2020-01-02")}, "value['d']: numpy scalar of type datetime64"),
            (
                [np.datetime64("2020-01-02T03:04:05", "us")],
                "value[0]: numpy scalar of type datetime64",
            ),
            (np.timedelta64(3, "s"), "value: numpy scalar of type timedelta64"),
            ({"c": 1j}, "value['c']: builtins.complex"),
            ([np.complex128(1j)], "value[0]: numpy scalar of type complex128 is not"),
            (np.complex64(1j), "value: numpy scalar of type complex64 is not"),
            (np.longdouble(1.5), "value: numpy scalar of type longdouble"),
            ({1, 2}, "value: builtins.set"),
            ([frozenset()], "value[0]: builtins.frozenset"),
            ((1, object()), "value[1]: builtins.object"),
            ({"k": [datetime.date(2020, 1, 2)]}, "value['k'][0]: datetime.date"),
            (collections.OrderedDict(a=1), "value: collections.OrderedDict"),
            (np.ma.masked_array([1, 2]), "value: numpy.ma.MaskedArray is not"),
        ],
    )
    def test_refused_values_name_where_they_are(self, value: object, where: str) -> None:
        with pytest.raises(TypeError) as info:
            prepare(value)
        assert where in str(info.value)

    def test_subclasses_of_allowed_types_are_refused(self) -> None:
        class Color(enum.IntEnum):
            RED = 1

        class Name(str):
            pass

        class Items(list[int]):
            pass

        class Blob(bytes):
            pass

        for value, name in [
            ([0, Color.RED], "value[1]: " + Color.__module__ + "."),
            ({"n": Name("x")}, "value['n']: "),
            (Items([1]), "value: "),
            ([Blob(b"x")], "value[0]: "),
        ]:
            with pytest.raises(TypeError, match="not wire-encodable") as info:
                prepare(value)
            assert str(info.value).startswith(name), info.value

    def test_an_ndarray_subclass_is_refused_saying_what_to_send(self) -> None:
        # np.load(mmap_mode="r") gives a numpy.memmap: "the wire carries ... numpy arrays"
        # alone read as if it were one.
        mapped = np.arange(4.0).view(np.memmap)
        for value in (mapped, np.ma.masked_array([1, 2], mask=[False, True])):
            with pytest.raises(TypeError, match="not wire-encodable") as info:
                prepare({"x": [value]})
            message = str(info.value)
            assert message.startswith("value['x'][0]: numpy."), message
            assert "subclass of numpy.ndarray" in message
            assert "numpy.asarray" in message

    @pytest.mark.parametrize(
        ("value", "where"),
        [
            (INT_MAX + 1, "value: int 18446744073709551616 is outside"),
            ([INT_MIN - 1], "value[0]: int -9223372036854775809 is outside"),
            ({"k": np.uint64(INT_MAX)}, ""),  # at the top of the range: accepted
        ],
    )
    def test_ints_outside_the_msgpack_range_are_refused(self, value: object, where: str) -> None:
        if not where:
            prepare(value)
            return
        with pytest.raises(TypeError, match=r"-2\*\*63\.\.2\*\*64-1") as info:
            prepare(value)
        assert str(info.value).startswith(where)

    @pytest.mark.parametrize(
        ("key", "message"),
        [
            (1.5, "value['a']: dict key 1.5 of type float is not allowed"),
            (None, "value['a']: dict key None of type NoneType"),
            (True, "value['a']: dict key True of type bool"),
            ((1, 2), "value['a']: dict key (1, 2) of type tuple"),
            (frozenset(), "value['a']: dict key frozenset() of type frozenset"),
            (np.int64(1), "value['a']: dict key np.int64(1) of type int64"),
            (INT_MAX + 1, "value['a']: dict key 18446744073709551616 is outside"),
            (INT_MIN - 1, "value['a']: dict key -9223372036854775809 is outside"),
        ],
        ids=repr,
    )
    def test_dict_keys_of_bad_types_are_refused(self, key: object, message: str) -> None:
        with pytest.raises(TypeError) as info:
            prepare({"a": {key: 1}})
        assert str(info.value).startswith(message)

    def test_dict_keys_at_the_ends_of_the_int_range_are_accepted(self) -> None:
        value = {INT_MIN: 1, INT_MAX: 2, b"k": 3, "s": 4}
        assert prepare(value) is value

    @pytest.mark.parametrize("make", [nested_lists, nested_dicts], ids=["lists", "dicts"])
    def test_nesting_is_allowed_64_deep_and_refused_deeper(self, make: Any) -> None:
        assert prepare(make(64)) is not None
        with pytest.raises(TypeError, match="nested deeper than 64 levels"):
            prepare(make(65))
        with pytest.raises(TypeError, match="nested deeper than 64 levels"):
            prepare(make(1000))

    @pytest.mark.parametrize(
        "leaf",
        [np.float32(1.0), np.zeros(2), bytearray(b"x"), memoryview(b"x")],
        ids=["np.float32", "ndarray", "bytearray", "memoryview"],
    )
    def test_a_leaf_inside_64_lists_is_accepted_whatever_its_type(self, leaf: object) -> None:
        prepare(nested_lists(64, "ok"))  # the str leaf is fine
        prepare(nested_lists(64, leaf))

    def test_a_non_contiguous_memoryview_is_refused(self) -> None:
        view = memoryview(bytearray(range(10)))[::2]
        with pytest.raises(TypeError, match=r"^value\['m'\]: a memoryview must be C-contiguous"):
            prepare({"m": view})

    def test_the_what_argument_names_the_root(self) -> None:
        with pytest.raises(TypeError, match=r"^payload\[0\]: builtins.set"):
            prepare([set()], "payload")

    def test_check_encodable_accepts_and_refuses_as_prepare_does(self) -> None:
        for value in [None, "s", [1, np.float32(2)], {"a": np.zeros(3)}, b"x" * 5000]:
            check_encodable(value)
        with pytest.raises(TypeError, match=r"^data\['k'\]\[1\]: builtins.set"):
            check_encodable({"k": [1, set()]}, "data")
        with pytest.raises(TypeError, match="nested deeper"):
            check_encodable(nested_lists(65))

    @pytest.mark.parametrize(
        "scalar",
        [
            np.datetime64("2020-01-02T03:04:05", "ns"),
            np.datetime64("NaT"),
            np.timedelta64(5, "ns"),
        ],
        ids=["datetime64[ns]", "NaT", "timedelta64[ns]"],
    )
    def test_datetime_scalars_are_refused_whatever_their_unit(self, scalar: object) -> None:
        try:
            out = prepare([scalar])
        except TypeError:
            return
        raise AssertionError(f"{scalar!r} was accepted as {out!r}")

    def test_a_structured_numpy_scalar_is_refused(self) -> None:
        scalar = np.zeros(1, dtype=[("x", "<i4"), ("y", "<f8")])[0]
        try:
            out = prepare(scalar)
        except TypeError:
            return
        raise AssertionError(f"{scalar!r} was accepted as {out!r}")

    def test_a_released_memoryview_is_refused_with_its_path(self) -> None:
        view = memoryview(b"abc")
        view.release()
        with pytest.raises(TypeError, match=r"^value\[0\]"):
            check_encodable([view])


# -- round trips ------------------------------------------------------------------------------


class TestRoundTrip:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("shape", [(2, 3), (4, OOB_THRESHOLD // 4)], ids=["small", "large"])
    def test_every_allowed_dtype_arrives_equal_with_its_byte_order(
        self, dtype: str, shape: tuple[int, int]
    ) -> None:
        sent = sample(dtype, shape)
        got, parts = round_trip({"a": sent})
        assert_arrived({"a": sent}, got)
        assert np.array_equal(got["a"], sent)
        assert len(parts) == (1 if sent.nbytes < OOB_THRESHOLD else 2)
        assert len(parts) == (1 if shape == (2, 3) else 2)

    def test_datetime_and_float_special_values_arrive_bit_for_bit(self) -> None:
        sent = [
            np.array(["NaT", "2020-01-02T03:04:05.123456789"], dtype="<M8[ns]"),
            np.array([np.nan, np.inf, -np.inf, -0.0], dtype=">f2"),
            np.array([complex(np.nan, 1), complex(-np.inf, 0)], dtype="<c8"),
        ]
        got, _ = round_trip(sent)
        assert_arrived(sent, got)

    @pytest.mark.parametrize(
        "shape",
        [(), (0,), (3, 0, 2), (2, 3, 4), (1,) * 10, (OOB_THRESHOLD,), (0, OOB_THRESHOLD)],
        ids=str,
    )
    def test_shapes_arrive_unchanged(self, shape: tuple[int, ...]) -> None:
        sent = sample("<i2", shape)
        got, parts = round_trip(sent)
        assert_arrived(sent, got)
        assert len(parts) == (1 if sent.nbytes < OOB_THRESHOLD else 2)

    @pytest.mark.parametrize(
        "sent",
        [np.array(3.5), np.array(b"x" * 2000), np.array("y" * 300)],
        ids=["0-d float", "0-d bytes, out of band", "0-d str, out of band"],
    )
    def test_0d_arrays_arrive_as_0d_arrays(self, sent: npt.NDArray[Any]) -> None:
        got, parts = round_trip(sent)
        assert_arrived(sent, got)
        assert as_array(got).shape == ()
        assert len(parts) == (1 if sent.nbytes < OOB_THRESHOLD else 2)

    @pytest.mark.parametrize(
        "make",
        [
            lambda a: a[:, ::2],
            lambda a: a.T,
            np.asfortranarray,
            lambda a: a[::-1, ::-1],
            lambda a: a.reshape(4, 3, -1)[:, 1],
        ],
        ids=["sliced", "transposed", "fortran", "reversed", "3-d slice"],
    )
    @pytest.mark.parametrize("columns", [6, 600], ids=["inline", "out of band"])
    def test_non_contiguous_arrays_arrive_c_contiguous_and_equal(
        self, make: Any, columns: int
    ) -> None:
        sent = make(np.arange(12 * columns, dtype=">f4").reshape(12, columns))
        assert not sent.flags.c_contiguous
        got, parts = round_trip(sent)
        assert_arrived(sent, got)
        assert np.array_equal(got, sent)
        assert len(parts) == (1 if sent.nbytes < OOB_THRESHOLD else 2)

    def test_an_unprepared_non_contiguous_array_is_still_encoded_correctly(self) -> None:
        sent = np.arange(2000, dtype=np.int32).reshape(40, 50).T
        parts = Encoder().encode([sent])
        got = receive(parts)
        assert np.array_equal(got[0], sent)
        assert len(parts) == 2

    @pytest.mark.parametrize(
        ("nbytes", "parts"),
        [(OOB_THRESHOLD - 1, 1), (OOB_THRESHOLD, 2), (OOB_THRESHOLD + 1, 2)],
    )
    def test_arrays_go_out_of_band_from_the_threshold_on(self, nbytes: int, parts: int) -> None:
        sent = np.arange(nbytes, dtype=np.uint8)
        got, sent_parts = round_trip(sent)
        assert_arrived(sent, got)
        assert len(sent_parts) == parts
        if parts == 2:
            assert bytes(sent_parts[1]) == sent.tobytes()

    @pytest.mark.parametrize("nbytes", [0, 1, OOB_THRESHOLD])
    def test_received_arrays_are_read_only(self, nbytes: int) -> None:
        got = as_array(round_trip(np.zeros(nbytes, dtype=np.uint8))[0])
        assert not got.flags.writeable
        if nbytes:
            with pytest.raises(ValueError, match="read-only"):
                got[0] = 1

    @pytest.mark.parametrize(
        ("scalar", "expected"),
        [
            (np.float32(1.5), 1.5),
            (np.float64(-2.25), -2.25),
            (np.float16(0.5), 0.5),
            (np.int64(-3), -3),
            (np.int8(-128), -128),
            (np.uint8(255), 255),
            (np.uint64(INT_MAX), INT_MAX),
            (np.bool_(True), True),
            (np.bool_(False), False),
            (np.str_("hé"), "hé"),
            (np.bytes_(b"ab"), b"ab"),
        ],
        ids=repr,
    )
    def test_numpy_scalars_arrive_as_the_plain_python_value(
        self, scalar: np.generic, expected: object
    ) -> None:
        for encode in (send, Encoder().encode):  # prepared, or handed to the encoder as is
            got = receive(encode([scalar, {"k": scalar}]))
            assert got == [expected, {"k": expected}]
            assert type(got[0]) is type(expected)
            assert type(got[1]["k"]) is type(expected)

    def test_a_large_numpy_bytes_scalar_goes_out_of_band_as_bytes(self) -> None:
        got, parts = round_trip(np.bytes_(b"z" * OOB_THRESHOLD))
        assert got == b"z" * OOB_THRESHOLD
        assert type(got) is bytes
        assert len(parts) == 2

    @pytest.mark.parametrize(
        ("nbytes", "parts"),
        [(0, 1), (OOB_THRESHOLD - 1, 1), (OOB_THRESHOLD, 2), (5 * OOB_THRESHOLD, 2)],
    )
    def test_bytes_arrive_as_bytes_inline_or_out_of_band(self, nbytes: int, parts: int) -> None:
        sent = bytes(i % 251 for i in range(nbytes))
        got, sent_parts = round_trip([sent])
        assert got == [sent]
        assert type(got[0]) is bytes
        assert len(sent_parts) == parts

    @pytest.mark.parametrize(
        "make",
        [bytearray, memoryview, lambda b: memoryview(bytearray(b))],
        ids=["bytearray", "memoryview of bytes", "memoryview of a bytearray"],
    )
    @pytest.mark.parametrize(
        ("nbytes", "parts"),
        [(0, 1), (OOB_THRESHOLD - 1, 1), (OOB_THRESHOLD, 2), (3 * OOB_THRESHOLD, 2)],
    )
    def test_buffers_arrive_as_read_only_memoryviews(
        self, make: Any, nbytes: int, parts: int
    ) -> None:
        raw = bytes(i % 253 for i in range(nbytes))
        source = make(raw)
        got, sent_parts = round_trip({"b": source})
        view = as_memoryview(got["b"])
        assert view.readonly
        assert bytes(view) == raw
        assert len(sent_parts) == parts
        if nbytes:
            with pytest.raises(TypeError):
                view[0] = 1

    @pytest.mark.parametrize("count", [3, 600])
    def test_a_memoryview_of_another_format_arrives_as_its_bytes(self, count: int) -> None:
        array = np.arange(count * 2, dtype="<i4").reshape(count, 2)
        source = array.data
        assert (source.format, source.ndim) == ("i", 2)
        got, parts = round_trip(source)
        view = as_memoryview(got)
        assert (view.format, view.ndim, view.nbytes) == ("B", 1, array.nbytes)
        assert bytes(view) == array.tobytes()
        assert len(parts) == (1 if array.nbytes < OOB_THRESHOLD else 2)

    def test_nested_containers_carry_arrays_at_depth(self) -> None:
        big = np.arange(300, dtype=np.float64)
        small = np.arange(3, dtype=np.int16)
        sent = {
            "a": [1, (2, {"b": small, "c": [[[[big]]]]})],
            3: {b"k": (big[::2].copy(), "s")},
            "d": nested_lists(20, np.array(True)),
        }
        got, parts = round_trip(sent)
        assert_arrived(sent, got)
        assert len(parts) == 3  # two large arrays, each out of band
        assert np.array_equal(got["a"][1][1]["c"][0][0][0][0], big)

    def test_out_of_band_buffers_are_numbered_in_order(self) -> None:
        values = [b"a" * OOB_THRESHOLD, np.full(OOB_THRESHOLD, 7, np.uint8), bytearray(b"c" * 2000)]
        got, parts = round_trip(values)
        assert len(parts) == 4
        assert [bytes(p)[:1] for p in parts[1:]] == [b"a", b"\x07", b"c"]
        assert_arrived(values, got)

    def test_tuples_arrive_as_lists(self) -> None:
        got, _ = round_trip((1, (2, (3,)), {"t": ()}))
        assert got == [1, [2, [3]], {"t": []}]
        assert type(got[1]) is list

    def test_the_ends_of_the_int_range_arrive_unchanged(self) -> None:
        got, _ = round_trip([INT_MIN, INT_MAX, -1, 0])
        assert got == [INT_MIN, INT_MAX, -1, 0]

    def test_an_encoder_that_failed_keeps_no_buffer_for_the_next_message(self) -> None:
        encoder = Encoder()
        with pytest.raises(TypeError):
            encoder.encode([prepare(b"a" * OOB_THRESHOLD), object()])
        parts = encoder.encode(prepare(b"b" * OOB_THRESHOLD))
        assert len(parts) == 2
        assert receive(parts) == b"b" * OOB_THRESHOLD

    def test_an_encoder_is_reusable(self) -> None:
        encoder = Encoder()
        first = encoder.encode(prepare([np.zeros(OOB_THRESHOLD, np.uint8)]))
        second = encoder.encode(prepare(["plain"]))
        assert len(first) == 2
        assert second == [body(["plain"])]

    def test_receivers_accept_small_values_out_of_band_and_large_ones_inline(self) -> None:
        # Another implementation may choose differently from ours: both must decode.
        floats = np.array([1.5, -2.0], dtype="<f4")
        large = np.arange(OOB_THRESHOLD, dtype=np.uint8)
        msg = [
            ext(1, ["<f4", [2], 0]),
            ext(1, ["|u1", [OOB_THRESHOLD], large.tobytes()]),
            ext(2, 1),
            ext(3, 1),
            ext(3, b"inline"),
        ]
        got = receive([body(msg), floats.tobytes(), b"tiny"])
        assert np.array_equal(got[0], floats)
        assert np.array_equal(got[1], large)
        assert got[2] == b"tiny"
        assert type(got[2]) is bytes
        assert bytes(got[3]) == b"tiny"
        assert bytes(got[4]) == b"inline"
        assert all(type(g) is memoryview and g.readonly for g in got[3:])

    def test_buffers_nobody_refers_to_are_ignored(self) -> None:
        assert receive([body(["x", ext(2, 1)]), b"unused", b"used"]) == ["x", b"used"]

    @pytest.mark.parametrize(
        "wrap",
        [bytes, bytearray, memoryview, zmq.Frame],
        ids=["bytes", "bytearray", "memoryview", "zmq.Frame"],
    )
    def test_parts_may_be_bytes_bytearrays_memoryviews_or_frames(self, wrap: Any) -> None:
        sent = {"a": np.arange(OOB_THRESHOLD, dtype=np.int64), "b": b"x" * 5000}
        parts = [wrap(bytes(p)) for p in send(sent)]
        assert_arrived(sent, receive(parts))
        assert_arrived({"s": "only a body"}, receive([wrap(body({"s": "only a body"}))]))

    def test_a_typed_decoder_validates_against_its_type(self) -> None:
        decoder = Decoder(list[int], strict=True)
        assert decoder.decode([body([1, 2])]) == [1, 2]
        with pytest.raises(msgspec.ValidationError, match="Expected `int`, got `str`"):
            decoder.decode([body([1, "x"])])

    @settings(max_examples=60, deadline=None)
    @given(values)
    def test_any_allowed_value_arrives_equal(self, value: object) -> None:
        check_encodable(value)
        got, parts = round_trip(value)
        assert_arrived(value, got)
        check_received(got)
        assert len(parts) == 1 + out_of_band(value)


# -- zero copy ----------------------------------------------------------------------------------


class TestZeroCopy:
    @pytest.mark.parametrize("writable", [bytearray, lambda b: memoryview(bytearray(b))])
    def test_a_received_array_is_a_view_on_its_buffer_part(self, writable: Any) -> None:
        sent = np.arange(256, dtype="<f8")
        parts = send([sent])
        buffer = writable(bytes(parts[1]))
        got = as_array(receive([parts[0], buffer])[0])
        assert np.shares_memory(got, byte_view(buffer))
        buffer[:8] = np.float64(42.0).tobytes()  # the frame's memory changes under it
        assert got[0] == 42.0
        assert np.array_equal(got[1:], sent[1:])

    def test_a_received_inline_array_is_a_view_on_the_body(self) -> None:
        # Inline data is part of the ext data; numpy reads it in place, read-only.
        got = as_array(receive(send(np.arange(4, dtype=np.uint8))))
        assert not got.flags.owndata
        assert not got.flags.writeable

    def test_a_received_buffer_is_a_read_only_view_on_its_buffer_part(self) -> None:
        parts = send(bytearray(b"m" * OOB_THRESHOLD))
        frame = bytearray(bytes(parts[1]))
        got = as_memoryview(receive([parts[0], frame]))
        assert got.readonly
        frame[0:1] = b"Z"
        assert got[0] == ord("Z")

    def test_received_out_of_band_bytes_are_a_copy(self) -> None:
        parts = send(b"q" * OOB_THRESHOLD)
        frame = bytearray(bytes(parts[1]))
        got = receive([parts[0], frame])
        frame[0:1] = b"Z"
        assert got == b"q" * OOB_THRESHOLD

    @pytest.mark.parametrize(
        "sent",
        [
            np.arange(OOB_THRESHOLD, dtype=np.uint8),
            np.arange(512, dtype=">i4").reshape(8, 64),
            np.array(["2020-01-01"] * 200, dtype="<M8[ns]"),
            np.array("x" * 300),
        ],
        ids=["u1", "3-d big-endian", "datetime64", "0-d str"],
    )
    def test_the_buffer_part_of_an_array_is_the_array_itself(self, sent: npt.NDArray[Any]) -> None:
        parts = send({"a": sent})
        assert len(parts) == 2
        assert np.shares_memory(byte_view(parts[1]), sent.reshape(-1).view(np.uint8))
        assert bytes(parts[1]) == sent.tobytes()
        # And in one process, the received array is the sender's memory: no copy anywhere.
        got = receive(parts)["a"]
        assert np.shares_memory(got, sent)

    def test_a_non_contiguous_array_is_copied_once_into_the_buffer_part(self) -> None:
        source = np.arange(4 * OOB_THRESHOLD, dtype=np.uint8).reshape(4, -1)
        sent = source[:, ::2]
        prepared = prepare(sent)
        parts = Encoder().encode(prepared)
        assert not np.shares_memory(byte_view(parts[1]), source)
        assert np.shares_memory(byte_view(parts[1]), as_array(prepared))

    @pytest.mark.parametrize(
        "make",
        [bytes, bytearray, memoryview, lambda b: memoryview(bytearray(b))],
        ids=["bytes", "bytearray", "memoryview", "writable memoryview"],
    )
    def test_the_buffer_part_of_bytes_or_a_buffer_is_its_memory(self, make: Any) -> None:
        sent = make(b"w" * OOB_THRESHOLD)
        parts = send([sent])
        assert len(parts) == 2
        assert np.shares_memory(byte_view(parts[1]), byte_view(sent))


# -- decoding what the wire does not allow ---------------------------------------------------

# (id, the offending ext value, extra buffer parts, what the error says)
BAD_EXTENSIONS: list[tuple[str, msgspec.msgpack.Ext, list[bytes], str]] = [
    ("unknown ext 5", ext(5, 0), [], "msgpack extension type 5 is not allowed on the wire"),
    ("unknown ext 0", ext(0, b""), [], "msgpack extension type 0 is not allowed on the wire"),
    ("ext 4 with a buffer", ext(4, 0), [b"x"], "msgpack extension type 4 is not allowed"),
    (
        "ext data not msgpack",
        msgspec.msgpack.Ext(1, b"\xc1"),
        [],
        "invalid data in msgpack extension 1",
    ),
    (
        "ext data truncated",
        msgspec.msgpack.Ext(3, b"\xc4\x05ab"),
        [],
        "invalid data in msgpack extension 3",
    ),
    ("array header not a list", ext(1, "<f8"), [], "invalid array header '<f8'"),
    ("array header too short", ext(1, ["<f8", [1]]), [], "invalid array header"),
    ("array dtype not a str", ext(1, [8, [1], b"\0" * 8]), [], "invalid array header"),
    ("array shape not a list", ext(1, ["<f8", 1, b"\0" * 8]), [], "invalid array header"),
    ("negative dimension", ext(1, ["<f8", [-1], b""]), [], "invalid array header"),
    ("bool dimension", ext(1, ["<f8", [True], b"\0" * 8]), [], "invalid array header"),
    ("str dimension", ext(1, ["<f8", ["1"], b"\0" * 8]), [], "invalid array header"),
    (
        "too few bytes",
        ext(1, ["<f8", [2], b"\0" * 8]),
        [],
        "array of shape (2,) and dtype <f8 needs 16 bytes, got 8",
    ),
    (
        "too many bytes out of band",
        ext(1, ["<i2", [2, 2], 0]),
        [b"\0" * 9],
        "array of shape (2, 2) and dtype <i2 needs 8 bytes, got 9",
    ),
    ("bad dtype string", ext(1, ["nope", [1], b"\0"]), [], "invalid array dtype 'nope'"),
    ("bad datetime unit", ext(1, ["<M8[foo]", [0], b""]), [], "invalid array dtype '<M8[foo]'"),
    ("object dtype", ext(1, ["|O", [1], b"\0" * 8]), [], "array dtype '|O' is not allowed"),
    ("void dtype", ext(1, ["|V8", [1], b"\0" * 8]), [], "array dtype '|V8' is not allowed"),
    ("subarray dtype", ext(1, ["(2,)<i4", [1], b"\0" * 8]), [], "is not allowed on the wire"),
    ("zero itemsize", ext(1, ["|S0", [3], b""]), [], "invalid array of shape (3,), dtype |S0"),
    ("65 dimensions", ext(1, ["|u1", [1] * 65, b"\0"]), [], "invalid array of shape (1, 1,"),
    ("huge empty shape", ext(1, ["<i8", [0, INT_MAX], b""]), [], "invalid array of shape (0,"),
    ("array data is a str", ext(1, ["|u1", [1], "x"]), [], "out-of-band buffer 'x'"),
    ("array buffer missing", ext(1, ["|u1", [1], 0]), [], "out-of-band buffer 0, which is not"),
    ("array buffer past the end", ext(1, ["|u1", [1], 1]), [b"x"], "out-of-band buffer 1,"),
    ("bytes buffer missing", ext(2, 0), [], "reference to out-of-band buffer 0"),
    ("bytes buffer negative", ext(2, -1), [b"x"], "reference to out-of-band buffer -1"),
    ("bytes index not an int", ext(2, "0"), [b"x"], "reference to out-of-band buffer '0'"),
    ("bytes index a bool", ext(2, False), [b"x"], "reference to out-of-band buffer False"),
    ("bytes inline", ext(2, b"abc"), [], "reference to out-of-band buffer b'abc'"),
    ("buffer index past the end", ext(3, 2), [b"x", b"y"], "out-of-band buffer 2"),
    ("buffer as a str", ext(3, "abc"), [], "reference to out-of-band buffer 'abc'"),
    # What a reference holds is named, and cut short: not an object's repr with its
    # address, nor a repr as long as the message.
    (
        "array data an extension",
        ext(1, ["|u1", [1], msgspec.msgpack.Ext(2, body(0))]),
        [b"x"],
        "reference to out-of-band buffer msgpack extension 2, which is not there",
    ),
]
BAD_IDS = [case[0] for case in BAD_EXTENSIONS]


class TestDecoderStrictness:
    @pytest.mark.parametrize(("name", "bad", "buffers", "message"), BAD_EXTENSIONS, ids=BAD_IDS)
    def test_strict_decoder_refuses_the_whole_message(
        self, name: str, bad: msgspec.msgpack.Ext, buffers: list[bytes], message: str
    ) -> None:
        parts = [body(["add", "r1", {"k": [1, bad]}]), *buffers]
        with pytest.raises(msgspec.DecodeError) as info:
            receive(parts, strict=True)
        assert message in str(info.value)

    @pytest.mark.parametrize(("name", "bad", "buffers", "message"), BAD_EXTENSIONS, ids=BAD_IDS)
    def test_non_strict_decoder_leaves_a_marker_that_check_received_reports(
        self, name: str, bad: msgspec.msgpack.Ext, buffers: list[bytes], message: str
    ) -> None:
        parts = [body(["add", "r1", {"k": [1, bad]}, "next"]), *buffers]
        msg = receive(parts, strict=False)
        assert msg[:2] == ["add", "r1"]
        assert msg[3] == "next"  # the rest of the message is intact
        marker = msg[2]["k"][1]
        assert type(marker) is Invalid
        assert message in marker.reason
        assert repr(marker) == f"Invalid({marker.reason!r})"
        with pytest.raises(ValueError, match=r"^data\['k'\]\[1\]: ") as info:
            check_received(msg[2], "data")
        assert message in str(info.value)

    @pytest.mark.parametrize(
        "reference",
        [[0] * 5000, "x" * 5000, {"k": [0] * 5000}, msgspec.msgpack.Ext(2, body(0))],
        ids=["long list", "long str", "map", "extension"],
    )
    def test_a_bad_buffer_reference_is_named_briefly(self, reference: object) -> None:
        # docs/wire.md section 6: the error goes back to the client, which should read what
        # was wrong, not an object's address or a repr as long as the message.
        with pytest.raises(msgspec.DecodeError) as info:
            receive([body(["add", "r1", ext(3, reference)]), b"x"], strict=True)
        message = str(info.value)
        assert message.startswith("reference to out-of-band buffer ")
        assert message.endswith(", which is not there")
        assert len(message) < 200
        assert " object at 0x" not in message

    @pytest.mark.parametrize("dtype", ["x" * 5000, "<M8[" + "s" * 5000 + "]", "|V" + "9" * 4000])
    def test_a_long_bad_dtype_is_named_briefly(self, dtype: str) -> None:
        with pytest.raises(msgspec.DecodeError) as info:
            receive([body(["add", "r1", ext(1, [dtype, [1], b"\0"])])], strict=True)
        assert "array dtype '" in str(info.value)
        assert len(str(info.value)) < 400

    def test_valid_values_beside_an_invalid_one_decode_normally(self) -> None:
        parts = [body([ext(2, 0), ext(9, 0), ext(1, ["|u1", [2], b"ab"])]), b"bytes"]
        got = receive(parts, strict=False)
        assert got[0] == b"bytes"
        assert type(got[1]) is Invalid
        assert bytes(got[2]) == b"ab"

    @pytest.mark.parametrize("strict", [True, False])
    def test_the_timestamp_extension_is_caught_by_check_received(self, strict: bool) -> None:
        # msgspec decodes ext -1 natively (the ext hook never sees it): check_received is
        # what keeps it off the wire, strict decoder or not.
        stamp = datetime.datetime(2020, 1, 2, tzinfo=datetime.timezone.utc)
        raw = body({"when": [stamp]})
        assert b"\xd6\xff" in raw  # timestamp 32: fixext 4, type -1
        got = receive([raw], strict=strict)
        assert got == {"when": [stamp]}
        with pytest.raises(ValueError, match=r"^value\['when'\]\[0\]: .*type -1 \(timestamp\)"):
            check_received(got)

    @pytest.mark.parametrize("strict", [True, False])
    def test_an_array_as_a_map_key_is_a_decode_error(self, strict: bool) -> None:
        raw = b"\x81" + body(ext(1, ["|u1", [1], b"\0"])) + body(1)
        with pytest.raises(msgspec.DecodeError, match="map keys must be hashable"):
            receive([raw], strict=strict)

    @pytest.mark.parametrize("strict", [True, False])
    def test_a_buffer_as_a_map_key_is_reported_by_check_received(self, strict: bool) -> None:
        got = receive([b"\x81" + body(ext(3, b"k")) + body(1)], strict=strict)
        with pytest.raises(ValueError, match=r"map key <memory at .* of type memoryview"):
            check_received(got)

    @pytest.mark.parametrize("strict", [True, False])
    def test_malformed_msgpack_is_a_decode_error(self, strict: bool) -> None:
        for raw in [b"", b"\xc1", b"\x92\x01", body(["x", "y"])[:-1]]:
            with pytest.raises(msgspec.DecodeError):
                receive([raw], strict=strict)

    @pytest.mark.parametrize("strict", [True, False])
    @settings(max_examples=150, deadline=None)
    @given(
        dtype=st.sampled_from(["|b1", "<i8", ">u2", "<f2", "<c16", "<M8[s]", "|S3", ">U2", "|O"]),
        shape=st.lists(st.integers(0, INT_MAX) | st.integers(0, 3), max_size=5),
        data=st.binary(max_size=40) | st.integers(-2, 3),
        buffers=st.lists(st.binary(max_size=40), max_size=2),
    )
    def test_any_array_header_decodes_to_an_array_or_is_refused_cleanly(
        self, strict: bool, dtype: str, shape: list[int], data: bytes | int, buffers: list[bytes]
    ) -> None:
        parts = [body([ext(1, [dtype, shape, data])]), *buffers]
        try:
            got = receive(parts, strict=strict)[0]
        except msgspec.DecodeError:
            assert strict
            return
        if type(got) is Invalid:
            assert not strict
            return
        array = as_array(got)
        assert array.shape == tuple(shape)
        assert array.dtype.str == dtype
        assert not array.flags.writeable

    @pytest.mark.parametrize("strict", [True, False])
    @pytest.mark.parametrize("dtype", [",", "01", "1)"])
    def test_dtype_strings_numpy_cannot_parse_are_refused_cleanly(
        self, dtype: str, strict: bool
    ) -> None:
        parts = [body(["add", "r1", ext(1, [dtype, [0], b""])])]
        if strict:
            with pytest.raises(msgspec.DecodeError, match="invalid array dtype"):
                receive(parts, strict=True)
        else:
            assert type(receive(parts, strict=False)[2]) is Invalid


# -- check_received -------------------------------------------------------------------------


class TestCheckReceived:
    @pytest.mark.parametrize(
        "value",
        [
            None,
            True,
            INT_MIN,
            INT_MAX,
            1.5,
            "s",
            b"b",
            [],
            {},
            [1, [2, {"a": b"x"}]],
            {"s": 1, 2: [3], b"b": {"n": None}},
            memoryview(b"abc"),
            np.zeros((2, 2)),
            {"a": [np.arange(3), memoryview(b"x")]},
        ],
        ids=repr,
    )
    def test_valid_values_pass(self, value: object) -> None:
        check_received(value)

    @pytest.mark.parametrize(
        ("raw", "message"),
        [
            (b"\x81\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x01", "map key 1.5 of type float"),
            (b"\x81\xca\x3f\xc0\x00\x00\x01", "map key 1.5 of type float"),
            (b"\x81\xc0\x01", "map key None of type nil"),
            (b"\x81\xc2\x01", "map key False of type bool"),
            (b"\x81\xc3\x01", "map key True of type bool"),
            (b"\x81\x92\x01\x02\x01", "map key (1, 2) of type array"),
            (b"\x81\x90\x01", "map key () of type array"),
        ],
        ids=["float64", "float32", "nil", "false", "true", "array", "empty array"],
    )
    def test_map_keys_other_than_str_int_bin_are_refused(self, raw: bytes, message: str) -> None:
        for strict in (True, False):
            decoded = receive([raw], strict=strict)
            with pytest.raises(ValueError, match=r"^value: ") as info:
                check_received(decoded)
            assert message in str(info.value)
            assert "(keys must be str, int or bin)" in str(info.value)
            # The same map, nested, is reported where it sits.
            nested = receive([b"\x92\xc0\x81\xa1k" + raw], strict=strict)
            with pytest.raises(ValueError, match=r"^data\[1\]\['k'\]: map key"):
                check_received(nested, "data")

    def test_a_map_as_a_map_key_is_a_decode_error(self) -> None:
        with pytest.raises(msgspec.DecodeError, match="hashable"):
            receive([b"\x81\x81\x01\x02\x01"])

    def test_str_int_and_bin_map_keys_pass(self) -> None:
        decoded = receive([b"\x83\xa1s\x01\xcf" + b"\xff" * 8 + b"\x02\xc4\x01b\x03"])
        assert decoded == {"s": 1, INT_MAX: 2, b"b": 3}
        check_received(decoded)

    def test_a_datetime_is_refused_where_it_sits(self) -> None:
        stamp = datetime.datetime(2020, 1, 2, tzinfo=datetime.timezone.utc)
        with pytest.raises(ValueError, match=r"^args\[0\]\[1\]: msgpack extension type -1"):
            check_received([[1, stamp]], "args")

    def test_an_invalid_marker_is_refused_with_its_reason(self) -> None:
        with pytest.raises(ValueError, match=r"^value: why not$"):
            check_received(Invalid("why not"))
        with pytest.raises(ValueError, match=r"^value\[b'k'\]\[0\]: why not$"):
            check_received({b"k": [Invalid("why not")]})

    @pytest.mark.parametrize(
        "value", [(1, 2), {1, 2}, object(), 1j, datetime.date(2020, 1, 1)], ids=repr
    )
    def test_values_no_decoder_produces_are_refused(self, value: object) -> None:
        with pytest.raises(ValueError, match=r"^value\[0\]: a value of type \w+ is not allowed"):
            check_received([value])

    @pytest.mark.parametrize("make", [nested_lists, nested_dicts], ids=["lists", "dicts"])
    def test_nesting_is_allowed_64_deep_and_refused_deeper(self, make: Any) -> None:
        check_received(receive([body(make(64))]))
        with pytest.raises(ValueError, match="nested deeper than 64 levels"):
            check_received(receive([body(make(65))]))

    @pytest.mark.parametrize("levels", [1, 63, 64, 65, 66, 500])
    @pytest.mark.parametrize("make", [nested_lists, nested_dicts], ids=["lists", "dicts"])
    def test_the_depth_limit_is_the_same_as_when_sending(self, make: Any, levels: int) -> None:
        value = make(levels)
        try:
            prepare(value)
            sendable = True
        except TypeError:
            sendable = False
        try:
            check_received(receive([body(value)]))
            receivable = True
        except ValueError:
            receivable = False
        assert sendable == receivable == (levels <= 64)

    def test_a_deep_value_is_refused_without_a_recursion_error(self) -> None:
        # msgspec decodes this (it is below its own limit); the check stops at 64 levels.
        decoded = receive([b"\x91" * 900 + b"\xc0"])
        with pytest.raises(ValueError, match=r"^value(\[0\]){64}: nested deeper"):
            check_received(decoded)

    def test_arrays_and_buffers_are_not_counted_as_levels(self) -> None:
        check_received(nested_lists(64, np.zeros(2)))
        check_received(nested_lists(64, memoryview(b"x")))


# -- recover_head --------------------------------------------------------------------------

INVALID_UTF8 = b"\xa2\xff\xfe"
TRUNCATED = b"\xa5ab"


class TestRecoverHead:
    @pytest.mark.parametrize(
        ("raw", "expected"),
        [
            (b"\x93\xa3add\xa2r1" + INVALID_UTF8, ("add", "r1")),
            (b"\x93\xa3add\xa2r1" + TRUNCATED, ("add", "r1")),
            (b"\x93\xa3add\xa2r1\xc1", ("add", "r1")),
            (b"\x93\xa4adds\x92\xa1a\xa2bc" + INVALID_UTF8, ("adds", ["a", "bc"])),
            (b"\x93\xa4adds\x90" + TRUNCATED, ("adds", [])),
            (b"\x94\xa7utility\x07\xa4name" + INVALID_UTF8, ("utility", 7)),
            (b"\x93\xa5hello\x02" + TRUNCATED, ("hello", 2)),
            (b"\x92\xa3add", ("add", None)),  # element 1 missing from the bytes
            (b"\x91\xa3add", ("add", None)),  # the array has no element 1
            (b"\x92\xa3add\xa5r", ("add", None)),  # element 1 truncated
            (b"\x92\xa3add" + INVALID_UTF8, ("add", None)),
            (b"\x92\xa4adds\x92\xa1a\x01", ("adds", None)),  # an id that is not a str
            (b"\x92\xa4adds\x92\xa1a", ("adds", None)),  # ids truncated
            (b"\x92\xa3add\xcb" + b"\0" * 8, ("add", None)),  # a float
            (b"\x92\xa3add\xc0", ("add", None)),
            (b"\x92\xa3add\x80", ("add", None)),
            (b"\x92\xa3add\xc4\x01x", ("add", None)),  # bin is not str
        ],
        ids=repr,
    )
    def test_reads_the_tag_and_id_before_the_invalid_part(
        self, raw: bytes, expected: tuple[str | None, object]
    ) -> None:
        assert recover_head(raw) == expected
        assert recover_head(memoryview(raw)) == expected
        assert recover_head(memoryview(bytearray(raw))) == expected

    @pytest.mark.parametrize(
        "header",
        [b"\x93", b"\xdc\x00\x03", b"\xdd\x00\x00\x00\x03"],
        ids=["fixarray", "array16", "array32"],
    )
    @pytest.mark.parametrize(
        "tag",
        [b"\xa3add", b"\xd9\x03add", b"\xda\x00\x03add", b"\xdb\x00\x00\x00\x03add"],
        ids=["fixstr", "str8", "str16", "str32"],
    )
    def test_reads_every_array_and_str_header(self, header: bytes, tag: bytes) -> None:
        req_id = "r" * 300  # a str16 itself
        raw = header + tag + body(req_id) + TRUNCATED
        assert recover_head(raw) == ("add", req_id)

    def test_reads_a_str32_id(self) -> None:
        req_id = "i" * 70_000
        raw = b"\x93\xa3add\xdb" + len(req_id).to_bytes(4, "big") + req_id.encode() + b"\xc1"
        assert recover_head(raw) == ("add", req_id)

    @pytest.mark.parametrize(
        "call_id",
        [
            0,
            127,
            128,
            255,
            256,
            70_000,
            2**32,
            INT_MAX,
            -1,
            -32,
            -33,
            -129,
            -40_000,
            -(2**31) - 1,
            INT_MIN,
        ],
    )
    def test_reads_ints_of_every_width_and_sign(self, call_id: int) -> None:
        raw = b"\x93" + body("utility") + body(call_id) + INVALID_UTF8
        assert recover_head(raw) == ("utility", call_id)

    @pytest.mark.parametrize(
        "raw",
        [
            b"",
            b"\x90",  # an empty array
            b"\xc1",
            b"\x80",  # a map
            b"\xa3add",  # a str, not an array
            b"\x92\x01\xa2r1",  # the tag is not a str
            b"\x92\xc0\xa2r1",
            b"\x92\xa5ad",  # the tag is truncated
            b"\x92" + INVALID_UTF8 + b"\xa2r1",  # the tag is not UTF-8
            b"\xdc\x00",  # a truncated array16 header
            b"\xdd\x00\x00\x00",
            b"\x92\xd9",  # a truncated str8 header
            b"\x92\xda\x00",
            b"\x92\xdb\x00\x00",
        ],
        ids=repr,
    )
    def test_garbage_gives_nothing(self, raw: bytes) -> None:
        assert recover_head(raw) == (None, None)

    def test_a_released_or_odd_buffer_gives_nothing(self) -> None:
        view = memoryview(b"\x92\xa3add\x01")
        view.release()
        assert recover_head(view) == (None, None)
        ints = np.array([0x92A3], dtype=">u2").data
        assert recover_head(ints) == (None, None)

    @settings(max_examples=150, deadline=None)
    @given(
        tag=st.text(max_size=40),
        head=st.integers(INT_MIN, INT_MAX) | st.text(max_size=300) | st.lists(st.text(max_size=20)),
        rest=st.binary(max_size=10),
    )
    def test_reads_the_head_of_any_valid_message_whatever_follows(
        self, tag: str, head: int | str | list[str], rest: bytes
    ) -> None:
        raw = body([tag, head, None])[:-1] + rest  # the third element replaced by garbage
        assert recover_head(raw) == (tag, head)

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=64) | st.binary(max_size=8).map(lambda b: b"\x93\xa3add" + b))
    def test_never_raises_on_arbitrary_bytes(self, raw: bytes) -> None:
        result = recover_head(raw)
        assert type(result) is tuple
        assert len(result) == 2
        tag, head = result
        assert tag is None or type(tag) is str
        assert head is None or type(head) in (int, str, list)
        if tag is None:
            assert head is None


# -- without numpy --------------------------------------------------------------------------

WITHOUT_NUMPY = """
import json, sys
sys.modules["numpy"] = None  # import numpy now raises ImportError
import msgspec
from enginecore.stage import _codec
parts = [bytes.fromhex(h) for h in sys.argv[1:]]
out = {}
try:
    _codec.Decoder(strict=True).decode(parts)
except msgspec.DecodeError as exc:
    out["strict"] = str(exc)
msg = _codec.Decoder(strict=False).decode(parts)
out["marker"] = type(msg[2]["a"]).__name__
out["rest"] = msg[2]["b"]
try:
    _codec.check_received(msg[2], "data")
except ValueError as exc:
    out["checked"] = str(exc)
# Sending needs no numpy either.
out["sent"] = len(_codec.Encoder().encode(_codec.prepare([1, b"x" * 2000, bytearray(3)])))
try:
    _codec.check_encodable({1, 2})
except TypeError as exc:
    out["refused"] = str(exc)
print(json.dumps(out))
"""


class TestWithoutNumpy:
    @pytest.mark.parametrize("size", [3, OOB_THRESHOLD], ids=["inline", "out of band"])
    def test_an_arriving_array_is_refused_with_a_clear_error(self, size: int) -> None:
        parts = send(["add", "r1", {"a": np.arange(size, dtype=np.uint8), "b": "kept"}])
        assert len(parts) == (1 if size < OOB_THRESHOLD else 2)
        proc = subprocess.run(
            [sys.executable, "-c", WITHOUT_NUMPY, *(bytes(p).hex() for p in parts)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        expected = "an array arrived, but numpy is not installed in this process"
        assert out["strict"] == expected
        assert out["marker"] == "Invalid"
        assert out["rest"] == "kept"
        assert out["checked"] == f"data['a']: {expected}"
        assert out["sent"] == 2
        assert out["refused"].startswith("value: builtins.set")

    def test_an_array_decoded_while_another_thread_imports_numpy_waits_for_it(self) -> None:
        # A pipeline's coordinator decodes each stage's events on that stage's receiver
        # thread: two arrays arriving at once in a process without numpy imported yet.
        # The second decoder saw numpy in sys.modules half initialized and failed ("module
        # 'numpy' has no attribute 'dtype'"): an invalid frame, taken for a dead stage.
        parts = send(["add", "r1", np.arange(3, dtype=np.float32)])
        code = (
            "import importlib.abc, importlib.util, sys, threading\n"
            "from enginecore.stage import _codec\n"
            "parts = [bytes.fromhex(h) for h in sys.argv[1:]]\n"
            "inserted, decoded = threading.Event(), threading.Event()\n"
            "class Pause(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name != 'numpy':\n"
            "            return None\n"
            "        sys.meta_path.remove(self)\n"
            "        spec = importlib.util.find_spec('numpy')\n"
            "        real = spec.loader.exec_module\n"
            "        def exec_module(module):\n"
            "            inserted.set()  # in sys.modules now, not initialized yet\n"
            "            decoded.wait(1.0)  # the decode fails meanwhile, or waits for it\n"
            "            real(module)\n"
            "        spec.loader.exec_module = exec_module\n"
            "        return spec\n"
            "sys.meta_path.insert(0, Pause())\n"
            "importer = threading.Thread(target=lambda: __import__('numpy'))\n"
            "importer.start()\n"
            "inserted.wait(30)\n"
            "try:\n"
            "    msg = _codec.Decoder(strict=True).decode(parts)\n"
            "    print(type(msg[2]).__name__, msg[2].tolist())\n"
            "except Exception as exc:\n"
            "    print('error', exc)\n"
            "decoded.set()\n"
            "importer.join()\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, *(bytes(p).hex() for p in parts)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "ndarray [0.0, 1.0, 2.0]"

    def test_decoding_plain_values_does_not_import_numpy(self) -> None:
        code = (
            "import sys, msgspec\n"
            "from enginecore.stage import _codec\n"
            "parts = _codec.Encoder().encode(_codec.prepare([1, 'a', b'x' * 2000]))\n"
            "value = _codec.Decoder(strict=True).decode(parts)\n"
            "_codec.check_received(value)\n"
            "print('numpy' in sys.modules)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "False"
