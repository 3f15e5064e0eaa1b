"""Chat template → prompt token ids, with exact-id continuity. Called on the proxy's loop for small requests and
from worker threads for large ones (`CallService.render`), so the piece cache is locked.

Continuity: the model's own output must never be re-tokenised. For each session we keep the last few
"tips" — an earlier call's prompt text + generated text, and its prompt ids + sampled ids. When a new
prompt's text starts with a tip's text, the tip's ids are reused verbatim and only the new suffix (tool
results, the next user turn, template glue) is tokenised. Per-turn cost then grows with the new text,
not the history. When no tip is a prefix (a template dropped `<think>`, a harness re-serialised a tool
call, compacted its context...), the prompt is tokenised in full and the divergence from the closest tip
is recorded in `info["divergence"]`.

Splicing (splice.py) comes first: turns this proxy produced go into the prompt as their sampled ids, and the tips
then reuse ids over a text that holds those turns exactly as sampled.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import jinja2

from polar_lab.errors import RequestError
from polar_lab.proxy.formats import FORMATS, ToolFormat
from polar_lab.proxy.history import TemplateHistory
from polar_lab.proxy.splice import Glue, Turn, probe_glue, sentinel, splice

_CONTEXT = 40  # characters of context on each side of a divergence


@dataclass
class Tip:
    """What the model has seen and said after one call: text and the exact ids behind it. A list, not a compact
    array: the next call copies the ids into its prompt, and rebuilding Python ints from an array cost 0.8-2 ms
    at 63k tokens (more than the rest of the render); memory is bounded by TipCache instead."""

    call_id: str
    text: str
    ids: list[int]


@dataclass
class Rendered:
    prompt_ids: list[int]
    text: str
    info: dict[str, Any] = field(default_factory=dict)


class TipCache:
    """Per-session tips, bounded: the newest `per_session` tips of the newest `sessions` sessions, within `max_bytes`
    (estimated: an id in a list of Python ints ~36 bytes, a character ~1); a closed session's are dropped (`drop`).
    Added to on the proxy's loop, dropped from whichever thread closes the session: locked."""

    def __init__(self, per_session: int = 8, sessions: int = 4096, max_bytes: int = 1 << 30):
        self.per_session = per_session
        self.sessions = sessions
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._tips: OrderedDict[str, list[Tip]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session_id: str) -> list[Tip]:
        return list(self._tips.get(session_id, ()))

    def add(self, session_id: str, tip: Tip) -> None:
        with self._lock:
            tips = self._tips.setdefault(session_id, [])
            self._tips.move_to_end(session_id)
            tips.append(tip)
            self.nbytes += _tip_bytes(tip) - sum(_tip_bytes(t) for t in tips[:-self.per_session])
            del tips[:-self.per_session]
            while self._tips and (len(self._tips) > self.sessions or self.nbytes > self.max_bytes):
                self.nbytes -= sum(_tip_bytes(t) for t in self._tips.popitem(last=False)[1])

    def drop(self, session_id: str) -> int:
        """Forget a session's tips; returns the bytes they held (estimated)."""
        with self._lock:
            freed = sum(_tip_bytes(t) for t in self._tips.pop(session_id, ()))
            self.nbytes -= freed
            return freed


def _tip_bytes(tip: Tip) -> int:
    return 36 * len(tip.ids) + len(tip.text)


class PieceEncoder:
    """Tokenises text piece by piece between added tokens, caching long pieces (system prompts, tool lists).

    Exact by construction: a fast tokenizer splits its input at added tokens before anything else, so
    the ids of a text are the ids of its pieces, in order. That holds only when no added token strips
    the whitespace beside it (lstrip/rstrip/single_word); for such tokenizers `exact` is False and every
    text is tokenised whole. Every session of one harness starts with the same system prompt and tools:
    the first call of each run then tokenises only its own user turn.
    """

    def __init__(self, tokenizer, *, min_cached_chars: int = 256, max_entries: int = 1024):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        added = self.backend.get_added_tokens_decoder() if self.backend is not None else {}
        self.exact = bool(added) and not any(t.lstrip or t.rstrip or t.single_word for t in added.values())
        self._ids = {t.content: i for i, t in added.items()}
        # Descending order puts every added token before its own prefixes, so the alternation matches the
        # longest token at a position, as the tokenizer does (leftmost-longest).
        longest_first = sorted(self._ids, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")").split if self.exact else None
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()  # the loop and worker threads (large bodies) render concurrently
        self.min_cached_chars = min_cached_chars
        self.max_entries = max_entries

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        out: list[int] = []
        for piece in self._split(text):
            if piece in self._ids:
                out.append(self._ids[piece])
            elif piece:
                out += self._piece(piece)
        return out

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            ids = self._cache.get(piece)
            if ids is not None:
                self._cache.move_to_end(piece)
                return ids
        ids = self.backend.encode(piece, add_special_tokens=False).ids
        if len(piece) >= self.min_cached_chars:
            with self._lock:
                self._cache[piece] = ids
                if len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
        return ids


class Renderer:
    def __init__(self, tokenizer, tool_format: ToolFormat | None = FORMATS["hermes"]):
        """tool_format: how the model writes a tool call (formats.py), to force or forbid one; None: it
        cannot be forced or forbidden."""
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.tool_format = tool_format if tool_format is not None and tool_format.open in template else None
        self.supports_tool_calls = self.tool_format is not None
        self.pieces = PieceEncoder(tokenizer)
        self._glue: dict[tuple, Glue | None] = {}  # (chat template (None: the model's), thinking) → its glue
        self.history = TemplateHistory(self._template)  # per session: renders only the new messages

    def glue(self, chat_template: str | None = None, thinking: bool | None = None) -> Glue | None:
        """Where a plain assistant turn sits in the template's text (splice.probe_glue); None: cannot splice."""
        key = (chat_template, thinking)
        if key not in self._glue:
            self._glue[key] = probe_glue(lambda messages, prompt: self._template(
                messages, [], chat_template, generation_prompt=prompt, thinking=thinking))
        return self._glue[key]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], prefill: str = "",
               tips: list[Tip] | None = None, chat_template: str | None = None,
               splices: dict[int, Turn] | None = None, thinking: bool | None = None,
               session: str | None = None) -> Rendered:
        """Render messages (+ tools) with the generation prompt, append `prefill`, tokenise (reusing a tip).

        splices: message index → the turn this proxy produced there, put in as its sampled ids (splice.py).
        thinking: the template's `enable_thinking` (None: its default).
        session: render only the messages that follow the session's previous request (TemplateHistory).
        """
        t0 = time.perf_counter()
        info: dict[str, Any] = {}
        segments = self._spliced(messages, tools, prefill, chat_template, splices, thinking, info, session) \
            if splices else None
        if segments is None:
            segments = [self.history.render(session, messages, tools, chat_template, thinking, info) + prefill]
        text = "".join(s if isinstance(s, str) else s.text for s in segments)
        tip = _longest_prefix_tip(text, tips or [], segments)
        if tip is not None:
            ids = tip.ids + self._encode_segments(segments, len(tip.text))
            info.update(mode="continued", from_call=tip.call_id, reused_tokens=len(tip.ids))
        else:
            ids = self._encode_segments(segments, 0)
            info["mode"] = "full"
            if tips:
                info["mode"] = "diverged"
                info["divergence"] = self._divergence(text, tips)
        info.update(prompt_chars=len(text), prefill=prefill, render_s=time.perf_counter() - t0)
        return Rendered(prompt_ids=ids, text=text, info=info)

    def _spliced(self, messages, tools, prefill, chat_template, splices, thinking, info,
                 session=None) -> list[str | Turn] | None:
        """The prompt as template text and spliced turns; None (and why, in info) when the template cannot."""
        glue = self.glue(chat_template, thinking)
        if glue is None:
            info["splice_failed"] = "the chat template has no plain assistant turn to splice into"
            return None
        marked = [{"role": "assistant", "content": sentinel(i)} if i in splices else m for i, m in enumerate(messages)]
        try:  # a template may refuse a plain turn where the harness sent calls (tool results must follow calls)
            text = self.history.render(session, marked, tools, chat_template, thinking, info) + prefill
        except RequestError as exc:
            info["splice_failed"] = f"the chat template refused the turns in plain form: {exc}"[:300]
            return None
        segments = splice(text, splices, glue)
        if segments is None:
            info["splice_failed"] = "the chat template rendered an echoed turn in an unexpected place"
            return None
        info["spliced"] = [splices[i].call_id for i in sorted(splices)]
        return segments

    def _encode_segments(self, segments: list[str | Turn], start: int) -> list[int]:
        """Ids of the prompt from character `start` on: template text tokenised, spliced turns as sampled."""
        ids: list[int] = []
        at = 0
        for segment in segments:
            text = segment if isinstance(segment, str) else segment.text
            if at + len(text) > start:
                ids += self.encode(text[max(start - at, 0):]) if isinstance(segment, str) else segment.ids
            at += len(text)
        return ids

    def encode(self, text: str) -> list[int]:
        return self.pieces.encode(text) if text else []

    def decode(self, ids: list[int]) -> str:
        """Exact text of ids, special tokens included (what the template would have rendered)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def template_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                      chat_template: str | None = None, *, generation_prompt: bool = True,
                      thinking: bool | None = None) -> str:
        """The chat template's text of messages (+ tools), rendered whole (what `/tokenize` shows without the
        generation prompt)."""
        return self._template(messages, tools, chat_template, generation_prompt=generation_prompt, thinking=thinking)

    def _template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  chat_template: str | None, *, generation_prompt: bool = True, thinking: bool | None = None) -> str:
        if self.tool_format is not None and self.tool_format.arguments_as_objects:
            messages = [_arguments_as_objects(m) if m.get("tool_calls") else m for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False,
                chat_template=chat_template, **({} if thinking is None else {"enable_thinking": thinking}))
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
            raise RequestError(f"the chat template cannot render these messages: {exc}",
                               param="messages") from exc

    def _divergence(self, text: str, tips: list[Tip]) -> dict[str, Any]:
        """Where the new prompt leaves the closest earlier tip: call, character, token, both sides' context."""
        best, at = max(((tip, common_prefix_len(text, tip.text)) for tip in tips), key=lambda p: p[1])
        return {"from_call": best.call_id, "char": at, "token": self._token_at(best.ids, at),
                "tip_chars": len(best.text), "tip_context": best.text[max(0, at - _CONTEXT):at + _CONTEXT],
                "prompt_context": text[max(0, at - _CONTEXT):at + _CONTEXT]}

    def _token_at(self, ids: list[int], char: int) -> int:
        """Index of the first token whose decoded span reaches past `char` (binary search on prefixes)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(ids[:mid + 1])) <= char:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def forced_prefill(self, tool_choice: str | dict[str, Any]) -> str:
        """Text that makes the model call a tool: the start of a tool-call block, in the template's shape.

        These tokens are part of the prompt (the model did not sample them), so they are never trained.
        The prefill stops right after a punctuation token, never after a space: byte-level BPE merges a
        space into the next word (` {"`), so a prompt ending in a lone space token is one the model has
        never seen, and it derails (measured on tiny-calc: 0 of 6 parseable calls with the trailing space).
        """
        if self.tool_format is None:
            return ""
        if isinstance(tool_choice, dict):
            return self.tool_format.named.format(name=tool_choice["name"])
        if tool_choice == "required":
            return self.tool_format.required
        return ""


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """The message with each tool call's JSON-string arguments as an object (XML-format templates iterate over
    them); arguments that are not a JSON object stay as they are, and the template says what it thinks."""
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function", call))
        if isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):
                parsed = json.loads(function["arguments"])
                if isinstance(parsed, dict):
                    function["arguments"] = parsed
        calls.append({**call, "function": function} if "function" in call else function)
    return {**message, "tool_calls": calls}


def _longest_prefix_tip(text: str, tips: list[Tip], segments: list[str | Turn]) -> Tip | None:
    """The longest tip whose text starts the prompt and does not end inside a spliced turn (whose ids are whole)."""
    inside, at = [], 0
    for segment in segments:
        length = len(segment) if isinstance(segment, str) else len(segment.text)
        if not isinstance(segment, str):
            inside.append((at, at + length))
        at += length
    matches = [tip for tip in tips if text.startswith(tip.text)
               and not any(a < len(tip.text) < b for a, b in inside)]
    return max(matches, key=lambda tip: len(tip.text)) if matches else None


def common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix, by binary search over `startswith` (memcmp speed on long texts).

    >>> common_prefix_len("abcdef", "abcxyz")
    3
    """
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo
