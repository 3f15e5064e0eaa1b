"""A command-line calculator agent: a standalone program that knows nothing about polar_lab.

It reads OPENAI_BASE_URL / OPENAI_API_KEY like any openai-SDK tool, solves one question with the
calculator tool, and prints the final answer as its last line. Used to test program harnesses.

    python -m polar_lab.harness.calc_cli "What is 3*7+2?"
"""

from __future__ import annotations

import sys

import openai

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, run_calculator


def main(question: str, max_turns: int = 4) -> str:
    client = openai.OpenAI(max_retries=0)  # base URL and key from the environment
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        message = client.chat.completions.create(model="tiny-calc", messages=messages, tools=[CALC_TOOL],
                                                 max_tokens=128).choices[0].message
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_calculator(call.function.arguments)})
    return ""


if __name__ == "__main__":
    print(main(sys.argv[1]))
