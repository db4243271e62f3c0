"""Routing: which request each output of a step belongs to, and whether it is the last.

Pure functions of the engine's hooks (``docs/stage.md``, "Routing outputs to requests"):
no socket, no thread. :func:`make_router` runs once per stage; the router it returns runs on
the loop thread for every step that produced outputs, and is on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final, NoReturn

import msgspec

from ._codec import only_types

__all__ = ["Route", "make_router", "only_bools"]

Route = Callable[[Iterable[Any], list[Any], list[Any], list[Any]], None]
"""``route(step_outputs, req_ids, finished, payloads)``: appends one step's routed outputs to
the three lists of its ``outputs`` event."""

_ROUTE_SHAPE: Final = "(req_ids: list[str | None], finished: list[bool], payloads: list)"
_RID_TYPES: Final = frozenset({str, type(None)})
_BOOL_LIST: Final = list[bool]


def only_bools(items: list[Any]) -> bool:
    """Whether every item of *items* is a ``bool`` (``bool`` has no subclasses; ``0`` and
    ``1`` are not bools). msgspec's strict conversion checks it in C: ~2.5 ns an item,
    against ~7.5 for :func:`_codec.only_types` (the copy it makes is dropped)."""
    try:
        msgspec.convert(items, _BOOL_LIST)
    except msgspec.ValidationError:
        return False
    return True


def make_router(engine: object) -> Route:
    """Build the router of *engine*'s step outputs.

    In order of preference: the engine's ``route_outputs(outputs)``, which returns
    ``(req_ids, finished, payloads)`` for a whole step; its ``route_output(out)``, which
    returns ``(req_id, finished, payload)`` for one output; else an output that is a
    2-tuple/list ``(req_id: str, payload)`` is routed to ``req_id``, finished when the
    engine's optional ``is_finished(out)`` says so, and any other output is unrouted
    (``req_id=None``). What a hook returns is checked: a wrong shape raises
    :class:`TypeError`, fatal to the loop (a bug in the engine); ``route_output`` has
    appended the outputs before the bad one by then, ``route_outputs`` none of its step.
    """
    name = type(engine).__name__
    batch_hook = getattr(engine, "route_outputs", None)
    if callable(batch_hook):

        def route_batch(
            outs: Iterable[Any], rids: list[Any], fins: list[Any], payloads: list[Any]
        ) -> None:
            outs = outs if outs.__class__ is list else list(outs)
            if not outs:
                return
            cols = batch_hook(outs)
            if cols.__class__ is not tuple or len(cols) != 3:
                _bad_batch(name, len(outs), cols)
            r, f, p = cols
            n = len(outs)
            if (
                r.__class__ is not list
                or f.__class__ is not list
                or p.__class__ is not list
                or len(r) != n
                or len(f) != n
                or len(p) != n
                or not only_types(r, _RID_TYPES)
                or not only_bools(f)
            ):
                _bad_batch(name, n, cols)
            rids += r
            fins += f
            payloads += p

        return route_batch

    hook = getattr(engine, "route_output", None)
    if callable(hook):

        def route_each(
            outs: Iterable[Any], rids: list[Any], fins: list[Any], payloads: list[Any]
        ) -> None:
            for out in outs:
                triple = hook(out)
                if triple.__class__ is not tuple or len(triple) != 3:
                    _bad_route(name, triple)
                rid, finished, payload = triple
                if finished.__class__ is not bool or (rid.__class__ is not str and rid is not None):
                    _bad_route(name, triple)
                rids.append(rid)
                fins.append(finished)
                payloads.append(payload)

        return route_each

    is_finished = getattr(engine, "is_finished", None)
    if not callable(is_finished):
        is_finished = None

    def route_default(
        outs: Iterable[Any], rids: list[Any], fins: list[Any], payloads: list[Any]
    ) -> None:
        for out in outs:
            t = out.__class__
            if (t is tuple or t is list) and len(out) == 2 and out[0].__class__ is str:
                finished = False if is_finished is None else bool(is_finished(out))
                rids.append(out[0])
                fins.append(finished)
                payloads.append(out[1])
            else:
                rids.append(None)
                fins.append(False)
                payloads.append(out)

    return route_default


def _bad_route(name: str, triple: object) -> NoReturn:
    raise TypeError(
        f"{name}.route_output() must return "
        f"(req_id: str | None, finished: bool, payload), got {triple!r:.200}"
    )


def _bad_batch(name: str, n: int, cols: object) -> NoReturn:
    raise TypeError(
        f"{name}.route_outputs() must return {_ROUTE_SHAPE}, three lists of one item per "
        f"output ({n}), got {cols!r:.200}"
    )
