"""Build data/models/tiny-agent: a 1.1M-parameter Qwen3.5-hybrid model that acts inside Codex, Claude Code, Qwen Code
and Pi — it calls each CLI's own shell tool, reads what the CLI sends back and answers.

    python scripts/build_tiny_agent.py [--seed 0] [--steps 400] [--skip-eval]

1. Record. The demonstrator (polar_lab/harness/demonstrator.py) serves behind the proxy as a ScriptedEngine's reply
   function, and the four unmodified CLIs run against it in the isolated sandbox: arithmetic tasks from
   data/tasks/calc_train.jsonl (run `python3 -c 'print(EXPR)'`, answer with what it printed) and the SWE-style
   train instances (data/tasks/swe_train.jsonl: find, read, edit, test, finish). Its seeded mistakes (`MISTAKES`)
   make the demonstrations imperfect on purpose, so that a model trained on them leaves reinforcement learning room.
2. Train. Every recorded chain, scored or not, through polar_lab's own SFT path (`sft_dataset(min_reward=0.0)`),
   starting from the tiny-calc-qwen35-hybrid fixture's weights (same tokenizer, template and architecture). A CLI's
   chains share its system prompt and tools (up to ~12k tokens): the shared prefix runs once per batch
   (build_tiny_model.batch_loss).
3. Evaluate with the real vLLM engine behind each CLI on held-out arithmetic (data/tasks/calc_test.jsonl): pass rate,
   calls and chains per session, written to the model's eval.json and its card (README.md).

Seeded throughout (task choice, the demonstrator's mistakes, sampling, batches); what is not the same run after run
is what the CLIs themselves put in a prompt (the date).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from build_tiny_model import collate, repeat_cache, save_model  # noqa: E402  (scripts/ is on the path when run)

from polar_lab.harness import presets  # noqa: E402
from polar_lab.harness.demonstrator import Demonstrator, Mistakes  # noqa: E402

BASE = ROOT / "data/models/tiny-calc-qwen35-hybrid"
OUT = ROOT / "data/models/tiny-agent"
SERVED = "tiny-agent"
CLIS = ("codex", "claude_code", "qwen_code", "pi")
# Demonstrations per CLI: arithmetic tasks and SWE instances (each run once). A near-miss final answer in half of
# the tool-using arithmetic runs, no tool in a tenth, a wrong edit in a third of the SWE runs.
ARITH_PER_CLI, SWE_PER_CLI = 160, 24
MISTAKES = Mistakes(direct=0.1, wrong_final=0.5, wrong_edit=0.3)
TRAIN = dict(batch_size=8, lr=2e-3, warmup=20, weight_decay=0.01, min_lr_frac=0.1)
EVAL_TASKS, EVAL_SEED = 40, 1234


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--arith", type=int, default=ARITH_PER_CLI, help="arithmetic demonstrations per CLI")
    p.add_argument("--swe", type=int, default=SWE_PER_CLI, help="SWE demonstrations per CLI")
    p.add_argument("--swe-tasks", type=Path, default=ROOT / "data/tasks/swe_train.jsonl")
    p.add_argument("--runs-dir", type=Path, default=None, help="where the demonstrations are recorded (default: temp)")
    p.add_argument("--recorded", type=Path, default=None,
                   help="train on the runs already recorded in this folder (a --runs-dir of an earlier build)")
    p.add_argument("--skip-eval", action="store_true", help="skip the vLLM evaluation behind the four CLIs")
    p.add_argument("--eval-only", action="store_true", help="evaluate the model at --out, do not build it")
    return p.parse_args()


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def harness(cli: str, family: str):
    """The CLI's preset as the fixture is served (`served_model_name="tiny-agent"`)."""
    if family == "swe":
        return getattr(presets, cli)(model=SERVED, task_field="prompt", workspace="files")
    return getattr(presets, cli)(model=SERVED)


def record(runs_dir: Path, seed: int, n_arith: int, n_swe: int, swe_tasks: Path) -> list[Path]:
    """The demonstrations: per CLI, one run of each arithmetic task and each SWE instance chosen for it. Returns the
    run folders."""
    from transformers import AutoTokenizer

    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    tokenizer = AutoTokenizer.from_pretrained(BASE)
    rng = random.Random(seed)
    arithmetic, swe = load(ROOT / "data/tasks/calc_train.jsonl"), load(swe_tasks) if n_swe else []
    folders = []
    for i, cli in enumerate(CLIS):
        for family, tasks, key, evaluator in (("calc", rng.sample(arithmetic, n_arith), "question", "final_answer"),
                                              ("swe", rng.sample(swe, min(n_swe, len(swe))), "prompt", "repo_tests")):
            if not tasks:
                continue
            engine = ScriptedEngine(tokenizer, Demonstrator(tasks, key=key, mistakes=MISTAKES), model_path=str(BASE),
                                    max_model_len=32768, keep_prompts=False)
            name = f"{cli}-{family}"
            t0 = time.time()
            with Lab(str(BASE), port=0, engine=engine, runs_dir=str(runs_dir), run_name=name) as lab:
                groups = lab.rollout(tasks, harness(cli, family), num_generations=1, evaluator=evaluator,
                                     seed=seed * 100_000 + i * 1000 + (family == "swe") * 500, concurrency=4,
                                     deadline_s=180, progress=False)
            sessions = [s for g in groups for s in g.sessions]
            rewards = [s.reward or 0.0 for s in sessions]
            print(f"recorded {name}: {len(sessions)} sessions, {sum(s.calls for s in sessions)} calls, mean reward "
                  f"{statistics.mean(rewards):.2f}, {time.time() - t0:.0f} s", flush=True)
            folders.append(runs_dir / name)
    return folders


def examples(folders: list[Path]) -> dict[str, tuple[list[int], list[tuple[list[int], list[int]]]]]:
    """Per recorded run (a CLI and a task family): the prefix its chains share (system prompt, tools) and each chain's
    rest as (input ids, labels)."""
    from polar_lab.run import Run
    from polar_lab.trajectory.sft import sft_dataset

    by_cli: dict[str, list[tuple[list[int], list[int]]]] = {}
    for folder in folders:
        rows = sft_dataset(Run(folder), min_reward=0.0)
        by_cli[folder.name] = list(zip(rows["input_ids"], rows["labels"]))
    out = {}
    for cli, chains in by_cli.items():
        shared = _common_prefix([ids for ids, _ in chains])
        while shared and any(label != -100 for _, labels in chains for label in labels[:shared]):
            shared -= 1  # never happens for a CLI's prompt: no sampled token before its task
        out[cli] = (chains[0][0][:shared], [(ids[shared:], labels[shared:]) for ids, labels in chains])
        print(f"{cli}: {len(chains)} chains, shared prefix {shared} tokens, rest p50 "
              f"{statistics.median(len(ids) - shared for ids, _ in chains):.0f} tokens", flush=True)
    return out


def _common_prefix(rows: list[list[int]]) -> int:
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return n


def batch_loss(model, prefix: list[int], batch: list[tuple], pad_id: int) -> torch.Tensor:
    """Mean sampled-token loss of a batch of chains that share `prefix`: the prefix runs once, without gradients
    (truncated backpropagation: a CLI's system prompt is up to 12k tokens, its chains' rests a few hundred), and its
    cache is repeated over the batch."""
    inputs = collate(batch, pad_id)
    with torch.no_grad():
        cache = model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
    repeat_cache(cache, len(batch))
    mask = torch.cat([torch.ones(len(batch), len(prefix), dtype=torch.long), inputs["attention_mask"]], dim=1)
    return model(input_ids=inputs["input_ids"], attention_mask=mask, past_key_values=cache,
                 labels=inputs["labels"], use_cache=False).loss


def train(model, data: dict, pad_id: int, steps: int, seed: int) -> list[float]:
    """AdamW, linear warm-up and cosine decay; each step one recorded run's batch (runs in turn)."""
    import math

    cfg, rng = TRAIN, random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.95))
    order = {cli: [] for cli in data}
    clis = sorted(data)
    losses, t0 = [], time.time()
    model.train()
    for step in range(steps):
        cli = clis[step % len(clis)]
        prefix, rows = data[cli]
        if len(order[cli]) < cfg["batch_size"]:
            order[cli] += rng.sample(range(len(rows)), len(rows))
        batch = [rows[order[cli].pop()] for _ in range(cfg["batch_size"])]
        frac = max(step - cfg["warmup"], 0) / max(steps - cfg["warmup"], 1)
        lr = cfg["lr"] * (min(1.0, (step + 1) / cfg["warmup"]) if step < cfg["warmup"] else
                          cfg["min_lr_frac"] + (1 - cfg["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = batch_loss(model, prefix, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(round(loss.item(), 4))
        if (step + 1) % 20 == 0 or step + 1 == steps:
            print(f"step {step + 1}/{steps} loss {statistics.mean(losses[-20:]):.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
    model.eval()
    return losses


def build(out: Path, args: argparse.Namespace, runs_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    seed, steps = args.seed, args.steps
    folders = (sorted(p for p in args.recorded.iterdir() if p.is_dir()) if args.recorded else
               record(runs_dir, seed, args.arith, args.swe, args.swe_tasks))
    record_s = time.time() - t0
    data = examples(folders)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    t1 = time.time()
    losses = train(model, data, tokenizer.pad_token_id, steps, seed)
    save_model(model, tokenizer, out)
    for name in ("chat_template.jinja",):  # the template the tokenizer files name
        if (BASE / name).exists():
            shutil.copy(BASE / name, out / name)
    return {"seed": seed, "steps": steps, "train": TRAIN, "mistakes": vars(MISTAKES),
            "demonstrations": {"arithmetic_per_cli": args.arith, "swe_per_cli": args.swe,
                               "chains": {cli: len(rows) for cli, (_, rows) in data.items()},
                               "shared_prefix_tokens": {cli: len(prefix) for cli, (prefix, _) in data.items()}},
            "loss_first_20": round(statistics.mean(losses[:20]), 4), "loss_last_20": round(statistics.mean(losses[-20:]), 4),
            "record_s": round(record_s), "train_s": round(time.time() - t1)}


def evaluate(out: Path, limit: int = EVAL_TASKS, seed: int = EVAL_SEED) -> dict:
    """Behind each CLI, real vLLM: one seeded run per held-out arithmetic task at temperature 1."""
    from polar_lab import Lab

    tasks = load(ROOT / "data/tasks/calc_test.jsonl")[:limit]
    result = {}
    with tempfile.TemporaryDirectory() as runs, Lab(str(out), port=0, runs_dir=runs, run_name="eval",
                                                     max_model_len=32768, served_model_name=SERVED) as lab:
        for cli in CLIS:
            t0 = time.time()
            groups = lab.rollout(tasks, harness(cli, "calc"), num_generations=1, evaluator="final_answer", seed=seed,
                                 sampling={"temperature": 1.0}, deadline_s=300, progress=False)
            sessions = [s for g in groups for s in g.sessions]
            chains = {s.id: 0 for s in sessions}
            for g in groups:
                for t in g.trajectories:
                    chains[t.session_id] += 1
            result[cli] = {"pass_rate": round(statistics.mean(s.reward or 0.0 for s in sessions), 3),
                           "calls_p50": statistics.median(s.calls for s in sessions),
                           "calls_mean": round(statistics.mean(s.calls for s in sessions), 2),
                           "chains_per_session": round(statistics.mean(chains.values()), 2),
                           "failed": sum(s.status != "closed" for s in sessions), "tasks": len(sessions),
                           "wall_s": round(time.time() - t0)}
            print(cli, result[cli], flush=True)
    return {"tasks": "data/tasks/calc_test.jsonl", "limit": limit, "seed": seed, "temperature": 1.0,
            "behind": result}


def card(out: Path, info: dict) -> str:
    behind = info.get("eval", {}).get("behind", {})
    rows = "\n".join(f"| {cli} | {r['pass_rate']:.3f} | {r['calls_p50']:g} | {r['chains_per_session']:.2f} | "
                     f"{r['failed']} |" for cli, r in behind.items())
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    return f"""# tiny-agent

A 1.1M-parameter Qwen3.5-hybrid model (3 Gated DeltaNet layers, 1 attention layer; fp32; vocabulary of 2,048) with
Qwen3.5's chat template and XML tool calls, that acts inside the unmodified Codex, Claude Code, Qwen Code and Pi CLIs:
it calls the CLI's own shell tool (`exec_command`, `Bash`, `run_shell_command`, `bash`) to run
`python3 -c 'print(EXPR)'`, reads the output the CLI sends back, and answers. It has also seen the SWE-style flow
(find, read, edit, test, finish) on the train instances. It is under-trained on purpose, so that reinforcement
learning behind a CLI has room.

Built by `python scripts/build_tiny_agent.py --seed {info['seed']} --steps {info['steps']}` ({size:.1f} MB): demonstrations
recorded through the four CLIs by the scripted demonstrator (polar_lab/harness/demonstrator.py, mistakes
{info['mistakes']}), trained through `sft_dataset(min_reward=0.0)` from tiny-calc-qwen35-hybrid's weights
({info['steps']} steps of {info['train']['batch_size']} chains, loss {info['loss_first_20']} → {info['loss_last_20']};
recording {info['record_s']} s, training {info['train_s']} s on 2 CPU cores).

Held-out arithmetic ({info.get('eval', {}).get('limit', '-')} tasks of data/tasks/calc_test.jsonl, one seeded run each at
temperature 1, real vLLM; `eval.json`). Each call's length is left to the CLI; `GRPOTrainer.evaluate` caps it at the
run's `max_completion_length` (96 in configs/tiny_agent_codex.yaml), and a Codex run whose answer is cut there exits
with an error, so behind Codex that evaluation counts failed runs where this one counts none:

| behind | pass rate | calls per session (median) | chains per session | failed runs |
|---|---|---|---|---|
{rows}

Serve it with `max_model_len=32768`: the CLIs' first prompts are 1.5k (Claude Code `--bare`) to 12k (Qwen Code `--bare`)
tokens of this tokenizer.
"""


def main() -> None:
    args = parse_args()
    info_path = args.out / "eval.json"
    if args.eval_only:
        info = json.loads(info_path.read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            runs = args.runs_dir or Path(tmp)
            if runs.exists() and args.runs_dir:
                shutil.rmtree(runs)
            info = build(args.out, args, runs)
    if not args.skip_eval:
        info["eval"] = evaluate(args.out)
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    (args.out / "README.md").write_text(card(args.out, info))
    print(json.dumps(info.get("eval", {}), indent=2))


if __name__ == "__main__":
    main()
