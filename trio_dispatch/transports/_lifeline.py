"""The lifeline: kills a worker's transport process groups when the worker dies.

Run as ``python -I -S _lifeline.py`` with a pipe from the worker on stdin
(standard library only; nothing of the package is imported). The worker
writes ``+PGID`` when a transport's process group starts and ``-PGID`` once
it is gone. When the pipe reaches EOF -- the worker exited or was killed,
SIGKILL included -- every group still registered is SIGKILLed, so neither a
transport child nor anything it started in its group outlives the worker.

It ignores the signals a terminal or a service manager sends to a group
(SIGINT, SIGTERM, SIGHUP, SIGQUIT) and runs in a session of its own: only
the end of its pipe ends it.
"""

import os
import signal


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_IGN)
    groups: set[int] = set()
    pending = b""
    while True:
        try:
            chunk = os.read(0, 65536)
        except InterruptedError:  # pragma: no cover - PEP 475 retries already
            continue
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            try:
                pgid = int(line[1:])
            except ValueError:
                continue
            if line.startswith(b"+"):
                groups.add(pgid)
            elif line.startswith(b"-"):
                groups.discard(pgid)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    main()
