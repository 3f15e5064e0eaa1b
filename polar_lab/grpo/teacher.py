"""On-policy distillation with the teacher in a vLLM engine of its own (`GRPOConfig(teacher_scorer="engine")`).

A teacher only has to score what was recorded: each sample's token ids go to the teacher engine as a prompt, and
vLLM's prompt logprobs (`SamplingSpec(prompt_logprobs=0)`, one sampled token that is thrown away) give
log π_teacher of every target, before the update; the samples carry them to the policy's ranks, where the loss reads
them as it reads a trainer-side teacher's (grpo/scorers.py). The teacher can be larger than anything the trainer
holds, on GPUs of its own, and a notebook can hand over an engine it already runs.

vLLM scores prompts on the raw distribution (T=1) whatever the request's temperature (measured: the same logprobs
at T=0.5 and 1.0, 9e-6 from transformers at T=1), so GRPOConfig refuses an engine teacher unless training samples
at temperature 1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from polar_lab.errors import EngineError, RequestError, TrainerError
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.scorers import check_same_vocabulary
from polar_lab.types import SamplingSpec

if TYPE_CHECKING:
    from polar_lab.config import EngineConfig
    from polar_lab.engine.base import Engine

SCORE = SamplingSpec(max_tokens=1, temperature=1.0, prompt_logprobs=0)  # each target's own logprob


class EngineTeacher:
    """Scores samples with a teacher engine: one it starts for `teacher_model` (and stops on close), or `engine`, an
    engine the caller owns."""

    def __init__(self, student_path: str, teacher_model: str, engine_config: EngineConfig, *,
                 engine: Engine | None = None, log_path: Path | None = None):
        """engine_config: the Lab's engine settings; the teacher's engine takes them with the teacher's model, one
        process, no LoRA."""
        check_same_vocabulary(student_path, engine.model_path if engine is not None else teacher_model)
        self.owned = engine is None
        if engine is None:
            from polar_lab.engine.vllm_engine import VLLMEngine  # its imports wait until a teacher is asked for

            config = dataclasses.replace(engine_config, model=teacher_model, served_model_name="teacher",
                                         replicas=1, cluster="local", max_lora_rank=None)
            engine = VLLMEngine(config, log_path=log_path).start()
        self.engine = engine

    def score(self, samples: list[Sample]) -> None:
        """Set each sample's `teacher_logprobs` (log π_teacher of its targets), all of them asked at once. vLLM
        scores a prompt over the whole vocabulary: a sample the engine sampled within a harness's top_p / top_k (its
        `support`) has no teacher score on that support here, so it is an error, not a biased distillation term."""
        truncated = sum(s.support is not None for s in samples)
        if truncated:
            raise TrainerError(f"{truncated} of {len(samples)} samples were sampled within a harness's top_p / top_k "
                               f"/ min_p, which a teacher engine cannot score within (vLLM scores prompts over the "
                               f"whole vocabulary): use teacher_scorer='trainer', or sampling_support='force'")
        futures = [self.engine.submit(s.input_ids.tolist(), SCORE) for s in samples]
        for sample, future in zip(samples, futures):
            try:
                scored = future.result().prompt_logprobs
            except (EngineError, RequestError) as exc:
                raise TrainerError(f"the teacher engine could not score a {len(sample.input_ids)}-token sample "
                                   f"({exc}); a longer context needs the teacher's max_model_len") from None
            sample.teacher_logprobs = torch.tensor(scored, dtype=torch.float32)

    def close(self) -> None:
        if self.owned:
            self.engine.close()
