"""polar_lab → NeMo RL: chains as NeMo Gym rollout rows (docs/harnesses.md).

`gym_rows(lab_or_run)` turns each `prefix_merging` chain into the row NeMo RL trains on: `responses_create_params`
(the chain's first request: its messages and tools), `response.output` (per call, the new input items — tool
results, user turns — then its generated items, the first carrying `prompt_token_ids`, `generation_token_ids`,
`generation_log_probs`), `reward`, and where it came from. NeMo RL keeps the items with generation token ids and
asserts that each one's prompt extends every token before it: `contiguous` is that rule, and
`check_rows_with_gym` runs Gym's own check (in Gym's venv).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from polar_lab.envs.nemo_gym import output_message, gym_python
from polar_lab.errors import LabError
from polar_lab.types import ModelCall

def gym_rows(source, *, builder: str = "prefix_merging", session_ids: list[str] | None = None
             ) -> list[dict[str, Any]]:
    """Each chain of `source` (a Lab or a Run) as a Gym rollout row: `responses_create_params` (the chain's first
    request: input messages, tools), `response.output` (per call: the new input items — tool results, user turns
    — then its generated items, the first of them carrying `prompt_token_ids`, `generation_token_ids`,
    `generation_log_probs`), `reward`, and where it came from. Items are read from Chat Completions calls' bodies;
    a call through another API gives one assistant message item (its tokens exact, its text not parsed)."""
    chains = source.trajectories(builder, session_ids=session_ids)
    calls = {c.call_id: c for c in source.call_records(session_ids)}
    rows = []
    for chain in chains:
        members = [calls[i] for i in chain.call_ids]
        first = members[0].request
        output: list[dict[str, Any]] = []
        seen = len(first.get("messages") or [])
        for k, call in enumerate(members):
            messages = call.request.get("messages") or []
            if k:
                output += [_input_item(m) for m in messages[seen + 1:]]  # after the echoed assistant turn
            seen = len(messages)
            output += _generated_items(call)
        rows.append({"responses_create_params": {"input": list(first.get("messages") or []),
                                                 "tools": [_responses_tool(t) for t in first.get("tools") or []]},
                     "response": {"id": f"resp_{chain.session_id}_{chain.chain_index}", "object": "response",
                                  "model": members[0].model, "output": output},
                     "reward": chain.reward,
                     "polar_lab": {"session_id": chain.session_id, "chain_index": chain.chain_index,
                                   "call_ids": list(chain.call_ids)}})
    return rows


def _generated_items(call: ModelCall) -> list[dict[str, Any]]:
    tokens = {"prompt_token_ids": list(call.prompt_ids), "generation_token_ids": list(call.output_ids),
              "generation_log_probs": list(call.output_logprobs)}
    choices = call.response.get("choices") if call.api == "openai.chat" else None
    message = choices[call.choice_index]["message"] if choices else {"content": None}
    items = [{"type": "function_call", "name": tc["function"]["name"], "arguments": tc["function"]["arguments"],
              "call_id": tc["id"], "id": tc["id"], "status": "completed"} for tc in message.get("tool_calls") or []]
    if message.get("content") or not items:
        items.insert(0, output_message(message.get("content") or ""))
    items[0].update(tokens)  # the tokens once per generation: NeMo RL reads each generated item as one turn
    return items


def _input_item(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") == "tool":
        return {"type": "function_call_output", "call_id": message.get("tool_call_id"),
                "output": message.get("content") or ""}
    return {"type": "message", "role": message.get("role", "user"), "content": message.get("content") or ""}


def _responses_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool)
    return {"type": "function", "name": fn.get("name"), "description": fn.get("description") or "",
            "parameters": fn.get("parameters") or {"type": "object"}, "strict": False}


def contiguous(row: dict[str, Any]) -> bool:
    """NeMo RL's rule for a rollout row: every item with generated tokens has a prompt that extends all the tokens
    before it (the previous prompt and generation); items without are skipped.

    >>> item = lambda p, g: {"prompt_token_ids": p, "generation_token_ids": g}
    >>> contiguous({"response": {"output": [item([1, 2], [3]), {"type": "x"}, item([1, 2, 3, 4], [5])]}})
    True
    >>> contiguous({"response": {"output": [item([1, 2], [3]), item([1, 9], [5])]}})
    False
    """
    seen: list[int] = []
    for item in row["response"]["output"]:
        if item.get("generation_token_ids") is None:
            continue
        prompt = item.get("prompt_token_ids") or []
        if prompt[:len(seen)] != seen:
            return False
        seen = list(prompt) + list(item["generation_token_ids"])
    return True


def check_rows_with_gym(rows: list[dict[str, Any]], venv: str | None = None) -> list[str | None]:
    """Each row checked by Gym's own `assert_prefix_contiguity` (in Gym's venv): None where it passes, else why."""
    code = ("import json, sys\n"
            "from nemo_gym.token_id_capture.builder import assert_prefix_contiguity\n"
            "out = []\n"
            "for line in sys.stdin:\n"
            "    try:\n"
            "        assert_prefix_contiguity(json.loads(line)['response']); out.append(None)\n"
            "    except AssertionError as exc:\n"
            "        out.append(str(exc))\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([str(gym_python(venv)), "-c", code], input="".join(json.dumps(r) + "\n" for r in rows),
                          capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise LabError(f"Gym's contiguity check failed to run: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


__all__ = ["check_rows_with_gym", "contiguous", "gym_rows"]
