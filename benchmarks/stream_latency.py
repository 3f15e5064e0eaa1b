"""Streaming: time to first token and the gap between tokens — the engine's own, through the proxy, and through
vLLM's OpenAI server (`vllm serve`) on the same model, engine arguments and requests, in one run.

    engine   `engine.generate(prompt_ids, on_delta=...)` in the kernel: the engine process's deltas as the
             proxy receives them (no HTTP, no render, no parse)
    proxy    POST /s/{key}/v1/chat/completions with stream=true from a client process (benchmarks/stream_client.py),
             each request the first call of its own session
    vllm     the same request to `vllm serve`, started after the Lab's rows, while the Lab's engine idles;
             --no-vllm-serve skips it
Every generation is MAX_TOKENS long (ignore_eos), plain text (no tools are offered, so nothing is held back as a
possible call). Time to first token (TTFT) is from
sending the request to the first token delta; the inter-token gap is between consecutive token deltas of one
stream. Goals: proxy TTFT p50 <= the engine's + 5 ms and <= vllm serve's; gap p50 within 10% of the engine's.

The engine runs in each layout given (`--cpu-bind`, default both): unbound (torch's threads on every core, the
default) and "auto" (bound to all cores but the last, as `vllm serve` lays out its own CPU engine); each row records
the CPUs the engine's main thread was allowed (`engine_cpus`). `vllm serve` is measured once per concurrency, after
the last layout's rows (beside that Lab, idle), and its figures are put beside each layout's row of that concurrency.

    python benchmarks/stream_latency.py [--concurrency 1 16] [--requests 64 128] [--rounds 8] [--cpu-bind nobind auto]
        [--cpu-small-batch 2 0] [--no-tcmalloc] [--no-vllm-serve]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

from polar_lab import Lab, SamplingSpec

sys.path.insert(0, str(Path(__file__).parent))
from proxy_latency import against_vllm_serve  # noqa: E402 - the peer server is shared with that benchmark
from client_process import run_client  # noqa: E402
from result import save  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
# tiny-calc ends its turn within a few tokens; past its end-of-turn token (ignore_eos) it samples special tokens,
# which carry no text to stream. Banned, it writes text for all MAX_TOKENS tokens, on every path alike
# (`bad_words` for vllm serve, a session's forced banned_strings for the proxy).
BANNED = ["<|im_end|>"]
MAX_TOKENS = 64


def _client(url: str, concurrency: int, total: int, keys: list[str] | None = None) -> dict:
    body = {"model": "tiny-calc", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "bad_words": BANNED}  # vLLM's name; the proxy's sessions force it instead
    return run_client("stream_client.py", url, concurrency, total, body, keys=keys)


async def _engine(lab: Lab, concurrency: int, total: int) -> dict:
    """The engine's own TTFT and gaps, measured where the proxy receives its deltas."""
    prompt_ids = lab.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    ttft, gaps = [], []
    counter = iter(range(total))

    async def worker() -> None:
        for i in counter:
            arrivals: list[float] = []
            t0 = time.perf_counter()
            await lab.engine.generate(prompt_ids, SamplingSpec(max_tokens=MAX_TOKENS, seed=i, ignore_eos=True,
                                                                      banned_strings=tuple(BANNED)),
                                      lambda d: d.text and arrivals.append(time.perf_counter()))
            ttft.append(arrivals[0] - t0)
            gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttft_s": ttft, "gaps_s": gaps, "wall_s": time.perf_counter() - t0}


def _ms(prefix: str, result: dict) -> dict[str, float]:
    out = {}
    for name, values in (("ttft", result["ttft_s"]), ("gap", result["gaps_s"])):
        ms = np.array(values) * 1000
        out[f"{prefix}_{name}_p50_ms"] = float(np.percentile(ms, 50))
        out[f"{prefix}_{name}_p99_ms"] = float(np.percentile(ms, 99))
    return out


def _client_cpu(result: dict) -> float:
    """The client process's CPU per token delta received (ms): what it took from the cores the servers run on."""
    return 1000 * result["client_cpu_s"] / max(sum(result["deltas"]), 1)


def measure(lab: Lab, concurrency: int, total: int, rounds: int = 4) -> dict[str, float]:
    """The engine's own streams and the proxy's, `total` of each, in `rounds` alternating rounds: this machine's speed
    drifts within minutes (the engine's own gap moved 3.0-5.7 ms between runs on 2026-12-03), and a ratio of two
    phases measured one after the other carried that drift. A round holds at least `concurrency` streams (fewer rounds
    when `total` is short), or it would measure a lower concurrency than its row says."""
    rounds = max(1, min(rounds, total // concurrency))
    lab.submit(_engine(lab, concurrency, 2 * concurrency)).result()  # warm-up
    forced = {"banned_strings": BANNED}
    keys = [lab.session(harness="bench", sampling=forced).key for _ in range(total)]
    _client(lab.url + "/v1/chat/completions", concurrency, concurrency,
            keys=[lab.session(harness="warmup", sampling=forced).key for _ in range(concurrency)])
    engine: dict[str, list] = {"ttft_s": [], "gaps_s": []}
    proxy: dict[str, list] = {"ttft_s": [], "gaps_s": [], "deltas": [], "client_cpu_s": []}
    for part in np.array_split(np.arange(total), rounds):
        for into, result in ((engine, lab.submit(_engine(lab, concurrency, len(part))).result()),
                             (proxy, _client(lab.url + "/v1/chat/completions", concurrency, len(part),
                                             keys=[keys[i] for i in part]))):
            for name in into:
                into[name] += result[name] if isinstance(result[name], list) else [result[name]]
    proxy["client_cpu_s"] = sum(proxy["client_cpu_s"])
    row = {"concurrency": concurrency, "requests": total, "rounds": rounds, **_ms("engine", engine),
           **_ms("proxy", proxy), "proxy_client_cpu_ms_per_token": _client_cpu(proxy)}
    row["proxy_ttft_added_p50_ms"] = row["proxy_ttft_p50_ms"] - row["engine_ttft_p50_ms"]
    row["proxy_gap_over_engine_p50"] = row["proxy_gap_p50_ms"] / row["engine_gap_p50_ms"]
    return row


def measure_vllm_serve():
    """`against_vllm_serve`'s per-row measurement: `vllm serve` alone (an idle one beside the Lab slows the Lab's
    figures), measured once per concurrency and put beside each layout's row of that concurrency."""
    peers: dict[tuple[int, int], dict] = {}

    def measure_row(row: dict, url: str) -> None:
        key = (row["concurrency"], row["requests"])
        if key not in peers:
            _client(url + "/v1/chat/completions", row["concurrency"], row["concurrency"])
            peer = _client(url + "/v1/chat/completions", row["concurrency"], row["requests"])
            peers[key] = {**_ms("vllm_serve", peer), "vllm_serve_client_cpu_ms_per_token": _client_cpu(peer)}
        row.update(peers[key])
        row["proxy_ttft_over_vllm_serve_p50"] = row["proxy_ttft_p50_ms"] / row["vllm_serve_ttft_p50_ms"]
    return measure_row


def engine_cpus(pid: int) -> str:
    """The CPUs the engine process's main thread may run on (what its layout did, whatever it was asked)."""
    with open(f"/proc/{pid}/status") as fh:
        return next(line for line in fh if line.startswith("Cpus_allowed_list:")).split()[1]


def headline(rows: list[dict]) -> tuple[dict, list[dict]]:
    """The result file's figures (each layout's ratios at the lowest concurrency, where the goals are) and its table."""
    def layout(row: dict) -> str:  # the engine's layout, and its thread settings where they are not the defaults
        settings = {"small batch": (row["cpu_small_batch"], 2), "small prefill": (row["cpu_small_prefill"], 128)}
        return ", ".join([row["cpu_bind"], *(f"{k} {v}" for k, (v, default) in settings.items() if v != default)])

    def pair(row: dict, prefix: str) -> str | None:
        return f"{row[f'{prefix}_ttft_p50_ms']:.2f} / {row[f'{prefix}_gap_p50_ms']:.2f}" \
            if f"{prefix}_ttft_p50_ms" in row else None

    lowest = min(row["concurrency"] for row in rows)
    figures = {}
    for row in (r for r in rows if r["concurrency"] == lowest):
        peer = f"{row['proxy_ttft_over_vllm_serve_p50']:.2f}" if "proxy_ttft_over_vllm_serve_p50" in row else "–"
        figures[f"{layout(row)}: gap ÷ engine's / TTFT added (ms) / TTFT ÷ `vllm serve`'s"] = \
            f"{row['proxy_gap_over_engine_p50']:.2f} / {row['proxy_ttft_added_p50_ms']:.2f} / {peer}"
    columns = ["layout", "concurrency", "engine TTFT / gap p50 (ms)", "proxy TTFT / gap p50 (ms)",
               "`vllm serve` TTFT / gap p50 (ms)", "proxy gap ÷ engine's"]
    table = [[layout(row), row["concurrency"], pair(row, "engine"), pair(row, "proxy"), pair(row, "vllm_serve"),
              round(row["proxy_gap_over_engine_p50"], 2)] for row in rows]
    return figures, [{"title": "p50 per layout and concurrency", "columns": columns, "rows": table}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--no-vllm-serve", action="store_true")
    parser.add_argument("--no-tcmalloc", action="store_true",
                        help="engines on glibc's allocator (EngineConfig.tcmalloc)")
    parser.add_argument("--cpu-bind", nargs="+", default=["nobind", "auto"],
                        help="the engine layouts to measure, one Lab each (EngineConfig.cpu_bind)")
    parser.add_argument("--cpu-small-batch", type=int, nargs="+", default=[2],
                        help="the engine's one-thread decode steps, one Lab each (EngineConfig.cpu_small_batch; 0: "
                             "every step on every thread, as before 2026-12-03)")
    parser.add_argument("--cpu-small-prefill", type=int, nargs="+", default=[128],
                        help="the most prompt tokens a one-thread step prefills, one Lab each "
                             "(EngineConfig.cpu_small_prefill; 0: every prefill on every thread, as before 2026-12-03 "
                             "afternoon)")
    parser.add_argument("--rounds", type=int, default=8, help="alternating engine / proxy rounds per row")
    parser.add_argument("--out", default="benchmarks/results/stream_latency.json")
    args = parser.parse_args()
    rows: list[dict] = []
    layouts = [(bind, small, prefill) for bind in args.cpu_bind for small in args.cpu_small_batch
               for prefill in args.cpu_small_prefill]
    for i, (layout, small, prefill) in enumerate(layouts):  # one Lab per engine layout; vllm serve after the last
        with Lab(args.model, port=0, runs_dir="data/runs", run_name=f"bench-stream-{int(time.time())}",
                 tcmalloc=not args.no_tcmalloc, cpu_bind=layout, cpu_small_batch=small,
                 cpu_small_prefill=prefill) as lab:
            cpus = engine_cpus(lab.engine.pid)
            rows += [{"cpu_bind": layout, "cpu_small_batch": small, "cpu_small_prefill": prefill, "engine_cpus": cpus,
                      **measure(lab, c, n, args.rounds)}
                     for c, n in zip(args.concurrency, args.requests)]
            if not args.no_vllm_serve and i == len(layouts) - 1:
                against_vllm_serve(lab, rows, measure_vllm_serve(), check=None)  # streams ask for text only
    for row in rows:
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    result = {"model": args.model, "max_tokens": MAX_TOKENS, "tcmalloc": not args.no_tcmalloc, "rows": rows}
    figures, tables = headline(rows)
    path = save("stream_latency", figures, title="Streaming: time to first token and the gap between tokens",
                tables=tables, raw=result, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
