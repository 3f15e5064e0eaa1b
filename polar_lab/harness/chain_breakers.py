"""Harnesses that provoke each chain-break class on purpose — to test the diagnostics and to show them.

Each is an ordinary openai-SDK program doing something real harnesses do:
    multi_turn_agent     N model calls, tool results and new user turns in between (no drift: one chain)
    reserializing_agent  re-serialises tool-call JSON compactly before sending it back (LangChain-style)
    compacting_agent     replaces its history with a summary after a few turns (context compaction)
    subagent_harness     hands a sub-task to a helper with its own system prompt, then carries on
    rewriting_agent      rewrites its history before the next call: edits an earlier user turn in place, or puts a
                         reminder turn ahead of it (as Claude Code's system reminders do) — nothing is dropped
Run any of them in a session opened with `chat_template=with_empty_think(...)` to get "thinking stripped".
Re-serialised JSON and stripped thoughts break a chain only under `continuity="template"`: the default,
"splice", puts the turns the proxy produced back as their sampled ids (proxy/splice.py).
"""

from __future__ import annotations

import json
from typing import Any

import openai

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, run_calculator
from polar_lab.harness.clients import openai_client
from polar_lab.types import Session

FORCE_CALCULATOR = {"type": "function", "function": {"name": "calculator"}}


def _client(session: Session) -> openai.AsyncOpenAI:
    return openai_client(session, max_retries=0, timeout=120)


async def _turn(client, messages: list[dict[str, Any]], *, force_tool: bool, rewrite_args=None,
                max_tokens: int = 64) -> dict[str, Any]:
    """One model call; appends the reply (and executed tool results) to `messages`; returns the reply."""
    reply = await client.chat.completions.create(
        model="tiny-calc", messages=messages, tools=[CALC_TOOL], max_tokens=max_tokens,
        tool_choice=FORCE_CALCULATOR if force_tool else "auto")
    message = reply.choices[0].message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)
    for call in message.get("tool_calls", []):
        if rewrite_args is not None:
            call["function"]["arguments"] = rewrite_args(call["function"]["arguments"])
    messages.append(message)
    for call in message.get("tool_calls", []):
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": run_calculator(call["function"]["arguments"])})
    return message


def _start(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


async def multi_turn_agent(session: Session, questions: list[str], *, turns: int = 5) -> list[dict[str, Any]]:
    """Exactly `turns` calls; a turn without tool calls is followed by the next question as a user turn."""
    messages = _start(questions[0])
    async with _client(session) as client:
        for i in range(turns):
            reply = await _turn(client, messages, force_tool=False)
            if not reply.get("tool_calls"):
                messages.append({"role": "user", "content": questions[(i + 1) % len(questions)]})
    return messages


def _compact_json(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), separators=(",", ":"))
    except json.JSONDecodeError:
        return arguments


async def reserializing_agent(session: Session, question: str) -> list[dict[str, Any]]:
    """Forces a tool call, then sends its arguments back re-serialised without spaces."""
    messages = _start(question)
    async with _client(session) as client:
        await _turn(client, messages, force_tool=True, rewrite_args=_compact_json)
        await _turn(client, messages, force_tool=False)
    return messages


async def compacting_agent(session: Session, question: str, follow_up: str) -> list[dict[str, Any]]:
    """Two turns, then the history is replaced by a one-line summary and the work continues."""
    messages = _start(question)
    async with _client(session) as client:
        await _turn(client, messages, force_tool=True)
        await _turn(client, messages, force_tool=False)
        summary = f"Summary so far: I was asked '{question}' and answered it. Next: {follow_up}"
        messages = [messages[0], {"role": "user", "content": summary}]
        await _turn(client, messages, force_tool=False)
    return messages


async def subagent_harness(session: Session, question: str) -> list[dict[str, Any]]:
    """The main agent calls the tool, a checker sub-agent (own system prompt) reviews, the main agent ends."""
    messages = _start(question)
    async with _client(session) as client:
        await _turn(client, messages, force_tool=True)
        checker = [{"role": "system", "content": "You check arithmetic. Reply with the correct result."},
                   {"role": "user", "content": question}]
        await _turn(client, checker, force_tool=False)
        await _turn(client, messages, force_tool=False)
    return messages


REMINDER = "Reminder: answer with the calculator's result only."


async def rewriting_agent(session: Session, question: str, follow_up: str, *, how: str = "edit",
                          ) -> list[dict[str, Any]]:
    """One turn, then the history is rewritten — `how="edit"`: the first question gets a reminder appended in
    place; `how="insert"`: the reminder becomes a user turn of its own ahead of the question — and the follow-up
    is asked. Every earlier turn is still there: history rewritten, not compacted."""
    if how not in ("edit", "insert"):
        raise ValueError(f"how must be 'edit' or 'insert', got {how!r}")
    messages = _start(question)
    async with _client(session) as client:
        await _turn(client, messages, force_tool=False)
        if how == "edit":
            messages[1] = {"role": "user", "content": f"{question}\n{REMINDER}"}
        else:
            messages.insert(1, {"role": "user", "content": REMINDER})
        messages.append({"role": "user", "content": follow_up})
        await _turn(client, messages, force_tool=False)
    return messages
