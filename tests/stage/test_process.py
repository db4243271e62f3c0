"""The stage process's entry points: resolving the engine factory by name."""

from __future__ import annotations

import pytest

from enginecore import CountdownEngine
from enginecore.stage._process import build_engine, import_factory


class TestFactories:
    def test_import_factory_resolves_dotted_attributes(self) -> None:
        assert import_factory("enginecore:CountdownEngine.is_finished")(("r", 0)) is True

    @pytest.mark.parametrize("spec", ["enginecore", ":x", "enginecore:", "a.b"])
    def test_malformed(self, spec: str) -> None:
        with pytest.raises(ValueError, match=r"pkg\.module:factory"):
            import_factory(spec)

    def test_not_callable(self) -> None:
        with pytest.raises(TypeError, match="not callable"):
            import_factory("enginecore:__version__")

    def test_missing_module_or_attribute(self) -> None:
        with pytest.raises(ImportError):
            import_factory("no_such_module_here:f")
        with pytest.raises(AttributeError):
            import_factory("enginecore:NoSuchThing")

    def test_build_engine_checks_the_protocol(self) -> None:
        assert isinstance(build_engine("enginecore:CountdownEngine", {}), CountdownEngine)
        with pytest.raises(TypeError, match="does not implement"):
            build_engine("builtins:list", {})
