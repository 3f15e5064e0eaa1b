"""Chat-template variants for experiments, derived from a model's own template.

`with_empty_think` reproduces the Qwen3 `enable_thinking=False` behaviour: the *generation prompt* gets an
empty `<think>\\n\\n</think>\\n\\n` block, but re-rendered history does not. Every multi-turn session then
breaks its chain at each turn — a real-world drift (the "thinking stripped" class) to study or to show.
Use per session: `lab.session(chat_template=with_empty_think(lab.tokenizer.chat_template))`.
"""

from __future__ import annotations

import re

# the generation-prompt block of a ChatML template: `{%- if add_generation_prompt %} {{- '<|im_start|>assistant\n' }}`
_GENERATION_PROMPT = re.compile(r"(\{%-?\s*if add_generation_prompt\s*-?%\}\s*\{\{-?\s*)'<\|im_start\|>assistant\\n'")


def with_empty_think(template: str) -> str:
    """The same template, but the generation prompt opens with an empty think block."""
    variant, count = _GENERATION_PROMPT.subn(r"\1'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'", template)
    if count != 1:
        raise ValueError("this template's generation prompt is not the plain ChatML one; cannot derive a variant")
    return variant
