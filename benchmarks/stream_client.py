"""A streaming client in a process of its own (benchmarks/stream_latency.py): POSTs a Chat Completions request
with `stream: true` N times at a given concurrency and prints, as JSON, each stream's time to its first token
delta and the gaps between its token deltas (content or reasoning), measured on arrival, and its own CPU time.
aiohttp, as in load_client.py and vLLM's own serving benchmark: httpx took 0.21-0.23 ms of CPU a token here, aiohttp
0.09-0.13 ms, and on 2 cores the client's CPU is taken from the engine it measures (2026-12-02).

    python benchmarks/stream_client.py URL CONCURRENCY TOTAL BODY_JSON [--header "Name: value"] [--keys FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp


async def one(client: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> tuple[float, list[float], int]:
    t0 = time.perf_counter()
    arrivals = []
    async with client.post(url, data=json.dumps(body), headers={"content-type": "application/json", **headers}) as r:
        r.raise_for_status()
        async for raw in r.content:  # one line at a time, as it arrives
            line = raw.rstrip(b"\r\n")
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                arrivals.append(time.perf_counter())
    return arrivals[0] - t0, [b - a for a, b in zip(arrivals, arrivals[1:])], len(arrivals)


async def run(url: str, concurrency: int, total: int, body: dict, headers: dict, keys: list[str]) -> dict:
    ttft, gaps, deltas = [], [], []
    counter = iter(range(total))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8),
                                     timeout=aiohttp.ClientTimeout(total=600)) as client:
        async def worker() -> None:
            for i in counter:
                h = {**headers, **({"Authorization": f"Bearer {keys[i]}"} if keys else {})}
                first, between, n = await one(client, url, {**body, "seed": i}, h)
                ttft.append(first)
                gaps.extend(between)
                deltas.append(n)

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttft_s": ttft, "gaps_s": gaps, "deltas": deltas, "wall_s": time.perf_counter() - t0,
            "client_cpu_s": time.process_time() - cpu0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("concurrency", type=int)
    parser.add_argument("total", type=int)
    parser.add_argument("body")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--keys", default=None, help="a file with one session key per request")
    args = parser.parse_args()
    headers = dict(h.split(": ", 1) for h in args.header)
    keys = open(args.keys).read().split() if args.keys else []
    print(json.dumps(asyncio.run(run(args.url, args.concurrency, args.total, json.loads(args.body), headers, keys))))


if __name__ == "__main__":
    main()
