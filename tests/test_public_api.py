"""The public surface: one __init__, a sorted __all__, every name exported once."""

from __future__ import annotations

import subprocess
import sys
import types

import enginecore


class TestPublicApi:
    def test_all_is_sorted_and_unique(self) -> None:
        assert list(enginecore.__all__) == sorted(set(enginecore.__all__))

    def test_every_public_name_is_exported(self) -> None:
        public = {
            name
            for name, obj in vars(enginecore).items()
            if not name.startswith("_") and not isinstance(obj, types.ModuleType)  # subpackages
        }
        assert public == set(enginecore.__all__)

    def test_names_from_the_issue_are_exported(self) -> None:
        for name in (
            "Abort",
            "Add",
            "CountdownEngine",
            "Engine",
            "EngineCoreLoop",
            "LoopEndedError",
            "PipelinedEngine",
            "RequestRejected",
            "Utility",
            "Wakeup",
            "shutdown_on_signals",
        ):
            assert name in enginecore.__all__
            assert getattr(enginecore, name) is not None

    def test_public_objects_claim_the_public_module(self) -> None:
        for name in enginecore.__all__:
            obj = getattr(enginecore, name)
            if isinstance(obj, type):
                assert obj.__module__.startswith("enginecore."), name

    def test_import_needs_no_optional_dependency(self) -> None:
        code = (
            "import sys\n"
            "sys.modules['zmq'] = None\n"
            "sys.modules['msgspec'] = None\n"
            "import enginecore\n"
            "assert 'zmq' not in sys.modules or sys.modules['zmq'] is None\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
