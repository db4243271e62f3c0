"""enginecore.stage: the stage process around an :class:`~enginecore.EngineCoreLoop`.

A child process runs the loop on its main thread with two ZMQ IO threads; a client in the
parent (:class:`StageClient`, blocking, or :class:`AsyncStageClient`, asyncio) talks to it
over msgpack frames (``docs/wire.md``). ``docs/stage.md`` is the guide. Needs the ``zmq``
extra: ``pip install 'enginecore[zmq]'``.
"""

from __future__ import annotations

try:
    import msgspec  # noqa: F401
    import zmq  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"enginecore.stage needs pyzmq and msgspec ({_exc}); "
        f"install them with: pip install 'enginecore[zmq]'"
    ) from _exc

from ._aclient import AsyncRequestStream, AsyncStageClient
from ._apipeline import AsyncPipeline, AsyncPipelineStream
from ._apool import AsyncPoolRequestStream, AsyncStagePool
from ._client import RequestStream, StageClient
from ._curve import CurveKeys
from ._edge import NOTHING
from ._errors import (
    AuthenticationError,
    EngineDeadError,
    NoReplicaError,
    PipelineFullError,
    PipelineRequestError,
    PipelineStageDeadError,
    ProtocolError,
    ReplicaDeadError,
    RequestError,
    SessionLostError,
    StageClosedError,
    StageStartupError,
    UtilityError,
)
from ._observer import StageObserver
from ._pipeline import Pipeline, PipelineStream
from ._pipelinebase import PipelineStage
from ._pool import PoolRequestStream, StagePool
from ._pool_core import (
    LeastLoaded,
    PoolEvent,
    PoolRequest,
    Replica,
    ReplicaEvent,
    ReplicaGone,
    ReplicaState,
    ReplicaView,
    RequestFailed,
    RestartPolicy,
    Routing,
    Scored,
    Sticky,
)
from ._session import StageHealth
from ._statistics import StageLoad, StageStatistics
from ._timings import StreamTimings
from ._wire import (
    PROTOCOL_VERSION,
    Aborted,
    ErrorReport,
    Fatal,
    Outputs,
    Shutdown,
    StageEvent,
    UtilityResult,
    check_encodable,
)

__all__ = [
    "NOTHING",
    "PROTOCOL_VERSION",
    "Aborted",
    "AsyncPipeline",
    "AsyncPipelineStream",
    "AsyncPoolRequestStream",
    "AsyncRequestStream",
    "AsyncStageClient",
    "AsyncStagePool",
    "AuthenticationError",
    "CurveKeys",
    "EngineDeadError",
    "ErrorReport",
    "Fatal",
    "LeastLoaded",
    "NoReplicaError",
    "Outputs",
    "Pipeline",
    "PipelineFullError",
    "PipelineRequestError",
    "PipelineStage",
    "PipelineStageDeadError",
    "PipelineStream",
    "PoolEvent",
    "PoolRequest",
    "PoolRequestStream",
    "ProtocolError",
    "Replica",
    "ReplicaDeadError",
    "ReplicaEvent",
    "ReplicaGone",
    "ReplicaState",
    "ReplicaView",
    "RequestError",
    "RequestFailed",
    "RequestStream",
    "RestartPolicy",
    "Routing",
    "Scored",
    "SessionLostError",
    "Shutdown",
    "StageClient",
    "StageClosedError",
    "StageEvent",
    "StageHealth",
    "StageLoad",
    "StageObserver",
    "StagePool",
    "StageStartupError",
    "StageStatistics",
    "Sticky",
    "StreamTimings",
    "UtilityError",
    "UtilityResult",
    "check_encodable",
]
