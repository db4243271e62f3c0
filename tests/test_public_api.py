"""The public surface: one __init__, a sorted __all__, every name exported once."""

from __future__ import annotations

import re
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
            # The object itself, not an alias of another one.
            assert getattr(enginecore, name).__name__ == name

    def test_public_objects_are_defined_in_private_modules_under_their_names(self) -> None:
        # The layout the package docstring states: defined in an enginecore._* module,
        # re-exported here under the name it was defined with (so it pickles by reference).
        for name in enginecore.__all__:
            obj = getattr(enginecore, name)
            if isinstance(obj, (type, types.FunctionType)):
                assert re.fullmatch(r"enginecore\._[a-z_]+", obj.__module__), (name, obj.__module__)
                assert obj.__name__ == name
                assert getattr(sys.modules[obj.__module__], obj.__qualname__) is obj, name

    def test_import_needs_no_optional_dependency(self) -> None:
        # Importing a module set to None raises ImportError: the import below fails if
        # enginecore imports either of them.
        code = (
            "import sys\n"
            "sys.modules['zmq'] = None\n"
            "sys.modules['msgspec'] = None\n"
            "import enginecore\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=30)

    def test_import_loads_no_optional_dependency(self) -> None:
        # Installed here (the dev extra), yet the core does not even load them.
        code = (
            "import sys, enginecore\n"
            "loaded = [m for m in ('zmq', 'msgspec') if m in sys.modules]\n"
            "assert not loaded, loaded\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
