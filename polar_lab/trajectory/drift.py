"""Chain-break classification: why a call's prompt did not extend its session's chain.

Classes (checked in this order; the first that explains the break wins):
    token_remerge         the texts agree but the ids do not: a boundary was tokenised differently
    new_context           the prompts part within the first turn: a sub-agent or a fresh conversation
    thinking_stripped     removing `<think>` blocks from the chain's text makes it a prefix again
    tool_call_rerendered  the texts part inside a `<tool_call>` whose JSON means the same thing
    whitespace            the texts agree once whitespace is ignored
    history_rewritten     no turn lost: the chain's turns are all in the prompt in another order (or with a turn put
                          between them), or each is still in its place, by role, with one or more texts changed
    truncation_compaction the prompt keeps the start but drops turns, or merges them into fewer (a summary)
    other                 none of the above (e.g. the template's own scaffolding changed)
One more class comes from the proxy, not the texts (report.chain_breaks): `turn_edited`, a call whose history
held a turn the proxy produced, changed by the harness (its render info's "edited" says what changed), so it
was rendered by the template instead of spliced (proxy/splice.py). Under the default "splice" continuity an
echoed turn the proxy recognises and finds unchanged does not break a chain; the other classes then come from
what the harness itself does (sub-agents, compaction), from turns the proxy no longer holds (evicted, or
ambiguous), or from a template that cannot be spliced (render info "splice_failed").
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from polar_lab.proxy.render import common_prefix_len

TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
_THINK = re.compile(r"<think>.*?</think>\n?\n?", re.DOTALL)  # the template glue only: content may start with whitespace
_TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SPACE = re.compile(r"\s+")
_CONTEXT = 40


def classify(chain_text: str, prompt_text: str) -> tuple[str, dict[str, Any]]:
    """(class, detail) for a prompt that does not extend a chain; see the module docstring."""
    at = common_prefix_len(chain_text, prompt_text)
    detail = {"char": at, "chain_context": chain_text[max(0, at - _CONTEXT):at + _CONTEXT],
              "prompt_context": prompt_text[max(0, at - _CONTEXT):at + _CONTEXT]}
    if prompt_text.startswith(chain_text):
        return "token_remerge", detail
    first_turn_end = chain_text.find(TURN_END)
    if first_turn_end == -1 or at <= first_turn_end:
        return "new_context", detail
    if "<think>" in chain_text and prompt_text.startswith(_THINK.sub("", chain_text)):
        return "thinking_stripped", detail
    if _inside_tool_call(chain_text, at) and _same_tool_calls(chain_text, prompt_text):
        return "tool_call_rerendered", detail
    if _SPACE.sub("", prompt_text).startswith(_SPACE.sub("", chain_text)):
        return "whitespace", detail
    if _rewritten(_turns(chain_text), _turns(prompt_text)):
        return "history_rewritten", detail
    if chain_text.rfind("<|im_start|>assistant", 0, len(chain_text)) > at or len(prompt_text) < len(chain_text):
        return "truncation_compaction", detail
    return "other", detail


def _turns(text: str) -> list[str]:
    """The text's turns, each from its `<|im_start|>` to its `<|im_end|>` (the newline between turns and a trailing
    generation prompt's open turn left out)."""
    turns = []
    for piece in text.split(TURN_START)[1:]:
        end = piece.find(TURN_END)
        if end != -1:
            turns.append(piece[:end])
    return turns


def _rewritten(chain: list[str], prompt: list[str]) -> bool:
    """Every turn of the chain is still in the prompt — re-ordered, or with turns put between — or the prompt keeps
    at least as many turns, the same roles in the same places, and one or more texts changed in place."""
    if not chain:
        return False
    left = Counter(prompt)
    left.subtract(chain)
    if all(n >= 0 for n in left.values()):
        return True
    return len(prompt) >= len(chain) and [_role(t) for t in prompt[:len(chain)]] == [_role(t) for t in chain]


def _role(turn: str) -> str:
    return turn.partition("\n")[0]


def _inside_tool_call(text: str, at: int) -> bool:
    start = text.rfind("<tool_call>", 0, at + 1)
    return start != -1 and text.find("</tool_call>", start) >= at


def _normalise_tool_calls(text: str) -> str:
    def canonical(match: re.Match) -> str:
        try:
            obj = json.loads(match.group(1))
            if isinstance(obj, dict) and isinstance(obj.get("arguments"), str):
                obj["arguments"] = json.loads(obj["arguments"])
            return "<tool_call>" + json.dumps(obj, sort_keys=True, separators=(",", ":")) + "</tool_call>"
        except (json.JSONDecodeError, TypeError):
            return match.group(0)

    return _TOOL_BLOCK.sub(canonical, text)


def _same_tool_calls(chain_text: str, prompt_text: str) -> bool:
    return _normalise_tool_calls(prompt_text).startswith(_normalise_tool_calls(chain_text))
