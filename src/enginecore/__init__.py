"""enginecore: the engine loop of a stage process, exact, typed and tested.

The public API is re-exported here; everything in ``enginecore._*`` is private.
"""

from ._engine import CountdownEngine, Engine, PipelinedEngine
from ._exceptions import EngineCoreError, LoopAlreadyRunError, LoopEndedError, RequestRejected
from ._loop import EngineCoreLoop
from ._messages import (
    Abort,
    Add,
    Control,
    Event,
    FatalEvent,
    Message,
    OutputEvent,
    ShutdownEvent,
    Utility,
    UtilityEvent,
    Wakeup,
)
from ._signals import shutdown_on_signals
from ._stats import LoopStatistics

__version__ = "0.1.0.dev0"

__all__ = [
    "Abort",
    "Add",
    "Control",
    "CountdownEngine",
    "Engine",
    "EngineCoreError",
    "EngineCoreLoop",
    "Event",
    "FatalEvent",
    "LoopAlreadyRunError",
    "LoopEndedError",
    "LoopStatistics",
    "Message",
    "OutputEvent",
    "PipelinedEngine",
    "RequestRejected",
    "ShutdownEvent",
    "Utility",
    "UtilityEvent",
    "Wakeup",
    "shutdown_on_signals",
]
