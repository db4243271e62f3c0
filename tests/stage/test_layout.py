"""The package's import layout: a client process does not load the stage's server side."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SERVER = (
    "enginecore.stage._runtime",
    "enginecore.stage._process",
    "enginecore.stage._inbox",
    "enginecore.stage._outbox",
    "enginecore.stage._input_queue",
    "enginecore.stage._stage_engine",
    "enginecore.stage._pipe_stage",  # a pipeline's stage side; the coordinator needs only _edge
    "enginecore.stage._routing",  # the client shares only _codec, _wire, _errors, _logs with it
)


@pytest.mark.parametrize(
    "module", ["enginecore.stage", "enginecore.stage._client", "enginecore.stage._aclient"]
)
def test_importing_a_client_does_not_load_the_stage_runtime(module: str) -> None:
    # A fresh interpreter: this one has the runtime loaded by other tests already.
    code = (
        f"import sys, {module}\n"
        f"loaded = sorted(m for m in {_SERVER!r} if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
