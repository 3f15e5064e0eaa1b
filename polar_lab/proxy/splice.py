"""Id-spliced continuity: an assistant turn this proxy produced goes back into the next prompt as the token ids
the model sampled, not as the chat template re-renders it. Owned by `CallService` (one `TurnLedger` per Lab).

Why: a harness echoes a turn back as parsed fields (content, JSON arguments, maybe the thought); the template
re-renders them, and wherever that text differs from what was sampled (XML arguments, a stripped thought,
other whitespace, other JSON spacing) the next prompt no longer extends the last one and the session's chain
breaks. Splicing keeps the engine's prompt and the trainer's sequence the same tokens by construction.

How:
1. Every choice the proxy returns is a `Turn` in the session's ledger: its sampled ids and what the harness was
   told (content, reasoning, tool calls with the ids the proxy issued).
2. A request's assistant message is recognised by those tool-call ids (any API's prefix: `call_`, `toolu_`...),
   else by the history before it (the messages of the request it answered), else by its content and calls, and
   checked against the recorded turn. An edited turn (content, a call or an echoed thought differs) is not
   spliced, nor one that fits several sampled turns; why is recorded in the call's render info ("edited").
3. The renderer renders the conversation with each recognised turn replaced by a sentinel message, then puts,
   in the sentinel's place, the rest of the generation prompt the turn was sampled after (the thought the
   template opened, a forced call's prefill) and the sampled ids. `Glue` says where a turn starts and ends in
   the template's text; it is probed once per template.

The trade-off (docs/design-notes.md): with splicing the model sees its own earlier thoughts even where the
template would strip them, so its context is what it sampled, not what the template would show a fresh model.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

_SENTINEL = "\ue000polar-splice-{}\ue001"  # private-use characters; `splice` refuses a text that has them already


@dataclass(frozen=True)
class Turn:
    """One choice the proxy returned: what was sampled, and what the harness was told it said."""

    call_id: str
    opening: str  # text the prompt held after the turn's header when this was sampled (Glue.opening + prefill)
    ids: tuple[int, ...]  # the sampled ids
    text: str  # their exact text, special tokens included
    stop: str  # text of the stop token that ended the turn ("" when it ended otherwise)
    content: str | None
    reasoning: str | None
    tool_calls: tuple[tuple[str, str, str], ...]  # (issued id, name, arguments as written)


@dataclass(frozen=True)
class Glue:
    """Where a plain assistant turn sits in a template's text: `header` + content + `trailer`; `opening` is what
    the generation prompt adds after the header (e.g. the `<think>\\n` a thinking template opens)."""

    header: str
    trailer: str
    opening: str


def probe_glue(render: Callable[[list[dict[str, Any]], bool], str]) -> Glue | None:
    """The template's glue, from three small renders; None when the template does not render a plain turn as
    header + content + trailer with a generation prompt that extends the header (splicing is then off)."""
    user = {"role": "user", "content": "\ue000u\ue001"}
    later = {"role": "user", "content": "\ue000v\ue001"}
    sentinel = _SENTINEL.format("probe")
    try:
        base, with_prompt = render([user], False), render([user], True)
        middle = render([user, {"role": "assistant", "content": sentinel}, later], False)
        later_turn = render([user, later], False)[len(base):]
    except Exception:  # noqa: BLE001 - a template that cannot take the probe cannot be spliced
        return None
    if not (with_prompt.startswith(base) and middle.startswith(base) and middle.endswith(later_turn)
            and middle.count(sentinel) == 1):
        return None
    header, _, rest = middle[len(base):].partition(sentinel)
    trailer = rest[:len(rest) - len(later_turn)]
    prompt = with_prompt[len(base):]
    if not prompt.startswith(header):
        return None
    return Glue(header=header, trailer=trailer, opening=prompt[len(header):])


class TurnLedger:
    """Per-session turns the proxy produced, bounded: the newest `per_session` index keys of the newest `sessions`
    sessions, within `max_bytes` (estimated: 8 bytes an id, 1 a character). Added to on the proxy's loop, dropped
    from whichever thread closes a session: locked.

    Lookup (`find`) goes from the most to the least specific key, and a key that several different turns share
    (two choices of one request, the same visible reply twice) finds none: a wrong splice would put ids the
    model never sampled at that place, a missed one only re-renders the turn."""

    def __init__(self, per_session: int = 16384, sessions: int = 4096, max_bytes: int = 512 * 2**20):
        self.per_session = per_session
        self.sessions = sessions
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._turns: OrderedDict[str, OrderedDict[str, list[Turn]]] = OrderedDict()  # session → key → turns
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, session_id: str, turn: Turn, history: str) -> None:
        """history: `history_keys(...)[-1]` of the request the turn answered."""
        size = 8 * len(turn.ids) + len(turn.text)
        with self._lock:
            turns = self._turns.setdefault(session_id, OrderedDict())
            self._turns.move_to_end(session_id)
            for key in [*(_id_key(i) for i, _, _ in turn.tool_calls), _content_key(turn.content, turn.tool_calls),
                        "history:" + history]:
                turns.setdefault(key, []).append(turn)
                turns.move_to_end(key)
            while len(turns) > self.per_session:
                turns.popitem(last=False)
            self._bytes[session_id] = self._bytes.get(session_id, 0) + size
            self.nbytes += size
            while self._turns and (len(self._turns) > self.sessions or self.nbytes > self.max_bytes):
                self._forget(next(iter(self._turns)))

    def drop(self, session_id: str) -> None:
        """Forget a closed session's turns."""
        with self._lock:
            self._forget(session_id)

    def _forget(self, session_id: str) -> None:
        self._turns.pop(session_id, None)
        self.nbytes -= self._bytes.pop(session_id, 0)

    def find(self, session_id: str, message: dict[str, Any], history: str) -> list[Turn]:
        """The turns this assistant message may echo, from the most specific key that knows any: an issued
        tool-call id, the history before it (`history`: `history_keys(messages)[i]`), its content and calls.
        More than one: the key is shared (`pick` decides)."""
        calls = message.get("tool_calls") or []
        with self._lock:
            turns = self._turns.get(session_id)
            if not turns:
                return []
            for call in calls:
                if isinstance(call, dict) and isinstance(call.get("id"), str) and _id_key(call["id"]) in turns:
                    return list(turns[_id_key(call["id"])])
            found = turns.get("history:" + history) or turns.get(_content_key(message.get("content"),
                                                                                _message_calls(calls)))
            return list(found or [])


def pick(candidates: list[Turn], message: dict[str, Any]) -> tuple[Turn | None, str | None]:
    """(the turn to splice, None) when exactly one sampled turn fits the echoed message; else (None, why): what the
    harness changed (the message fits none), or that it fits several that differ (two choices alike in what the
    harness sees): which one was echoed cannot be known, and a wrong guess would splice ids never sampled there."""
    fits = [t for t in candidates if edits(t, message) is None]
    distinct = {(t.ids, t.opening) for t in fits}
    if len(distinct) == 1:
        return fits[0], None
    if fits:
        return None, "ambiguous: it fits several sampled turns"
    return None, edits(candidates[0], message) if candidates else None


def history_keys(messages: list[dict[str, Any]]) -> list[str]:
    """Digests of every prefix of a request's messages (`[i]`: of `messages[:i]`, the last: of them all), in one
    pass: an edited turn without ids is still known by what came before it. orjson, keys in the adapters' own
    order (the same for every request of a surface): this runs on every call."""
    digest = hashlib.blake2b(digest_size=16)
    keys = [digest.hexdigest()]
    for message in messages:
        digest.update(orjson.dumps(message, default=str))
        keys.append(digest.hexdigest())
    return keys


class HistoryDigests:
    """`history_keys` per session, hashing only what is new: when a request's messages start with the session's
    previous request's (equal as values), its digests and the hash state after them are reused. Bounded to the newest
    `sessions` sessions; a closed session's are dropped (`drop`). Used from the proxy's loop only."""

    def __init__(self, sessions: int = 4096):
        self.sessions = sessions
        self._last: OrderedDict[str, tuple[list[dict[str, Any]], Any, list[str]]] = OrderedDict()

    def keys(self, session_id: str, messages: list[dict[str, Any]]) -> list[str]:
        last = self._last.pop(session_id, None)
        if last is not None and len(messages) >= len(last[0]) and messages[:len(last[0])] == last[0]:
            done, digest, keys = len(last[0]), last[1].copy(), list(last[2])
        else:
            done, digest, keys = 0, hashlib.blake2b(digest_size=16), []
            keys.append(digest.hexdigest())
        for message in messages[done:]:
            digest.update(orjson.dumps(message, default=str))
            keys.append(digest.hexdigest())
        self._last[session_id] = (list(messages), digest, keys)
        while len(self._last) > self.sessions:
            self._last.popitem(last=False)
        return keys

    def drop(self, session_id: str) -> None:
        self._last.pop(session_id, None)


def edits(turn: Turn, message: dict[str, Any]) -> str | None:
    """What the harness changed in an echoed turn (None: nothing). A thought the harness did not echo is not an
    edit: most APIs' clients drop it."""
    if (message.get("content") or None) != (turn.content or None):
        return "content"
    calls = _message_calls(message.get("tool_calls") or [])
    if len(calls) != len(turn.tool_calls):
        return "tool calls"
    for (_, name, args), (_, turn_name, turn_args) in zip(calls, turn.tool_calls):
        if name != turn_name or not _same_arguments(args, turn_args):
            return f"tool call {turn_name}"
    reasoning = message.get("reasoning_content")
    if reasoning and reasoning.strip("\n") != (turn.reasoning or "").strip("\n"):
        return "reasoning"
    return None


def sentinel(index: int) -> str:
    return _SENTINEL.format(index)


def splice(text: str, turns: dict[int, Turn], glue: Glue) -> list[str | Turn] | None:
    """The prompt as segments: template text, and in each sentinel's place the turn's opening (text) and the
    turn itself (its ids). None when the template did not render a sentinel as header + sentinel + trailer."""
    if text.count(_SENTINEL[0]) != len(turns):  # the harness's own text holds the sentinel's character
        return None
    segments: list[str | Turn] = []
    cursor = 0
    for index in sorted(turns):
        turn, mark = turns[index], sentinel(index)
        at = text.find(mark, cursor)
        end = at + len(mark)
        if at < cursor or not text.startswith(glue.header, at - len(glue.header)) \
                or not text.startswith(glue.trailer, end):
            return None
        segments += [text[cursor:at] + turn.opening, turn]
        # the stop token the model sampled is the start of the template's trailer: it is in the ids already
        cursor = end + (len(turn.stop) if turn.stop and glue.trailer.startswith(turn.stop) else 0)
    segments.append(text[cursor:])
    return segments


def _id_key(call_id: str) -> str:
    """Issued ids differ by API only in their prefix (`call_x`, `toolu_x`, `fc_x`)."""
    return "id:" + call_id.rpartition("_")[2]


def _content_key(content: str | None, calls) -> str:
    text = json.dumps([content or None, [(name, _normal(args)) for _, name, args in calls]])
    return "content:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _message_calls(calls: list[Any]) -> list[tuple[str, str, str]]:
    out = []
    for call in calls:
        if not isinstance(call, dict):
            continue
        function = call.get("function") if isinstance(call.get("function"), dict) else call
        args = function.get("arguments")
        out.append((str(call.get("id") or ""), str(function.get("name") or ""),
                    args if isinstance(args, str) else json.dumps(args)))
    return out


def _normal(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except (ValueError, RecursionError):  # not JSON, or nested past what json can take: compared as text
        return arguments


def _same_arguments(a: str, b: str) -> bool:
    return a == b or _normal(a) == _normal(b)
