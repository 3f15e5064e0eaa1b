"""The CLI's mechanics: `polar-lab train` on the tiny model and the calculator harness evaluates, trains a step, syncs,
evaluates again with the same seed and writes its summary, metrics and checkpoint. Its own process and engine, as the
CLI runs. That the same command raises held-out accuracy is proven once, on Ray
(tests/integration/test_replicas.py::test_train_on_a_running_ray_cluster_learns_and_leaves_no_actor_behind: 3 steps of
8 tasks, 50 held out), and locally from a notebook (notebooks/05_grpo.ipynb); the 20-step figures are in
docs/benchmarks.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def test_polar_lab_train_evaluates_trains_syncs_and_writes_its_records(tmp_path, model_path):
    config = yaml.safe_load((ROOT / "configs" / "tiny_calc_grpo.yaml").read_text())
    config["engine"]["model"] = model_path
    config["store"] = {"runs_dir": str(tmp_path / "runs"), "run_name": "train-cli"}
    config["grpo"].update(max_steps=1, tasks_per_step=4, eval_limit=8, output_dir=str(tmp_path / "out"))
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))

    cli = Path(sys.executable).with_name("polar-lab")
    done = subprocess.run([str(cli), "train", str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out reward" in done.stdout

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["policy_version"] == 1 and summary["steps"] == 1
    for when in ("before", "after"):  # the 8 held-out tasks, each run and scored, before the step and after it
        assert summary[when]["eval_runs"] == 8 and summary[when]["eval_failed"] == 0, summary[when]
        assert 0.0 <= summary[when]["eval_reward"] <= 1.0, summary[when]
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]
    trained = load_file(tmp_path / "out" / "checkpoint-1" / "model.safetensors")
    shipped = load_file(Path(model_path) / "model.safetensors")
    assert trained.keys() >= shipped.keys() - {"lm_head.weight"}
    assert any(not trained[k].equal(shipped[k]) for k in shipped if k in trained)  # the step moved the weights
