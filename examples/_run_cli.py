"""The examples' command line, shared: ``--help`` and a clean stop on Ctrl-C or SIGTERM.
Not an example itself (``tests/test_examples.py`` skips names that start with ``_``)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable


def cli(main: Callable[[], int | None], doc: str | None) -> int:
    """Run *main* as a command: ``--help`` prints *doc* (the example's docstring), and
    Ctrl-C or SIGTERM stops it early, cleanly: the ``with`` blocks shut the stages down on
    the way out, then one line on stderr and status 130 or 143 (no traceback, nothing left
    behind)."""
    argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    terminated = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return main() or 0
    except KeyboardInterrupt:
        print("terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
