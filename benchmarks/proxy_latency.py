"""Proxy added latency vs calling the engine directly, and engine start-up time.

For each concurrency level, the same prompt (the calculator's first turn) with the same sampling
(fixed output length via ignore_eos, per-request seeds) is sent N times two ways:
  direct  engine.submit(prompt_ids) from this process — no HTTP, no render, no parse, no store
  proxy   HTTP POST /v1/chat/completions (httpx) — render, engine, parse, record, respond
and the latency distributions are compared. The proxy also reports its own share per call
(`proxy_s` = server time minus engine time), which excludes the HTTP client.
Everything shares 2 cores and one GIL with the engine: this is the in-kernel cost, not an idle-box figure.

    python benchmarks/proxy_latency.py [--model M] [--concurrency 1 64] [--requests 64 384]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

import httpx
import numpy as np

from polar_lab import Lab, SamplingSpec
from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT

MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 37*12+5?"}]
MAX_TOKENS = 16


async def _closed_loop(concurrency: int, total: int, one) -> list[float]:
    """`concurrency` workers issue `total` requests back to back; returns each request's latency (s)."""
    latencies: list[float] = []
    counter = iter(range(total))

    async def worker() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await one(i)
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def measure(lab: Lab, concurrency: int, total: int) -> dict[str, float]:
    prompt_ids = lab.tokenizer.apply_chat_template(MESSAGES, tools=[CALC_TOOL], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
    session = lab.session()

    async def direct(i: int) -> None:
        spec = SamplingSpec(max_tokens=MAX_TOKENS, seed=i, ignore_eos=True)
        await asyncio.wrap_future(lab.engine.submit(prompt_ids, spec))

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=session.openai_base_url, limits=limits, timeout=600) as client:
        async def proxied(i: int) -> None:
            r = await client.post("/chat/completions", json={
                "model": "m", "messages": MESSAGES, "tools": [CALC_TOOL], "max_tokens": MAX_TOKENS,
                "seed": i, "ignore_eos": True})
            r.raise_for_status()

        await _closed_loop(concurrency, 2 * concurrency, proxied)  # warm connections and caches
        before = lab.store.num_calls
        direct_lat = await _closed_loop(concurrency, total, direct)
        proxy_lat = await _closed_loop(concurrency, total, proxied)
    own = [c.timings["proxy_s"] for c in lab.call_records()[before:]]
    d, p, o = (np.array(x) * 1000 for x in (direct_lat, proxy_lat, own))
    return {
        "concurrency": concurrency, "requests": total,
        "direct_p50_ms": float(np.percentile(d, 50)), "direct_p99_ms": float(np.percentile(d, 99)),
        "proxy_p50_ms": float(np.percentile(p, 50)), "proxy_p99_ms": float(np.percentile(p, 99)),
        "added_p50_ms": float(np.percentile(p, 50) - np.percentile(d, 50)),
        "added_p99_ms": float(np.percentile(p, 99) - np.percentile(d, 99)),
        "in_server_p50_ms": float(np.percentile(o, 50)), "in_server_p99_ms": float(np.percentile(o, 99)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 384])
    parser.add_argument("--out", default="benchmarks/results/proxy_latency.json")
    args = parser.parse_args()

    t0 = time.perf_counter()
    with Lab(args.model, port=0, runs_dir="data/runs", run_name=f"bench-{int(time.time())}") as lab:
        startup = {"engine_startup_s": lab.engine.startup_seconds, "lab_startup_s": time.perf_counter() - t0}
        rows = [asyncio.run(measure(lab, c, n)) for c, n in zip(args.concurrency, args.requests)]
    result = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "python": platform.python_version()},
              "model": args.model, "max_tokens": MAX_TOKENS, **startup, "rows": rows}
    print(f"engine start-up {startup['engine_startup_s']:.1f} s, Lab start-up {startup['lab_startup_s']:.1f} s")
    cols = list(rows[0])
    print(" ".join(f"{c:>16}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>16.2f}" if isinstance(row[c], float) else f"{row[c]:>16}" for c in cols))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
