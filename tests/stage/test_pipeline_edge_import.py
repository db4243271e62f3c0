"""A pipeline stage whose ``edge`` does not resolve to a function (``docs/pipelines.md``,
"Stages and edges"): its launch fails with a :class:`~enginecore.stage.StageStartupError`
that names the stage and says it is the edge, not the engine's factory, that is wrong."""

from __future__ import annotations

import pytest

from enginecore.stage import Pipeline, PipelineStage, StageStartupError

COUNTDOWN = "enginecore:CountdownEngine"
RELAY = "enginecore.stage.testing:relay"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.mark.parametrize(
    ("edge", "says"),
    [
        ("enginecore:__version__", r"edge 'enginecore:__version__' is a str, not callable"),
        ("enginecore.no_such_module:fn", r"edge 'enginecore.no_such_module:fn' .*No module"),
        ("enginecore:no_such_fn", r"edge 'enginecore:no_such_fn' .*no_such_fn"),
        ("no_colon", r"edge must look like 'pkg.module:fn', got 'no_colon'"),
    ],
)
def test_an_edge_that_does_not_resolve_fails_the_launch_naming_the_edge(
    no_leftovers: str, edge: str, says: str
) -> None:
    with pytest.raises(StageStartupError, match=says) as info:
        Pipeline.launch([PipelineStage(COUNTDOWN, name="head", edge=edge), RELAY])
    assert "pipeline stage 'head'" in str(info.value)
    assert "engine factory" not in str(info.value)
