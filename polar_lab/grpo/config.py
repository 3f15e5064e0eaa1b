"""GRPOConfig: every knob of a GRPO run, with TRL's field names where TRL has one; maps 1:1 onto the
`grpo:` section of a `polar-lab train` YAML file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from polar_lab.config import _f
from polar_lab.errors import ConfigError, warn_at_caller
from polar_lab.grpo.lora import lora_config, lora_dict
from polar_lab.grpo.trackers import resolve_report_to
from polar_lab.rollout import TRAINING, RolloutSpec

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "cispo")
IS_LEVELS = ("token", "sequence")
# how the engine-vs-trainer mismatch is corrected (TRL's vllm_importance_sampling_mode, plus the geometric-mean mask)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask")
SCALE_REWARDS = ("group", "batch", "none")
STRATEGIES = ("ddp", "fsdp")


@dataclass
class GRPOConfig:
    """One GRPO run: rollouts, loss, optimiser, async/staleness, trainer placement, bookkeeping."""

    # ---- rollouts (what one step collects) -----------------------------------------------------
    tasks: str = _f("data/tasks/calc_train.jsonl", "training tasks, JSON lines; cycled in a seeded shuffle")
    harness: str | list[str] = _f("calculator", "a built-in harness name (polar_lab.harness.registry.HARNESSES), "
                                  "'module:function', or a list of names: one harness per task, in turn")
    harness_options: dict[str, Any] | None = _f(None, "keyword options of a preset harness (codex, claude_code, "
                                                      "mini_swe_agent), e.g. {task_field: prompt, workspace: files}; "
                                                      "for a list of harnesses, keyed by name")
    evaluator: str = _f("final_answer", "reward function name (polar_lab.rewards.registry)")
    num_generations: int = _f(8, "runs per task: the GRPO group size")
    tasks_per_step: int = _f(16, "groups (tasks) per optimiser step")
    temperature: float = _f(1.0, "sampling temperature forced on every rollout call, whatever the harness sends")
    sampling_support: str = _f("replay", "replay: a harness's own top_k / top_p / min_p apply, and the trainer "
                                         "renormalises over the same support (loss.restrict); force: they are "
                                         "forced off (the whole vocabulary)")
    max_completion_length: int = _f(128, "cap on each call's max_tokens; also dr_grpo's per-run normaliser")
    builder: str = _f("prefix_merging", "trajectory builder: prefix_merging or per_request")
    train_constrained: bool = _f(False, "train on tokens sampled under a grammar (a structured output, a forced "
                                        "tool call); off: their logprobs are of the renormalised distribution, "
                                        "not the policy's, so they get loss 0")
    concurrency: int = _f(64, "harness runs in flight at once")
    deadline_s: float = _f(TRAINING.deadline_s, "a run still going after this long is stopped (and gets "
                                                "timeout_reward)")
    # the failure rewards: rollout.py's RolloutSpec declares them, with the trainer's defaults in TRAINING
    timeout_reward: float | None = _f(TRAINING.timeout_reward, "reward of a run the policy kept going past "
                                      "deadline_s (looping, never finishing); None masks it out of the loss")
    overflow_reward: float | None = _f(TRAINING.overflow_reward, "reward of a run that failed after its context "
                                       "overflowed (a call refused as too long for the model); None masks it")
    failed_reward: float | None = _f(TRAINING.failed_reward, "reward of a run whose harness crashed after the "
                                     "model answered (cause unknown); None masks it. Infrastructure failures (an "
                                     "engine or proxy error, no model call served, a failing evaluator) are always "
                                     "masked")

    # ---- loss ------------------------------------------------------------------------------------
    loss_type: str = _f("dapo", "grpo: mean over each run's tokens, then over runs; dr_grpo: sum / "
                                "(runs x max_completion_length); dapo: mean over all tokens of the batch; cispo: "
                                "dapo's mean of -sg(min(ratio, epsilon_high)) x A x log pi (MiniMax-M1), "
                                "epsilon_high read as the cap on the ratio itself")
    importance_sampling_level: str = _f("token", "the policy ratio per token, or per sequence: the exp of its "
                                                 "tokens' mean log-ratio, clipped as one (GSPO)")
    scale_rewards: str = _f("group", "divide advantages by the reward std of the group, the batch, or none "
                                     "(Dr. GRPO)")
    epsilon: float = _f(0.2, "lower clip range of the policy ratio")
    epsilon_high: float | None = _f(0.28, "upper clip range (clip-higher, DAPO); None = epsilon. cispo: the cap "
                                          "on the ratio (ScaleRL: 5.0)")
    beta: float = _f(0.0, "KL coefficient to the initial policy (k3 estimator); 0 = no reference model")
    teacher_model: str | None = _f(None, "on-policy distillation: a model folder (the student's tokenizer) that "
                                         "scores every trained token of the recorded chains; each token's "
                                         "advantage becomes A - distill_coef x (log pi_old - log pi_teacher)")
    distill_coef: float = _f(1.0, "the weight of the teacher's per-token reverse KL in the advantage")
    teacher_scorer: str = _f("trainer", "who runs the teacher: 'trainer' (a frozen copy beside the policy, at the "
                                        "training temperature, sharded like it) or 'engine' (a vLLM engine of its own "
                                        "scores the chains as prompts; vLLM's prompt logprobs are at T=1)")
    # ---- the engine-vs-trainer correction (TRL's names): weight pi_old / mu, mu the engine's sampler logprob
    vllm_importance_sampling_correction: bool = _f(True, "weight each token by the trainer-vs-engine ratio "
                                                         "pi_old / mu as vllm_importance_sampling_mode says")
    vllm_importance_sampling_mode: str = _f("token_truncate", "token_truncate: min(ratio, clip_max) per token "
                                            "(TIS); token_mask: 0 outside [clip_min, clip_max] (IcePop with both "
                                            "bounds); sequence_truncate / sequence_mask: the same on the product of "
                                            "a sequence's ratios; geometric_mask: on their geometric mean")
    vllm_importance_sampling_clip_min: float | None = _f(None, "lower bound of the ratio (truncate: clamped up; "
                                                               "mask: 0 below); None = none")
    vllm_importance_sampling_clip_max: float | None = _f(2.0, "upper bound of the ratio (truncate: clamped down; "
                                                              "mask: 0 above); None = none")
    dynamic_sampling: bool = _f(False, "DAPO's dynamic sampling: a group whose runs all score the same (no "
                                       "advantage, no gradient) is dropped and the step refilled with fresh tasks")
    max_refill_rounds: int = _f(3, "dynamic_sampling's bound: extra rollouts per step (sync), or tasks_per_step x "
                                   "this many dropped groups per step (async), before training on what there is")
    overlong_buffer_len: int = _f(0, "DAPO's soft overlong punishment: a run's reward falls linearly by up to "
                                     "overlong_penalty_factor over its last this-many sampled tokens before "
                                     "overlong_max_tokens; 0 = off")
    overlong_max_tokens: int | None = _f(None, "the run length the punishment counts to (sampled tokens over all "
                                               "its calls); None = max_completion_length")
    overlong_penalty_factor: float = _f(1.0, "the punishment at overlong_max_tokens and beyond")
    mask_truncated_completions: bool = _f(False, "leave runs with a call cut by max_tokens out of the loss")
    num_iterations: int = _f(1, "optimiser steps per batch (PPO epochs); >1 makes the clip active")
    fidelity_warn_nats: float = _f(0.1, "warn when a fully on-policy batch's mean |log pi_old - log mu| (trainer "
                                        "vs engine logprob of the same token) exceeds this: the two are not "
                                        "computing the same distribution (truncated sampling, dtype, template)")
    max_nonfinite_updates: int = _f(3, "updates in a row whose gradient norm is NaN/inf (steps skipped, nothing "
                                       "synced) before training stops with an error")

    # ---- optimiser -------------------------------------------------------------------------------
    learning_rate: float = _f(1e-4, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay (never on biases, norms and embeddings)")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2 (TRL's default)")
    lr_scheduler_type: str = _f("constant", "learning-rate schedule over max_steps x num_iterations optimiser "
                                            "steps: constant, linear, cosine (TRL's names; TRL defaults to "
                                            "linear, we to constant so that interactive steps beyond max_steps "
                                            "keep learning)")
    warmup_ratio: float = _f(0.0, "fraction of those steps the learning rate warms up from 0")
    max_grad_norm: float | None = _f(1.0, "clip the global gradient norm; None = no clipping")
    micro_batch_size: int = _f(32, "sequences per forward/backward (gradient accumulation over the batch)")
    micro_batch_tokens: int | None = _f(None, "padded tokens per forward/backward (sequences x the longest); set, "
                                              "it sizes micro-batches instead of micro_batch_size (agent chains "
                                              "vary from hundreds to tens of thousands of tokens)")
    logprob_chunk_tokens: int = _f(4096, "positions whose full-vocabulary fp32 logits exist at once in the loss "
                                         "(the lm_head runs chunk by chunk, recomputed in backward)")
    peft_config: Any = _f(None, "LoRA: a peft.LoraConfig, or its fields as a dict (YAML); only the adapter trains "
                                "(TRL's name). None = full fine-tuning")
    lora_sync: str = _f("adapter", "with peft_config: 'adapter' (the engine serves the adapter live; needs "
                                   "EngineConfig.max_lora_rank >= r; a sync moves only the adapter) or 'merged' "
                                   "(W + scale*B*A synced as full weights, for an engine without LoRA)")
    gradient_checkpointing: bool = _f(False, "recompute each layer's activations in backward instead of keeping "
                                             "them (TRL's name): less memory, ~1/3 more compute")
    shared_prefix_min_tokens: int | None = _f(1024, "an update whose samples all begin with at least this many "
                                                    "equal untrained tokens (a harness's system prompt and tools) "
                                                    "runs them once, with exact gradients (grpo/prefix.py); one "
                                                    "process without gradient checkpointing only. None: never")

    # ---- async rollouts --------------------------------------------------------------------------
    async_mode: bool = _f(False, "keep rollouts running while the trainer steps (else: rollout, train, sync)")
    async_window_steps: int = _f(1, "groups admitted ahead of the trainer, in steps: at most tasks_per_step x "
                                    "this are running or waiting")
    max_staleness: int = _f(4, "a group whose oldest trained token is more than this many policy versions behind "
                               "the trainer never reaches the loss (TRL's async default); below it, TIS corrects")
    stale_groups: str = _f("drop", "what happens to a too-stale group: drop, or rerun its task")
    max_reruns: int = _f(2, "stale_groups='rerun': times in a row a task is re-queued before it is dropped")
    drain_timeout_s: float = _f(30.0, "weight sync waits this long for in-flight calls before loading anyway")
    sync_pause: str = _f("drain", "weight sync: drain (calls in flight finish on the old weights) or keep (they are "
                                  "held for the load and go on with the new ones: Lab.sync_weights)")

    # ---- trainer placement -----------------------------------------------------------------------
    world_size: int = _f(1, "trainer ranks; 1 trains in this process (strategy ddp), >1 in worker processes")
    strategy: str = _f("ddp", "how ranks hold the model: ddp (a full copy each; gradients all-reduced) or fsdp "
                              "(FSDP2: parameters, gradients and Adam state sharded over the ranks, each layer "
                              "gathered when it runs; always in worker processes, also with 1 rank)")
    cpu_offload: bool = _f(False, "fsdp on GPU: keep parameter shards and optimiser state in host memory")
    device: str = _f("auto", "auto (cuda if present, else cpu), cpu, or cuda")
    trainer_devices: list[str] | None = _f(None, "CUDA devices of the trainer ranks, e.g. ['cuda:1', 'cuda:2']; "
                                                 "None = the GPUs after the engine's")
    colocate: bool = _f(False, "let trainer ranks share the engine's GPUs (a 1-GPU machine); else they need "
                               "GPUs of their own (engine/layout.py)")
    dtype: str = _f("float32", "trainer compute dtype: float32, or bfloat16 autocast (weights and Adam stay fp32)")
    cpu_threads: int | None = _f(None, "torch threads of a CPU trainer in this process; None = all cores in sync "
                                       "mode, half of them in async mode (the engine process steps on the rest)")

    # ---- bookkeeping -----------------------------------------------------------------------------
    max_steps: int = _f(20, "optimiser steps of train()")
    time_budget_s: float | None = _f(None, "train() starts no step that would end past this many seconds of "
                                           "training, evaluations included (None = no limit)")
    seed: int = _f(0, "task order and rollout sampling seeds")
    output_dir: str | None = _f(None, "metrics.jsonl and checkpoints; None = <run folder>/grpo")
    report_to: str | list[str] = _f("none", "experiment trackers (TRL's name): tensorboard, wandb, mlflow, trackio, "
                                            "a list of them, 'all' (those installed) or 'none' (grpo/trackers.py)")
    save_steps: int = _f(0, "save a checkpoint every N steps (0 = only at the end of train())")
    eval_tasks: str | None = _f("data/tasks/calc_test.jsonl", "held-out tasks for evaluate()")
    eval_limit: int | None = _f(None, "evaluate on the first N held-out tasks only")
    eval_seed: int = _f(1234, "sampling seed of evaluations (run i uses eval_seed + i)")
    eval_steps: int = _f(0, "also evaluate every N steps during train() (0 = never)")
    xray_steps: int = _f(8, "the loss X-ray (lab.show_loss): every token's logprobs, weight and rule, kept for the "
                            "last N steps (0 = not captured)")

    def __post_init__(self) -> None:
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        _check(self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if isinstance(self.scale_rewards, bool):  # older TRL: True/False
            self.scale_rewards = "group" if self.scale_rewards else "none"
        _check(self.scale_rewards in SCALE_REWARDS,
               f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        _check(self.stale_groups in ("drop", "rerun"), f"stale_groups must be drop or rerun, got {self.stale_groups!r}")
        _check(self.num_generations >= 2, f"num_generations must be >= 2 (a group needs a baseline), "
                                          f"got {self.num_generations}")
        _check(self.shared_prefix_min_tokens is None or self.shared_prefix_min_tokens >= 1,
               f"shared_prefix_min_tokens must be >= 1 or None, got {self.shared_prefix_min_tokens}")
        _check(self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
               f"micro_batch_tokens must be >= 1 or None, got {self.micro_batch_tokens}")
        _check(self.max_refill_rounds >= 0, f"max_refill_rounds must be >= 0, got {self.max_refill_rounds}")
        _check(0 <= self.overlong_buffer_len < self.overlong_limit or not self.overlong_buffer_len,
               f"overlong_buffer_len must be in [0, {self.overlong_limit}) (overlong_max_tokens), "
               f"got {self.overlong_buffer_len}")
        for name in ("tasks_per_step", "max_completion_length", "micro_batch_size", "num_iterations",
                     "logprob_chunk_tokens", "max_nonfinite_updates", "async_window_steps",
                     "world_size", "concurrency", "max_steps"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(self.time_budget_s is None or self.time_budget_s > 0,
               f"time_budget_s must be > 0 or None, got {self.time_budget_s}")
        _check(self.cpu_threads is None or self.cpu_threads >= 1, f"cpu_threads must be >= 1, got {self.cpu_threads}")
        _check(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}")
        _check(self.lr_scheduler_type in ("constant", "linear", "cosine"),
               f"lr_scheduler_type must be constant, linear or cosine, got {self.lr_scheduler_type!r}")
        _check(0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        _check(0 < self.epsilon < 1, f"epsilon must be in (0, 1), got {self.epsilon}")
        _check(self.epsilon_high >= self.epsilon,
               f"epsilon_high ({self.epsilon_high}) must be >= epsilon ({self.epsilon})")
        _check(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        _check(self.distill_coef >= 0, f"distill_coef must be >= 0, got {self.distill_coef}")
        _check(self.teacher_scorer in ("trainer", "engine"),
               f"teacher_scorer must be trainer or engine, got {self.teacher_scorer!r}")
        _check(self.teacher_scorer == "trainer" or self.temperature == 1.0,
               f"teacher_scorer='engine' scores at T=1 (vLLM's prompt logprobs are the raw distribution): train at "
               f"temperature 1.0 (got {self.temperature}) or let the trainer score (teacher_scorer='trainer')")
        _check(self.sampling_support in ("replay", "force"),
               f"sampling_support must be replay or force, got {self.sampling_support!r}")
        _check_correction(self)
        _check(self.temperature > 0, f"temperature must be > 0 for RL sampling, got {self.temperature}")
        _check(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
        _check(self.max_reruns >= 0, f"max_reruns must be >= 0, got {self.max_reruns}")
        _check(not self.async_mode or self.async_window_steps <= self.max_staleness,
               f"async_window_steps ({self.async_window_steps}) must be <= max_staleness ({self.max_staleness}): "
               f"groups admitted that far ahead would be dropped")
        _check(not (self.async_mode and self.max_staleness < 1),
               f"async_mode=True needs max_staleness >= 1 (got {self.max_staleness}): rollouts made while "
               f"the trainer steps are one version old when they are trained on")
        self.peft_config = lora_config(self.peft_config)
        resolve_report_to(self.report_to)  # a name no tracker has is refused now, not at the first step
        _check(self.lora_sync in ("adapter", "merged"), f"lora_sync must be adapter or merged, got {self.lora_sync!r}")
        _check(self.sync_pause in ("drain", "keep"), f"sync_pause must be drain or keep, got {self.sync_pause!r}")
        _check(self.strategy in STRATEGIES, f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        _check(not self.cpu_offload or self.strategy == "fsdp",
               f"cpu_offload=True needs strategy='fsdp' (got {self.strategy!r}): DDP keeps a full copy per GPU")
        _check(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        _check(self.dtype in ("float32", "bfloat16"), f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        _check(self.trainer_devices is None or len(self.trainer_devices) == self.world_size,
               f"trainer_devices lists {len(self.trainer_devices or [])} devices but world_size is "
               f"{self.world_size}")

    @property
    def overlong_limit(self) -> int:
        return self.overlong_max_tokens or self.max_completion_length

    @property
    def tis_cap(self) -> float | None:
        """The token_truncate cap under its earlier name (None when no correction applies)."""
        return self.vllm_importance_sampling_clip_max if self.vllm_importance_sampling_correction else None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GRPOConfig:
        if "tis_cap" in data:  # the earlier name: configs written before TRL's names keep working, with a warning
            data = _from_tis_cap(dict(data))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown keys in 'grpo': {sorted(unknown)}")
        return cls(**_numbers(data))

    def rollout_spec(self) -> RolloutSpec:
        """The deadline and failure rewards every rollout of this training runs with."""
        return RolloutSpec(self.deadline_s, self.failed_reward, self.timeout_reward, self.overflow_reward)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(dataclasses.replace(self, peft_config=None))
        data["peft_config"] = lora_dict(self.peft_config)  # JSON-able; from_dict turns it back into a LoraConfig
        return data


def _check_correction(c: GRPOConfig) -> None:
    """GRPOConfig's checks of the engine-vs-trainer correction."""
    _check(c.importance_sampling_level in IS_LEVELS,
           f"importance_sampling_level must be one of {IS_LEVELS}, got {c.importance_sampling_level!r}")
    _check(c.vllm_importance_sampling_mode in IS_MODES,
           f"vllm_importance_sampling_mode must be one of {IS_MODES}, got {c.vllm_importance_sampling_mode!r}")
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    _check(low is None or 0 <= low <= 1, f"vllm_importance_sampling_clip_min must be in [0, 1] or None, got {low}")
    _check(high is None or high >= 1, f"vllm_importance_sampling_clip_max must be >= 1 or None, got {high}")
    _check(c.loss_type != "cispo" or c.epsilon_high > 1,
           f"loss_type='cispo' reads epsilon_high as the cap on the ratio itself (ScaleRL uses 5.0), so it "
           f"must be > 1; got {c.epsilon_high}")


def _numbers(data: dict[str, Any]) -> dict[str, Any]:
    """`data`, its numeric fields checked: a value that is not a number (null where the field takes none, text, a bool)
    is an error that names the field, rather than a TypeError from a comparison later."""
    for f in dataclasses.fields(GRPOConfig):
        kinds = {part.strip() for part in str(f.type).split("|")}  # the annotation's text: "float | None"
        nullable = "None" in kinds
        if f.name not in data or not kinds - {"None"} <= {"int", "float"}:
            continue  # not given, or not a numeric field
        value = data[f.name]
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{f.name} must be a number{' or null' if nullable else ''}, got {value!r}")
    return data


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _from_tis_cap(data: dict[str, Any]) -> dict[str, Any]:
    cap = data.pop("tis_cap")
    warn_at_caller("grpo.tis_cap is now vllm_importance_sampling_clip_max (with vllm_importance_sampling_mode "
                   "token_truncate); tis_cap: null is vllm_importance_sampling_correction: false", DeprecationWarning)
    if cap is None:
        data.setdefault("vllm_importance_sampling_correction", False)
    else:
        data.setdefault("vllm_importance_sampling_clip_max", cap)
    return data
