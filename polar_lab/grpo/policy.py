"""The trainer's policy: a transformers model and its optimiser, one rank. No threads, no processes.

`Policy.update(samples)` is one GRPO update (num_iterations optimiser steps) on the samples it is given;
the per-token weights inside the samples already carry the normalisation of the *whole* batch, so ranks
that each see a shard compute exactly the shards of one loss (see distributed.py). When the model is
wrapped in DDP, gradients are averaged over ranks; the loss is multiplied by the world size to make that
average a sum.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from polar_lab.grpo.batch import Sample
from polar_lab.grpo.config import GRPOConfig
from polar_lab.grpo.loss import TokenLogprobs, policy_loss

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class Policy:
    def __init__(self, model_path: str, config: GRPOConfig, *, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, get_scheduler

        self.config = config  # nothing here draws random numbers: the kernel's torch RNG is left alone
        self.device = torch.device(device)
        # weights and optimizer state stay fp32 (bf16 weights would round Adam's ~lr-sized steps away);
        # dtype=bfloat16 runs the forward/backward under autocast
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self._autocast_dtype = _DTYPES[config.dtype]
        self.model.train()
        disable_dropout(self.model)  # the sampler had none: with it, π_old ≠ μ before any step
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.train_model = TokenLogprobs(self.model, config.logprob_chunk_tokens)  # DDP wraps this (distributed.py)
        self.world_size = 1
        self.ref_model = None
        if config.beta > 0:  # through the same chunked fp32 head as π_θ: at step 0 the KL is exactly 0
            self.ref_model = TokenLogprobs(copy.deepcopy(self.model).eval().requires_grad_(False),
                                           config.logprob_chunk_tokens)
        self.optimizer = torch.optim.AdamW(_param_groups(self.model, config.weight_decay), lr=config.learning_rate,
                                           betas=(config.adam_beta1, config.adam_beta2))
        total = config.max_steps * config.num_iterations
        warmup = "_with_warmup" if config.lr_scheduler_type == "constant" and config.warmup_ratio else ""
        self.scheduler = get_scheduler(config.lr_scheduler_type + warmup, self.optimizer,
                                       num_warmup_steps=round(config.warmup_ratio * total), num_training_steps=total)
        self.pad_id = self.model.config.pad_token_id or 0
        self.steps = 0

    def update(self, samples: list[Sample]) -> UpdateStats:
        """One GRPO update on `samples`; returns summed statistics (merge ranks with `+`)."""
        micro = self._micro_batches(samples)
        frozen = [self._frozen_logprobs(mb) for mb in micro]  # (old, ref) per micro-batch
        totals = UpdateStats()
        for iteration in range(self.config.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for i, (mb, (old, ref)) in enumerate(zip(micro, frozen)):
                last = i == len(micro) - 1
                with self._no_sync(not last), self._autocast():
                    logp = self.train_model(mb["input_ids"], mb["attention_mask"], mb["temperature"])
                    loss, stats = policy_loss(logp, old if old is not None else logp.detach(), mb["behavior"],
                                              ref, mb["advantage"], mb["weights"], self.config)
                    (loss * self.world_size).backward()
                if iteration == 0:
                    totals.add(stats)  # tokens, loss, IS: what the batch was; later passes re-use it
                else:
                    totals.clipped += float(stats["clipped"])  # ratios move away from 1 only after a step
            totals.grad_norm = self._clip_and_step()
            totals.skipped += not math.isfinite(totals.grad_norm)
        totals.iterations = self.config.num_iterations
        self.steps += 1
        return totals

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """The trainer's logprob of every target of each sample (L-1 each), at the sample's temperature."""
        out = []
        for s in samples:
            mb = self._collate([s])
            with self._autocast():
                out.append(self._logprobs_model(mb["input_ids"], mb["attention_mask"], mb["temperature"])[0].cpu())
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU fp32 tensors named as in the HF checkpoint, `lm_head.weight` included (vLLM needs it)."""
        return {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def close(self) -> None:
        pass  # nothing outside this process

    # ---- internals -------------------------------------------------------------------------------
    @property
    def _logprobs_model(self) -> TokenLogprobs:
        """The chunked logprob model without DDP (no gradients, no all-reduce)."""
        return getattr(self.train_model, "module", self.train_model)

    def _micro_batches(self, samples: list[Sample]) -> list[dict[str, torch.Tensor]]:
        """Sorted by length so padding stays small; `micro_batch_size` sequences each, or, with
        `micro_batch_tokens`, as many as fit that many padded tokens (a longer sample goes alone)."""
        order = sorted(samples, key=lambda s: len(s.input_ids))
        return [self._collate(group) for group in token_budget_groups(
            [len(s.input_ids) for s in order], self.config.micro_batch_size, self.config.micro_batch_tokens, order)]

    def _collate(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        width = max(len(s.input_ids) for s in samples)

        def pad(t: torch.Tensor, n: int, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, n - len(t)), value=value)

        batch = {
            "input_ids": torch.stack([pad(s.input_ids, width, self.pad_id) for s in samples]),  # (B, T)
            "attention_mask": torch.stack([pad(torch.ones(len(s.input_ids), dtype=torch.long), width, 0)
                                           for s in samples]),
            "weights": torch.stack([pad(s.weights, width - 1, 0.0) for s in samples]),  # (B, T-1)
            "behavior": torch.stack([pad(s.behavior_logprobs, width - 1, 0.0) for s in samples]),
            "advantage": torch.tensor([s.advantage for s in samples], dtype=torch.float32),  # (B,)
            "temperature": torch.tensor([s.temperature for s in samples], dtype=torch.float32),
        }
        return {k: v.to(self.device) for k, v in batch.items()}

    @torch.no_grad()
    def _frozen_logprobs(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """π_old (only needed when the batch is reused) and π_ref (only with a KL term), before any step."""
        old = ref = None
        with self._autocast():
            if self.config.num_iterations > 1:
                old = self._logprobs_model(mb["input_ids"], mb["attention_mask"], mb["temperature"])
            if self.ref_model is not None:
                ref = self.ref_model(mb["input_ids"], mb["attention_mask"], mb["temperature"])
        return old, ref

    def _autocast(self):
        enabled = self._autocast_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self._autocast_dtype, enabled=enabled)

    def _no_sync(self, skip: bool):
        if skip and hasattr(self.train_model, "no_sync"):
            return self.train_model.no_sync()  # DDP: all-reduce only on the last micro-batch
        return contextlib.nullcontext()

    def _clip_and_step(self) -> float:
        """Clip and step; a non-finite gradient norm skips the step (the weights stay as they were) and is
        returned as NaN. Every rank sees the same norm after the all-reduce, so every rank skips together."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])) if params else torch.tensor(0.)
        if not math.isfinite(float(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return float("nan")
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)


@dataclass
class UpdateStats:
    """Statistics of one update, summed over micro-batches (first iteration) and ranks; merge with `+`."""

    tokens: float = 0.0  # trained tokens
    loss: float = 0.0
    pg_loss: float = 0.0
    kl_weighted: float = 0.0
    kl_sum: float = 0.0  # k3 KL summed over trained tokens
    clipped: float = 0.0  # (token, iteration) pairs whose ratio was clipped, over all num_iterations passes
    is_capped: float = 0.0  # trained tokens whose IS weight hit tis_cap
    log_is: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (tokens,) log(π_old / μ) per token
    grad_norm: float = float("nan")  # before clipping; the same on every rank after the all-reduce
    iterations: int = 1  # passes over the batch (GRPOConfig.num_iterations)
    skipped: int = 0  # of those passes, the ones whose optimiser step was skipped (non-finite gradient norm)

    @property
    def stepped(self) -> bool:
        """Whether any optimiser step changed the weights (else there is nothing to sync)."""
        return self.skipped < self.iterations

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's `policy_loss` statistics."""
        for name, value in stats.items():
            value = value.detach().float().cpu()
            setattr(self, name, torch.cat([self.log_is, value]) if name == "log_is" else getattr(self, name) + float(value))

    def __add__(self, other: UpdateStats) -> UpdateStats:
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                if f.name not in ("log_is", "grad_norm", "iterations", "skipped")}
        return UpdateStats(**sums, log_is=torch.cat([self.log_is, other.log_is]), grad_norm=self.grad_norm,
                           iterations=self.iterations, skipped=self.skipped)  # the same on every rank

    def metrics(self) -> dict[str, float]:
        """The logged metrics: means over trained tokens, importance-ratio quantiles."""
        tokens = max(self.tokens, 1.0)
        ratio = self.log_is.exp()
        empty = not len(ratio)
        q = torch.full((3,), float("nan")) if empty else torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95]))
        return {
            "loss": self.loss, "pg_loss": self.pg_loss, "kl": self.kl_sum / tokens,
            "clip_frac": self.clipped / (tokens * self.iterations),
            "grad_norm": self.grad_norm, "is_ratio_mean": float("nan") if empty else float(ratio.mean()),
            "is_ratio_p05": float(q[0]), "is_ratio_p50": float(q[1]), "is_ratio_p95": float(q[2]),
            "is_ratio_max": float("nan") if empty else float(ratio.max()), "is_capped_frac": self.is_capped / tokens,
            "logprob_abs_diff_mean": float("nan") if empty else float(self.log_is.abs().mean()),
            "skipped_steps": self.skipped,
        }


def token_budget_groups(lengths: list[int], size: int, budget: int | None, items: list) -> list[list]:
    """`items` (sorted by their `lengths`, ascending) in consecutive groups: `size` each, or, with a token
    `budget`, as many as keep (count × the longest) within it; an item over the budget alone.

    >>> token_budget_groups([2, 3, 5, 9], 32, 10, "abcd")  # 2 × 3 fits 10; 2 × 5 does not; 9 alone
    [['a', 'b'], ['c'], ['d']]
    >>> token_budget_groups([2, 3, 5, 9], 2, None, "abcd")
    [['a', 'b'], ['c', 'd']]
    """
    if any(a > b for a, b in zip(lengths, lengths[1:])):
        raise ValueError("token_budget_groups needs items sorted by length (the last of a group is its longest)")
    if budget is None:
        return [list(items[i:i + size]) for i in range(0, len(items), size)]
    groups, current = [], []
    for length, item in zip(lengths, items):
        if current and (len(current) + 1) * length > budget:
            groups.append(current)
            current = []
        current.append(item)
    return groups + ([current] if current else [])


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on weight matrices only, never on biases, norms (1-D) or embeddings."""
    decay, keep = [], []
    for name, param in model.named_parameters():
        (keep if param.ndim < 2 or "embed" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off in every pass (TRL's `disable_dropout`), while the model stays in train mode (gradient
    checkpointing needs it): `nn.Dropout` modules get p=0, and attention modules' functional dropout rates
    (`attention_dropout`, `dropout`, read only in train mode) are set to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
