"""`polar-lab train CONFIG.yaml`: the headless form of a notebook's GRPO cells, from one YAML file.

Starts a Lab from the engine/proxy/store sections, evaluates on the held-out tasks, trains
`grpo.max_steps` steps (fewer under `grpo.time_budget_s`), evaluates again with the same seed, and writes
`summary.json` next to the metrics. The same `GRPOTrainer` a notebook drives.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from polar_lab.config import LabConfig
from polar_lab.errors import ConfigError
from polar_lab.grpo.config import GRPOConfig
from polar_lab.grpo.trainer import GRPOTrainer, check_run

LAB_SECTIONS = ("engine", "proxy", "store", "harness")


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading floats as YAML 1.2 does: `3e-4`, with no dot, is a number, not text."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\.\d+|\d+(\.\d*)?)[eE][-+]?\d+$"),
                              list("-+.0123456789"))


def load_train_config(path: str | Path, settings: dict[str, Any] | None = None,
                      **grpo_overrides: Any) -> tuple[LabConfig, GRPOConfig]:
    """The file's Lab and GRPO configs. grpo_overrides: flags' values, None meaning "the file's"; settings (`--set`),
    applied last: any GRPO field, None included (`--set overlong_buffer_len=null` lifts the file's)."""
    data = yaml.load(Path(path).read_text(), Loader=_Loader) or {}
    unknown = set(data) - {*LAB_SECTIONS, "grpo"}
    if unknown:
        raise ConfigError(f"unknown sections {sorted(unknown)} in {path}; known: {[*LAB_SECTIONS, 'grpo']}")
    lab_config = LabConfig.from_dict({k: data[k] for k in LAB_SECTIONS if k in data})
    overrides = {k: v for k, v in grpo_overrides.items() if v is not None}
    grpo = {**(data.get("grpo") or {}), **overrides, **(settings or {})}
    return lab_config, GRPOConfig.from_dict(grpo)


def parse_setting(text: str) -> tuple[str, Any]:
    """`--set KEY=VALUE` → (KEY, VALUE read as YAML, as the config file is: 192 is an int, 3e-4 a float, null None)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key.strip(), yaml.load(value, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key.strip()}: {value!r} is not a YAML value ({e.problem})") from None


def on_cluster(lab_config: LabConfig, *, replicas: int | None = None, ray_address: str | None = None) -> LabConfig:
    """The run's Lab config with `polar-lab train`'s --replicas and --ray-address applied ('local': a Ray cluster
    of its own on 127.0.0.1; anything else is Ray's address, e.g. 'auto')."""
    engine = lab_config.engine
    if replicas is not None:
        engine = dataclasses.replace(engine, replicas=replicas)
    if ray_address is not None:
        engine = dataclasses.replace(engine, cluster="ray", ray_address=None if ray_address == "local" else ray_address)
    return dataclasses.replace(lab_config, engine=engine)


def train_from_config(lab_config: LabConfig, config: GRPOConfig, *, progress: bool = True) -> dict[str, Any]:
    from polar_lab.lab import Lab

    t0 = time.perf_counter()
    check_run(lab_config, config)  # layout, LoRA, offload: errors before the engine or any rank starts
    with Lab(config=lab_config) as lab, GRPOTrainer(lab, config) as trainer:
        t_ready = time.perf_counter()
        before = trainer.evaluate() if config.eval_tasks else None
        t_train = time.perf_counter()
        metrics = trainer.train(progress=progress)
        train_s = time.perf_counter() - t_train
        after = trainer.evaluate() if config.eval_tasks else None
        summary = {
            "run_dir": str(lab.run_dir), "output_dir": str(trainer.output_dir),
            "steps": len(metrics), "max_steps": config.max_steps, "time_budget_s": config.time_budget_s,
            "policy_version": lab.policy_version, "async_mode": config.async_mode,
            "world_size": config.world_size, "replicas": lab_config.engine.replicas,
            "cluster": lab_config.engine.cluster, "trainer_on_ray": trainer.policy.on_ray, "before": before, "after": after,
            "eval_gain": after["eval_reward"] - before["eval_reward"] if before and after else None,
            "train_s": train_s, "startup_s": t_ready - t0, "total_s": time.perf_counter() - t0,
            **step_figures(metrics),
        }
        (trainer.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def step_figures(metrics: pd.DataFrame) -> dict[str, float | None]:
    """The summary's per-step figures; None when no step ran (eval_steps 1 and a budget shorter than an evaluation)."""
    if metrics.empty:
        return dict.fromkeys(("mean_step_s", "mean_engine_busy_frac", "reward_first_step", "reward_last_step"))
    return {"mean_step_s": float(metrics["step_s"].mean()),
            "mean_engine_busy_frac": float(metrics["engine_busy_frac"].mean()),
            "reward_first_step": float(metrics["reward_mean"].iloc[0]),
            "reward_last_step": float(metrics["reward_mean"].iloc[-1])}


def format_train_summary(s: dict[str, Any]) -> str:
    lines = [f"run folder        {s['run_dir']}", f"metrics, ckpts    {s['output_dir']}",
             f"steps             {s['steps']} ({'async' if s['async_mode'] else 'sync'}, "
             f"{s['world_size']} trainer rank{'s' if s['world_size'] > 1 else ''}, {s.get('replicas', 1)} engine "
             f"replica{'s' if s.get('replicas', 1) > 1 else ''}{' on Ray' if s.get('cluster') == 'ray' else ''})",
             f"train wall        {s['train_s']:.1f} s" + (f" ({s['mean_step_s']:.2f} s/step, engine busy "
                                                          f"{s['mean_engine_busy_frac']:.2f})" if s["steps"] else ""),
             f"train reward      {s['reward_first_step']:.3f} (step 1) -> {s['reward_last_step']:.3f} (last step)"
             if s["steps"] else "train reward      (no step)"]
    if s.get("time_budget_s") and s["steps"] < s["max_steps"]:
        lines.insert(3, f"time budget       {s['time_budget_s']:.0f} s: no time for step {s['steps'] + 1} "
                        f"of {s['max_steps']}")
    if s["before"] and s["after"]:
        lines.append(f"held-out reward   {s['before']['eval_reward']:.3f} -> {s['after']['eval_reward']:.3f} "
                     f"({s['eval_gain']:+.3f}) on {s['after']['eval_runs']} tasks, same seed")
    return "\n".join(lines)
