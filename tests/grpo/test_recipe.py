"""The paper's recipe (configs/polar_qwen35_4b.yaml) runs 2 steps on the CPU with the model, the tasks and the
hardware overridden: the Qwen3.5-format tiny model, the SWE-style repo tasks, no GPUs, small groups. Everything
else is the file's own: Codex unmodified in the sandbox, repo_tests, prefix_merging, async GRPO, FSDP ranks.
Its engine is the recipe's own (`train_from_config` builds the Lab from the file, as the CLI does)."""

import json
from pathlib import Path

import pytest
import yaml

from polar_lab.grpo.run import load_train_config, train_from_config
from polar_lab.harness.presets import agents_bin

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "polar_qwen35_4b.yaml"


def _installed(name: str) -> bool:
    try:
        return Path(agents_bin(name)).exists()
    except FileNotFoundError:  # not installed: its test skips, the file still collects
        return False


def test_the_recipe_file_is_the_papers_setup():
    lab_config, grpo = load_train_config(RECIPE)
    assert (grpo.num_generations, grpo.tasks_per_step, grpo.learning_rate, grpo.weight_decay) == (16, 4, 1e-6, 0.1)
    assert grpo.builder == "prefix_merging" and grpo.tis_cap and grpo.async_mode
    assert (grpo.harness, grpo.evaluator, grpo.strategy) == ("codex", "repo_tests", "fsdp")
    assert lab_config.engine.tensor_parallel_size == 4 and grpo.trainer_devices == [f"cuda:{g}" for g in range(4, 8)]


@pytest.mark.ci_required
@pytest.mark.skipif(not _installed("codex"), reason="run `make agents` (npm) to install Codex CLI")
def test_the_recipe_runs_two_steps_on_cpu_with_the_qwen35_fixture(tmp_path):
    data = yaml.safe_load(RECIPE.read_text())
    data["engine"].update(model="data/models/tiny-calc-qwen35", dtype="float32", tensor_parallel_size=1, gpus=None,
                          max_model_len=None, enforce_eager=True)
    data["store"] = {"runs_dir": str(tmp_path / "runs"), "run_name": "recipe"}
    data["grpo"].update(tasks="data/tasks/repo_fix.jsonl", num_generations=2, tasks_per_step=1, max_steps=2,
                        max_completion_length=64, deadline_s=120, concurrency=2, trainer_devices=None, world_size=2,
                        device="cpu", dtype="float32", output_dir=str(tmp_path / "out"),
                        save_steps=0)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    lab_config, grpo = load_train_config(path)
    summary = train_from_config(lab_config, grpo, progress=False)

    assert summary["steps"] == 2 and summary["world_size"] == 2
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["groups"] == 1 for m in metrics), metrics
    calls = [json.loads(line) for line in Path(summary["run_dir"], "calls.jsonl").read_text().splitlines()]
    assert calls and {c["api"] for c in calls} == {"openai.responses"}  # Codex, through the proxy
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists()
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
    assert "--dangerously-bypass-approvals-and-sandbox" in codex.argv  # exec's own sandbox is read-only
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
    assert codex.isolated_only and not get_harness("codex").isolated_only
    codex.sandbox = "process"
    with pytest.raises(SandboxError, match="must run in the isolated sandbox"):
        asyncio.run(codex(None, {"prompt": "fix it", "files": {}}))
