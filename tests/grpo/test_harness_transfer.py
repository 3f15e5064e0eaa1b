"""benchmarks/harness_transfer.py end to end on its smallest setting, on the suite's shared engine (issue 44): two
harnesses over two provider APIs, one seed, one step — the matrix's rows, each cell's gain against the same "before",
and its plot."""

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness_transfer  # noqa: E402
from harness_transfer import plot, summary, transfer_matrix  # noqa: E402

HARNESSES = ["calculator", "calculator_anthropic"]


def test_the_transfer_matrix_trains_behind_each_harness_and_evaluates_behind_every_one(lab, shipped_weights,
                                                                                       monkeypatch):
    earlier = {c.session_id for c in lab.call_records()}  # the shared Lab's other tests' sessions
    runs = transfer_matrix(lab, shipped_weights, HARNESSES, seeds=[1], steps=1, tasks_per_step=2, eval_limit=4)
    assert sorted(zip(runs["train"], runs["eval"])) == sorted((a, b) for a in HARNESSES for b in HARNESSES)
    assert (runs.groupby("eval")["before"].nunique() == 1).all()  # one "before" per eval harness, for every row
    assert ((runs["gain"] - (runs["after"] - runs["before"])).abs() < 1e-12).all()
    assert runs["after"].between(0, 1).all() and (runs["train_s"] > 0).all()
    apis = {}
    for call in lab.call_records():
        if call.session_id not in earlier:
            apis.setdefault(call.session_id, set()).add(call.api)
    assert all(len(a) == 1 for a in apis.values())  # each run over one API
    assert sorted(a for (a,) in set(map(tuple, apis.values()))) == ["anthropic.messages", "openai.chat"]
    cells = summary(runs)
    assert len(cells) == 4 and (cells["seeds"] == 1).all()
    assert len(plot(runs).axes[0].texts) == 4  # every cell annotated with its mean ± spread

    # another seed added to one row of the same matrix (`--merge --train`): the earlier rows kept, the "before"
    # reused, not measured again; only the named harness trained behind, evaluated behind every one; a time budget
    # shorter than a step stops it after its first of two steps
    from polar_lab import GRPOTrainer

    evaluated, evaluate = [], GRPOTrainer.evaluate
    monkeypatch.setattr(GRPOTrainer, "evaluate", lambda *a, **k: evaluated.append(1) or evaluate(*a, **k))
    more = transfer_matrix(lab, shipped_weights, HARNESSES, seeds=[2], steps=2, tasks_per_step=2, eval_limit=4,
                           known=runs, train=HARNESSES[:1], time_budget_s=1.0)
    assert len(evaluated) == 2 and more.iloc[:4].equals(runs) and sorted(set(more["seed"])) == [1, 2]
    added = more.iloc[4:]
    assert set(added["train"]) == {HARNESSES[0]} and sorted(added["eval"]) == HARNESSES and (added["steps"] == 1).all()
    assert len(plot(added).axes[0].texts) == 2  # a row alone: one trained behind, every evaluated behind
    assert (more.groupby("eval")["before"].nunique() == 1).all()
    assert summary(more)["seeds"].to_dict() == {(a, b): 2 if a == HARNESSES[0] else 1 for a in HARNESSES
                                                for b in HARNESSES}


def test_the_google_calculator_agent_runs_its_own_function_call_loop_as_one_chain_per_run(lab):
    """The matrix's third API (the test above runs two): functionCall parts answered by functionResponse parts, each
    run recorded over Google's surface and rebuilt as one chain."""
    from polar_lab.harness.registry import get_harness
    from polar_lab.tasks import load_tasks

    (group,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl")[:1], get_harness("calculator_google"),
                           num_generations=4, evaluator="final_answer", seed=1, progress=False,
                           sampling={"max_tokens": 64})
    assert all(s.status == "closed" and s.reward is not None for s in group.sessions)
    calls = lab.call_records([s.id for s in group.sessions])
    assert {c.api for c in calls} == {"google.generate_content"} and len(calls) > len(group.sessions)  # tool turns
    assert len(group.trajectories) == len(group.sessions)


class Started(Exception):
    """The benchmark got as far as starting its engine."""


def test_the_benchmark_refuses_other_rows_merged_or_a_setting_it_replaces_before_an_engine_starts(monkeypatch, capsys):
    def lab(*args, **kwargs):
        raise Started

    monkeypatch.setattr(harness_transfer, "Lab", lab)
    monkeypatch.chdir(ROOT)  # the result file names its config as the command gave it
    row = ["--config", "configs/tiny_agent_codex.yaml", "--harnesses", "codex,claude_code,qwen_code,pi",
           "--seeds", "3", "--steps", "60", "--budget-s", "1200", "--eval-limit", "40",
           "--set", "mask_truncated_completions=true", "--set", "overlong_buffer_len=192",
           "--set", "overlong_max_tokens=384", "--merge", str(ROOT / "benchmarks/results/cli_transfer_codex.json")]
    with pytest.raises(SystemExit, match=r"'train': \['codex'\].*asked .*'train': None"):
        harness_transfer.main(row)  # every row asked, of a file that holds one: its tables would lose the others
    with pytest.raises(Started):
        harness_transfer.main([*row, "--train", "codex"])  # the same row: merged, and on to the engine
    with pytest.raises(SystemExit):
        harness_transfer.main([*row, "--train", "codex", "--set", "eval_limit=10"])  # set per run by the benchmark
    assert "--set ['eval_limit']" in capsys.readouterr().err


@pytest.mark.parametrize("name, flags", [
    # the full 4x4 matrix: each CLI's sessions behind itself
    ("cli_transfer", ["--steps", "5", "--eval-limit", "30", "--lr", "2e-4"]),
    # one row: the sessions behind every CLI the row was evaluated behind
    ("cli_transfer_codex", ["--train", "codex", "--steps", "60", "--budget-s", "1200", "--eval-limit", "40",
                            "--set", "mask_truncated_completions=true", "--set", "overlong_buffer_len=192",
                            "--set", "overlong_max_tokens=384"]),
])
def test_a_committed_result_renders_its_tables_again_from_its_runs(name, flags, tmp_path):
    from polar_lab import GRPOConfig

    committed = json.loads((ROOT / f"benchmarks/results/{name}.json").read_text())
    args = harness_transfer.parse_args(["--config", "configs/tiny_agent_codex.yaml", "--harnesses",
                                        "codex,claude_code,qwen_code,pi", "--out", str(tmp_path / "out.json"), *flags])
    args.tasks_per_step, args.lr = 4, args.lr or 2e-4  # as main() reads them from the config
    runs = pd.DataFrame(committed["raw"]["runs"]).assign(steps=committed["raw"]["steps"])
    harness_transfer.save_result(args, runs, GRPOConfig(num_generations=8), committed["raw"]["model"],
                                 committed["figures"]["wall, all runs (s)"], committed["notes"][1:])
    rendered = json.loads((tmp_path / "out.json").read_text())
    assert rendered["tables"] == committed["tables"] and rendered["notes"] == committed["notes"]
