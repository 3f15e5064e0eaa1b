"""Bytes on disk for one long session: its calls.jsonl, the same records written whole (without store/delta.py's
references to the previous call), and its one merged chain (the trajectory training reads), as JSON and as Parquet.

Also the file gzipped (stdlib), to see whether a compressed format would pay. A 100-turn session through the real
proxy over HTTP (render, record, the run store); each turn adds a ~640-token user message, so the context reaches
~64k tokens by turn 100. The engine is the scripted one (engine/fake.py), with a 128k-token context the tiny model
does not have: what is measured is the record format, and a reply's size is all the engine contributes (a fixed
short answer, as in benchmarks/trajectory_cost.py). Goal: the session's bytes <= 2x its merged chain's record.

    python benchmarks/storage.py [--turns 100]
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from transformers import AutoTokenizer

from polar_lab import Lab
from polar_lab.engine import ScriptedEngine
from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT
from polar_lab.store import load_calls
from polar_lab.trajectory import prefix_merging, to_parquet

from result import save

FILLER = ("The log shows the build step ran, the tests were collected, and three of them failed with "
          "an assertion about the parser's handling of nested brackets in the input file. ")


def session(lab: Lab, turns: int) -> None:
    s = lab.session()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    with httpx.Client(timeout=120) as client:
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": f"Step {turn}. " + FILLER * 11})
            r = client.post(s.openai_base_url + "/chat/completions", headers={"Authorization": f"Bearer {s.key}"},
                            json={"model": "m", "messages": messages, "tools": [CALC_TOOL], "max_tokens": 16})
            r.raise_for_status()
            messages.append(r.json()["choices"][0]["message"])
    s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/storage.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = ScriptedEngine(tokenizer, ["I will look at the failing parser tests next."], model_path=args.model,
                            max_model_len=131072, keep_prompts=False)
    with tempfile.TemporaryDirectory() as runs:
        t0 = time.perf_counter()
        with Lab(port=0, engine=engine, runs_dir=runs, run_name="storage") as lab:
            session(lab, args.turns)
            run_dir = lab.run_dir
        wall = time.perf_counter() - t0
        on_disk = (run_dir / "calls.jsonl").stat().st_size
        gzipped = len(gzip.compress((run_dir / "calls.jsonl").read_bytes()))  # would compressing the file pay?
        calls = load_calls(run_dir)
        whole = sum(len(orjson.dumps(c.record())) + 1 for c in calls)
        (chain,) = prefix_merging(calls)
        chain_json = len(orjson.dumps(dataclasses.asdict(chain))) + 1
        chain_parquet = to_parquet([chain], Path(runs) / "chain.parquet").stat().st_size
    result = {"turns": args.turns, "context_tokens": len(chain.token_ids), "calls_jsonl_bytes": on_disk, "calls_jsonl_gzip_bytes": gzipped,
              "whole_records_bytes": whole, "chain_json_bytes": chain_json, "chain_parquet_bytes": chain_parquet,
              "ratio_to_chain_json": on_disk / chain_json, "whole_ratio_to_chain_json": whole / chain_json,
              "wall_s": wall}
    print(f"{args.turns} turns, context {result['context_tokens']} tokens")
    print(f"calls.jsonl (references)   {on_disk / 1e6:8.2f} MB  = {result['ratio_to_chain_json']:.2f}x the chain's JSON")
    print(f"calls.jsonl, gzip          {gzipped / 1e6:8.2f} MB  (this benchmark's filler text repeats: real text "
          f"compresses less)")
    print(f"records written whole      {whole / 1e6:8.2f} MB  = {result['whole_ratio_to_chain_json']:.2f}x")
    print(f"merged chain, JSON         {chain_json / 1e6:8.2f} MB   (Parquet {chain_parquet / 1e6:.2f} MB)")
    ratio = result["ratio_to_chain_json"]
    path = save("storage", {"calls.jsonl (MB)": round(on_disk / 1e6, 2), "÷ the merged chain as JSON": round(ratio, 2),
                            "records written whole (MB)": round(whole / 1e6, 1),
                            "merged chain, JSON / Parquet (MB)": f"{chain_json / 1e6:.2f} / {chain_parquet / 1e6:.2f}"},
                notes=[f"{args.turns} turns, context {result['context_tokens']} tokens; goal ≤ 2× the merged chain: "
                       f"{'met' if ratio <= 2 else 'missed'} ({ratio:.2f}×)"],
                title="Bytes on disk for one long session", raw=result, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
