"""SFT data from accepted runs (Polar's Table 2: run a harness over many tasks, keep the accepted trajectories).

`sft_dataset(run, min_reward=...)` keeps the chains whose session's reward reaches `min_reward` and gives one row
per chain in both forms TRL's `SFTTrainer` reads:

- conversational: `messages` (the chain's last request's messages and the reply it got, tool calls included, in
  Chat Completions' shape) and `tools`;
- tokenized: `input_ids` (the chain's exact ids, as sampled and as the template rendered the rest), `labels`
  (the ids where the policy sampled them, -100 elsewhere), `assistant_masks` (the chain's loss mask);

plus `reward`, `session_id`, `chain_index`, `task_id`. `messages` and `tools` are `datasets.Json` columns (their
dicts vary from row to row). A filter that accepts nothing gives an empty dataset with these columns. A chain with
nothing to train (every token masked: a turn cut off by its caller, a constrained one) is left out.
`acceptance(run, min_reward)` is the table beside it: per task, runs, accepted runs, masked runs.

The messages are read from Chat Completions bodies (what most harnesses speak) as the proxy read them (the
`developer` role as system, content parts joined, `reasoning` as `reasoning_content`); a chain whose last call came
through another API has `messages` None, its tokenized form exact all the same.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from polar_lab.types import ModelCall, Session, Trajectory

IGNORE = -100  # the label of a token the loss skips (PyTorch's cross-entropy `ignore_index`, TRL's and HF's)


def features():
    from datasets import Features, Json, List, Value

    return Features({"messages": List(Json()), "tools": List(Json()), "input_ids": List(Value("int64")),
                     "labels": List(Value("int64")), "assistant_masks": List(Value("int8")),
                     "reward": Value("float64"), "session_id": Value("string"), "chain_index": Value("int64"),
                     "task_id": Value("string")})


def accepted(reward: float | None, min_reward: float) -> bool:
    """A run is accepted when it has a reward (failed and masked runs have none) of at least `min_reward`.

    >>> accepted(1.0, 1.0), accepted(0.5, 1.0), accepted(None, 0.0)
    (True, False, False)
    """
    return reward is not None and reward >= min_reward


def sft_rows(chains: list[Trajectory], calls: dict[str, ModelCall], sessions: dict[str, Session], *,
             min_reward: float) -> list[dict[str, Any]]:
    rows = []
    for chain in chains:
        session = sessions.get(chain.session_id)
        if session is None or not accepted(session.reward, min_reward) or not any(chain.loss_mask):
            continue
        last = calls[chain.call_ids[-1]]
        messages = _conversation(last)
        rows.append({
            "messages": messages, "tools": list(last.request.get("tools") or []) if messages is not None else None,
            "input_ids": list(chain.token_ids),
            "labels": [t if m else IGNORE for t, m in zip(chain.token_ids, chain.loss_mask, strict=True)],
            "assistant_masks": list(chain.loss_mask), "reward": float(session.reward),
            "session_id": chain.session_id, "chain_index": chain.chain_index, "task_id": _task_id(session)})
    return rows


def _conversation(call: ModelCall) -> list[dict[str, Any]] | None:
    """The call's request messages as the proxy read them and its reply, in Chat Completions' shape; None for
    another API's call, or one whose reply was not built (cut off by its caller)."""
    choices = call.response.get("choices") if call.api == "openai.chat" else None
    if not choices or call.finish_reason == "abort":
        return None
    from polar_lab.proxy.apis import openai_chat  # the proxy's own reader; on use: a Run opens without the proxy

    body = openai_chat.ChatCompletionRequest.model_validate(call.request)
    reply = {k: v for k, v in choices[call.choice_index]["message"].items() if v is not None}
    return openai_chat.to_canonical(body).messages + [reply]


def _task_id(session: Session) -> str:
    """The task's id; a run without one is its own task (its group, else its session)."""
    task = session.task or {}
    return str(task.get("id") or session.group_id or session.id)


def sft_dataset(source, *, min_reward: float = 1.0, builder: str = "prefix_merging",
                session_ids: list[str] | None = None):
    """The accepted chains of `source` (a Lab or a Run) as a `datasets.Dataset` (see the module docstring).
    Save it with `.to_parquet(path)`; train on it with TRL's `SFTTrainer` (conversational or tokenized)."""
    import datasets

    wanted = set(session_ids) if session_ids is not None else None
    sessions = {s.id: s for s in source.session_records()
                if accepted(s.reward, min_reward) and (wanted is None or s.id in wanted)}
    ids = sorted(sessions)  # only the accepted runs' calls are read (by offset in a live Lab)
    chains = source.trajectories(builder, session_ids=ids)
    calls = {c.call_id: c for c in source.call_records(ids)}
    rows = sft_rows(chains, calls, sessions, min_reward=min_reward)
    table = {name: [row[name] for row in rows] for name in features()}
    return datasets.Dataset.from_dict(table, features=features())


def acceptance(source, *, min_reward: float = 1.0, session_ids: list[str] | None = None) -> pd.DataFrame:
    """Per task: runs finished, runs accepted (a reward of at least `min_reward`), runs masked (no reward: failed
    or masked by their environment) and the acceptance rate over all finished runs, like Polar's Table 2. Open
    sessions are not counted."""
    wanted = set(session_ids) if session_ids is not None else None
    rows = [{"task_id": _task_id(s), "accepted": accepted(s.reward, min_reward), "masked": s.reward is None}
            for s in source.session_records() if s.status != "open" and (wanted is None or s.id in wanted)]
    frame = pd.DataFrame(rows, columns=["task_id", "accepted", "masked"])
    out = frame.groupby("task_id", sort=True).agg(runs=("accepted", "count"), accepted=("accepted", "sum"),
                                                  masked=("masked", "sum")).reset_index()
    out[["accepted", "masked"]] = out[["accepted", "masked"]].astype(int)
    out["rate"] = out["accepted"] / out["runs"]
    return out
