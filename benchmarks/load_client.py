"""Closed-loop HTTP load from its own process (as harnesses are): `concurrency` workers send `requests` POSTs
of one JSON body back to back (request i carries seed=i, after the warm-up's seeds); prints one JSON object:
{"latencies_s": {seed: seconds} (successful requests), "completed", "failed", "timed_out", "wall_s",
"client_cpu_s"}. The seeds let the caller pair each latency with the server's record of that request.

    python benchmarks/load_client.py URL CONCURRENCY REQUESTS BODY_JSON [--header "Name: value"] [--warmup N]
        [--keys FILE --ramp-s S --timeout S]

--keys: one session key per line; URL may contain {key}, and request i uses key i (mod the number of keys).
--ramp-s: worker j starts j/concurrency × S seconds after the first (the sustained-sessions ramp).
The client is aiohttp, as in vLLM's own serving benchmark: httpx spent 10 ms of CPU per request at 64
connections and 32 ms at 256 (its pool scales with the number of connections), which on 2 cores is CPU
taken from the server under test. The client's own CPU time is reported so that it can be checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp


async def closed_loop(session: aiohttp.ClientSession, urls: list[str], concurrency: int, total: int, body: dict,
                      ramp_s: float, first_seed: int = 0) -> dict:
    out: dict = {"latencies_s": {}, "completed": 0, "failed": 0, "timed_out": 0}
    counter = iter(range(first_seed, first_seed + total))

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            async with session.post(urls[i % len(urls)], data=json.dumps({**body, "seed": i}),
                                    headers={"content-type": "application/json"}) as r:
                await r.read()
                ok = r.status == 200
        except asyncio.TimeoutError:
            out["timed_out"] += 1
            return
        except aiohttp.ClientError:
            ok = False
        out["completed" if ok else "failed"] += 1
        if ok:
            out["latencies_s"][i] = time.perf_counter() - t0

    async def worker(j: int) -> None:
        await asyncio.sleep(ramp_s * j / concurrency)
        for i in counter:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(j) for j in range(concurrency)))
    out["wall_s"] = time.perf_counter() - t0
    return out


async def run(args: argparse.Namespace) -> dict:
    body = json.loads(args.body)
    headers = dict(h.split(": ", 1) for h in args.header)
    keys = open(args.keys).read().split() if args.keys else [""]
    urls = [args.url.replace("{key}", k) for k in keys]
    connector = aiohttp.TCPConnector(limit=args.concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        if args.warmup:
            await closed_loop(session, urls, args.concurrency, args.warmup, body, 0.0)  # connections, caches
        cpu0 = time.process_time()
        out = await closed_loop(session, urls, args.concurrency, args.requests, body, args.ramp_s, args.warmup)
        out["client_cpu_s"] = time.process_time() - cpu0
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("concurrency", type=int)
    parser.add_argument("requests", type=int)
    parser.add_argument("body")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--keys", default=None)
    parser.add_argument("--ramp-s", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
