"""What the command-line tools of ``benchmarks/`` share: argument types that refuse a bad
value with a one-line usage error before anything runs (never a traceback, a hang or a
run that ends in an error minutes later), and Ctrl-C (or SIGTERM) as one line and exit
status 130 (143), after the stages are closed."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence

__all__ = [
    "RawHelp",
    "at_least",
    "ignore_ctrl_c",
    "output_path",
    "run_main",
    "seconds",
    "share",
]

INTERRUPTED = 130
"""The exit status of a tool stopped by Ctrl-C (128 + SIGINT), as a shell reports it."""

TERMINATED = 143
"""The exit status of a tool stopped by SIGTERM (128 + SIGTERM)."""


class RawHelp(argparse.RawDescriptionHelpFormatter):
    """``--help`` keeps the description's lines (its usage examples)."""


def seconds(text: str) -> float:
    """A number of seconds: finite and above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be finite and above 0, got {text!r}")
    return value


def share(text: str) -> float:
    """A share: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # NaN fails both
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text!r}")
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer of *minimum* or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {text!r}")
        return value

    return parse


def output_path(text: str) -> str:
    """A file to write at the end of a run: its folder must exist and be writable now, so
    that a typo fails before the run, not after it."""
    if not text:
        raise argparse.ArgumentTypeError("must be a file path, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist (for {text!r})")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder!r} is not writable (for {text!r})")
    return text


def run_main(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """``main(argv)``'s exit status. Ctrl-C is one line on stderr and status 130 instead of
    a traceback; SIGTERM (``timeout``, a CI job cancelled) takes the same way out, status
    143, where it used to end the process at once and leave its stages' socket folders and
    shared-memory segments behind. Either way the tools' ``with`` blocks close their stages
    first. Call from the main thread."""
    terminated: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return main(argv)
    except KeyboardInterrupt:
        if terminated:
            print("terminated (SIGTERM)", file=sys.stderr)
            return TERMINATED
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


def ignore_ctrl_c() -> None:
    """In a benchmark's own peer process (a raw server, an mp.Queue stage, a hop of a raw
    chain): ignore SIGINT, as a launched stage does. Ctrl-C in a terminal goes to the whole
    process group; the parent, which owns the peer, closes it on its way out (a peer that
    died of the signal instead would print a traceback of its own, and could leave the
    parent waiting for an answer)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
