"""The exception tree. Every enginecore exception derives from :class:`EngineCoreError`."""

from __future__ import annotations

__all__ = ["EngineCoreError", "LoopAlreadyRunError"]


class EngineCoreError(Exception):
    """Root of every exception that enginecore raises on purpose."""


class LoopAlreadyRunError(EngineCoreError, RuntimeError):
    """Raised by :meth:`EngineCoreLoop.run` when that loop has already been run.

    A loop is single-use, like :class:`threading.Thread`: its end state (shutdown or fatal) is
    final. Build a new loop to run again.
    """
