"""Rendering only what is new: a session's chat-template text is its previous request's text plus the text of the
messages after it, for templates checked to render that way.

A harness sends the whole conversation on every call, and Jinja renders all of it: at turn 100 of a ~64k-token
session the template alone cost ~10x turn 1. `TemplateHistory` keeps, per session, the previous request's messages
and their text (without the generation prompt). When the next request's messages start with those (same tools,
template and thinking switch), only the new messages are rendered, after a short stand-in for the history — the
first message (the system prompt, which templates treat apart) and the last one (templates look at a message's
neighbour: consecutive tool results share one turn) — and the stand-in's own text is cut off:

    text(m[:n]) = text(m[:k]) + render(S + m[k:n])[len(render(S)):]    S = [m[0], m[k-1]]

That holds for a template when every message renders from itself and its neighbours, and the generation prompt is
a fixed suffix. Not every template does: Qwen3's hides the thoughts of turns before the last user message, so an
earlier turn's text changes when a new question comes. So each template (with its thinking switch) is checked
once, on first use, against a corpus of conversations (system prompts first and later, tools or none, calls,
consecutive tool results, thoughts, several turns) at every point where a request can end; a template that renders
any of them differently is always rendered whole. Whatever the template, a session's first call, a request that
does not continue the previous one (an edited history, compaction, other tools), one that continues it at a point
the probe does not check (after an assistant message, or a tool result after a tool result) and a stand-in whose
text is not a prefix of its extension are rendered whole too. The check costs ~0.1-0.2 s, once per template and
thinking switch, on the call that first needs it. `tests/proxy/test_history.py` renders every family fixture's
corpus both ways and requires the same text and ids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polar_lab.errors import RequestError
from polar_lab.proxy.formats import THINKING

_PROBE_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _probe_conversations() -> list[list[dict[str, Any]]]:
    """Conversations with every shape of message a template treats differently; requests end after users/tools.
    `user` is a question and `said` an answer (`thought`: with a thought), numbered by their place, so no two read
    alike: a template that quotes one message in another (the first question, in later ones) shows only when they
    differ."""
    system = {"role": "system", "content": "You are a careful assistant."}
    user, said, thought = object(), object(), object()  # `thought`: an answer with its thought
    reasoning = "Two sevens."

    def call(i):
        return {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
            "name": "calculator", "arguments": f'{{"expression": "{i}*7"}}'}}]}

    def result(i):
        return {"role": "tool", "tool_call_id": f"c{i}", "content": str(7 * i)}

    def numbered(conversation):
        return [{"role": "user", "content": f"Question {i}: what is {i}*7?"} if m is user else
                {"role": "assistant", "content": f"It is {i}*7."} if m is said else
                {"role": "assistant", "content": f"It is {i}*7.", "reasoning_content": reasoning} if m is thought else m
                for i, m in enumerate(conversation)]

    return [numbered(c) for c in [
        [system, user, said, user, said, user],
        [user, said, user],
        [system, user, call(0), result(0), said, user, call(1), result(1), said, user],
        [system, user, {**call(0), "tool_calls": call(0)["tool_calls"] + call(1)["tool_calls"]}, result(0),
         result(1), said, user],
        [system, user, thought, user, said, user],
        [system, user, said, {"role": "system", "content": "Be brief."}, user, said, user],
        [system, user, call(0), result(0), thought, user, call(1), result(1), said, user],
        [system, user, {**call(0), "reasoning_content": reasoning}, result(0), said, user],
        [system, user, {**call(0), "content": "<think>\nSeven.\n</think>\n\n"}, result(0), said, user],
    ]]


def _has_thoughts(messages: list[dict[str, Any]]) -> bool:
    """Whether a message carries a thought (a field, or markers in its text that a template reads as one)."""
    closes = tuple(close for _, close in THINKING.values())
    return any(m.get("reasoning_content") or (isinstance(m.get("content"), str) and any(c in m["content"] for c in closes))
               for m in messages)


@dataclass
class _Previous:
    """A session's previous request, as rendered."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    chat_template: str | None
    thinking: bool | None
    text: str  # its template text without the generation prompt
    thoughts: bool = False  # a message carries a thought (_has_thoughts)
    head: str | None = None  # the text of the first message alone (the short stand-in's), once rendered

    def continued_by(self, messages, tools, chat_template, thinking) -> bool:
        """`messages` extend these at a point the probe checks: after a user or tool message, and not between
        two tool results (templates join consecutive results into one turn, and look ahead to close it)."""
        k = len(self.messages)
        return len(messages) > k and chat_template == self.chat_template and thinking == self.thinking \
            and self.messages[-1].get("role") in ("user", "tool") \
            and not (self.messages[-1].get("role") == "tool" and messages[k].get("role") == "tool") \
            and tools == self.tools and messages[:k] == self.messages


class TemplateHistory:
    """Per-session template text, extended by each request's new messages (see the module docstring). Renders run on
    the proxy's loop and in worker threads: locked. Bounded: the newest `sessions` sessions, within `max_chars`;
    a closed session's is dropped (`drop`)."""

    def __init__(self, template: Callable[..., str], *, sessions: int = 4096, max_chars: int = 256 * 2**20):
        """template(messages, tools, chat_template, generation_prompt=, thinking=) → text (Renderer._template)."""
        self.template = template
        self.sessions, self.max_chars = sessions, max_chars
        self.chars = 0
        self._previous: OrderedDict[str, _Previous] = OrderedDict()
        # (chat template, thinking, thoughts) → (its generation prompt, whether the first message alone stands in for
        # the history); None: not incremental. Bounded: sessions may bring templates of their own.
        self._checked: OrderedDict[tuple, tuple[str, bool] | None] = OrderedDict()
        self._lock = threading.Lock()

    def render(self, session: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               chat_template: str | None, thinking: bool | None, info: dict[str, Any] | None = None) -> str:
        """The template text of `messages` with the generation prompt (as `template` renders it)."""
        if session is None:
            return self.template(messages, tools, chat_template, thinking=thinking)
        with self._lock:
            previous = self._previous.get(session)
        if previous is not None and not previous.continued_by(messages, tools, chat_template, thinking):
            previous = None
        # only the new messages are looked at: the previous request's were
        thoughts = previous.thoughts or _has_thoughts(messages[len(previous.messages):]) if previous is not None \
            else _has_thoughts(messages)
        checked = self.checked(chat_template, thinking, thoughts)
        text = self._extend(previous, messages, tools, short=checked[1]) \
            if previous is not None and checked is not None else None
        if text is None:
            text = self.template(messages, tools, chat_template, thinking=thinking)
        elif info is not None:
            info["template"] = f"{len(messages) - len(previous.messages)} new messages"
        if checked is None or not text.endswith(checked[0]):  # not incremental for this template (or these messages)
            self.drop(session)
            return text
        self._keep(session, _Previous(list(messages), tools, chat_template, thinking,
                                      text[:len(text) - len(checked[0])], thoughts,
                                      previous.head if previous is not None else None))
        return text

    def _extend(self, previous: _Previous, messages, tools, *, short: bool) -> str | None:
        """short: the stand-in is the first message alone (its text rendered once per session, kept as `head`)."""
        k = len(previous.messages)
        stand_in = [messages[0]] + ([messages[k - 1]] if k > 1 and not short else [])
        base = previous.head if short else None
        if base is None:
            base = self.template(stand_in, tools, previous.chat_template, generation_prompt=False,
                                 thinking=previous.thinking)
            if short:
                previous.head = base
        extended = self.template(stand_in + messages[k:], tools, previous.chat_template, thinking=previous.thinking)
        if not extended.startswith(base):
            return None
        return previous.text + extended[len(base):]

    def _keep(self, session: str, previous: _Previous) -> None:
        with self._lock:
            old = self._previous.pop(session, None)
            self.chars += len(previous.text) - (len(old.text) if old else 0)
            self._previous[session] = previous
            while self._previous and (len(self._previous) > self.sessions or self.chars > self.max_chars):
                self.chars -= len(self._previous.popitem(last=False)[1].text)

    def drop(self, session: str) -> None:
        with self._lock:
            old = self._previous.pop(session, None)
            self.chars -= len(old.text) if old else 0

    def checked(self, chat_template: str | None, thinking: bool | None, thoughts: bool) -> tuple[str, bool] | None:
        """(generation prompt, short stand-in) if the template renders the probe corpus incrementally — checked once,
        first with the two-message stand-in, then with the first message alone (one render per call instead of
        two) — else None. thoughts: the messages carry thoughts (probed apart: templates that hide earlier
        thoughts, as Qwen3's do, render conversations without any incrementally — spliced turns carry none)."""
        key = (chat_template, thinking, thoughts)
        if key not in self._checked:
            suffix = self._probe(chat_template, thinking, thoughts, short=False)
            self._checked[key] = None if suffix is None else \
                (suffix, self._probe(chat_template, thinking, thoughts, short=True) is not None)
            while len(self._checked) > 64:
                self._checked.popitem(last=False)
        return self._checked[key]

    def _probe(self, chat_template: str | None, thinking: bool | None, thoughts: bool, *, short: bool) -> str | None:
        """Render each probe conversation whole and incrementally, at every point a request can end."""
        render = self.template
        suffix = None
        conversations = [c for c in _probe_conversations() if thoughts or not _has_thoughts(c)]
        try:
            for tools in ([], [_PROBE_TOOL]):
                for conversation in conversations:
                    ends = [n for n in range(1, len(conversation) + 1) if conversation[n - 1]["role"] in ("user", "tool")
                            and (n == len(conversation) or conversation[n]["role"] != "tool")]
                    for i, k in enumerate(ends):
                        whole = render(conversation[:k], tools, chat_template, thinking=thinking)
                        bare = render(conversation[:k], tools, chat_template, generation_prompt=False, thinking=thinking)
                        if not whole.startswith(bare) or suffix not in (None, whole[len(bare):]):
                            return None
                        suffix = whole[len(bare):]
                        for n in ends[i + 1:]:
                            previous = _Previous(conversation[:k], tools, chat_template, thinking, bare)
                            if self._extend(previous, conversation[:n], tools, short=short) != \
                                    render(conversation[:n], tools, chat_template, thinking=thinking):
                                return None
        except RequestError:  # a template that refuses a probe shape (a strict role order): rendered whole
            return None
        return suffix
