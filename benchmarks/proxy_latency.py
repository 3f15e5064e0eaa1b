"""Proxy added latency vs calling the engine directly (and vs LiteLLM), throughput, sustained sessions.

For each concurrency level, the same prompt (the calculator's first turn) with the same sampling
(fixed output length via ignore_eos, per-request seeds) is sent N times three ways:
  direct   engine.submit(prompt_ids) from this process — no HTTP, no render, no parse, no store
  proxy    HTTP POST /v1/chat/completions from a client process (benchmarks/load_client.py, httpx) —
           render, engine, parse, record, respond
  litellm  the same request to a LiteLLM proxy (a separate process, `make litellm`) whose upstream is
           this Lab's proxy: LiteLLM's added latency is litellm − proxy, measured in the same run, in front
           of the same engine and prompts
The proxy also reports its own share per call (`proxy_s` = server time minus engine time), which excludes
the HTTP client. The HTTP load comes from its own process, as harnesses do. Throughput = sampled tokens per second of wall time over the N requests, proxy vs direct.
Then the sustained test: `--sessions` sessions (1000) each send one call, started in 10 waves 0.2 s apart
so that all are in flight together; completed / failed / timed out and the latency distribution are reported.
Everything shares 2 cores with the engine: this is the in-kernel cost, not an idle-box figure.

    python benchmarks/proxy_latency.py [--concurrency 1 64 256] [--requests 64 384 768] [--sessions 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
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


def _load(url: str, concurrency: int, total: int, headers: dict[str, str]) -> tuple[list[float], float]:
    """Run benchmarks/load_client.py in its own process (harnesses are processes of their own)."""
    body = {"model": "tiny-calc", "messages": MESSAGES, "tools": [CALC_TOOL], "max_tokens": MAX_TOKENS,
            "ignore_eos": True}
    argv = [sys.executable, str(Path(__file__).with_name("load_client.py")), url, str(concurrency), str(total),
            json.dumps(body), "--warmup", str(2 * concurrency)]
    for name, value in headers.items():
        argv += ["--header", f"{name}: {value}"]
    out = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True, timeout=1800).stdout)
    return out["latencies_s"], out["wall_s"]


async def measure(lab: Lab, concurrency: int, total: int, litellm: tuple[str, str] | None) -> dict[str, float]:
    """direct (in-process) vs proxy vs LiteLLM-in-front-of-the-proxy (both HTTP paths from a client process).
    litellm: (base URL, key) of a LiteLLM proxy in front of this Lab, or None."""
    prompt_ids = lab.tokenizer.apply_chat_template(MESSAGES, tools=[CALC_TOOL], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
    session = lab.session()

    async def direct(i: int) -> None:
        spec = SamplingSpec(max_tokens=MAX_TOKENS, seed=i, ignore_eos=True)
        await asyncio.wrap_future(lab.engine.submit(prompt_ids, spec))

    await _closed_loop(concurrency, 2 * concurrency, direct)
    t0 = time.perf_counter()
    direct_lat = await _closed_loop(concurrency, total, direct)
    direct_wall = time.perf_counter() - t0
    before = lab.store.num_calls
    proxy_lat, proxy_wall = await asyncio.to_thread(
        _load, session.openai_base_url + "/chat/completions", concurrency, total, {})
    own = [c.timings["proxy_s"] for c in lab.call_records()[before:]]
    peer = None
    if litellm:
        peer, _ = await asyncio.to_thread(_load, litellm[0] + "/chat/completions", concurrency, total,
                                          {"Authorization": f"Bearer {litellm[1]}"})
    d, p, o = (np.array(x) * 1000 for x in (direct_lat, proxy_lat, own))
    row = {
        "concurrency": concurrency, "requests": total,
        "direct_p50_ms": float(np.percentile(d, 50)), "direct_p99_ms": float(np.percentile(d, 99)),
        "proxy_p50_ms": float(np.percentile(p, 50)), "proxy_p99_ms": float(np.percentile(p, 99)),
        "added_p50_ms": float(np.percentile(p, 50) - np.percentile(d, 50)),
        "added_p99_ms": float(np.percentile(p, 99) - np.percentile(d, 99)),
        "in_server_p50_ms": float(np.percentile(o, 50)), "in_server_p99_ms": float(np.percentile(o, 99)),
        "throughput_vs_direct": direct_wall / proxy_wall,  # same tokens: the ratio of wall times
    }
    if peer is not None:
        q = np.array(peer) * 1000
        row.update({"litellm_p50_ms": float(np.percentile(q, 50)), "litellm_p99_ms": float(np.percentile(q, 99)),
                    "litellm_added_p50_ms": float(np.percentile(q, 50) - np.percentile(p, 50)),
                    "litellm_added_p99_ms": float(np.percentile(q, 99) - np.percentile(p, 99))})
    return row


async def sustained(lab: Lab, sessions: int, waves: int = 10, gap_s: float = 0.2,
                    timeout_s: float = 300.0) -> dict[str, float]:
    """`sessions` sessions, one call each, started in `waves` waves: how many complete, fail, time out."""
    keys = [lab.session(harness="load").key for _ in range(sessions)]
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    outcome: dict[str, int] = {"completed": 0, "failed": 0, "timed_out": 0}
    latencies: list[float] = []
    peak = 0

    async with httpx.AsyncClient(base_url=lab.url, limits=limits, timeout=timeout_s) as client:
        async def one(key: str) -> None:
            t0 = time.perf_counter()
            try:
                r = await client.post(f"/s/{key}/v1/chat/completions", json={
                    "model": "m", "messages": MESSAGES, "tools": [CALC_TOOL], "max_tokens": MAX_TOKENS,
                    "ignore_eos": True})
                outcome["completed" if r.status_code == 200 else "failed"] += 1
            except httpx.TimeoutException:
                outcome["timed_out"] += 1
            except httpx.HTTPError:
                outcome["failed"] += 1
            latencies.append(time.perf_counter() - t0)

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, lab.proxy_state["in_flight"])
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter()
        per_wave = -(-sessions // waves)
        jobs = []
        for w in range(waves):
            jobs += [asyncio.create_task(one(k)) for k in keys[w * per_wave:(w + 1) * per_wave]]
            await asyncio.sleep(gap_s)
        await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
        watcher.cancel()
    lat = np.array(latencies) * 1000
    return {"sessions": sessions, **outcome, "peak_in_flight": peak, "wall_s": wall,
            "latency_p50_ms": float(np.percentile(lat, 50)), "latency_p99_ms": float(np.percentile(lat, 99))}


class LiteLLM:
    """A LiteLLM proxy process whose only model forwards to `upstream` (OpenAI-compatible)."""

    def __init__(self, binary: str, upstream: str, key: str, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.key = "sk-" + secrets.token_hex(16)  # LiteLLM refuses to start without a master key
        self._dir = tempfile.mkdtemp(prefix="litellm-")
        config = Path(self._dir) / "config.yaml"
        config.write_text(
            "model_list:\n  - model_name: tiny-calc\n    litellm_params:\n      model: openai/tiny-calc\n"
            f"      api_base: {upstream}\n      api_key: {key}\n"
            "litellm_settings:\n  drop_params: true\n  telemetry: false\n")
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
               "HOME": self._dir, "NO_DOCS": "True", "DISABLE_ADMIN_UI": "True", "LITELLM_MASTER_KEY": self.key}
        self.proc = subprocess.Popen([binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                                      "--num_workers", "1"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(Path(self._dir) / "stderr.log", "w"))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"litellm exited: {(Path(self._dir) / 'stderr.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health/liveliness", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("litellm did not come up within 180 s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def _litellm_binary(path: str | None) -> str | None:
    for candidate in (path, os.environ.get("POLAR_LAB_LITELLM"), ".cache/litellm/bin/litellm"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 384, 768])
    parser.add_argument("--sessions", type=int, default=1000, help="sustained test; 0 skips it")
    parser.add_argument("--litellm", default=None, help="litellm binary (default: .cache/litellm/bin/litellm)")
    parser.add_argument("--out", default="benchmarks/results/proxy_latency.json")
    args = parser.parse_args()

    t0 = time.perf_counter()
    binary = _litellm_binary(args.litellm)
    with Lab(args.model, port=0, runs_dir="data/runs", run_name=f"bench-{int(time.time())}") as lab:
        startup = {"engine_startup_s": lab.engine.startup_seconds, "lab_startup_s": time.perf_counter() - t0}
        peer = LiteLLM(binary, lab.session(harness="litellm").openai_base_url, "unused", _free_port()) \
            if binary else None
        try:
            rows = [asyncio.run(measure(lab, c, n, (peer.url + "/v1", peer.key) if peer else None))
                    for c, n in zip(args.concurrency, args.requests)]
        finally:
            if peer is not None:
                peer.close()
        load = asyncio.run(sustained(lab, args.sessions)) if args.sessions else None
    result = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "python": platform.python_version()},
              "model": args.model, "max_tokens": MAX_TOKENS, **startup, "rows": rows, "sustained": load,
              "litellm": binary is not None}
    print(f"engine start-up {startup['engine_startup_s']:.1f} s, Lab start-up {startup['lab_startup_s']:.1f} s")
    if binary is None:
        print("LiteLLM not installed (`make litellm`): its rows are missing")
    for row in rows:
        print(" ".join(f"{c}={row[c]:.2f}" if isinstance(row[c], float) else f"{c}={row[c]}" for c in row))
    if load:
        print("sustained: " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in load.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
