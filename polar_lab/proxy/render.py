"""Chat template → prompt token ids. Stateless; called from worker threads so the proxy loop never tokenises.

Exact-id continuity across the turns of a session (reusing earlier ids, tokenising only the new
suffix) is layered on top of this in the trajectory issue; here every prompt is tokenised in full
and `info["mode"] == "full"` says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jinja2

from polar_lab.errors import RequestError
from polar_lab.proxy.parse import TOOL_OPEN


@dataclass
class Rendered:
    prompt_ids: list[int]
    text: str
    info: dict[str, Any] = field(default_factory=dict)


class Renderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.supports_tool_calls = TOOL_OPEN in template  # Hermes-style calls we can parse and force

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               prefill: str = "") -> Rendered:
        """Render messages (+ tools) with the generation prompt, append `prefill`, tokenise."""
        t0 = time.perf_counter()
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
            raise RequestError(f"the chat template cannot render these messages: {exc}",
                               param="messages") from exc
        text += prefill
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        info = {"mode": "full", "prompt_chars": len(text), "prefill": prefill,
                "render_s": time.perf_counter() - t0}
        return Rendered(prompt_ids=ids, text=text, info=info)

    def forced_prefill(self, tool_choice: str | dict[str, Any]) -> str:
        """Text that makes the model call a tool: the start of a tool-call block, in the template's shape.

        These tokens are part of the prompt (the model did not sample them), so they are never trained.
        """
        if not self.supports_tool_calls:
            return ""
        if isinstance(tool_choice, dict):
            return f'{TOOL_OPEN}\n{{"name": "{tool_choice["name"]}", "arguments": '
        if tool_choice == "required":
            return f'{TOOL_OPEN}\n{{"name": "'
        return ""
