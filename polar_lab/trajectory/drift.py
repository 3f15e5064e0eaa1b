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

Turns are read the way the model's own chat template writes them (`TurnFormat.of(tokenizer)`: ChatML, Llama 3,
Mistral...), learned by rendering a probe conversation; `CHATML` when no tokenizer is given.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from polar_lab.proxy.render import common_prefix_len

_THINK = re.compile(r"<think>.*?</think>\n?\n?", re.DOTALL)  # the template glue only: content may start with whitespace
_TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SPACE = re.compile(r"\s+")
_CONTEXT = 40


@dataclass(frozen=True)
class TurnFormat:
    """How a chat template writes turns: the special strings it puts between and around contents (`markers`), the
    text a content starts with after its marker (`headers`, ChatML's "user\\n"), the template's own pieces between
    markers that hold no content (`scaffold`, Llama 3's role names), and what opens an assistant turn."""

    markers: tuple[str, ...]
    headers: tuple[str, ...]
    scaffold: frozenset[str]
    assistant_open: str

    @classmethod
    def of(cls, tokenizer) -> TurnFormat:
        """Learned from the tokenizer's chat template, by rendering a system, user, assistant, user probe."""
        names = ["system", "user", "assistant", "user"]
        marks = [f"QZX{i}PROBE" for i in range(len(names))]
        text = tokenizer.apply_chat_template([{"role": r, "content": m} for r, m in zip(names, marks)], tokenize=False)
        special = {t.content for t in tokenizer.added_tokens_decoder.values()} | set(tokenizer.all_special_tokens)
        markers = tuple(sorted((t for t in special if t and t in text), key=len, reverse=True))
        headers, scaffold = set(), set()
        for _, piece, _ in _split(text, markers):
            holding = [m for m in marks if m in piece]
            if holding:
                headers.add(piece[:piece.index(holding[0])])
            elif piece.strip():
                scaffold.add(piece.strip())
        start, end = text.index(marks[1]) + len(marks[1]), text.index(marks[2])
        return cls(markers, tuple(sorted(headers, key=len, reverse=True)), frozenset(scaffold), text[start:end])

    def turns(self, text: str) -> list[tuple[str, str, int]]:
        """(piece, role, end) for each marker and the text after it, up to the next marker; `role` is the marker and
        the piece's header, or the whole piece where it is the template's own (a role name)."""
        out = []
        for marker, piece, end in _split(text, self.markers):
            if not (marker + piece).strip():
                continue
            kept = piece.strip()
            head = kept if kept in self.scaffold else next((h for h in self.headers if piece.startswith(h)), "")
            out.append(((marker + piece).strip(), (marker + head).strip(), end))
        return out

    def first_content_end(self, text: str) -> int:
        """Where the first turn's content ends (-1: no turn in the text)."""
        for marker, piece, end in _split(text, self.markers):
            if marker and piece.strip() and piece.strip() not in self.scaffold:
                return end
        return -1


CHATML = TurnFormat(markers=("<|im_start|>", "<|im_end|>"), headers=("assistant\n", "system\n", "user\n"),
                    scaffold=frozenset(), assistant_open="<|im_end|>\n<|im_start|>assistant\n")


def _split(text: str, markers: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """(marker, the text after it up to the next marker, where that text ends); the text before the first marker
    comes with marker ""."""
    if not markers:
        return [("", text, len(text))]
    parts = re.split("(" + "|".join(map(re.escape, markers)) + ")", text)
    out, at = [("", parts[0], len(parts[0]))], len(parts[0])
    for marker, piece in zip(parts[1::2], parts[2::2]):
        at += len(marker) + len(piece)
        out.append((marker, piece, at))
    return out


def classify(chain_text: str, prompt_text: str, turns: TurnFormat = CHATML) -> tuple[str, dict[str, Any]]:
    """(class, detail) for a prompt that does not extend a chain, the turns read in `turns`' format; see the
    module docstring."""
    at = common_prefix_len(chain_text, prompt_text)
    detail = {"char": at, "chain_context": chain_text[max(0, at - _CONTEXT):at + _CONTEXT],
              "prompt_context": prompt_text[max(0, at - _CONTEXT):at + _CONTEXT]}
    if prompt_text.startswith(chain_text):
        return "token_remerge", detail
    first_turn_end = turns.first_content_end(chain_text)
    if first_turn_end == -1 or at <= first_turn_end:
        return "new_context", detail
    if "<think>" in chain_text and prompt_text.startswith(_THINK.sub("", chain_text)):
        return "thinking_stripped", detail
    if _inside_tool_call(chain_text, at) and _same_tool_calls(chain_text, prompt_text):
        return "tool_call_rerendered", detail
    if _SPACE.sub("", prompt_text).startswith(_SPACE.sub("", chain_text)):
        return "whitespace", detail
    if _rewritten(turns.turns(chain_text), turns.turns(prompt_text)):
        return "history_rewritten", detail
    if chain_text.rfind(turns.assistant_open) > at or len(prompt_text) < len(chain_text):
        return "truncation_compaction", detail
    return "other", detail


def _rewritten(chain: list[tuple[str, str, int]], prompt: list[tuple[str, str, int]]) -> bool:
    """Every turn of the chain is still in the prompt — re-ordered, or with turns put between — or the prompt keeps
    at least as many turns, the same roles in the same places, and one or more texts changed in place."""
    if not chain:
        return False
    left = Counter(t for t, _, _ in prompt)
    left.subtract(t for t, _, _ in chain)
    if all(n >= 0 for n in left.values()):
        return True
    return len(prompt) >= len(chain) and [r for _, r, _ in prompt[:len(chain)]] == [r for _, r, _ in chain]


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
