"""Weight sync from the trainer into a live engine on CPU (SmolLM2-135M and tiny-calc): write, preload and pause per
sync, in memory and by file, from one rank and two FSDP ranks; streams during a sync; drain vs keep; engine memory.

The two transports run side by side in one run: weights written in place into the Lab's shared-memory slot
(`weights_transport="memory"`, the default: engine/weights.py) and a fresh safetensors file per sync (the fallback,
written in fp32 whatever the engine's dtype).

For each source — one in-process rank, two FSDP ranks — `--repeats` syncs per transport, alternating: `write_s` (the
trainer writes the weights where the engine reads them; rollouts keep running), `preload_s` (the engine loads them
into its standby copy while it serves), `sync_s` (the pause: drain, swap, resume) and `total_s`, their sum. After the
syncs the engine's logprobs of sampled tokens are compared with the trainer's. Then, with the memory transport:
- beside streams: one sync while 16 requests stream from the engine — tokens/s before it and over the whole sync
  (write + preload + pause), and the longest gap any stream saw;
- drain vs keep: 16 streaming calls through the proxy, one sync mid-way with `pause="drain"` and one with
  `pause="keep"`: the longest stall any call saw over the sync (a gap between two of its deltas, or its wait for a
  first delta beyond the median first-delta time);
- the engine's resident memory at start and after every sync;
- tiny-calc (its own Lab): write + preload + pause per sync; and the wall time of a whole `lab.load_weights(sd)`
  call (no pause) beside a whole `lab.sync_weights(sd)` call, alternating, medians.
Results → benchmarks/results/weight_sync.json.

    python benchmarks/weight_sync.py [--model data/models/smollm2-135m-instruct] [--repeats 5]
                                     [--tiny data/models/tiny-calc] [--lora] [--out F]
                                     [--dtype bfloat16] [--parts one_rank,tiny]
--dtype: the engines' dtype (default: the Lab's, float32 on CPU; a GPU engine serves in bfloat16). --standby-share:
the engines' `standby_share` (the preload's pacing beside requests in flight).
--parts: a subset of one_rank, fsdp, streams, stall, overlap, tiny (default: all). overlap: the write beside the
preload (what streaming the write into the standby could at best save), against each alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

import torch

from polar_lab import Lab
from polar_lab.engine.weights import unmap
from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.distributed import DistributedPolicy
from polar_lab.grpo.policy import Policy
from polar_lab.types import SamplingSpec

from result import save

LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]}
KEYS = ("write_s", "preload_s", "sync_s", "total_s")


def one_sync(lab: Lab, policy, transport: str) -> dict:
    """Write the policy's weights by `transport` and sync them; the timings of each part."""
    t0 = time.perf_counter()
    path = lab.weights_path(adapter=transport == "file")  # the slot, or a fresh path
    policy.write_weights(str(path), lab.engine.weights_dtype if transport == "memory" else None)
    write_s = time.perf_counter() - t0
    sync = lab.sync_weights(path)
    return {"write_s": write_s, "preload_s": sync.preload_s, "sync_s": sync.sync_s,
            "total_s": write_s + sync.preload_s + sync.sync_s, "bytes": sync.bytes, "path": sync.path,
            "swapped": sync.swapped, "standby_load": getattr(lab.engine, "standby_how", None)}


def side_by_side(lab: Lab, policy, repeats: int) -> dict:
    """`repeats` syncs per transport, alternating (the machine's drift touches both alike); medians."""
    rows: dict[str, list[dict]] = {"memory": [], "file": []}
    for _ in range(repeats):
        for transport in rows:
            rows[transport].append(one_sync(lab, policy, transport))
    out = {}
    for transport, runs in rows.items():
        out[transport] = {**{k: statistics.median(r[k] for r in runs) for k in KEYS},
                          "bytes": runs[-1]["bytes"], "path": runs[-1]["path"],
                          "swapped": all(r["swapped"] for r in runs),
                          "standby_load": sorted({str(r["standby_load"]) for r in runs}),
                          "each_total_s": [round(r["total_s"], 3) for r in runs]}
    return out


def agreement(lab: Lab, policy, tokens: int = 32) -> dict:
    """Mean and max |engine logprob - trainer logprob| of `tokens` sampled tokens after a fixed prompt."""
    prompt = lab.tokenizer.apply_chat_template([{"role": "user", "content": "Name three prime numbers."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    gen = lab.engine.submit(prompt, SamplingSpec(max_tokens=tokens, temperature=1.0, seed=7, ignore_eos=True)).result()
    ids = prompt + gen.output_ids
    sample = Sample(input_ids=torch.tensor(ids), weights=torch.zeros(len(ids) - 1), advantage=0.0,
                    behavior_logprobs=torch.zeros(1), versions=torch.zeros(1), temperature=1.0)
    gap = (policy.logprobs([sample])[0][len(prompt) - 1:] - torch.tensor(gen.output_logprobs)).abs()
    return {"logprob_gap_mean": float(gap.mean()), "logprob_gap_max": float(gap.max())}


def beside_streams(lab: Lab, policy, streams: int = 16, window_s: float = 3.0) -> dict:
    """One in-memory sync while `streams` requests stream straight from the engine: tokens/s over `window_s` before
    it and over the whole sync (write, preload, pause), and the longest gap between two deltas of any stream then."""
    prompt = lab.tokenizer.apply_chat_template([{"role": "user", "content": "Count to a thousand."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    stamps: list[float] = []  # one per token received
    last: dict[int, float] = {}
    gaps: list[tuple[float, float]] = []  # (gap, when it ended)
    stop = threading.Event()
    loop = asyncio.new_event_loop()

    async def stream(i: int) -> None:
        while not stop.is_set():
            def on_delta(delta, i=i) -> None:
                now = time.perf_counter()
                stamps.extend([now] * len(delta.ids))
                if i in last:
                    gaps.append((now - last[i], now))
                last[i] = now
            await lab.engine.generate(prompt, SamplingSpec(max_tokens=128, temperature=1.0, ignore_eos=True),
                                      on_delta)
            last.pop(i, None)  # the next request's first token is not a gap of this one

    async def streaming() -> None:
        await asyncio.gather(*(stream(i) for i in range(streams)))

    runner = threading.Thread(target=loop.run_until_complete, args=(streaming(),), daemon=True)
    runner.start()
    try:
        time.sleep(2.0)  # every stream running
        t0 = time.perf_counter()
        time.sleep(window_s)
        t1 = time.perf_counter()
        sync = one_sync(lab, policy, "memory")
        t2 = time.perf_counter()
        time.sleep(0.5)
    finally:
        stop.set()
        runner.join(timeout=60)
        loop.close()
    before = sum(t0 <= t < t0 + window_s for t in stamps) / window_s
    during = sum(t1 <= t < t2 for t in stamps) / (t2 - t1)
    return {"streams": streams, "tokens_per_s_before": before, "tokens_per_s_during_sync": during,
            "during_over_before": during / before, "sync_total_s": t2 - t1,
            "longest_gap_s_over_sync": max((g for g, at in gaps if t1 <= at <= t2 + 0.5), default=None), **sync}


def stall_through_proxy(lab: Lab, policy, pause: str, calls: int = 16, max_tokens: int = 96) -> dict:
    """`calls` streaming chat calls through the proxy, started one after another for 6 s; one in-memory sync with
    `pause` 2 s in. The longest stall any call saw over the sync: a gap between two of its deltas, or how much longer
    than the median its wait for a first delta was."""
    import httpx

    s = lab.session(sampling={"ignore_eos": True, "temperature": 1.0})
    url, headers = s.openai_base_url + "/chat/completions", {"Authorization": f"Bearer {s.key}"}
    firsts: list[tuple[float, float]] = []  # (wait for the first delta, when the call started)
    stamps: list[float] = []  # one per delta received
    gaps: list[tuple[float, float]] = []  # (gap, when it ended)
    stop = threading.Event()

    def caller() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                start = previous = time.perf_counter()
                body = {"messages": [{"role": "user", "content": "Count."}], "stream": True, "max_tokens": max_tokens}
                with client.stream("POST", url, json=body, headers=headers) as r:
                    for i, line in enumerate(line for line in r.iter_lines() if line.startswith("data: {")):
                        now = time.perf_counter()
                        stamps.append(now)
                        if i == 0:
                            firsts.append((now - start, start))
                        else:
                            gaps.append((now - previous, now))
                        previous = now

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(calls)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(2.0)
    t1 = time.perf_counter()
    path = lab.weights_path()
    policy.write_weights(str(path), lab.engine.weights_dtype)
    write_s = time.perf_counter() - t1
    sync = lab.sync_weights(path, pause=pause)
    t2 = time.perf_counter()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    typical = statistics.median(w for w, _ in firsts)
    waits = [w - typical for w, started in firsts if t1 - 1.0 <= started <= t2]
    over = [g for g, at in gaps if t1 <= at <= t2 + 2.0]
    before = sum(t1 - 2.0 <= t < t1 for t in stamps) / 2.0
    return {"pause": pause, "calls": calls, "deltas_per_s_before": before,
            "deltas_per_s_over_sync": sum(t1 <= t < t2 for t in stamps) / (t2 - t1),
            "longest_gap_s": max(over, default=0.0),
            "longest_extra_first_delta_wait_s": max(waits, default=0.0), "median_first_delta_s": typical,
            "longest_stall_s": max(max(over, default=0.0), max(waits, default=0.0)), "undrained": sync.undrained,
            "write_s": write_s, "preload_s": sync.preload_s, "sync_s": sync.sync_s, "drain_s": sync.drain_s}


def write_beside_preload(lab: Lab, policy, repeats: int) -> dict:
    """The best a write streamed into the standby as it goes could do on these cores: the whole write (into another
    slot) beside the whole preload (of the slot written before), against each alone; medians over `repeats`."""
    slot = lab.weights_path()
    policy.write_weights(str(slot), lab.engine.weights_dtype)
    other = slot.with_name(f"{slot.stem}-beside{slot.suffix}")  # a slot too (its name's prefix): written in place

    def preload() -> float:
        t0 = time.perf_counter()
        why = lab.engine.preload_weights_file(slot)
        if why is not None:
            raise RuntimeError(f"no standby load: {why}")
        return time.perf_counter() - t0

    def write() -> float:
        t0 = time.perf_counter()
        policy.write_weights(str(other), lab.engine.weights_dtype)
        return time.perf_counter() - t0

    rows: dict[str, list[float]] = {"preload_s": [], "write_s": [], "preload_beside_write_s": [],
                                    "write_beside_preload_s": [], "both_wall_s": []}
    try:
        policy.write_weights(str(other), lab.engine.weights_dtype)  # made once: later writes go in place
        for _ in range(repeats):
            rows["preload_s"].append(preload())
            rows["write_s"].append(write())
            beside: list[float] = []
            writer = threading.Thread(target=lambda: beside.append(write()))
            t0 = time.perf_counter()
            writer.start()
            rows["preload_beside_write_s"].append(preload())
            writer.join()
            rows["both_wall_s"].append(time.perf_counter() - t0)
            rows["write_beside_preload_s"].append(beside[0])
    finally:
        unmap(other)  # a slot's mapping stays open in this process after each write (engine/weights.py)
        other.unlink(missing_ok=True)
    return {k: statistics.median(v) for k, v in rows.items()}


def engine_memory_mib(lab: Lab) -> dict:
    """The engine process's resident memory: in all, its own (anonymous), and shared memory it maps (the slots)."""
    with open(f"/proc/{lab.engine.pid}/status") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return {key: int(fields[name].split()[0]) / 1024 for key, name in
            (("rss", "VmRSS"), ("anon", "RssAnon"), ("shmem", "RssShmem"))}


def nudge(policy, lab_tokenizer) -> None:
    """One small update, so the synced weights differ from the engine's (a stale engine shows in the gap)."""
    ids = torch.tensor(lab_tokenizer("The quick brown fox jumps over the lazy dog. " * 8)["input_ids"][:64])
    weights = torch.full((len(ids) - 1,), 1.0 / len(ids))
    policy.update([Sample(input_ids=ids, weights=weights, advantage=1.0,
                          behavior_logprobs=torch.full((len(ids) - 1,), -3.0),
                          versions=torch.zeros(len(ids) - 1, dtype=torch.long), temperature=1.0, session_id="nudge")])


def model_bytes(policy) -> int:
    return sum(t.numel() * t.element_size() for t in policy.state_dict().values())


PARTS = ("one_rank", "fsdp", "streams", "stall", "overlap", "tiny")


def engine_args(args) -> dict:
    """The Labs' engine settings the command line asks for (none: the Lab's defaults)."""
    return {**({"dtype": args.dtype} if args.dtype else {}),
            **({"standby_share": args.standby_share} if args.standby_share is not None else {})}


def smollm2(args, results: dict) -> None:
    if not set(args.parts) - {"tiny"}:
        return
    with Lab(args.model, port=0, run_name=f"bench-sync-{int(time.time())}", **engine_args(args)) as lab:
        results["engine_mib_at_start"] = engine_memory_mib(lab)
        single = Policy(args.model, GRPOConfig(learning_rate=1e-4))
        nudge(single, lab.tokenizer)
        if "one_rank" in args.parts:
            results["one_rank"] = {**side_by_side(lab, single, args.repeats), **agreement(lab, single)}
            print("one_rank", json.dumps(results["one_rank"]), flush=True)
        if "fsdp" in args.parts:
            fsdp(args, lab, results)
        if "streams" in args.parts:
            for _ in range(2):  # both slots laid out by this trainer: the runs measure steady syncs, not a slot's creation
                one_sync(lab, single, "memory")
            runs = [beside_streams(lab, single) for _ in range(args.repeats)]  # noisy: one sync's window is ~1-3 s
            results["beside_streams"] = {"median_during_over_before": statistics.median(r["during_over_before"]
                                                                                        for r in runs), "runs": runs}
            print("beside_streams", json.dumps(results["beside_streams"]), flush=True)
        if "overlap" in args.parts:
            results["write_beside_preload"] = write_beside_preload(lab, single, args.repeats)
            print("write_beside_preload", json.dumps(results["write_beside_preload"]), flush=True)
        if "stall" in args.parts:
            for pause in ("drain", "keep"):
                results[f"stall_{pause}"] = stall_through_proxy(lab, single, pause)
                print(f"stall_{pause}", json.dumps(results[f"stall_{pause}"]), flush=True)
        results["engine_mib_after_syncs"] = engine_memory_mib(lab)
        results["model_mib"] = model_bytes(single) / 2**20
        print("engine memory", results["engine_mib_at_start"], "→", results["engine_mib_after_syncs"],
              "MiB; model", round(results["model_mib"]), "MiB", flush=True)


def fsdp(args, lab: Lab, results: dict) -> None:
    ranks = DistributedPolicy(args.model, GRPOConfig(strategy="fsdp", world_size=2, learning_rate=1e-4),
                              devices=["cpu", "cpu"])
    try:
        nudge(ranks, lab.tokenizer)
        results["fsdp_2_ranks"] = {**side_by_side(lab, ranks, args.repeats), **agreement(lab, ranks)}
    finally:
        ranks.close()
    print("fsdp_2_ranks", json.dumps(results["fsdp_2_ranks"]), flush=True)


def tiny(args, results: dict) -> None:
    if "tiny" not in args.parts:
        return
    with Lab(args.tiny, port=0, run_name=f"bench-sync-tiny-{int(time.time())}", **engine_args(args)) as lab:
        policy = Policy(args.tiny, GRPOConfig(learning_rate=1e-4))
        nudge(policy, lab.tokenizer)
        results["tiny_calc"] = {**side_by_side(lab, policy, max(args.repeats, 10)),
                                **load_against_sync(lab, policy, max(args.repeats, 10))}
        print("tiny_calc", json.dumps(results["tiny_calc"]), flush=True)


def load_against_sync(lab: Lab, policy, repeats: int) -> dict:
    """Whole calls from a state dict: `load_weights` (no pause) and `sync_weights` (drain), alternating."""
    weights = policy.state_dict()
    times: dict[str, list[float]] = {"load_weights_s": [], "sync_weights_s": []}
    for _ in range(repeats):
        for key, call in (("load_weights_s", lab.load_weights), ("sync_weights_s", lab.sync_weights)):
            t0 = time.perf_counter()
            call(weights)
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(values) for key, values in times.items()}


def lora(args, results: dict) -> None:
    with Lab(args.model, port=0, run_name=f"bench-sync-lora-{int(time.time())}", max_lora_rank=16,
             **engine_args(args)) as lab:
        policy = Policy(args.model, GRPOConfig(learning_rate=1e-3, peft_config=LORA))
        nudge(policy, lab.tokenizer)
        nudge(policy, lab.tokenizer)  # B starts at 0: a second step makes the adapter's product non-zero
        rows = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            path = lab.weights_path(adapter=True)
            policy.write_adapter(str(path))
            write_s = time.perf_counter() - t0
            sync = lab.sync_weights(path)
            rows.append({"write_s": write_s, "preload_s": sync.preload_s, "sync_s": sync.sync_s,
                         "total_s": write_s + sync.preload_s + sync.sync_s})
        results["lora_adapter"] = {**{k: statistics.median(r[k] for r in rows) for k in KEYS},
                                   **agreement(lab, policy)}
        print("lora_adapter", json.dumps(results["lora_adapter"]), flush=True)


def headline(results: dict) -> dict:
    """The result file's figures, for the parts this run measured: a sync in memory end to end and its pause, the
    streams' tokens/s during a sync, the engine's memory growth."""
    figures = {}
    for key, label in (("one_rank", "SmolLM2, 1 rank"), ("fsdp_2_ranks", "SmolLM2, 2 FSDP ranks"),
                       ("tiny_calc", "tiny-calc")):
        if key in results:
            memory = results[key]["memory"]
            figures[f"{label}, in memory: write + preload + pause (ms)"] = round(memory["total_s"] * 1e3, 1)
            figures[f"{label}, in memory: pause (ms)"] = round(memory["sync_s"] * 1e3, 1)
    if "beside_streams" in results:
        ratio = results["beside_streams"]["median_during_over_before"]
        figures["16 streams' tokens/s during a sync ÷ before"] = round(ratio, 3)
    if "engine_mib_after_syncs" in results:
        grown = results["engine_mib_after_syncs"]["anon"] - results["engine_mib_at_start"]["anon"]
        figures["engine memory growth, MiB (the model's)"] = f"+{grown:.0f} ({results['model_mib']:.0f})"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/models/smollm2-135m-instruct")
    parser.add_argument("--tiny", default="data/models/tiny-calc")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="also a LoRA adapter's sync (the adapter alone moves)")
    parser.add_argument("--out", default="benchmarks/results/weight_sync.json")
    parser.add_argument("--dtype", default=None, help="the engines' dtype (default: the Lab's, float32 on CPU)")
    parser.add_argument("--standby-share", type=float, default=None,
                        help="the engines' standby_share (default: the Lab's): the preload's share of the wall time "
                             "while requests are in flight")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    if set(args.parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(set(args.parts) - set(PARTS))}; known: {', '.join(PARTS)}")
    results: dict = {"model": args.model, "dtype": args.dtype or "the Lab's default", "parts": args.parts}
    smollm2(args, results)
    tiny(args, results)
    if args.lora:
        lora(args, results)
    save("weight_sync", headline(results), title="Weight sync into the engine", raw=results, out=args.out)


if __name__ == "__main__":
    main()
