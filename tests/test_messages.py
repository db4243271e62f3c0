"""Messages: exact positional shapes, frozen, slotted, and clear errors for misuse."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from enginecore import Abort, Add, Utility, Wakeup


class TestShapes:
    def test_positional_field_order(self) -> None:
        assert Add("r", 3) == Add(req_id="r", data=3)
        assert Abort(["r"]).req_ids == ["r"]
        u = Utility(7, "div", (1, 2))
        assert (u.call_id, u.name, u.args) == (7, "div", (1, 2))
        assert Utility(1, "x").args == ()
        assert Wakeup() == Wakeup()

    @pytest.mark.parametrize("msg", [Add("r", 1), Abort(["r"]), Utility(1, "x", ()), Wakeup()])
    def test_messages_are_frozen_and_slotted(self, msg: object) -> None:
        assert not hasattr(msg, "__dict__")
        field = next(iter(dataclasses.fields(msg)), None)  # type: ignore[arg-type]
        if field is not None:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(msg, field.name, None)


class TestValidation:
    def test_abort_of_a_bare_string_is_rejected(self) -> None:
        with pytest.raises(TypeError, match=r"Abort\(\['r1'\]\)"):
            Abort("r1")

    @pytest.mark.parametrize(
        ("req_ids", "match"),
        [
            (None, "got NoneType"),
            (7, "got int"),
            (iter(["r1"]), "got list_iterator"),
            ((rid for rid in ["r1"]), "got generator"),
        ],
        ids=["none", "int", "iterator", "generator"],
    )
    def test_abort_of_no_collection_is_rejected(self, req_ids: Any, match: str) -> None:
        # A one-shot iterator would be consumed by the first pass of an engine's abort():
        # one that logs the ids, or calls super().abort(req_ids) and then iterates them
        # again, silently aborts nothing.
        with pytest.raises(TypeError, match=rf"Abort\(req_ids\) takes a collection.*{match}"):
            Abort(req_ids)

    @pytest.mark.parametrize("req_ids", [["r1"], ("r1", "r2"), {"r1"}, {"r1": 0}.keys(), []])
    def test_abort_takes_any_collection(self, req_ids: Any) -> None:
        assert Abort(req_ids).req_ids is req_ids

    def test_utility_args_must_be_a_tuple(self) -> None:
        with pytest.raises(TypeError, match="must be a tuple, got list"):
            Utility(1, "div", [1, 2])  # type: ignore[arg-type]


class TestMakeAdd:
    def test_builds_the_same_frozen_add(self) -> None:
        from enginecore._messages import make_add

        add = make_add("r1", [1, 2])
        assert type(add) is Add
        assert add == Add("r1", [1, 2])
        assert hash(make_add("r1", 3)) == hash(Add("r1", 3))
        with pytest.raises(dataclasses.FrozenInstanceError):
            add.req_id = "r2"  # type: ignore[misc]
