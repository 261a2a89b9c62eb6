"""The relay_flood scenario's flooder process (bench/attacks/relay_flood.py):

    python -m bench.relay_flooder PORT FRAMES_FILE CONNECTIONS MAX_S

POSTs the file's length-prefixed frames to the relay over CONNECTIONS keep-alive
connections until they run out or MAX_S passed; prints `flooding` when it
starts and, as its last line, JSON counts. A module of its own, outside
`bench.attacks`, so that it starts in a fraction of a second: importing that
package (torch, the federation harness) took the flooder 3-4 s, waited for by
the scenario while it measures nothing.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from node.relay_wire import RELAY_MESSAGE_PATH


def main(argv: list[str]) -> None:
    """argv: PORT FRAMES_FILE CONNECTIONS MAX_S (the module's docstring)."""
    if len(argv) != 4:
        raise SystemExit("usage: python -m bench.relay_flooder PORT FRAMES_FILE CONNECTIONS MAX_S")
    port, path, connections, max_s = argv[0], Path(argv[1]), int(argv[2]), float(argv[3])
    data = path.read_bytes()
    frames, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        frames.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    url = f"http://127.0.0.1:{port}{RELAY_MESSAGE_PATH}"

    async def flood() -> dict[str, Any]:
        counts: dict[str, int] = {}
        deadline = time.monotonic() + max_s
        started = time.monotonic()
        connector = aiohttp.TCPConnector(limit=connections)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker() -> None:
                while frames and time.monotonic() < deadline:
                    frame = frames.pop()
                    try:
                        async with session.post(url, data=frame) as resp:
                            await resp.read()
                            key = str(resp.status)
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        key = type(exc).__name__
                    counts[key] = counts.get(key, 0) + 1

            print("flooding", flush=True)
            await asyncio.gather(*(worker() for _ in range(connections)))
        elapsed = time.monotonic() - started
        sent = sum(counts.values())
        return {"sent": sent, "seconds": round(elapsed, 2),
                "per_s": round(sent / max(elapsed, 1e-9)), "answers": counts}  # fmt: skip

    print(json.dumps(asyncio.run(flood())), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
