"""Reading a generation into reasoning, content and tool-call deltas while it streams, so that what a stream
sends adds up to what the call records.

`Splitter` is fed a choice's text as the engine samples it and returns `Delta`s; `finish(parsed)` is given
the whole generation as `OutputParser` read it (the record's reading, the same as a non-streamed response)
and returns what is still missing. The family's markers decide where a thought ends and a tool call begins;
a marker cut in half by a token boundary is held back until it is whole.

What is streamed as it comes, and what waits:
- reasoning and content, token by token; the newlines the parsers strip around them (leading, and trailing
  before a marker) are held back, and sent later if they turn out to be text;
- a tool call whole, once it is known to be one: with the Hermes reader (parse.py), when its block closes
  and parses, with the block's own reading; in other families (vLLM's parsers), at the end, from the final
  parse. A call is never streamed before it parses, because a stream cannot take a call back: vLLM's
  streaming tool parsers send a botched call's name and arguments as they come, and the harness then acts on
  a call the record (and a non-streamed response) reads as plain text. Here a streamed turn and a
  non-streamed one are the same turn.
What a stream sent and the final reading disagree on (a thought cut off by max_tokens, which the Hermes reader
reads as text) is kept in `diverged` and recorded with the call (render["stream_diverged"]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polar_lab.proxy.canonical import ParsedOutput


@dataclass(frozen=True)
class Delta:
    """One piece of a streamed choice: reasoning or content text, or one whole tool call."""

    kind: str  # "reasoning" | "content" | "call"
    text: str = ""  # reasoning or content
    call: dict[str, Any] | None = None  # {"id", "name", "arguments"} (kind "call")
    index: int = 0  # the call's position among the choice's calls


class Splitter:
    """One choice's text → deltas (see the module docstring). Feed it the forced prefill first, if any."""

    def __init__(self, *, thinking: tuple[str, str] | None, in_thought: bool, tool_open: str | None,
                 tool_close: str | None, own: bool, call_id: Callable[[int], str] | None = None):
        """thinking: the (open, close) markers of a thought, or None. in_thought: the prompt opened one.
        tool_open/tool_close: the call markers when calls are parsed (None: all text is content). own: the
        Hermes reader reads calls (blocks stream as they close); else vLLM's parsers do (calls at the end).
        call_id: the id of the k-th call, as the final reading will carry it (Prepared.tool_call_id)."""
        self.thinking, self.tool_open, self.tool_close, self.own = thinking, tool_open, tool_close, own
        self.call_id = call_id
        self.mode = "thought" if in_thought and thinking else "lead"  # lead | thought | content | calls
        self.text = ""  # everything fed
        self.pos = 0  # text before this is read
        self.sent = {"reasoning": "", "content": ""}
        self.held = {"reasoning": "", "content": ""}  # newlines held back at the end of what was sent
        self.calls: list[dict[str, Any]] = []  # calls sent
        # the parsers strip a section's leading newlines: vLLM's always, the Hermes reader a thought's and the
        # content after one
        self.strips = {"reasoning": True, "content": not own}
        self.diverged: list[str] = []

    def feed(self, text: str) -> list[Delta]:
        self.text += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self, parsed: ParsedOutput) -> list[Delta]:
        """What the final reading has that was not sent yet. The calls that were sent keep the ids they were
        sent with (set on `parsed`, so the response and the record carry them too)."""
        out = []
        for kind, final in (("reasoning", parsed.reasoning or ""), ("content", parsed.content or "")):
            sent = self.sent[kind]
            if final.startswith(sent):
                if final[len(sent):]:
                    out.append(Delta(kind, final[len(sent):]))
            else:
                self.diverged.append(f"{kind}: streamed {sent[:80]!r}, recorded {final[:80]!r}")
        for k, call in enumerate(parsed.tool_calls):
            if k >= len(self.calls):
                out.append(Delta("call", call=call, index=k))
            elif (self.calls[k]["name"], self.calls[k]["arguments"]) == (call["name"], call["arguments"]):
                call["id"] = self.calls[k]["id"]
            else:
                self.diverged.append(f"tool call {k}: streamed {self.calls[k]['name']}, recorded {call['name']}")
        if len(self.calls) > len(parsed.tool_calls):
            self.diverged.append(f"{len(self.calls)} tool calls streamed, {len(parsed.tool_calls)} recorded")
        return out

    # ---- one step of reading; False when it needs more text ----------------------------------------
    def _step(self, out: list[Delta]) -> bool:
        rest = self.text[self.pos:]
        if self.mode == "lead":
            return self._lead(rest)
        if self.mode == "thought":
            return self._section(out, "reasoning", self.thinking[1], then="content")
        if self.mode == "content":
            if self.tool_open is None:
                return self._section(out, "content", None, then="content")
            return self._section(out, "content", self.tool_open, then="calls", keep_marker=True)
        return self._calls(out) if self.own else False  # vLLM's parsers: calls come from the final reading

    def _lead(self, rest: str) -> bool:
        """Before the output's first text: does it open a thought?"""
        opening = self.thinking[0] if self.thinking else None
        stripped = rest.lstrip()
        if opening is not None and (not stripped or opening.startswith(stripped)) and not stripped.startswith(opening):
            return False  # could still become the opening marker
        if opening is not None and stripped.startswith(opening):
            self.pos += len(rest) - len(stripped) + len(opening)
            self.mode = "thought"
        else:
            self.mode = "content"
        return True

    def _section(self, out: list[Delta], kind: str, marker: str | None, *, then: str, keep_marker: bool = False
                 ) -> bool:
        """Send `kind` text up to `marker` (or up to what could be its start); at the marker, move on."""
        at = self.text.find(marker, self.pos) if marker else -1
        if at < 0:
            end = len(self.text) - (_partial(self.text, marker) if marker else 0)
            self._send(out, kind, self.text[self.pos:end])
            self.pos = end
            return False
        self._send(out, kind, self.text[self.pos:at])
        if kind == "reasoning":
            self.held[kind] = ""  # the newlines before the thought's end are the template's, not text
            self.strips["content"] = True
        self.pos = at if keep_marker else at + len(marker)
        self.mode = then
        return True

    def _send(self, out: list[Delta], kind: str, text: str) -> None:
        text = self.held[kind] + text
        if not self.sent[kind] and self.strips[kind]:
            text = text.lstrip("\n")
        body = text.rstrip("\n")
        self.held[kind] = text[len(body):]
        if body:
            self.sent[kind] += body
            out.append(Delta(kind, body))

    def _calls(self, out: list[Delta]) -> bool:
        """Hermes blocks from `pos`: a block that closes and parses is sent as a call. Before the first call a
        botched block is content, and so is what follows it up to the next block; after a call, text outside
        blocks is dropped (as parse.parse_output reads them)."""
        from polar_lab.proxy.parse import _parse_block

        opening, closing = self.tool_open, self.tool_close
        if not self.text.startswith(opening, self.pos):  # after a call: skip to the next block
            next_block = self.text.find(opening, self.pos)
            if next_block < 0:
                return False
            self.pos = next_block
        start = self.pos + len(opening)
        after, close = self.text.find(opening, start), self.text.find(closing, start)
        if close < 0 or 0 <= after < close:  # not closed yet, or cut short by the next block (unterminated)
            if after < 0:
                return False
            end, call = after, None
        else:
            end = close + len(closing)
            call, _ = _parse_block(self.text[start:close].strip(), closed=True)
        if call is not None:
            if not self.calls and self.held["content"][:-1]:  # one newline before a call is the template's; more are text
                self.sent["content"] += self.held["content"][:-1]
                out.append(Delta("content", self.held["content"][:-1]))
            self.held["content"] = ""
            if self.call_id is not None:
                call["id"] = self.call_id(len(self.calls))
            self.calls.append(call)
            out.append(Delta("call", call=call, index=len(self.calls) - 1))
        elif not self.calls:
            self._send(out, "content", self.text[self.pos:end])
            self.mode = "content"
        self.pos = end
        return True


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is the start of `marker` (a marker cut by a token boundary).

    >>> _partial("abc<tool_", "<tool_call>"), _partial("abc", "<tool_call>")
    (6, 0)
    """
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
