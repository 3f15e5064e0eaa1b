"""The paper's recipe: configs/polar_qwen35_4b.yaml is read as written (the paper's groups and rate, async FSDP over
GPUs 4-7 beside a 4-GPU engine), and configs/polar_recipe_cpu.yaml — the same loop at CPU size: the hybrid Qwen3.5
fixture, the shipped SWE set, Codex and Claude Code unmodified in the sandbox, repo_tests, prefix_merging, sync GRPO
over two FSDP ranks — runs 2 steps. Its engine is the recipe's own (`train_from_config` builds the Lab from the file,
as the CLI does)."""

import json
from pathlib import Path

import pytest
import yaml

from polar_lab.grpo.run import load_train_config, train_from_config
from polar_lab.rewards.code import repo_tests
from polar_lab.rewards.registry import register
from tests.conftest import agent_installed

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "polar_qwen35_4b.yaml"
CPU_RECIPE = ROOT / "configs" / "polar_recipe_cpu.yaml"



def test_the_recipe_file_is_the_papers_setup():
    lab_config, grpo = load_train_config(RECIPE)
    assert (grpo.num_generations, grpo.tasks_per_step, grpo.learning_rate, grpo.weight_decay) == (16, 4, 1e-6, 0.1)
    assert grpo.builder == "prefix_merging" and grpo.tis_cap and grpo.async_mode
    assert (grpo.harness, grpo.evaluator, grpo.strategy) == ("codex", "repo_tests", "fsdp")
    assert lab_config.engine.tensor_parallel_size == 4 and grpo.trainer_devices == [f"cuda:{g}" for g in range(4, 8)]


@register("repo_tests_then_brevity")
def _repo_tests_then_brevity(task: dict, result: dict) -> dict[str, float]:
    """repo_tests' score, then a little for a shorter agent output: ties broken so that a group has a spread."""
    parts = repo_tests(task, result)
    brevity = -1e-4 * len(result.get("stdout", ""))
    return {**parts, "brevity": brevity, "total": parts["total"] + brevity}


@pytest.mark.ci_required
@pytest.mark.skipif(not (agent_installed("codex") and agent_installed("claude")),
                    reason="run `make agents` (npm) to install Codex CLI and Claude Code")
def test_the_cpu_recipe_runs_the_papers_loop_for_two_steps(tmp_path):
    """configs/polar_recipe_cpu.yaml (where it writes moved): the hybrid Qwen3.5 fixture behind Codex and Claude Code
    on the shipped SWE set. The model cannot fix a repository, so every run scores 0 and no group would train; the
    evaluator here adds a small tie-breaker to the tests' score so that step 1 trains and syncs (the plumbing is the
    claim, not learning)."""
    from polar_lab.run import Run

    data = yaml.safe_load(CPU_RECIPE.read_text())
    data["store"] = {"runs_dir": str(tmp_path / "runs"), "run_name": "recipe"}
    data["grpo"].update(output_dir=str(tmp_path / "out"), evaluator="repo_tests_then_brevity")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    lab_config, grpo = load_train_config(path)
    summary = train_from_config(lab_config, grpo, progress=False)

    assert summary["steps"] == 2 and summary["world_size"] == 2
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["groups"] == 2 for m in metrics), metrics
    run = Run(summary["run_dir"])
    sessions = run.session_records()
    by_harness = {}
    for s in sessions:
        by_harness.setdefault(s.info["harness"], []).append(s)
    assert sorted(by_harness) == ["claude_code", "codex"] and all(len(v) == 4 for v in by_harness.values())
    calls = run.call_records()
    api_of = {"codex": "openai.responses", "claude_code": "anthropic.messages"}
    for name, group in by_harness.items():  # every harness's calls recorded, through its own API
        ids = {s.id for s in group}
        assert {c.api for c in calls if c.session_id in ids} == {api_of[name]}, name
    # rewards come from the repositories' tests: every finished run was scored (0 or 1), none was left unscored
    scored = [s for s in sessions if s.status == "closed"]
    assert scored and all(s.reward_parts["passed"] in (0.0, 1.0) for s in scored), sessions
    # prefix_merging: each session with calls gives chains covering its calls
    chains = run.trajectories("prefix_merging")
    assert {t.session_id for t in chains} == {c.session_id for c in calls}
    # a weight sync after step 1 (rollout, train, sync): step 1 sampled at version 0, step 2 at version 1
    assert {c.policy_version for c in calls} == {0, 1}
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert len(list((checkpoint / "training_state").glob("*.distcp"))) == 2  # one shard file per FSDP rank


@pytest.fixture
def agents_named(tmp_path, monkeypatch):
    """Stand-in executables named codex and claude: these tests build presets (which find their agent when built) but
    run none, so they need no npm."""
    folder = tmp_path / "agents" / "node_modules" / ".bin"
    folder.mkdir(parents=True)
    for name in ("codex", "claude"):
        (folder / name).write_text("#!/bin/sh\nexit 1\n")
        (folder / name).chmod(0o755)
    monkeypatch.setenv("POLAR_LAB_AGENTS_DIR", str(tmp_path / "agents"))


def test_presets_take_their_options_by_name_and_other_harnesses_refuse_options(agents_named):
    from polar_lab.harness.command import Command
    from polar_lab.harness.registry import get_harness

    codex = get_harness("codex", {"task_field": "prompt", "workspace": "files", "model": "qwen3.5-4b"})
    assert isinstance(codex, Command) and codex.workspace == "files" and "{prompt}" in codex.argv
    assert "--dangerously-bypass-approvals-and-sandbox" in codex.argv  # its own sandbox cannot nest in polar_lab's
    assert 'model = "qwen3.5-4b"' in codex.files["codex-home/config.toml"]
    assert get_harness("claude_code", {"workspace": "files"}).workspace == "files"
    with pytest.raises(ValueError, match="harness_options are for the presets"):
        get_harness("calculator", {"workspace": "files"})
    assert get_harness(codex) is codex  # a Command (unhashable) passed as it is


def test_an_agent_with_its_own_guards_off_refuses_to_run_outside_the_isolated_sandbox(agents_named):
    import asyncio

    from polar_lab.errors import SandboxError
    from polar_lab.harness.registry import get_harness

    codex = get_harness("codex", {"workspace": "files"})
    assert codex.isolated_only and not get_harness("codex", {"run_commands": False}).isolated_only
    codex.sandbox = "process"
    with pytest.raises(SandboxError, match="must run in the isolated sandbox"):
        asyncio.run(codex(None, {"prompt": "fix it", "files": {}}))


def test_a_list_of_harnesses_runs_each_task_through_one_of_them_in_turn(agents_named):
    import asyncio

    from polar_lab.harness.mixture import HarnessMixture
    from polar_lab.harness.registry import get_harness
    from polar_lab.rollout import harness_name

    options = {"codex": {"task_field": "prompt", "workspace": "files"}, "claude_code": {"workspace": "files"}}
    mixture = get_harness(["codex", "claude_code"], options)
    assert isinstance(mixture, HarnessMixture) and mixture.harnesses["codex"].workspace == "files"
    with pytest.raises(ValueError, match="keyed by their names"):
        get_harness(["codex", "claude_code"], {"task_field": "prompt"})

    async def a(session, task):
        return {"ran": "a", "task": task["id"]}

    async def b(session, task):
        return {"ran": "b", "task": task["id"]}

    two = HarnessMixture({"a": a, "b": b})
    tasks = [{"id": "t1"}, {"id": "t2"}, {"id": "t1"}, {"id": "t3"}]
    ran = [asyncio.run(two(None, t))["ran"] for t in tasks]
    assert ran == ["a", "b", "a", "a"]  # tasks take the harnesses in turn; a task's runs keep its harness
    assert [harness_name(two, t) for t in tasks] == ran and harness_name(two) == "HarnessMixture"
