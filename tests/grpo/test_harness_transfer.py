"""benchmarks/harness_transfer.py end to end on its smallest setting, on the suite's shared engine (issue 44): two
harnesses over two provider APIs, one seed, one step — the matrix's rows, each cell's gain against the same "before",
and its plot."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

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
    # reused, not measured again; only the named harness trained behind, evaluated behind every one
    from polar_lab import GRPOTrainer

    evaluated, evaluate = [], GRPOTrainer.evaluate
    monkeypatch.setattr(GRPOTrainer, "evaluate", lambda *a, **k: evaluated.append(1) or evaluate(*a, **k))
    more = transfer_matrix(lab, shipped_weights, HARNESSES, seeds=[2], steps=1, tasks_per_step=2, eval_limit=4,
                           known=runs, train=HARNESSES[:1])
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
