"""A code-writing agent: asks for a Python function, runs the task's unit tests on it in a sandbox, retries
once with the failure output. An ordinary openai-SDK program; tasks come from data/tasks/code_test.jsonl.
"""

from __future__ import annotations

import re
from typing import Any

from polar_lab.harness.clients import openai_client
from polar_lab.rewards.code import run_tests
from polar_lab.types import Session

SYSTEM = "You write Python. Reply with one ```python code block that defines the requested function."
_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The first fenced code block, else the whole text.

    >>> extract_code("Here:\\n```python\\ndef f():\\n    return 1\\n```")
    'def f():\\n    return 1\\n'
    """
    match = _BLOCK.search(text)
    return match.group(1) if match else text


async def code_agent(session: Session, task: dict[str, Any], *, max_turns: int = 2,
                     max_tokens: int = 256) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    code, passed = "", False
    async with openai_client(session, max_retries=0) as client:
        for _ in range(max_turns):
            reply = await client.chat.completions.create(model="tiny-calc", messages=messages, max_tokens=max_tokens)
            content = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": content})
            code = extract_code(content)
            passed, output = run_tests(code, task["tests"], timeout_s=10)
            if passed:
                break
            messages.append({"role": "user", "content": f"The tests failed:\n{output}\nFix the code."})
    return {"code": code, "passed": passed, "turns": len(messages) // 2 - 1}
