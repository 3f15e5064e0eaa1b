"""Keep-alive connections under load: `--connections` httpx connections to the proxy at once, each session's `--calls`
chat calls sent back to back over its connection, on the shipped tiny model; every failed request counted by type.

The client's pool is sized to all the connections, as a framework that shares one client among its rollouts does.
For each failed request, the time from the client reading the previous response on that connection to sending the
request that failed (`reuse_gap_s`) is kept beside the proxy's keep-alive timeout. `--runs` runs, one Lab.

    python benchmarks/keepalive_load.py [--connections 1000] [--calls 2] [--runs 3] [--max-tokens 8]
        [--keep-alive S] [--out benchmarks/results/keepalive_load.json]

Loopback only; bounded: `--connections` × `--calls` requests per run, each with a `--timeout` (s).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

import httpx

from polar_lab import Lab

from result import save


async def one_run(lab: Lab, connections: int, calls: int, max_tokens: int, timeout: float) -> dict:
    sessions = [lab.session(task={"i": i}) for i in range(connections)]
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    errors: collections.Counter = collections.Counter()
    gaps: list[float] = []
    ok = 0

    async def session_calls(client: httpx.AsyncClient, session) -> None:
        nonlocal ok
        read_at = None
        for k in range(calls):
            body = {"model": "tiny-calc", "max_tokens": max_tokens, "seed": k,
                    "messages": [{"role": "user", "content": f"What is {k}+{k}?"}]}
            sent_at = time.monotonic()
            try:
                response = await client.post(f"{session.openai_base_url}/chat/completions", json=body,
                                             headers={"Authorization": f"Bearer {session.api_key}"})
                response.raise_for_status()
                ok += 1
            except Exception as exc:  # noqa: BLE001 - counted by type, the run goes on
                errors[type(exc).__name__] += 1
                if read_at is not None:
                    gaps.append(round(sent_at - read_at, 3))
            read_at = time.monotonic()
        session.close(reward=0.0)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(session_calls(client, s) for s in sessions))
    return {"requests": connections * calls, "ok": ok, "errors": dict(errors), "reuse_gap_s": sorted(gaps),
            "server_gap_s_max": server_gap(lab, sessions), "wall_s": round(time.perf_counter() - t0, 1)}


def server_gap(lab: Lab, sessions: list) -> float:
    """The longest time the proxy held a connection idle between a session's answer and its next request, read from
    the call records: what the proxy's keep-alive timer sees (the client's own gap, `reuse_gap_s`, starts only when
    it has read the answer, which a busy client does late)."""
    by_session: dict[str, list] = collections.defaultdict(list)
    for call in lab.reader.call_records([s.id for s in sessions]):
        by_session[call.session_id].append(call.timings)
    gaps = []
    for timings in by_session.values():
        ordered = sorted(timings, key=lambda t: t["received"])
        gaps += [later["received"] - earlier["responded"] for earlier, later in zip(ordered, ordered[1:])]
    return round(max(gaps, default=0.0), 1)


def by_type(row: dict) -> str:
    """A run's failed requests by exception type: "1 ReadError", or "0"."""
    return ", ".join(f"{n} {kind}" for kind, n in row["errors"].items()) or "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--keep-alive", type=int, default=None, help="the proxy's keep_alive_s (default: the Lab's)")
    parser.add_argument("--out", default="benchmarks/results/keepalive_load.json")
    args = parser.parse_args()
    rows = []
    keep = {} if args.keep_alive is None else {"keep_alive_s": args.keep_alive}
    with Lab(port=0, run_name=f"bench-keepalive-{int(time.time())}", **keep) as lab:
        keep_alive = lab.config.proxy.keep_alive_s
        for run in range(args.runs):
            row = asyncio.run(one_run(lab, args.connections, args.calls, args.max_tokens, args.timeout))
            print(json.dumps({"run": run, **row}), flush=True)
            rows.append(row)
    total = sum(sum(r["errors"].values()) for r in rows)
    print(f"errors over {args.runs} runs of {args.connections * args.calls} requests: {total}")
    save("keepalive_load", {**{f"run {i + 1}: requests / ok / errors / longest idle at the proxy (s)":
                               f"{r['requests']} / {r['ok']} / {by_type(r)} / {r['server_gap_s_max']}"
                               for i, r in enumerate(rows)}, f"errors over {args.runs} runs": total},
         notes=[f"{args.connections} connections × {args.calls} calls a run; the proxy's keep_alive_s {keep_alive}"],
         title="Keep-alive connections under load",
         raw={"keep_alive_s": keep_alive, "runs": rows, "errors_total": total}, out=args.out)


if __name__ == "__main__":
    main()
