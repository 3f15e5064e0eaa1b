"""The models a step scores its batch with and never trains: the reference policy (the KL term, `beta`) and the
teacher (on-policy distillation, `teacher_model`). Both go through the same chunked fp32 head as the policy
(loss.TokenLogprobs), frozen, dropout off, and sharded like the policy under FSDP.

The teacher only has to score what was recorded: the chains' token ids as the engine sampled them, whatever harness
produced them, so a black-box harness can be distilled into as well as a Python one.
"""

from __future__ import annotations

import copy

import torch

from polar_lab.errors import ConfigError
from polar_lab.grpo.config import GRPOConfig
from polar_lab.grpo.loss import TokenLogprobs


class FrozenScorers:
    def __init__(self, model: torch.nn.Module, model_path: str, config: GRPOConfig, device: torch.device,
                 *, shard=None):
        """model: the policy before any wrapping (the reference is a copy of it). shard(model): FSDP's wrapping,
        when the policy is sharded."""
        self.config, self.device, self._shard = config, device, shard
        self.ref = self._frozen(copy.deepcopy(model)) if config.beta > 0 else None  # at step 0 the KL is exactly 0
        self.teacher = None
        if config.teacher_model and config.teacher_scorer == "trainer":  # else a teacher engine (grpo/teacher.py)
            from transformers import AutoModelForCausalLM

            check_same_vocabulary(model_path, config.teacher_model)
            teacher = AutoModelForCausalLM.from_pretrained(config.teacher_model, dtype=torch.float32)
            self.teacher = self._frozen(teacher.to(device))

    def score(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(log π_ref, log π_teacher) of a micro-batch's targets, each None without its model, over the same sampling
        support as the policy's (`mb["support"]`: a harness's top_p / top_k replayed); a teacher engine's scores come
        with the micro-batch ("teacher")."""
        args = (mb["input_ids"], mb["attention_mask"], mb["temperature"], mb.get("support"))
        teacher = self.teacher(*args) if self.teacher is not None else mb.get("teacher")
        return self.ref(*args) if self.ref is not None else None, teacher

    def _frozen(self, model: torch.nn.Module) -> TokenLogprobs:
        scorer = TokenLogprobs(model.eval().requires_grad_(False), self.config.logprob_chunk_tokens)
        disable_dropout(scorer)
        if self._shard is not None:
            self._shard(scorer)
        return scorer


def check_same_vocabulary(student: str, teacher: str) -> None:
    """A teacher scores the student's token ids: it must read them as the same tokens."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(student).get_vocab() != AutoTokenizer.from_pretrained(teacher).get_vocab():
        raise ConfigError(f"teacher_model {teacher} has another vocabulary than the policy {student}: it would score "
                          f"other tokens than the ones the engine sampled")


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
