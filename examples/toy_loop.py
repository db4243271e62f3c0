"""A CountdownEngine driven by EngineCoreLoop on the main thread, fed by another thread.

Run it:  python examples/toy_loop.py      (Ctrl-C ends it early, cleanly)

The main thread runs the loop under ``shutdown_on_signals``, as a stage process would. A
feeder thread plays the input IO thread: it submits requests, aborts one, calls utilities,
waits for the work to finish, then asks the loop to shut down.
"""

from __future__ import annotations

import argparse
import threading

from enginecore import (
    Abort,
    Add,
    CountdownEngine,
    EngineCoreLoop,
    Event,
    Utility,
    shutdown_on_signals,
)


def main() -> int:
    finished: set[str] = set()
    all_done = threading.Event()
    expected = {"r1", "r3"}  # r2 gets aborted

    def emit(event: Event) -> None:
        match event:
            case ("output", (rid, remaining)):
                print(f"  output   {rid}: {remaining} step(s) left")
                if remaining == 0:
                    finished.add(rid)
                    if finished >= expected:
                        all_done.set()
            case ("utility", call_id, result, None):
                print(f"  utility  #{call_id} -> {result!r}")
            case ("utility", call_id, _, error):
                print(f"  utility  #{call_id} -> error {error}")
            case _:
                print(f"  {event}")

    loop = EngineCoreLoop(CountdownEngine(), emit)

    def feeder() -> None:
        for msg in (
            Add("r1", 3),
            Add("r2", 5),
            Utility(1, "num_requests", ()),
            Abort(["r2"]),
            Add("r3", 2),
            Utility(2, "div", (1, 0)),
        ):
            print(f"submit     {msg}")
            loop.submit(msg)
        all_done.wait(timeout=10)
        loop.submit(Utility(3, "num_requests", ()))
        loop.request_shutdown()

    threading.Thread(target=feeder, name="feeder", daemon=True).start()
    with shutdown_on_signals(loop):
        loop.run()
    return 0


if __name__ == "__main__":
    argparse.ArgumentParser(  # --help: this docstring
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    raise SystemExit(main())
