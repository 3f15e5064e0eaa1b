"""The CLI's learning acceptance: `polar-lab train` on the tiny model and the calculator harness raises held-out
accuracy (same seed before and after), at the size docs/benchmarks.md measured over seeds (3 steps of 8 tasks x 8
runs, 50 held-out tasks); the 20-step run's figures are there too. Its own process and engine, as the CLI runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_polar_lab_train_raises_held_out_accuracy(tmp_path, model_path):
    config = yaml.safe_load((ROOT / "configs" / "tiny_calc_grpo.yaml").read_text())
    config["engine"]["model"] = model_path
    config["store"] = {"runs_dir": str(tmp_path / "runs"), "run_name": "train-cli"}
    # the size docs/benchmarks.md measured over seeds ("Learning, the suite's size"): 3 steps of 8 tasks x 8 runs
    config["grpo"].update(max_steps=3, tasks_per_step=8, eval_limit=50, output_dir=str(tmp_path / "out"))
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))

    cli = Path(sys.executable).with_name("polar-lab")
    done = subprocess.run([str(cli), "train", str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out reward" in done.stdout

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    before, after = summary["before"]["eval_reward"], summary["after"]["eval_reward"]
    assert after - before >= 0.15, f"held-out accuracy {before:.2f} -> {after:.2f} after 3 steps"
    assert summary["policy_version"] == 3
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert (tmp_path / "out" / "checkpoint-3" / "model.safetensors").exists()
