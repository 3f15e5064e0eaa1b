"""SFT data from accepted runs (issue 23): real calculator runs on the real engine, filtered by reward, in TRL's
conversational and tokenized forms; the acceptance table per task."""

import datasets
import pytest

from polar_lab.harness import calculator_agent
from polar_lab.run import Run
from polar_lab.tasks import load_tasks
from polar_lab.trajectory.sft import IGNORE


@pytest.fixture(scope="module")
def calc_runs(lab):
    tasks = load_tasks("data/tasks/calc_train.jsonl", limit=3)
    groups = lab.rollout(tasks, calculator_agent, evaluator="final_answer", num_generations=4, progress=False,
                         sampling={"temperature": 1.0}, seed=11)
    return [s for g in groups for s in g.sessions]


def test_the_tokenized_form_is_the_accepted_chains_ids_with_labels_masked_where_the_loss_is(lab, calc_runs):
    ids = [s.id for s in calc_runs]
    accepted = {s.id for s in calc_runs if s.reward is not None and s.reward >= 1.0}
    assert 0 < len(accepted) < len(calc_runs)  # the filter has something to keep and something to drop
    data = lab.sft_dataset(min_reward=1.0, session_ids=ids)
    chains = {(t.session_id, t.chain_index): t for t in lab.trajectories(session_ids=ids)}
    assert set(data["session_id"]) == accepted
    for row in data:
        chain = chains[(row["session_id"], row["chain_index"])]
        assert row["input_ids"] == chain.token_ids and row["assistant_masks"] == chain.loss_mask
        assert row["labels"] == [t if m else IGNORE for t, m in zip(chain.token_ids, chain.loss_mask)]
        assert any(label != IGNORE for label in row["labels"]) and row["reward"] >= 1.0


def test_the_conversational_form_is_the_last_request_and_its_reply(lab, calc_runs, tokenizer):
    data = lab.sft_dataset(min_reward=1.0, session_ids=[s.id for s in calc_runs])
    for row in data:
        messages = row["messages"]
        assert [m["role"] for m in messages[:2]] == ["system", "user"] and messages[-1]["role"] == "assistant"
        assert row["tools"][0]["function"]["name"] == "calculator"
        if len(messages) > 3:  # a tool call and its result before the answer: kept as the harness sent them
            assert messages[2]["tool_calls"] and messages[3]["role"] == "tool"
        # TRL renders it with the model's template: here it gives back the very text the chain's ids decode to,
        # up to the reply (which the template renders from the parsed call, the chain from the sampled ids)
        text = tokenizer.apply_chat_template(messages[:-1], tools=row["tools"], tokenize=False,
                                             add_generation_prompt=True)
        assert tokenizer.decode(row["input_ids"]).startswith(text)


def test_a_filter_that_accepts_nothing_gives_an_empty_dataset_with_the_columns(lab, calc_runs):
    data = lab.sft_dataset(min_reward=2.0, session_ids=[s.id for s in calc_runs])
    assert len(data) == 0
    assert data.column_names == ["messages", "tools", "input_ids", "labels", "assistant_masks", "reward",
                                 "session_id", "chain_index", "task_id"]


def test_acceptance_counts_runs_and_accepted_runs_per_task_and_a_run_folder_gives_the_same(lab, calc_runs, tmp_path):
    ids = [s.id for s in calc_runs]
    open_run, masked = lab.session(task=calc_runs[0].task), lab.session(task=calc_runs[0].task)
    masked.close(reward=None, status="error")  # a failed run: counted, masked, not accepted; the open one: not counted
    table = lab.sft_acceptance(min_reward=1.0, session_ids=ids + [open_run.id, masked.id]).set_index("task_id")
    for task_id, runs in _by_task(calc_runs).items():
        extra = int(task_id == calc_runs[0].task["id"])
        assert table.loc[task_id, "runs"] == len(runs) + extra
        assert table.loc[task_id, "accepted"] == sum(s.reward is not None and s.reward >= 1.0 for s in runs)
        assert table.loc[task_id, "masked"] == sum(s.reward is None for s in runs) + extra
        assert table.loc[task_id, "rate"] == table.loc[task_id, "accepted"] / table.loc[task_id, "runs"]
    offline = Run(lab.run_dir).sft_dataset(min_reward=1.0, session_ids=ids)
    assert offline["input_ids"] == lab.sft_dataset(min_reward=1.0, session_ids=ids)["input_ids"]
    offline.to_parquet(str(tmp_path / "sft.parquet"))
    assert datasets.Dataset.from_parquet(str(tmp_path / "sft.parquet"))["messages"] == offline["messages"]


def _by_task(sessions):
    out = {}
    for s in sessions:
        out.setdefault(s.task["id"], []).append(s)
    return out
