"""Records that cost their new tokens: a call's record leaves out what an earlier record of its session holds.

A session's calls mostly repeat each other: call k's prompt is call k-1's prompt, its sampled tokens and a few
new messages, and its request body repeats the earlier messages. Written whole, a 100-turn session whose
context reaches 64k tokens writes the sum of its prompts (~48x its final chain). So `Compactor` writes, for a
call whose prompt continues an earlier call of its session (the tip its render reused, `render["from_call"]`):

    "prompt_ref":  {"call": <earlier call id>, "tokens": n}   the prompt's first n ids are that call's
                                                               prompt + output ids
    "prompt_tail": the ids after those n                       (in place of "prompt_ids")
and, for a request whose message list (`messages`, `input` or `contents`) starts with the session's previous
request's:
    "request_ref": {"call": <previous call id>, "items": k}   the list's first k items are that request's
    "request_tail": the body with only the items after those k (in place of "request")
The parts get names of their own so that a build from before this format refuses such a record (it lacks
"prompt_ids") instead of reading a tail as a whole prompt.
The request is stored as a JSON delta, not compressed: it stays readable line by line, and per-line zstd would
not see the repetition, which is across lines.

`Expander` rebuilds full records while reading a run in order (`RunStore`'s readers and `Run` use it); records
without references (every run written before this format) pass through unchanged. Crash safety: a reference
points only at a call this store wrote whole, earlier, in the same session (a reopened folder starts afresh; a
write that fails is not referenced), so a torn line is never referenced. A reference that still cannot be
resolved (a file cut by hand) makes that record unreadable, like a torn line: readers skip it and count it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


LIST_KEYS = ("messages", "input", "contents")  # where each API keeps its conversation


class Compactor:
    """The write side: which earlier record of the session a new one can point at. Owned by the RunStore, under
    its lock. Keeps, per open session, the length of each written call and the previous request's list (the
    objects the request already holds, not a copy); `forget` drops a closed session's."""

    def __init__(self, sessions: int = 4096):
        self.sessions = sessions
        self._lengths: OrderedDict[str, dict[str, int]] = OrderedDict()  # session → call id → prompt + output
        self._last: dict[str, tuple[str, str, list]] = {}  # session → (call id, list key, its list)

    def compact(self, call, record: dict[str, Any]) -> dict[str, Any]:
        """`record` with what an earlier record holds replaced by references (a new dict; `record` unchanged)."""
        out = dict(record)
        ref, tokens = call.render.get("from_call"), call.render.get("reused_tokens")
        if ref is not None and self._lengths.get(call.session_id, {}).get(ref) == tokens:
            out["prompt_ref"] = {"call": ref, "tokens": tokens}
            out["prompt_tail"] = call.prompt_ids[tokens:]
            del out["prompt_ids"]
        key, items = _conversation(call.request)
        last = self._last.get(call.session_id)
        if key is not None and last is not None and last[1] == key and len(items) >= len(last[2]) \
                and items[:len(last[2])] == last[2]:
            out["request_ref"] = {"call": last[0], "items": len(last[2])}
            out["request_tail"] = {**call.request, key: items[len(last[2]):]}
            del out["request"]
        return out

    def written(self, call, *, whole_request: bool = True) -> None:
        """`call`'s record is on disk: later records may point at it (at its request only if written whole)."""
        lengths = self._lengths.setdefault(call.session_id, {})
        self._lengths.move_to_end(call.session_id)
        lengths[call.call_id] = len(call.prompt_ids) + len(call.output_ids)
        key, items = _conversation(call.request)
        if key is not None and whole_request:
            self._last[call.session_id] = (call.call_id, key, items)
        else:
            self._last.pop(call.session_id, None)
        while len(self._lengths) > self.sessions:  # sessions never closed: the oldest are written whole again
            self.forget(next(iter(self._lengths)))

    def forget(self, session_id: str) -> None:
        self._lengths.pop(session_id, None)
        self._last.pop(session_id, None)


class Expander:
    """The read side: full records from compact ones, read in file order (a session's references point back)."""

    def __init__(self):
        self._ids: dict[str, tuple[list[int], list[int]]] = {}  # call id → (prompt ids, output ids)
        self._items: dict[str, tuple[str, list]] = {}  # call id → (list key, the request's whole list)
        self.unresolved: list[str] = []  # records whose reference could not be resolved (skipped)

    def expand(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The whole record; None (and counted in `unresolved`) when it refers to a call not read before it."""
        call_id = record.get("call_id")
        prompt_ref, request_ref = record.get("prompt_ref"), record.get("request_ref")
        if prompt_ref is not None or request_ref is not None:
            record = dict(record)
            if (prompt_ref is not None and prompt_ref.get("call") not in self._ids) or \
                    (request_ref is not None and request_ref.get("call") not in self._items):
                self.unresolved.append(str(call_id))
                return None
        if prompt_ref is not None:
            prompt, output = self._ids[prompt_ref["call"]]
            record["prompt_ids"] = (prompt + output)[:prompt_ref["tokens"]] + record.pop("prompt_tail")
            del record["prompt_ref"]
        if request_ref is not None:
            key, items = self._items[request_ref["call"]]
            tail = record.pop("request_tail")
            record["request"] = {**tail, key: items[:request_ref["items"]] + tail[key]}
            del record["request_ref"]
        if call_id is not None:
            self._ids[call_id] = (record.get("prompt_ids", []), record.get("output_ids", []))
            key, items = _conversation(record.get("request"))
            if key is not None:
                self._items[call_id] = (key, items)
        return record


def _conversation(request: Any) -> tuple[str | None, list]:
    """The request's conversation list and its key, or (None, [])."""
    if isinstance(request, dict):
        for key in LIST_KEYS:
            if isinstance(request.get(key), list):
                return key, request[key]
    return None, []
