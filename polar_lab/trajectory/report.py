"""Drift diagnostics as tables: every chain break of a run, classified, and counts by harness and class."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from polar_lab.trajectory.builders import ChainBreak, prefix_merging
from polar_lab.trajectory.drift import TurnFormat, classify
from polar_lab.types import ModelCall


def chain_breaks(calls: Iterable[ModelCall], tokenizer, harness_of: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per chain break: session, harness, call, class, where it diverged and both sides' context."""
    calls = list(calls)
    breaks: list[ChainBreak] = []
    chains = prefix_merging(calls, on_break=breaks.append)
    tokens = {(c.session_id, c.chain_index): c.token_ids for c in chains}
    by_id = {c.call_id: c for c in calls}
    turns = TurnFormat.of(tokenizer) if breaks else None  # the model's own template's turns
    rows = []
    for b in breaks:
        chain_ids = tokens[(b.session_id, b.closest_chain)]
        # the chain as it stood when the break happened is a prefix of its final ids: cut at its length then
        chain_text = _decode(tokenizer, chain_ids[:b.chain_tokens])
        kind, detail = classify(chain_text, _decode(tokenizer, by_id[b.call_id].prompt_ids), turns)
        if by_id[b.call_id].render.get("edited") and kind not in ("new_context", "truncation_compaction"):
            kind = "turn_edited"  # the proxy saw the harness change a turn it had produced (not a new context)
        rows.append({"session_id": b.session_id, "harness": (harness_of or {}).get(b.session_id, "unknown"),
                     "call_id": b.call_id, "kind": kind, "new_chain": b.new_chain,
                     "closest_chain": b.closest_chain, "common_tokens": b.common_tokens,
                     "chain_tokens": b.chain_tokens, **detail})
    columns = ["session_id", "harness", "call_id", "kind", "new_chain", "closest_chain", "common_tokens",
               "chain_tokens", "char", "chain_context", "prompt_context"]
    return pd.DataFrame(rows, columns=columns)


def drift_summary(breaks: pd.DataFrame) -> pd.DataFrame:
    """Counts of chain breaks by harness and class, with one example call and its context."""
    if breaks.empty:
        return pd.DataFrame(columns=["harness", "kind", "count", "example_call", "chain_context", "prompt_context"])
    grouped = breaks.groupby(["harness", "kind"], sort=True)
    first = grouped.first()
    out = pd.DataFrame({"count": grouped.size(), "example_call": first.call_id,
                        "chain_context": first.chain_context, "prompt_context": first.prompt_context})
    return out.reset_index()


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def builder_counts(calls: list[ModelCall]) -> dict[str, Any]:
    """Samples and tokens under each builder: the cost of one-sample-per-call made visible."""
    from polar_lab.trajectory.builders import per_request

    out = {}
    for name, build in (("per_request", per_request), ("prefix_merging", prefix_merging)):
        trajs = build(calls)
        out[name] = {"samples": len(trajs), "tokens": sum(len(t.token_ids) for t in trajs),
                     "trained_tokens": sum(sum(t.loss_mask) for t in trajs)}
    return out
