"""A replica pool: one client over several stage processes.

Launches three replicas of a "device" engine (each step sleeps 5 ms with the GIL released,
like an accelerator), sends a burst spread by load, kills one replica mid-stream and shows
that only its requests fail (or move on, through ``on_replica_death``), that the pool
starts it again, and that a replica can join and leave while the pool serves.

    python examples/pool.py
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable

from enginecore.stage import PoolRequest, ReplicaDeadError, ReplicaState, StagePool

DEVICE = "enginecore.stage.testing:device"


def resume(request: PoolRequest, delivered: int) -> PoolRequest | None:
    """A replica died under *request*: go on elsewhere with the steps it has left (a real
    server would resubmit the prompt plus the tokens delivered so far), except for the
    "fragile" requests, which fail with ReplicaDeadError."""
    if request.req_id.startswith("fragile"):
        return None
    return PoolRequest(request.req_id, request.data - delivered, request.key)


def main() -> None:
    with StagePool.launch(
        DEVICE, replicas=3, restart=True, on_replica_death=resume, ping_interval=0.5
    ) as pool:
        print("replicas  ", ", ".join(f"{r.name} pid {r.pid}" for r in pool.replicas))

        # A burst, spread by load: one frame per replica.
        burst = [(f"req{i}", 100) for i in range(27)] + [(f"fragile{i}", 100) for i in range(3)]
        streams = pool.add_many(burst)
        spread = Counter(s.replica.name for s in streams if s.replica is not None)
        print("burst      30 requests ->", dict(sorted(spread.items())))

        # Kill one replica while its requests stream: they move on (resume), the rest go on.
        for s in streams:
            s.get(timeout=10)  # every request has delivered its first output
        victim = pool.replicas[1]
        os.kill(victim.pid or 0, signal.SIGKILL)
        outputs, failed = 0, []
        for s in streams:
            try:
                outputs += 1 + len(s.collect(timeout=30))
            except ReplicaDeadError as err:  # only the victim's, and only without a move
                failed.append(f"{s.req_id} ({err.replica.name}, {err.delivered} delivered)")
        moved = sum(s.migrations for s in streams)
        print(
            f"kill       {victim.name}: {moved} requests moved on and finished;",
            f"failed: {', '.join(failed) or 'none'}; {outputs} outputs in all",
        )

        # The pool starts the dead replica again (backoff 0.5 s), and routes to it once up.
        deadline = time.monotonic() + 10
        while victim.state is not ReplicaState.SERVING and time.monotonic() < deadline:
            time.sleep(0.05)
        print(
            f"restart    {victim.name} is {victim.state.value}, pid {victim.pid},",
            f"restarts {victim.restarts}",
        )

        # Membership while serving: add one, then remove another after draining it.
        new = pool.add_replica(DEVICE)
        live = [pool.add(f"late{i}", 20) for i in range(8)]
        code = pool.remove_replica(pool.replicas[0], drain=True)
        done = sum(1 for s in live if s.collect(timeout=30)[-1] == 0)
        print(f"membership +{new.name}, -r0 (exit {code}): {done}/8 requests finished")

        answers = pool.call_utility("pid", broadcast=True)
        print("broadcast ", {r.name: pid for r, pid in answers.items()})
    print("closed     every replica stopped")


def cli(main: Callable[[], int | None]) -> int:
    """Run *main* as a command: ``--help`` prints this module's docstring, and Ctrl-C or
    SIGTERM stops it early, cleanly: the ``with`` blocks shut the stages down on the way out,
    then one line on stderr and status 130 or 143 (no traceback, nothing left behind)."""
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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


if __name__ == "__main__":
    sys.exit(cli(main))
