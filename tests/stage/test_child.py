"""The stage side's pure parts: routing outputs to requests, resolving factories."""

from __future__ import annotations

from typing import Any

import pytest

from enginecore import CountdownEngine
from enginecore.stage._child import StageRuntime, build_engine, import_factory, make_router
from enginecore.stage.testing import ScriptedEngine


class _Plain:
    """No hooks at all."""


class _OnlyIsFinished:
    @staticmethod
    def is_finished(out: Any) -> bool:
        return bool(out[1] == "eos")


class _BadRoute:
    @staticmethod
    def route_output(out: Any) -> Any:
        return out  # not a (req_id, finished, payload) triple


class TestMakeRouter:
    def test_countdown_engine_routes_with_its_hook(self) -> None:
        route = make_router(CountdownEngine())
        assert route(("r1", 2)) == ("r1", False, 2)
        assert route(("r1", 0)) == ("r1", True, 0)

    def test_default_routes_pairs_and_never_finishes_without_is_finished(self) -> None:
        route = make_router(_Plain())
        assert route(("r1", {"tok": 5})) == ("r1", False, {"tok": 5})
        assert route(["r2", 1]) == ("r2", False, 1)

    def test_default_uses_is_finished(self) -> None:
        route = make_router(_OnlyIsFinished())
        assert route(("r1", "tok")) == ("r1", False, "tok")
        assert route(("r1", "eos")) == ("r1", True, "eos")

    @pytest.mark.parametrize("out", ["bare", (1, 2), ("a", "b", "c"), {"r": 1}, None])
    def test_anything_else_is_unrouted(self, out: object) -> None:
        assert make_router(_Plain())(out) == (None, False, out)

    def test_a_bad_hook_result_raises(self) -> None:
        with pytest.raises(TypeError, match=r"route_output\(\) must return"):
            make_router(_BadRoute())(("r1", 1))

    def test_scripted_engine_routes_unrouted_values(self) -> None:
        route = make_router(ScriptedEngine())
        assert route("tick") == (None, False, "tick")


class TestFactories:
    def test_import_factory_resolves_dotted_attributes(self) -> None:
        assert import_factory("enginecore:CountdownEngine.is_finished")(("r", 0)) is True

    @pytest.mark.parametrize("spec", ["enginecore", ":x", "enginecore:", "a.b"])
    def test_malformed(self, spec: str) -> None:
        with pytest.raises(ValueError, match=r"pkg\.module:factory"):
            import_factory(spec)

    def test_not_callable(self) -> None:
        with pytest.raises(TypeError, match="not callable"):
            import_factory("enginecore:__version__")

    def test_build_engine_checks_the_protocol(self) -> None:
        assert isinstance(build_engine("enginecore:CountdownEngine", {}), CountdownEngine)
        with pytest.raises(TypeError, match="does not implement"):
            build_engine("builtins:list", {})


class _TwoOutputs:
    """route_output is fine for the first output and broken for the second."""

    def __init__(self, second: Any) -> None:
        self.second = second

    def has_work(self) -> bool:
        return True

    def add(self, req_id: str, data: Any) -> None:
        pass

    def abort(self, req_ids: Any) -> None:
        pass

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        return None

    def step(self) -> list[Any]:
        return [("r1", 1), self.second]

    @staticmethod
    def route_output(out: Any) -> Any:
        return out if len(out) != 2 else (out[0], False, out[1])


class TestStageStep:
    @pytest.mark.parametrize(
        "second", [("r2", 1), ["r2", False, 1], ("r2", 0, 1), (5, False, 1), ("r2", False, 1, 2)]
    )
    def test_a_bad_route_is_fatal_after_the_outputs_before_it(self, second: Any) -> None:
        runtime = StageRuntime(
            _TwoOutputs(second), "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", engine_name="t"
        )
        try:
            if second == ("r2", 1):  # a valid one: both outputs, nothing for the loop
                assert runtime.loop._engine.step() == ()
                assert runtime._outq.get_nowait() == [
                    ("output", "r1", False, 1),
                    ("output", "r2", False, 1),
                ]
                return
            with pytest.raises(TypeError, match=r"_TwoOutputs\.route_output\(\) must return"):
                runtime.loop._engine.step()
            assert runtime._outq.get_nowait() == [("output", "r1", False, 1)]
        finally:
            runtime._ctx.destroy(linger=0)
