"""Kernel memory across many closed long sessions: does the proxy give back what their continuity caches held?

A Lab on a scripted engine (real HTTP, the real renderer, tips and splice ledger; no vLLM, so the figure is the
proxy's own) serves `--sessions` sessions of `--turns` calls each, every turn adding a ~`--tokens`-token user
message to the history, then closes them. Prints the process's resident memory (after a garbage collection)
before, at the peak (all sessions open) and after they closed, the caches' own estimate, and the ratio
after / before (the goal: within 10%). The scripted engine keeps no log of its prompts here (tests
use it; no real engine has one).

    python benchmarks/kernel_memory.py [--sessions 1000] [--turns 8] [--tokens 600]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time

import httpx
import psutil
from transformers import AutoTokenizer

from polar_lab import Lab
from polar_lab.engine import ScriptedEngine

from result import save

MODEL = "data/models/tiny-calc"
FILLER = "The build ran, the tests were collected, and three failed on nested brackets in the parser input. "


def rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


async def one_session(client: httpx.AsyncClient, session, turns: int, words: int) -> None:
    messages = [{"role": "system", "content": "You are careful."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}. " + FILLER * words})
        r = await client.post(f"/s/{session.key}/v1/chat/completions", json={"messages": messages, "max_tokens": 8})
        r.raise_for_status()
        messages.append(r.json()["choices"][0]["message"])


async def drive(lab: Lab, sessions: list, turns: int, words: int, concurrency: int = 16) -> None:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=lab.url, timeout=120) as client:
        async def bounded(s):
            async with limit:
                await one_session(client, s, turns, words)
        await asyncio.gather(*(bounded(s) for s in sessions))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tokens", type=int, default=600, help="about this many tokens per user turn")
    args = p.parse_args()
    words = max(1, args.tokens // 20)  # FILLER is ~20 tokens
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    engine = ScriptedEngine(tokenizer, ["Noted; I will look at the parser next."], model_path=MODEL,
                            max_model_len=32768, keep_prompts=False)  # its log of prompts is for tests
    with Lab(port=0, engine=engine, run_name="bench-kernel-memory") as lab:
        warm = [lab.session() for _ in range(8)]  # warm every code path and cache first
        asyncio.run(drive(lab, warm, args.turns, words))
        for s in warm:
            s.close()
        before = rss_mib()
        t0 = time.time()
        sessions = [lab.session() for _ in range(args.sessions)]
        asyncio.run(drive(lab, sessions, args.turns, words))
        peak, tip_bytes = rss_mib(), lab.service.tips.nbytes
        for s in sessions:
            s.close()
        after = rss_mib()
        out = {"sessions": args.sessions, "turns": args.turns, "tokens_per_turn": args.tokens,
               "seconds": round(time.time() - t0, 1), "rss_before_mib": round(before, 1),
               "rss_open_mib": round(peak, 1), "tips_bytes_open": tip_bytes, "rss_after_close_mib": round(after, 1),
               "tips_bytes_after_close": lab.service.tips.nbytes, "after_over_before": round(after / before, 3)}
    print(json.dumps(out))
    save("kernel_memory", {"resident before (MiB)": out["rss_before_mib"],
                           f"{args.sessions} sessions open (MiB)": out["rss_open_mib"],
                           "after they closed (MiB)": out["rss_after_close_mib"],
                           "after ÷ before": out["after_over_before"]},
         notes=[f"{args.sessions} sessions × {args.turns} calls, ~{args.tokens} new tokens a turn; goal: after ÷ "
                f"before ≤ 1.1 ({'met' if out['after_over_before'] <= 1.1 else 'missed'})"],
         title="Kernel memory after closed sessions",
         raw=out)


if __name__ == "__main__":
    main()
