"""Typing is part of the API: mypy accepts a user's engine as an Engine and rejects a wrong one."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

_GOOD = """
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from enginecore import Add, EngineCoreLoop, Event, PipelinedEngine


class MyEngine:
    def __init__(self) -> None:
        self.live: dict[str, int] = {}

    def has_work(self) -> bool:
        return bool(self.live)

    def add(self, req_id: str, data: Any) -> None:
        self.live[req_id] = int(data)

    def abort(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self.live.pop(rid, None)

    def utility(self, name: str, args: tuple[Any, ...]) -> Any:
        return len(self.live)

    def step(self) -> list[str]:
        done = list(self.live)
        self.live.clear()
        return done


def emit(event: Event) -> None:
    print(event)


loop = EngineCoreLoop(MyEngine(), emit)
loop.submit(Add("r", 1))


class MyPipelinedEngine:
    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.launched = 0

    def has_work(self) -> bool:
        return bool(self.live)

    def add(self, req_id: str, data: Any) -> None:
        self.live[req_id] = int(data)

    def abort(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self.live.pop(rid, None)

    def utility(self, name: str, args: tuple[Any, ...]) -> Future[int]:
        done: Future[int] = Future()
        done.set_result(len(self.live))
        return done

    def launch(self) -> tuple[int, list[str]]:
        self.launched += 1
        return self.launched, list(self.live)

    def collect(self, handle: tuple[int, list[str]]) -> list[str]:
        return [rid for rid in handle[1] if rid in self.live]

    def cancel(self, handle: tuple[int, list[str]]) -> None:
        pass


engine: PipelinedEngine[tuple[int, list[str]]] = MyPipelinedEngine()
pipelined = EngineCoreLoop(MyPipelinedEngine(), emit, pipeline_depth=2)
depth: int = pipelined.pipeline_depth
"""

_BAD = """
from collections.abc import Sequence
from typing import Any

from enginecore import EngineCoreLoop, PipelinedEngine


class NoStep:
    def has_work(self) -> bool:
        return False

    def add(self, req_id: str, data: Any) -> None: ...
    def abort(self, req_ids: list[str]) -> None: ...
    def utility(self, name: str, args: tuple[Any, ...]) -> Any: ...


class WrongHasWork:
    def has_work(self, now: float) -> bool:
        return False

    def add(self, req_id: str, data: Any) -> None: ...
    def abort(self, req_ids: list[str]) -> None: ...
    def utility(self, name: str, args: tuple[Any, ...]) -> Any: ...
    def step(self) -> list[Any]:
        return []


class CollectTakesNoHandle:
    def has_work(self) -> bool:
        return False

    def add(self, req_id: str, data: Any) -> None: ...
    def abort(self, req_ids: Sequence[str]) -> None: ...
    def utility(self, name: str, args: tuple[Any, ...]) -> Any: ...
    def launch(self) -> int:
        return 0

    def collect(self) -> list[Any]:
        return []


class HandleMismatch:
    def has_work(self) -> bool:
        return False

    def add(self, req_id: str, data: Any) -> None: ...
    def abort(self, req_ids: Sequence[str]) -> None: ...
    def utility(self, name: str, args: tuple[Any, ...]) -> Any: ...
    def launch(self) -> int:
        return 0

    def collect(self, handle: str) -> list[Any]:
        return []


EngineCoreLoop(NoStep(), print)
EngineCoreLoop(WrongHasWork(), print)
EngineCoreLoop(CollectTakesNoHandle(), print, pipeline_depth=2)
wrong: PipelinedEngine[int] = HandleMismatch()
"""

# Iterating a pool's or a pipeline's stream: iter() / aiter() give the stream's own type,
# with its own attributes (a pool stream's replica and migrations), not the base class's.
_STREAMS = """
from enginecore.stage import (
    AsyncPipeline,
    AsyncPipelineStream,
    AsyncPoolRequestStream,
    AsyncRequestStream,
    AsyncStageClient,
    AsyncStagePool,
    Pipeline,
    PipelineStream,
    PoolRequestStream,
    RequestStream,
    StageClient,
    StagePool,
)


def blocking(client: StageClient, pool: StagePool, pipe: Pipeline) -> None:
    plain: RequestStream = iter(client.add("a", 1))
    pooled: PoolRequestStream = iter(pool.add("b", 1))
    print(plain, pooled.replica, pooled.migrations)
    piped: PipelineStream = iter(pipe.add("c", 1))
    print(piped.aborted)


async def awaited(client: AsyncStageClient, pool: AsyncStagePool, pipe: AsyncPipeline) -> None:
    plain: AsyncRequestStream = aiter(await client.add("a", 1))
    pooled: AsyncPoolRequestStream = aiter(await pool.add("b", 1))
    print(plain, pooled.replica, pooled.migrations)
    piped: AsyncPipelineStream = aiter(await pipe.add("c", 1))
    print(piped.aborted)
"""


def _mypy(tmp_path: Path, source: str) -> tuple[str, int]:
    path = tmp_path / "user_engine.py"
    path.write_text(textwrap.dedent(source))
    stdout, stderr, status = mypy_api.run(
        ["--strict", "--no-incremental", "--config-file=", "--cache-dir=/dev/null", str(path)]
    )
    return stdout + stderr, status


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestEngineProtocolUnderMypy:
    def test_a_user_engine_is_accepted(self, tmp_path: Path) -> None:
        out, status = _mypy(tmp_path, _GOOD)
        assert status == 0, out

    def test_engines_missing_or_mistyping_a_method_are_rejected(self, tmp_path: Path) -> None:
        out, status = _mypy(tmp_path, _BAD)
        assert status == 1, out
        assert 'Argument 1 to "EngineCoreLoop" has incompatible type "NoStep"' in out
        assert 'Argument 1 to "EngineCoreLoop" has incompatible type "WrongHasWork"' in out
        assert 'Argument 1 to "EngineCoreLoop" has incompatible type "CollectTakesNoHandle"' in out
        # The handle launch() returns must be the one collect() takes.
        assert 'has type "HandleMismatch", variable has type "PipelinedEngine[int]"' in out
        assert "def collect(self, handle: str)" in out

    def test_the_readme_examples_type_check(self, tmp_path: Path) -> None:
        readme = (Path(__file__).parent.parent / "README.md").read_text()
        blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
        assert len(blocks) >= 2, "README.md lost its examples"
        for block in blocks:
            out, status = _mypy(tmp_path, block)
            assert status == 0, f"{out}\n{block}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_iterating_a_pool_or_pipeline_stream_keeps_its_type(tmp_path: Path) -> None:
    out, status = _mypy(tmp_path, _STREAMS)
    assert status == 0, out
