"""The loss X-ray: every token of a step's samples with what the loss did with it — the engine's and the trainer's
logprob and their gap, the importance weight, the advantage the token was trained with, its policy version and
staleness, and the rule that decided it (first that applies):

    prompt        not sampled: the chat template's scaffolding, the user's and the tools' text
    not trained   sampled, loss weight 0: its run was masked, cut off (mask_truncated_completions) or stale
    IcePop / MIS / geometric mask
                  sampled, and the engine-vs-trainer correction zeroed it (vllm_importance_sampling_mode *_mask)
    TIS cap       its correction weight was truncated at clip_min / clip_max
    clipped       the policy ratio left [1-ε, 1+ε_high] in the advantage's direction (a later pass's doing only
                  when the batch is reused; the X-ray is the first pass)
    trained       the rest

The values are the loss's own tensors of the update's first pass (`policy_loss(..., xray=True)`, captured on every
rank and merged), not a recomputation: `lab.show_loss(step)` (viz/xray.py) draws them. `scaffold` marks the template's
tokens among the prompt's: special and added tokens, and a role header after a special token up to its newline.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import torch

from polar_lab.grpo.batch import Sample
from polar_lab.grpo.config import GRPOConfig

MASK_NAMES = {"token_mask": "IcePop", "sequence_mask": "MIS", "geometric_mask": "geometric mask"}
RULES = ("prompt", "not trained", "IcePop", "MIS", "geometric mask", "TIS cap", "clipped", "trained")


def token_rows(samples: list[Sample], per_token: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """One micro-batch's per-token tensors (B, T-1), cut to each sample's own length: one dict per sample."""
    rows = []
    for j, sample in enumerate(samples):
        n = len(sample.input_ids) - 1
        rows.append({"session_id": sample.session_id, "chain_index": sample.chain_index,
                     **{name: t[j, :n].detach().float().cpu().numpy() for name, t in per_token.items()}})
    return rows


class XRays:
    """The X-rays of a trainer's last `keep` steps: `steps[n]` is step n's token table (`frame`), built when first
    read — a step keeps only the captured arrays, so a trainer whose X-rays nobody reads pays no decoding."""

    def __init__(self, keep: int, tokenizer, config: GRPOConfig):
        self.keep, self.tokenizer, self.config = keep, tokenizer, config
        self.steps = _Tables(self.frame)

    def record(self, step: int, captured: list[dict[str, Any]], samples: list[Sample], version: int) -> None:
        if not self.keep or not captured:
            return
        self.steps.raw[step] = (captured, samples, version)
        while len(self.steps.raw) > self.keep:
            dropped, _ = self.steps.raw.popitem(last=False)
            self.steps.built.pop(dropped, None)

    def frame(self, captured: list[dict[str, Any]], samples: list[Sample], version: int) -> pd.DataFrame:
        """One row per target token of every sample, in batch order."""
        by_name = {(row["session_id"], row["chain_index"]): row for row in captured}
        parts = []
        for index, sample in enumerate(samples):
            row = by_name[(sample.session_id, sample.chain_index)]
            ids = sample.input_ids[1:].tolist()
            versions = sample.versions.numpy()
            sampled = versions >= 0
            table = pd.DataFrame({
                "sample": index, "session_id": sample.session_id, "chain_index": sample.chain_index,
                "position": np.arange(1, len(ids) + 1), "token_id": ids,
                "text": [self.tokenizer.decode([t]) for t in ids], "scaffold": self._scaffold(ids),
                "sampled": sampled, "trained": row["weight"] > 0,
                "engine_logprob": np.where(sampled, row["behavior"], np.nan),
                "trainer_logprob": np.where(sampled, row["old"], np.nan),
                "is_weight": np.where(sampled, row["is_weight"], np.nan), "advantage": row["advantage"],
                "weight": row["weight"], "version": versions, "staleness": np.where(sampled, version - versions, -1)})
            table["gap"] = table["trainer_logprob"] - table["engine_logprob"]
            table["rule"] = self._rules(row, sampled)
            parts.append(table)
        return pd.concat(parts, ignore_index=True)

    def _rules(self, row: dict[str, Any], sampled: np.ndarray) -> np.ndarray:
        masked_as = MASK_NAMES.get(self.config.vllm_importance_sampling_mode, "masked")
        trained = row["weight"] > 0
        return np.select([~sampled, ~trained, row["is_masked"] > 0, row["is_truncated"] > 0, row["clipped"] > 0],
                         ["prompt", "not trained", masked_as, "TIS cap", "clipped"], default="trained")

    def _scaffold(self, ids: list[int]) -> np.ndarray:
        """The template's own tokens: special and added ones, and the role header after a special token (up to and
        including its newline)."""
        marks = set(self.tokenizer.all_special_ids) | set(self.tokenizer.get_added_vocab().values())
        out, header = np.zeros(len(ids), dtype=bool), False
        for i, token in enumerate(ids):
            if token in marks:
                out[i], header = True, True
            elif header:
                out[i] = True
                header = "\n" not in self.tokenizer.decode([token])
        return out


class _Tables(Mapping):
    """Step number → token table, each built once from its captured arrays on first read."""

    def __init__(self, build):
        self.build, self.raw, self.built = build, OrderedDict(), {}

    def __getitem__(self, step: int) -> pd.DataFrame:
        if step not in self.built:
            self.built[step] = self.build(*self.raw[step])
        return self.built[step]

    def __contains__(self, step: object) -> bool:  # without building the table (Mapping's would)
        return step in self.raw

    def __iter__(self):
        return iter(self.raw)

    def __reversed__(self):
        return reversed(self.raw)

    def __len__(self) -> int:
        return len(self.raw)
