"""Closed-loop HTTP load from its own process (as harnesses are): `concurrency` workers send `requests`
POSTs of one JSON body back to back; prints {"latencies_s": [...], "wall_s": ...} as JSON on stdout.

    python benchmarks/load_client.py URL CONCURRENCY REQUESTS BODY_JSON [--header "Name: value"] [--warmup N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx


async def run(url: str, concurrency: int, total: int, body: dict, headers: dict[str, str], warmup: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600, headers=headers) as client:
        async def loop(n: int) -> tuple[list[float], float]:
            latencies: list[float] = []
            counter = iter(range(n))

            async def worker() -> None:
                for i in counter:
                    t0 = time.perf_counter()
                    r = await client.post(url, json={**body, "seed": i})
                    r.raise_for_status()
                    latencies.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return latencies, time.perf_counter() - t0

        await loop(warmup)  # connections and caches
        latencies, wall = await loop(total)
    return {"latencies_s": latencies, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("concurrency", type=int)
    parser.add_argument("requests", type=int)
    parser.add_argument("body")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--warmup", type=int, default=0)
    args = parser.parse_args()
    headers = dict(h.split(": ", 1) for h in args.header)
    print(json.dumps(asyncio.run(run(args.url, args.concurrency, args.requests, json.loads(args.body), headers,
                                     args.warmup))))


if __name__ == "__main__":
    main()
