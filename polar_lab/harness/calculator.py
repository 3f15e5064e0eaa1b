"""The built-in calculator harness: an ordinary openai-SDK agent loop, nothing polar_lab-specific inside.

It asks the model, executes any `calculator` tool calls itself (a safe AST evaluator, no `eval`),
feeds the results back as `tool` messages, and stops at the first answer without tool calls.
The tiny-calc model was trained on exactly this prompt and tool (scripts/build_tiny_model.py).
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from polar_lab.types import Session

SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool for arithmetic."

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
            "required": ["expression"],
        },
    },
}

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expression: str) -> int:
    """Evaluate an integer expression with + - * and parentheses; ValueError for anything else.

    >>> safe_eval("(3+4)*-2")
    -14
    """
    if len(expression) > 200:
        raise ValueError("expression too long")

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from exc
    return walk(tree)


def run_calculator(arguments: str) -> str:
    """The tool's reply to one call's JSON arguments: the integer result, or an error string."""
    try:
        args = json.loads(arguments)
        return str(safe_eval(args["expression"]))
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as exc:
        return f"Error: {exc}"


async def calculator_agent(session: Session, task: dict[str, Any], *, max_turns: int = 4,
                           temperature: float = 1.0, max_tokens: int = 128, timeout: float = 120.0,
                           max_retries: int = 2, http_client=None) -> dict[str, Any]:
    """Solve `task["question"]` through the session's endpoint; returns the final text and the transcript.

    max_retries: the SDK's own retries of 5xx answers (2 is the SDK's default); they carry a run across an
    engine restart. http_client: an httpx.AsyncClient of the caller's (tests count the answers with it)."""
    from polar_lab.harness.clients import openai_client  # here: the tools above import without the SDK

    client = openai_client(session, max_retries=max_retries, timeout=timeout, http_client=http_client)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": task["question"]}]
    try:
        for turn in range(1, max_turns + 1):
            reply = await client.chat.completions.create(
                model="tiny-calc", messages=messages, tools=[CALC_TOOL], temperature=temperature,
                max_tokens=max_tokens)
            message = reply.choices[0].message
            messages.append(message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
            if not message.tool_calls:
                return {"final": message.content or "", "turns": turn, "messages": messages}
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_calculator(call.function.arguments)})
        return {"final": None, "turns": max_turns, "messages": messages}
    finally:
        await client.close()
