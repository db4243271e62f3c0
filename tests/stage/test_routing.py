"""Routing a step's outputs to requests: the routers that make_router builds, which are the
ones the stage's step runs (``_stage_engine.make_step``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from enginecore import CountdownEngine
from enginecore.stage._codec import only_types
from enginecore.stage._routing import make_router, only_bools
from enginecore.stage.testing import EchoEngine, ScriptedEngine


def _route(engine: object, outs: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """The three columns the stage's router appends for one step's outputs."""
    rids: list[Any] = []
    fins: list[Any] = []
    payloads: list[Any] = []
    make_router(engine)(outs, rids, fins, payloads)
    return rids, fins, payloads


class _Str(str):
    """A subclass of str: not a wire type (msgspec refuses it)."""


class _Plain:
    """No hooks at all."""


class _OnlyIsFinished:
    @staticmethod
    def is_finished(out: Any) -> bool:
        return bool(out[1] == "eos")


class _RouteOutput:
    def __init__(self, triple: Any = None) -> None:
        self.triple = triple

    def route_output(self, out: Any) -> Any:
        if out == "bad":
            return self.triple
        return out[0], out[1] == 0, out[1]


class _RouteOutputs:
    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls = 0

    def route_outputs(self, outs: list[Any]) -> Any:
        self.calls += 1
        return self.result


class _BothHooks(_RouteOutput):
    @staticmethod
    def route_outputs(outs: list[Any]) -> Any:
        return ["batch"] * len(outs), [True] * len(outs), outs


class TestBatchHook:
    def test_route_outputs_gives_the_columns(self) -> None:
        assert _route(CountdownEngine(), [("r1", 2), ("r2", 0)]) == (
            ["r1", "r2"],
            [False, True],
            [2, 0],
        )

    def test_it_is_preferred_to_route_output(self) -> None:
        assert _route(_BothHooks(), [("r1", 1)]) == (["batch"], [True], [("r1", 1)])

    def test_outputs_reach_it_as_a_list_even_from_a_generator(self) -> None:
        def outs() -> Iterator[tuple[str, Any]]:
            yield ("a", 1)
            yield ("b", 2)

        assert _route(EchoEngine(), outs()) == (["a", "b"], [True, True], [1, 2])

    def test_an_empty_step_does_not_call_it(self) -> None:
        engine = _RouteOutputs(None)
        assert _route(engine, []) == ([], [], [])
        assert engine.calls == 0

    def test_a_step_appends_after_what_is_there(self) -> None:
        rids: list[Any] = ["x"]
        fins: list[Any] = [False]
        payloads: list[Any] = [0]
        make_router(CountdownEngine())([("r", 0)], rids, fins, payloads)
        assert (rids, fins, payloads) == (["x", "r"], [False, True], [0, 0])

    @pytest.mark.parametrize(
        "result",
        [
            None,
            ["a"],
            (["a"], [False]),
            (["a"], [False], ["p"], ["extra"]),
            [["a"], [False], ["p"]],
            (("a",), [False], ["p"]),
            (["a"], (False,), ["p"]),
            (["a"], [False], ("p",)),
            (["a", "b"], [False], ["p"]),
            (["a"], [False, True], ["p"]),
            (["a"], [False], ["p", "q"]),
            ([1], [False], ["p"]),
            ([b"a"], [False], ["p"]),
            (["a"], [0], ["p"]),
            (["a"], [None], ["p"]),
        ],
    )
    def test_a_bad_result_raises_and_routes_nothing_of_the_step(self, result: Any) -> None:
        rids: list[Any] = []
        fins: list[Any] = []
        payloads: list[Any] = []
        route = make_router(_RouteOutputs(result))
        with pytest.raises(TypeError, match=r"_RouteOutputs\.route_outputs\(\) must return"):
            route([("a", 1)], rids, fins, payloads)
        assert (rids, fins, payloads) == ([], [], [])

    @pytest.mark.parametrize(
        "result",
        [
            (["a", "b", 1], [False] * 3, [1, 2, 3]),  # the first right, a later one wrong
            (["a", None, b"c"], [False] * 3, [1, 2, 3]),
            (["a", "b", "c"], [False, True, 0], [1, 2, 3]),
            (["a", "b", "c"], [False, False, 1], [1, 2, 3]),  # 1 == True, but not a bool
            (["a", _Str("b"), "c"], [False] * 3, [1, 2, 3]),  # msgspec refuses a subclass
        ],
    )
    def test_every_item_of_a_column_is_checked(self, result: Any) -> None:
        route = make_router(_RouteOutputs(result))
        with pytest.raises(TypeError, match=r"_RouteOutputs\.route_outputs\(\) must return"):
            route([("a", 1)] * 3, [], [], [])

    def test_unrouted_outputs_mix_with_routed_ones(self) -> None:
        cols = (["a", None, "b", None], [False, False, True, False], [1, 2, 3, 4])
        assert _route(_RouteOutputs(cols), [1, 2, 3, 4]) == cols


class TestOnlyTypes:
    """The exact-type check of a step's columns (the routed ids, the finished flags and the
    payloads), which takes a fast path when every item has the first one's type."""

    allowed = frozenset({str, type(None)})

    @pytest.mark.parametrize(
        ("items", "ok"),
        [
            ([], True),
            (["a"], True),
            (["a", "b", "c"], True),
            ([None, None], True),
            (["a", None, "b"], True),  # mixed, each allowed: the slow path
            ([None, "a"], True),
            (["a", "b", 1], False),
            ([1, "a"], False),  # the first not allowed
            ([1, 1], False),
            (["a", _Str("b")], False),  # exact types: no subclass
            ([_Str("a"), _Str("b")], False),
        ],
    )
    def test_exact_types_within_the_allowed_set(self, items: list[Any], ok: bool) -> None:
        assert only_types(items, self.allowed) is ok
        assert ok is (set(map(type, items)) <= self.allowed)  # what it replaces

    def test_bools_are_not_ints(self) -> None:
        assert only_types([True, False], frozenset({bool}))
        assert not only_types([True, 1], frozenset({bool}))
        assert not only_types([0, 1], frozenset({bool}))

    @pytest.mark.parametrize(
        ("items", "ok"),
        [
            ([], True),
            ([True, False, False], True),
            ([False, 0], False),  # 0 == False, but not a bool
            ([1], False),
            ([True, None], False),
            ([False, "False"], False),
            ([False, 0.0], False),
        ],
    )
    def test_only_bools_is_exact(self, items: list[Any], ok: bool) -> None:
        assert only_bools(items) is ok
        assert ok is only_types(items, frozenset({bool}))  # what it replaces for the column


class TestPerOutputHook:
    def test_route_output_gives_each_triple(self) -> None:
        assert _route(_RouteOutput(), [("r1", 1), ("r1", 0)]) == (
            ["r1", "r1"],
            [False, True],
            [1, 0],
        )

    def test_scripted_engine_routes_unrouted_values(self) -> None:
        assert _route(ScriptedEngine(), [("r", 1), "tick"]) == (
            ["r", None],
            [False, False],
            [1, "tick"],
        )

    @pytest.mark.parametrize(
        "triple",
        [
            ("r2", 1),
            ["r2", False, 1],
            ("r2", 0, 1),
            (5, False, 1),
            (b"r2", False, 1),
            ("r2", False, 1, 2),
            None,
        ],
    )
    def test_a_bad_triple_raises_after_the_outputs_before_it(self, triple: Any) -> None:
        rids: list[Any] = []
        fins: list[Any] = []
        payloads: list[Any] = []
        route = make_router(_RouteOutput(triple))
        with pytest.raises(TypeError, match=r"_RouteOutput\.route_output\(\) must return"):
            route([("r1", 1), "bad", ("r3", 1)], rids, fins, payloads)
        assert (rids, fins, payloads) == (["r1"], [False], [1])


class TestDefault:
    def test_pairs_are_routed_and_never_finish_without_is_finished(self) -> None:
        assert _route(_Plain(), [("r1", {"tok": 5}), ["r2", 1]]) == (
            ["r1", "r2"],
            [False, False],
            [{"tok": 5}, 1],
        )

    def test_is_finished_marks_the_last_output(self) -> None:
        assert _route(_OnlyIsFinished(), [("r1", "tok"), ("r1", "eos")]) == (
            ["r1", "r1"],
            [False, True],
            ["tok", "eos"],
        )

    @pytest.mark.parametrize("out", ["bare", (1, 2), ("a", "b", "c"), {"r": 1}, None, ("a",)])
    def test_anything_else_is_unrouted(self, out: object) -> None:
        assert _route(_Plain(), [out]) == ([None], [False], [out])
