"""The calculator agent over the other provider APIs, each with its official SDK and that API's own tool loop:
Anthropic Messages (`tool_use` blocks answered by `tool_result` blocks) and Google generateContent (`functionCall`
parts answered by `functionResponse` parts). The task, the system prompt and the tool are calculator.py's; what
differs is what each API's harness sends — the same policy trained behind one can be evaluated behind another
(benchmarks/harness_transfer.py).
"""

from __future__ import annotations

import json
from typing import Any

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, run_calculator
from polar_lab.harness.clients import anthropic_client
from polar_lab.types import Session

TOOL = CALC_TOOL["function"]


async def anthropic_calculator_agent(session: Session, task: dict[str, Any], *, max_turns: int = 4,
                                     temperature: float = 1.0, max_tokens: int = 128, timeout: float = 120.0,
                                     max_retries: int = 2) -> dict[str, Any]:
    """Solve `task["question"]` through the session's Anthropic endpoint; returns the final text and the turns."""
    client = anthropic_client(session, max_retries=max_retries, timeout=timeout)
    tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    try:
        for turn in range(1, max_turns + 1):
            reply = await client.messages.create(  # this SDK (2.x) no longer names temperature: sent as a body field
                model="tiny-calc", system=SYSTEM_PROMPT, messages=messages, tools=[tool], max_tokens=max_tokens,
                extra_body={"temperature": temperature})
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                return {"final": "".join(b.text for b in reply.content if b.type == "text"), "turns": turn}
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": run_calculator(json.dumps(u.input))}
                for u in uses]})
        return {"final": None, "turns": max_turns}
    finally:
        await client.close()


async def google_calculator_agent(session: Session, task: dict[str, Any], *, max_turns: int = 4,
                                  temperature: float = 1.0, max_tokens: int = 128) -> dict[str, Any]:
    """Solve `task["question"]` through the session's Google endpoint (google-genai, automatic function calling
    off: the loop is the harness's own); returns the final text and the turns."""
    from google import genai
    from google.genai import types

    client = genai.Client(api_key=session.api_key, http_options=types.HttpOptions(base_url=session.google_base_url))
    declaration = types.FunctionDeclaration(name=TOOL["name"], description=TOOL["description"],
                                            parameters_json_schema=TOOL["parameters"])
    config = types.GenerateContentConfig(
        system_instruction=SYSTEM_PROMPT, tools=[types.Tool(function_declarations=[declaration])],
        temperature=temperature, max_output_tokens=max_tokens,
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    contents = [types.Content(role="user", parts=[types.Part(text=task["question"])])]
    for turn in range(1, max_turns + 1):
        reply = await client.aio.models.generate_content(model="tiny-calc", contents=contents, config=config)
        content = reply.candidates[0].content
        contents.append(content)
        calls = [p.function_call for p in content.parts or [] if p.function_call]
        if not calls:
            return {"final": "".join(p.text or "" for p in content.parts or []), "turns": turn}
        contents.append(types.Content(role="user", parts=[
            types.Part.from_function_response(name=c.name, response={"result": run_calculator(json.dumps(c.args))})
            for c in calls]))
    return {"final": None, "turns": max_turns}
