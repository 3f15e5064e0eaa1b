"""Trajectory costs: the proxy's render + tokenise time per call as a session grows to 100 turns (~64k tokens), and
the samples and tokens of the per_request and prefix_merging builders on a real 10-turn session.

Part 1 (renderer only, the proxy's exact code path, no engine): a 100-turn session whose history grows
to ~64k tokens. Each turn adds a ~640-token user message; the "model output" is a fixed reply encoded
once, as the proxy would have received it from the engine. Reports the per-call render+tokenise time at
turn 1 and turn 100 with exact-id continuity and the template rendering only the new messages (proxy/history.py),
as the proxy renders a session, and what a full re-tokenisation costs at turn 100.

Part 2 (real Lab, real vLLM, the tiny model): one 10-turn tool-using session (`multi_turn_agent`),
rebuilt with both builders after 2, 4, ..., 10 turns: samples, tokens, trained tokens.

    python benchmarks/trajectory_cost.py [--model data/models/tiny-calc] [--turns 100] [--skip-engine]
"""

from __future__ import annotations

import argparse
import statistics
import time

from transformers import AutoTokenizer

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT
from polar_lab.proxy.render import Renderer, Tip

from result import save

FILLER = ("The log shows the build step ran, the tests were collected, and three of them failed with "
          "an assertion about the parser's handling of nested brackets in the input file. ")


def render_costs(tokenizer, turns: int, repeats: int = 5) -> dict:
    """`repeats` sessions of `turns` turns, each turn's user message its own text (the proxy's piece cache would
    tokenise a text shared by all sessions once, and the median would time cache hits); per turn, the median over
    the sessions of one call's render + tokenise."""
    renderer = Renderer(tokenizer)
    reply_ids = renderer.encode("I will look at the failing parser tests next.") + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")]
    sessions = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(repeats)]
    tips: list[list[Tip]] = [[] for _ in range(repeats)]
    per_turn, tokens = [], 0
    for turn in range(1, turns + 1):
        timings = []
        for r, messages in enumerate(sessions):  # each call is a new turn of its own session
            messages.append({"role": "user", "content": f"Step {turn} of run {r}. " + FILLER * 11})  # ~640 tokens
            t0 = time.perf_counter()
            rendered = renderer.render(messages, [CALC_TOOL], tips=tips[r], session=f"s{r}")
            timings.append(time.perf_counter() - t0)
            tips[r] = [Tip(f"c{turn}", rendered.text + renderer.decode(reply_ids), rendered.prompt_ids + reply_ids)]
            messages.append({"role": "assistant", "content": "I will look at the failing parser tests next."})
        per_turn.append(statistics.median(timings))
        tokens = len(rendered.prompt_ids)
    messages = sessions[0][:-1]  # turn 100's request (the loop appended the reply it would get)
    t0 = time.perf_counter()
    for _ in range(repeats):  # template + whole-text tokenisation: what continuity avoids (no piece cache)
        text = renderer.tokenizer.apply_chat_template(messages, tools=[CALC_TOOL], add_generation_prompt=True,
                                                      tokenize=False)
        renderer.tokenizer.encode(text, add_special_tokens=False)
    full = (time.perf_counter() - t0) / repeats
    return {"turns": turns, "history_tokens": tokens, "turn1_ms": per_turn[0] * 1000,
            "last_turn_ms": per_turn[-1] * 1000, "ratio": per_turn[-1] / per_turn[0],
            "last_turn_full_retokenise_ms": full * 1000}


def builder_sizes(model: str, turns: int) -> list[dict]:
    from polar_lab import Lab
    from polar_lab.harness.chain_breakers import multi_turn_agent
    from polar_lab.trajectory.report import builder_counts

    questions = ["What is 12*(3+4)?", "What is 81-17?", "Compute 5*6*7.", "What is 100+23?", "What is 9*9?"]
    with Lab(model, port=0, run_name=f"bench-traj-{int(time.time())}") as lab:
        session = lab.session()
        lab.run(multi_turn_agent(session, questions, turns=turns), timeout=600)
        calls = sorted(lab.call_records(), key=lambda c: c.call_index)
    rows = []
    for k in range(2, turns + 1, 2):
        counts = builder_counts(calls[:k])
        rows.append({"turns": k, **{f"{b}_{m}": v for b, d in counts.items() for m, v in d.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--builder-turns", type=int, default=10)
    parser.add_argument("--skip-engine", action="store_true", help="only part 1 (no vLLM)")
    parser.add_argument("--out", default="benchmarks/results/trajectory_cost.json")
    args = parser.parse_args()

    render = render_costs(AutoTokenizer.from_pretrained(args.model), args.turns)
    print(f"render+tokenise: turn 1 {render['turn1_ms']:.2f} ms, turn {args.turns} {render['last_turn_ms']:.2f} ms "
          f"(ratio {render['ratio']:.2f}, history {render['history_tokens']} tokens); full re-tokenisation at "
          f"turn {args.turns}: {render['last_turn_full_retokenise_ms']:.1f} ms")
    result, tables = {"render": render}, []
    if not args.skip_engine:
        rows = builder_sizes(args.model, args.builder_turns)
        result["builders"] = rows
        cols = list(rows[0])
        print(" ".join(f"{c:>28}" for c in cols))
        for row in rows:
            print(" ".join(f"{row[c]:>28}" for c in cols))
        last = rows[-1]
        print(f"samples per_request/prefix_merging at {last['turns']} turns: "
              f"{last['per_request_samples'] / last['prefix_merging_samples']:.1f}x")
        tables.append({"title": f"Builders on one {args.builder_turns}-turn session: samples / tokens",
                       "columns": ["turns", "per_request", "prefix_merging", "trained tokens (both)"],
                       "rows": [[r["turns"], f"{r['per_request_samples']} / {r['per_request_tokens']}",
                                 f"{r['prefix_merging_samples']} / {r['prefix_merging_tokens']}",
                                 r["prefix_merging_trained_tokens"]] for r in rows]})
    final = f"turn {args.turns}"
    figures = {"render + tokenise, turn 1 (ms)": round(render["turn1_ms"], 2),
               f"{final} (ms)": round(render["last_turn_ms"], 2), f"{final} ÷ turn 1": round(render["ratio"], 2),
               f"whole-text tokenisation at {final} (ms)": round(render["last_turn_full_retokenise_ms"], 1)}
    path = save("trajectory_cost", figures, title="Trajectory costs", tables=tables, raw=result, out=args.out,
                notes=[f"history {render['history_tokens']} tokens at {final}; goal: {final} ≤ 2× turn 1 "
                       f"({'met' if render['ratio'] <= 2 else 'missed'})"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
