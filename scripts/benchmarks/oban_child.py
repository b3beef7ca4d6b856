"""An Oban worker process for the postgres section, run by the Python 3.12
virtualenv that :mod:`oban_side` makes (not by ours: it imports only
``oban`` and the standard library).

    python oban_child.py URL N fill [BODY_JSON]   # install the schema, queue N jobs
    python oban_child.py URL LIMIT drain          # "ready", then on "go" run the queue

``drain`` runs ``Oban(pool=..., queues={"bench": LIMIT})`` with its defaults
(leadership, stager, notifier, producer) and a no-op worker until SIGTERM.
"""

import asyncio
import json
import sys

from oban import Oban, worker
from oban.schema import install


@worker(queue="bench")
class Bench:
    async def process(self, job):  # type: ignore[no-untyped-def]
        return None


async def fill(url: str, n: int, body: dict) -> None:  # type: ignore[type-arg]
    pool = await Oban.create_pool(url)
    try:
        await install(pool)
        oban = Oban(pool=pool)  # a client: no queues
        for offset in range(0, n, 1000):
            await oban.enqueue_many([Bench.new(body) for _ in range(min(1000, n - offset))])
    finally:
        await pool.close()


async def drain(url: str, limit: int) -> None:
    pool = await Oban.create_pool(url)
    oban = Oban(pool=pool, queues={"bench": limit})
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await oban.start()
    await asyncio.Event().wait()  # until SIGTERM


if __name__ == "__main__":
    url, count, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode == "fill":
        asyncio.run(fill(url, count, json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}))
    else:
        asyncio.run(drain(url, count))
