"""The tiny-agent fixture's multi-turn sessions behind the four unmodified CLIs, on the real engine.

Per CLI (Codex over Responses, Claude Code over Anthropic Messages, Qwen Code and Pi over Chat Completions): the
fixture, sampling, drives the held-out SWE-style instances through the CLI's own tools, one run each, until a session of
three to twenty-four calls — the model's tool call, the CLI running it, the next request carrying its output — comes up
(5 of 12 runs seen across the four CLIs were; which ones depends on the sampled tokens, and so on the run's temporary
paths and date in the prompt: a fixed sample would not find one everywhere). It is recorded as one chain, or each of its
breaks is classified (`chain_breaks`: Claude Code echoes an `Edit` call back with `replace_all: false` added, a turn the
harness edited); and `lab.replay` runs it again, every call answered from the record, id for id — up to the first tool
output that holds a run-specific value (Codex's chunk id and wall time, the seconds pytest reports), which no replay can
reproduce: then the replay must part from the record inside that output and nowhere else.

One engine for the module, over data/models/tiny-agent (the suite's engine pool; the first use of this model).
"""

import pytest

from polar_lab.harness import presets
from polar_lab.tasks import load_tasks
from polar_lab.trajectory.report import chain_breaks
from tests.conftest import agent_installed, session_calls

MODEL = "data/models/tiny-agent"
CLIS = ["codex", "claude_code", "qwen_code", "pi"]
pytestmark = pytest.mark.ci_required  # the CLIs are installed by `make agents` in CI



def harness(cli: str):
    return getattr(presets, cli)(model="tiny-agent", task_field="prompt", workspace="files")


@pytest.fixture(scope="module")
def agent_lab(engines, tmp_path_factory):
    with engines.lab(MODEL, engine_settings={"served_model_name": "tiny-agent"},
                     runs_dir=str(tmp_path_factory.mktemp("multiturn")), run_name="cli-multiturn") as lab:
        yield lab


def long_session(lab, cli: str, max_calls: int = 24):
    """The first run, over the held-out instances in order, that ends by itself after 3..max_calls calls."""
    seen = []
    for i, task in enumerate(load_tasks("data/tasks/swe_mini.jsonl")):
        # a run that ends by itself takes 3-20 s here; one that loops (Qwen Code's reach 50+ calls a minute) is cut at
        # 30 s and the search goes on
        # no evaluator: nothing here reads a reward (test_demonstrator.py scores a run behind each CLI with repo_tests)
        (group,) = lab.rollout([task], harness(cli), num_generations=1, seed=11 + i, deadline_s=30, progress=False)
        (session,) = group.sessions
        assert session.status in {"closed", "timeout"}, session.info  # a crash is a failure; a long run is not
        seen.append((session.status, session.calls))
        if session.status == "closed" and 3 <= session.calls <= max_calls:
            return group, session
    pytest.fail(f"no run of 3..{max_calls} calls behind {cli}: {seen}")


@pytest.mark.parametrize("cli", CLIS)
def test_a_multi_turn_session_behind_each_cli_is_one_chain_or_classified_breaks_and_replays_exactly(cli, agent_lab):
    if not agent_installed(cli):
        pytest.skip("run `make agents`")
    from transformers import AutoTokenizer

    group, session = long_session(agent_lab, cli)
    calls = session_calls(agent_lab, session)
    assert all(len(c.output_logprobs) == len(c.output_ids) > 0 for c in calls)
    assert calls[1].request != calls[0].request  # the CLI's own history: the tool's output came back to the model
    chains = group.trajectories
    assert sum(len(t.call_ids) for t in chains) == len(calls)
    breaks = chain_breaks(calls, AutoTokenizer.from_pretrained(MODEL))
    assert len(chains) == 1 + int(breaks["new_chain"].sum())
    assert set(breaks["kind"]) <= {"turn_edited"}, \
        breaks[["kind", "chain_context", "prompt_context"]].to_dict("records")
    replayed = agent_lab.replay(session.id, until_turn=len(calls) + 1, harness=harness(cli), branches=1)
    (row,) = replayed.frame().to_dict("records")
    if not row["exact"]:  # a tool's output held a run-specific value: Codex's chunk id and wall time, pytest's time
        assert row["diverged_call"] >= 1, row
        (branch,) = [c for c in agent_lab.call_records() if c.session_id == row["session_id"]
                     and c.call_index == row["diverged_call"]]
        recorded = calls[row["diverged_call"]].prompt_ids
        assert branch.prompt_ids[:row["diverged_token"]] == recorded[:row["diverged_token"]]
        before = AutoTokenizer.from_pretrained(MODEL).decode(recorded[:row["diverged_token"]])
        assert before.rfind("<tool_response>") > before.rfind("</tool_response>"), before[-300:]  # inside one
