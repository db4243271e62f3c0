"""enginecore.stage: the stage process around an :class:`~enginecore.EngineCoreLoop`.

A child process runs the loop on its main thread with two ZMQ IO threads; a client in the
parent (:class:`StageClient`, blocking, or :class:`AsyncStageClient`, asyncio) talks to it
over msgpack frames (``docs/wire.md``). ``docs/stage.md`` is the guide. Needs the ``zmq``
extra: ``pip install 'enginecore[zmq]'``.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

try:
    import msgspec  # noqa: F401
    import zmq  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"enginecore.stage needs pyzmq and msgspec ({_exc}); "
        f"install them with: pip install 'enginecore[zmq]'"
    ) from _exc

# The public names and the private module of each, imported on first use (PEP 562): a stage
# process (a launched stage, `serve`, a Ray actor) imports only the modules it runs, not the
# clients, pools and pipelines (docs/performance.md, "Stages placed on Ray").
_EXPORTS: _typing.Final[dict[str, str]] = {
    "Aborted": "_wire",
    "AsyncPipeline": "_apipeline",
    "AsyncPipelineStream": "_apipeline",
    "AsyncPoolRequestStream": "_apool",
    "AsyncRequestStream": "_aclient",
    "AsyncStageClient": "_aclient",
    "AsyncStagePool": "_apool",
    "AuthenticationError": "_errors",
    "CurveKeys": "_curve",
    "EngineDeadError": "_errors",
    "ErrorReport": "_wire",
    "Fatal": "_wire",
    "LeastLoaded": "_pool_core",
    "MessageTooLargeError": "_errors",
    "NOTHING": "_edge",
    "NoReplicaError": "_errors",
    "Outputs": "_wire",
    "PROTOCOL_VERSION": "_wire",
    "Pipeline": "_pipeline",
    "PipelineFullError": "_errors",
    "PipelineRequestError": "_errors",
    "PipelineStage": "_pipelinebase",
    "PipelineStageDeadError": "_errors",
    "PipelineStream": "_pipeline",
    "PoolEvent": "_pool_core",
    "PoolRequest": "_pool_core",
    "PoolRequestStream": "_pool",
    "ProtocolError": "_errors",
    "Replica": "_pool_core",
    "ReplicaDeadError": "_errors",
    "ReplicaEvent": "_pool_core",
    "ReplicaGone": "_pool_core",
    "ReplicaState": "_pool_core",
    "ReplicaView": "_pool_core",
    "RequestError": "_errors",
    "RequestFailed": "_pool_core",
    "RequestStream": "_client",
    "RestartPolicy": "_pool_core",
    "Retry": "_pipelinebase",
    "Routing": "_pool_core",
    "Scored": "_pool_core",
    "SessionLostError": "_errors",
    "Shutdown": "_wire",
    "StageClient": "_client",
    "StageClosedError": "_errors",
    "StageEvent": "_wire",
    "StageHealth": "_session",
    "StageLoad": "_statistics",
    "StageObserver": "_observer",
    "StagePool": "_pool",
    "StageStartupError": "_errors",
    "StageStatistics": "_statistics",
    "Sticky": "_pool_core",
    "StreamTimings": "_timings",
    "UtilityError": "_errors",
    "UtilityResult": "_wire",
    "check_encodable": "_wire",
}

if _typing.TYPE_CHECKING:
    from ._aclient import AsyncRequestStream, AsyncStageClient
    from ._apipeline import AsyncPipeline, AsyncPipelineStream
    from ._apool import AsyncPoolRequestStream, AsyncStagePool
    from ._client import RequestStream, StageClient
    from ._curve import CurveKeys
    from ._edge import NOTHING
    from ._errors import (
        AuthenticationError,
        EngineDeadError,
        MessageTooLargeError,
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
    from ._pipelinebase import PipelineStage, Retry
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
    "MessageTooLargeError",
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
    "Retry",
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


def __getattr__(name: str) -> _typing.Any:
    """A public name, imported from its module on first use (then kept in the package)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
