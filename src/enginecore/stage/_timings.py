"""Per-request timings: what a stream knows of when its request was sent, when its outputs
arrived and when it ended (``stream.timings``, both clients).

The receiver records the raw readings in the stream (:class:`~enginecore.stage._session.
StreamCore`: the send's clock reading, one arrival reading per output, the end's reading
and its :class:`~enginecore.stage._session.End`); :func:`snapshot` turns them into a
:class:`StreamTimings` when someone asks, so that the receiver pays one list append per
output and nothing else. Every reading is a ``time.monotonic()`` value: the same clock and,
for arrivals, the same reading per received frame that the client's liveness rules use.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ._session import End

__all__ = ["Outcome", "StreamTimings", "snapshot"]

Outcome = Literal["finished", "aborted", "error"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamTimings:
    """A snapshot of one request's timings, from ``stream.timings``.

    Every ``*_at`` field is a ``time.monotonic()`` reading in seconds (compare them with
    other ``time.monotonic()`` readings of this process, never across processes); every
    duration is in seconds. An output *arrives* when the client's reader (the receiver
    thread, a ``call_utility`` that reads the socket for it, or the asyncio client's reader)
    takes the frame that carries it off the output socket: the clock is read once per frame,
    and every output in that frame, of every request, gets that one reading. The stage sends
    a step's outputs as one event, and several steps' events share a frame when the client
    or the stage's output thread lags behind; outputs of one request that came in one frame
    therefore have the same arrival time, and the gaps between them are ``0.0``. So
    ``len(gaps) == outputs - 1`` always holds, and a gap of ``0.0`` means "arrived
    together", not "produced together".
    """

    sent_at: float
    """When the request was handed to the socket: the clock is read just before the send
    (``add_many``: once, for the whole frame). No output can arrive before it."""
    first_output_at: float | None
    """When the first output arrived; ``None`` before it."""
    last_output_at: float | None
    """When the latest output arrived; ``None`` before the first."""
    ended_at: float | None
    """When the client learned that the stream ended: the arrival of its finished output,
    of its ``aborted`` or ``error`` event, or the moment the client found the stage gone
    (:class:`~enginecore.stage.EngineDeadError`) or was closed
    (:class:`~enginecore.stage.StageClosedError`). ``None`` while the request runs. Set
    when the end reaches the stream, whether or not the consumer has read it yet."""
    outcome: Outcome | None
    """How the stream ended: ``"finished"`` (its finished output), ``"aborted"`` (an abort
    applied in the stage), ``"error"`` (it raises :attr:`error`); ``None`` while it runs."""
    error: BaseException | None = field(repr=False)
    """With :attr:`outcome` ``"error"``: the exception the stream raises
    (:class:`~enginecore.stage.RequestError`, :class:`~enginecore.stage.EngineDeadError`,
    :class:`~enginecore.stage.StageClosedError`); else ``None``."""
    outputs: int
    """How many outputs have arrived (read or not)."""
    gaps: tuple[float, ...] = field(repr=False)
    """The time between each output's arrival and the next one's: ``outputs - 1`` values
    (``()`` before the second output); ``0.0`` for outputs that arrived in one frame."""
    time_to_first_output: float | None
    """``first_output_at - sent_at``; ``None`` before the first output."""
    mean_gap: float | None
    """The mean of :attr:`gaps`, ``(last_output_at - first_output_at) / (outputs - 1)``;
    ``None`` before the second output."""
    max_gap: float | None
    """The largest of :attr:`gaps`; ``None`` before the second output."""
    total: float | None
    """``ended_at - sent_at``; ``None`` while the request runs."""


def snapshot(
    sent_at: float, arrivals: Sequence[float], ended_at: float | None, end: End | None
) -> StreamTimings:
    """The :class:`StreamTimings` of a stream sent at *sent_at*, whose outputs arrived at
    *arrivals* (a copy: the receiver may append to the stream's own list meanwhile), which
    ended at *ended_at* with *end* (both ``None`` while it runs)."""
    n = len(arrivals)
    first = last = mean_gap = max_gap = None
    gaps: tuple[float, ...] = ()
    if n:
        first, last = arrivals[0], arrivals[-1]
        if n > 1:
            gaps = tuple(map(operator.sub, arrivals[1:], arrivals[:-1]))
            mean_gap = (last - first) / (n - 1)
            max_gap = max(gaps)
    outcome: Outcome | None = None
    error = None
    if end is not None:
        if end.exc is not None:
            outcome, error = "error", end.exc
        else:
            outcome = "aborted" if end.aborted else "finished"
    return StreamTimings(
        sent_at=sent_at,
        first_output_at=first,
        last_output_at=last,
        ended_at=ended_at,
        outcome=outcome,
        error=error,
        outputs=n,
        gaps=gaps,
        time_to_first_output=None if first is None else first - sent_at,
        mean_gap=mean_gap,
        max_gap=max_gap,
        total=None if ended_at is None else ended_at - sent_at,
    )
