"""GRPOTrainer: the RL loop over a live Lab — collect groups, build the batch, update, sync weights.

One step, as in the algorithm:
    groups  = rollouts.next_groups()              # harness runs through the proxy, scored by the evaluator
    batch   = build_batch(groups)                 # staleness filter, group-relative advantages, weights
    metrics = policy.update(batch)                # clipped PG × truncated IS (+ KL), one optimiser step
    lab.sync_weights(policy.write_weights(f))     # pause proxy, drain, load into vLLM, version+1, resume

Where this departs from the GRPO paper (Shao et al. 2024):
- Loss aggregation is configurable (`loss_type`): the paper's per-sequence mean ("grpo"), Dr. GRPO's
  constant normaliser, or DAPO's token mean (the default, as in TRL). The unit is the harness *run*: a run
  that yields several chains shares one advantage and, for "grpo", one per-run mean.
- Clip-higher (DAPO): separate `epsilon` / `epsilon_high`.
- Off-policy correction: by default every token is weighted by min(π_old/μ, 2) where μ is the engine's own
  sampler logprob of that token (truncated importance sampling, as in Polar/slime; the other corrections in
  loss.py, chosen by vllm_importance_sampling_mode); this covers both the
  trainer/engine numerical mismatch and, in async mode, tokens sampled by older policy versions.
- KL to the reference is off by default (β = 0, as in DAPO/Dr. GRPO/TRL); with β > 0 it is the k3 estimator.
- Groups whose rewards are all equal are skipped (no signal), not counted in the normalisation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from polar_lab.engine.layout import engine_gpus, visible_gpus
from polar_lab.errors import ConfigError, TrainerError, warn_at_caller
from polar_lab.grpo.batch import Batch, build_batch
from polar_lab.grpo.config import GRPOConfig
from polar_lab.grpo.lora import check_targets
from polar_lab.grpo.policy import Policy, outgoing_weights, resolve_device
from polar_lab.grpo.rollouts import AsyncRollouts, SyncRollouts, TaskStream, rollout_sampling, trajectory_builder
from polar_lab.grpo.teacher import EngineTeacher
from polar_lab.grpo.trackers import Trackers, resolve_report_to
from polar_lab.grpo.xray import XRays
from polar_lab.harness.registry import get_harness
from polar_lab.rewards.registry import get_evaluator
from polar_lab.rewards.table import reward_rows, rewards_frame
from polar_lab.tasks import load_tasks
from polar_lab.types import Evaluator, Group, Harness, SyncResult

if TYPE_CHECKING:
    from polar_lab.config import LabConfig
    from polar_lab.engine.base import Engine
    from polar_lab.lab import Lab


class GRPOTrainer:
    def __init__(self, lab: Lab, config: GRPOConfig | None = None, *, harness: str | Harness | None = None,
                 evaluator: str | Evaluator | None = None, tasks: list[dict[str, Any]] | None = None,
                 teacher: Engine | None = None):
        """Train the Lab's model on `tasks` (default: config.tasks) run through `harness`. teacher: with
        teacher_scorer="engine", an engine of the caller's that scores the chains (default: one started for
        teacher_model, stopped with the trainer). The trainer starts from the model folder the engine serves; if
        the engine already holds other weights (policy_version > 0), the trainer's are loaded into it first.
        """
        self.lab = lab
        self.config = config = config or GRPOConfig()
        self.harness = get_harness(harness or config.harness, None if harness else config.harness_options)
        self.evaluator = get_evaluator(evaluator or config.evaluator)
        self.tasks = TaskStream(tasks if tasks is not None else load_tasks(config.tasks), seed=config.seed)
        self.output_dir = Path(config.output_dir or lab.run_dir / "grpo")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
        check_lora_engine(config, lab.config.engine.max_lora_rank)
        check_transfer(config, lab.config.engine.weights_transport)
        engine = lab.config.engine
        self.policy = make_policy(lab.model_path, config, engine_gpus(engine, visible_gpus()),
                                  ray_address=engine.ray_address if engine.cluster == "ray" else False)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(trainer_threads(config, self._threads_before))
        if lab.policy_version != 0:  # the engine serves other weights: the full model (LoRA: B = 0, so the base)
            self.sync_weights(full=True)
        self.history: list[dict[str, Any]] = []
        self.reward_log: list[dict[str, Any]] = []  # one row per run of every step (trainer.rewards)
        self.evaluations: list[dict[str, Any]] = []
        self.last_groups: list[Group] = []  # the latest step's inputs, for inspection in a notebook
        self.last_batch: Batch | None = None
        self.xrays = XRays(config.xray_steps, lab.tokenizer, config)  # the loss X-ray of recent steps (lab.show_loss)
        self.last_eval_groups: list[Group] = []
        self._rollouts: SyncRollouts | AsyncRollouts | None = None
        self._nonfinite_in_a_row = 0  # updates whose every step was skipped (see _check_finite)
        card = {"model": str(lab.model_path), "served_as": lab.served_as, "strategy": config.strategy,
                "world_size": config.world_size, "lora": config.peft_config is not None, "run": str(lab.run_dir)}
        self.teacher: EngineTeacher | None = None
        try:
            if config.teacher_model and config.teacher_scorer == "engine":
                self.teacher = EngineTeacher(str(lab.model_path), config.teacher_model, engine, engine=teacher,
                                             log_path=self.output_dir / "teacher-engine.log")
            self.trackers = Trackers(resolve_report_to(config.report_to), self.output_dir, config.to_dict(), card)
        except BaseException:  # a teacher or a tracker that cannot start: nothing of this trainer is left running
            if self.teacher is not None:
                self.teacher.close()
            self.policy.close()
            torch.set_num_threads(self._threads_before)
            raise
        lab.adopt(self)  # closing the Lab stops this trainer's producer and rank processes

    # ---- the loop -------------------------------------------------------------------------------
    def step(self, *, progress: bool = True) -> dict[str, Any]:
        """One GRPO iteration (collect → batch → update → sync); returns its metrics.
        progress: a bar over the step's harness runs (sync mode)."""
        version = self.lab.policy_version
        t0, busy0 = time.perf_counter(), self.lab.engine_busy_seconds
        groups, rollout_stats = self._source().next_groups(version, progress=progress)
        t1 = time.perf_counter()
        batch = build_batch(groups, self.config, version)
        if self.teacher is not None and batch.samples:
            self.teacher.score(batch.samples)
        update = self.policy.update(batch.samples) if batch.samples else None
        self.xrays.record(len(self.history) + 1, update.xray if update else [], batch.samples, version)
        self._check_finite(update)
        self._check_fidelity(batch, update)
        t2 = time.perf_counter()
        sync = self.sync_weights() if update is not None and update.stepped else None  # a NaN step: nothing new
        t3 = time.perf_counter()
        self.last_groups, self.last_batch = groups, batch
        self.reward_log += reward_rows(groups, step=len(self.history) + 1)
        metrics = {"step": len(self.history) + 1, "policy_version": self.lab.policy_version,
                   "trained_version": version, **batch.stats, **rollout_stats, **(update.metrics() if update else {}),
                   "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0,
                   "drain_s": sync.drain_s if sync else 0.0, "load_s": sync.load_s if sync else 0.0,
                   "undrained_calls": sync.undrained if sync else 0, "sync_bytes": sync.bytes if sync else 0,
                   "weights_write_s": sync.write_s if sync else 0.0, "preload_s": sync.preload_s if sync else 0.0,
                   "pause_s": sync.sync_s if sync else 0.0,
                   "engine_busy_frac": (self.lab.engine_busy_seconds - busy0) / max(t3 - t0, 1e-9),
                   "sampled_tokens_per_s": batch.stats["tokens"] / max(t3 - t0, 1e-9),
                   "time": time.time()}
        self._log(metrics)
        self.trackers.log(metrics["step"], metrics, [r["reward"] for r in reward_rows(groups) if r["reward"] is not None],
                          self._samples(groups))
        return metrics

    def _samples(self, groups: list[Group], limit: int = 4) -> list[dict[str, Any]]:
        """A few of the step's runs for the trackers' tables: each group's first chain, decoded."""
        if not self.trackers.trackers:
            return []
        out = []
        for group in groups[:limit]:
            if group.trajectories:
                chain = group.trajectories[0]
                out.append({"task_id": str(group.task.get("id", "")), "session_id": chain.session_id,
                            "reward": chain.reward, "text": self.lab.tokenizer.decode(chain.token_ids)})
        return out

    def sync_weights(self, *, full: bool = False) -> SyncResult:
        """The trainer's weights into the engine: the policy writes them as a file in shared memory (rank 0,
        tensor by tensor) while rollouts go on, the engine loads it into its standby copy (where it keeps one)
        while serving, then the Lab pauses, loads (swaps) it and resumes. The result has the bytes, the write,
        preload and pause times and the path used (also in each step's metrics). With LoRA
        (`lora_sync="adapter"`) only the adapter moves, served over the engine's base weights; `full=True`
        sends the merged model instead (how a trainer puts the base weights back into an engine that served
        others)."""
        t0 = time.perf_counter()
        weights = outgoing_weights(self.lab, self.policy, self.config, full=full)
        write_s = time.perf_counter() - t0
        result = self.lab.sync_weights(weights, drain_timeout=self.config.drain_timeout_s, pause=self.config.sync_pause)
        return dataclasses.replace(result, write_s=write_s)

    def _check_finite(self, update) -> None:
        """Count updates in a row that stepped nothing (non-finite gradient norm); too many is an error."""
        if update is None:
            return
        self._nonfinite_in_a_row = 0 if update.stepped else self._nonfinite_in_a_row + 1
        if self._nonfinite_in_a_row >= self.config.max_nonfinite_updates:
            raise TrainerError(
                f"{self._nonfinite_in_a_row} updates in a row had a non-finite gradient norm (no step taken, "
                f"nothing synced; the weights are the last finite ones). Look for NaN/inf in the batch "
                f"(trainer.last_batch) or lower learning_rate; max_nonfinite_updates sets this limit")

    def _check_fidelity(self, batch: Batch, update) -> None:
        """On-policy, trainer and engine logprobs of a token agree to ~1e-5 (fp32 on CPU); far more means the
        trainer is correcting for a distribution it does not compute, and TIS weights carry that bias."""
        if update is None or batch.stats["staleness_max"] != 0:
            return
        gap = update.metrics()["logprob_abs_diff_mean"]
        if gap > self.config.fidelity_warn_nats:
            warn_at_caller(f"engine and trainer disagree on an on-policy batch: mean |log pi_old - log mu| = "
                          f"{gap:.3f} nats > fidelity_warn_nats={self.config.fidelity_warn_nats}. Check that the "
                          f"trainer scores over the engine's sampling support (sampling_support='replay'), at the training "
                          f"temperature, in the engine's dtype and chat template")

    def train(self, num_steps: int | None = None, *, time_budget_s: float | None = None,
              progress: bool = True) -> pd.DataFrame:
        """Run `num_steps` steps (default config.max_steps), fewer when the next would end past `time_budget_s`
        seconds of this call (default config.time_budget_s; math.inf: no limit; `train_steps`); evaluates every
        eval_steps; checkpoints every save_steps and at the end. Returns the metrics DataFrame."""
        budget = self.config.time_budget_s if time_budget_s is None else time_budget_s
        train_steps(self, num_steps or self.config.max_steps, time_budget_s=budget, progress=progress)
        self.save_checkpoint()
        return self.metrics

    def evaluate(self, tasks: list[dict[str, Any]] | None = None, *, limit: int | None = None, seed: int | None = None,
                 progress: bool = True, harness: str | Harness | None = None) -> dict[str, Any]:
        """Mean reward on held-out tasks, one seeded run each at the training temperature; behind `harness` when
        given (another harness than the one trained behind: benchmarks/harness_transfer.py).

        The same seed on the same weights gives the same runs, so before/after numbers are comparable.
        """
        c = self.config
        if tasks is None:
            if c.eval_tasks is None:
                raise ValueError("no eval tasks: pass tasks= or set GRPOConfig.eval_tasks")
            tasks = load_tasks(c.eval_tasks)
        tasks = tasks[:limit or c.eval_limit or len(tasks)]
        t0 = time.perf_counter()
        groups = self.lab.rollout(tasks, get_harness(harness) if harness else self.harness, num_generations=1,
                                  evaluator=self.evaluator, concurrency=c.concurrency, deadline_s=c.deadline_s,
                                  builder=trajectory_builder(c), progress=progress, sampling=rollout_sampling(c),
                                  seed=c.eval_seed if seed is None else seed)
        self.last_eval_groups = groups
        sessions = [s for g in groups for s in g.sessions]
        rewards = [s.reward if s.reward is not None else 0.0 for s in sessions]
        result = {"step": len(self.history), "policy_version": self.lab.policy_version,
                  "eval_reward": sum(rewards) / len(rewards), "eval_runs": len(rewards),
                  "eval_failed": sum(s.status != "closed" for s in sessions), "eval_s": time.perf_counter() - t0,
                  "time": time.time()}
        for part in sorted({k for s in sessions for k in s.reward_parts} - {"total"}):
            result[f"eval_{part}"] = sum(s.reward_parts.get(part, 0.0) for s in sessions) / len(sessions)
        self.evaluations.append(result)
        _append_jsonl(self.output_dir / "evaluations.jsonl", result)
        self.trackers.log(result["step"], {k: v for k, v in result.items() if k.startswith("eval_")}, [], [])
        return result

    # ---- results --------------------------------------------------------------------------------
    @property
    def metrics(self) -> pd.DataFrame:
        """One row per step (also in <output_dir>/metrics.jsonl)."""
        return pd.DataFrame(self.history)

    @property
    def rewards(self) -> pd.DataFrame:
        """One row per harness run of every step: step, group, task id, session, reward, status."""
        return rewards_frame(self.reward_log)

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """A model folder vLLM and transformers can load (weights incl. lm_head, config, tokenizer), plus
        `training_state/` (model and optimiser state via torch.distributed.checkpoint: one file per rank with
        FSDP, each writing its own shards) and trainer_state.json. `load_checkpoint` resumes from it."""
        step = len(self.history)
        path = Path(path or self.output_dir / f"checkpoint-{step}")
        path.mkdir(parents=True, exist_ok=True)
        source = Path(self.lab.model_path)
        for item in source.iterdir():  # config, tokenizer, chat template: everything but the weights
            if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".pt")):
                shutil.copy2(item, path / item.name)
        self.policy.write_weights(str(path / "model.safetensors"))
        self.policy.save_training_state(str(path / "training_state"))
        state = {"step": step, "policy_version": self.lab.policy_version, "config": self.config.to_dict()}
        (path / "trainer_state.json").write_text(json.dumps(state, indent=2))
        return path

    def load_checkpoint(self, path: str | Path) -> SyncResult:
        """Resume from `save_checkpoint`'s folder: the model and optimiser state (any number of ranks, either
        strategy), then those weights into the engine. Metrics history and task order start afresh."""
        self.policy.load_training_state(str(Path(path) / "training_state"))
        return self.sync_weights()

    def close(self) -> None:
        """Stop async rollouts and trainer worker processes. The Lab stays up."""
        if self._rollouts is not None:
            self._rollouts.close()
            self._rollouts = None
        self.policy.close()
        if self.teacher is not None:
            self.teacher.close()
        self.trackers.close()
        torch.set_num_threads(self._threads_before)
        self.lab.release(self)

    def __enter__(self) -> GRPOTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------
    def _source(self) -> SyncRollouts | AsyncRollouts:
        if self._rollouts is None:
            kind = AsyncRollouts if self.config.async_mode else SyncRollouts
            self._rollouts = kind(self.lab, self.config, self.harness, self.evaluator, self.tasks)
        return self._rollouts

    def _log(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        _append_jsonl(self.output_dir / "metrics.jsonl", metrics)


def train_steps(trainer: GRPOTrainer, steps: int, *, time_budget_s: float | None = None, progress: bool = True,
                clock: Callable[[], float] | None = None) -> float:
    """train()'s loop: up to `steps` steps, evaluating every config.eval_steps and checkpointing every save_steps.

    Under a time budget a step is started only if it would end within `time_budget_s` seconds of the loop's start,
    taking it to last as long as the longest step so far and, when it is followed by an evaluation, the evaluation
    as long as the longest so far (the trainer's earlier evaluations, e.g. the one before training, are the first
    estimate). Returns the seconds spent."""
    from tqdm.auto import tqdm

    clock = clock or time.perf_counter
    c, t0, longest_step = trainer.config, clock(), 0.0
    longest_eval = max((e["eval_s"] for e in trainer.evaluations), default=0.0)
    with tqdm(total=steps, desc="grpo", disable=not progress) as bar:
        for _ in range(steps):
            n = len(trainer.history) + 1
            evaluates = bool(c.eval_steps) and n % c.eval_steps == 0
            if time_budget_s is not None and clock() - t0 + longest_step + evaluates * longest_eval > time_budget_s:
                break
            t1 = clock()
            m = trainer.step(progress=False)  # the bar counts steps
            longest_step = max(longest_step, clock() - t1)
            bar.update()
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", v=m["policy_version"])
            if evaluates:
                t1 = clock()
                trainer.evaluate(progress=progress)
                longest_eval = max(longest_eval, clock() - t1)
            if c.save_steps and n % c.save_steps == 0:
                trainer.save_checkpoint()
    return clock() - t0


def trainer_threads(config: GRPOConfig, current: int) -> int:
    """Torch threads for an in-process CPU trainer. In async mode the engine process steps at the same time on
    the same cores, and two OpenMP pools that each want every core thrash (2 cores: async 22.9 s/step with
    2 trainer threads, 16.3 s with 1)."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    on_cpu = config.world_size == 1 and config.trainer_devices is None and resolve_device(config.device) == "cpu"
    if not (on_cpu and config.async_mode):
        return current
    return max(1, (os.cpu_count() or 2) // 2)


def make_policy(model_path: str, config: GRPOConfig, engine_gpus: list[int] | tuple[int, ...] = (), *,
                ray_address: str | None | bool = False):
    """One rank in this process, or `world_size` ranks in worker processes (always for FSDP: sharding needs
    a process group, and the kernel must not join one), or as Ray actors (`ray_address`, not False: a Lab
    whose engine replicas run on Ray trains there too). Every check that can fail (device layout beside the
    engine's `engine_gpus`, LoRA targets, offload) runs first, before any process starts."""
    from polar_lab.grpo.distributed import DistributedPolicy

    if ray_address is not False:  # Ray places the ranks on its own GPU bundles: no layout on this node
        if config.peft_config is not None:
            check_targets(model_path, config.peft_config)
        return DistributedPolicy(model_path, config, ray_address=ray_address)
    devices = check_policy(model_path, config, engine_gpus)
    if in_process(config):
        return Policy(model_path, config, device=devices[0])
    return DistributedPolicy(model_path, config, devices=devices)


def check_policy(model_path: str, config: GRPOConfig, engine_gpus) -> list[str]:
    """The trainer's own checks (offload, devices beside the engine's GPUs, LoRA targets); the ranks' devices."""
    from polar_lab.grpo.distributed import trainer_devices

    if config.cpu_offload and resolve_device(config.device) == "cpu":
        raise ConfigError("cpu_offload=True moves the trainer's shards to host memory; this trainer already runs "
                          "on the CPU (no GPU, or device='cpu')")
    devices = trainer_devices(config, engine_gpus)
    if config.peft_config is not None:
        check_targets(model_path, config.peft_config)
    return devices


def check_run(lab_config: LabConfig, config: GRPOConfig) -> None:
    """Every check of a training run's configuration that does not need the run itself: the engine's GPUs
    and tensor-parallel size, the trainer ranks' devices beside them, LoRA's targets and the engine's LoRA
    rank, CPU offload. `polar-lab train` calls it before it starts anything."""
    from polar_lab.engine.launch import check_engine_layout

    gpus = check_engine_layout(lab_config.engine)
    get_harness(config.harness, config.harness_options)  # a preset's options, a 'module:function' that imports
    check_lora_engine(config, lab_config.engine.max_lora_rank)
    check_transfer(config, lab_config.engine.weights_transport)
    check_policy(lab_config.engine.model, config, gpus)


def in_process(config: GRPOConfig) -> bool:
    """The policy trains in the Lab's own process (`Policy`), not in rank processes (`DistributedPolicy`)."""
    return config.world_size == 1 and config.trainer_devices is None and config.strategy == "ddp"


def check_transfer(config: GRPOConfig, transport: str) -> None:
    """vLLM's weight-transfer API takes weights from one process, the one holding the Lab: a trainer of several
    ranks (DDP or FSDP) has no such process holding every tensor. Say so before anything starts."""
    from polar_lab.engine.weight_transfer import TRANSFER_BACKENDS

    if transport in TRANSFER_BACKENDS and not in_process(config):
        raise ConfigError(f"weights_transport={transport!r} sends from a trainer in the Lab's process (world_size=1, "
                          f"strategy ddp); with {config.world_size} ranks ({config.strategy}) use "
                          f"weights_transport='memory', which FSDP's ranks write into directly")


def check_lora_engine(config: GRPOConfig, engine_rank: int | None) -> None:
    """An adapter sync needs an engine serving LoRA at the adapter's rank: say so before anything starts."""
    if config.peft_config is None or config.lora_sync != "adapter":
        return
    rank = max([config.peft_config.r, *(config.peft_config.rank_pattern or {}).values()])
    if engine_rank is None or engine_rank < rank:
        raise ConfigError(f"peft_config has rank {rank} and lora_sync='adapter', but the engine serves LoRA up to "
                          f"rank {engine_rank} — start the Lab with max_lora_rank >= {rank} (EngineConfig; one of "
                          f"8, 16, 32, 64, ...), or set lora_sync='merged' to sync merged full weights")


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One JSON line; NaN and inf (a mean over nothing) become null, which every JSON reader takes."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with open(path, "a") as fh:
        fh.write(json.dumps(clean, default=float) + "\n")
