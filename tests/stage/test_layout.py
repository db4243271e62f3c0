"""The package's import layout: a client process does not load the stage's server side, and
a stage's process (launched, served, or a Ray actor's) does not load the client side."""

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


_CLIENT = (
    "enginecore.stage._client",
    "enginecore.stage._aclient",
    "enginecore.stage._clientbase",
    "enginecore.stage._session",
    "enginecore.stage._pool",
    "enginecore.stage._apool",
    "enginecore.stage._pool_core",
    "enginecore.stage._pipeline",
    "enginecore.stage._apipeline",
    "enginecore.stage._launch",
    "enginecore.stage.ray",
)


@pytest.mark.parametrize(
    "module",
    [
        "enginecore.stage",
        "enginecore.stage._client",
        "enginecore.stage._aclient",
        "enginecore.stage.ray",  # the driver side of Ray: the actor's module runs nothing
    ],
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


@pytest.mark.parametrize(
    "module",
    [
        "enginecore.stage._process",  # a launched stage and serve
        "enginecore.stage._ray_actor",  # a Ray actor's process, before and after start
        "enginecore.stage._runtime",
    ],
)
def test_a_stage_process_does_not_load_the_client_side(module: str) -> None:
    # enginecore.stage imports its public names on first use: a stage's process loads the
    # runtime it runs, not the clients, pools and pipelines.
    code = (
        f"import sys, {module}\n"
        "import enginecore.stage._process, enginecore.stage._runtime\n"
        f"loaded = sorted(m for m in {_CLIENT!r} if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
