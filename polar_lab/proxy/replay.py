"""A recorded session replayed up to a turn: the proxy answers a branch's first calls from the record, then samples.

A branch session carries a `Script` (`Session.replay`): the recorded calls of the session it replays, by call index.
Call i of the branch, for i < `live_from` (until_turn − 1), is answered from recorded call i when the prompt the proxy
rendered for it is the recorded prompt, id for id: the recorded ids, logprobs and versions become the answer's
Generation (its text decoded as the engine decodes: special tokens skipped, cut at a stop string) and go through the
same parsing, streaming and recording as a live answer, without the engine (`engine_s` 0, `ModelCall.replayed`).
The first call whose prompt differs — the harness is not deterministic, a tool answered differently — is the
branch's divergence (`Divergence`: the call, the first differing token, both ids); it and every later call go live.
From `live_from` on every call is live.

A replayed answer is the recorded one byte for byte: the call takes its record's request id and time
(`CallService.prepare`), and what the proxy issues per answer derives from those — the response's id, its tool-call
ids (`Prepared.tool_call_id`), its timestamp. Two things are this proxy's secrets: an Anthropic thinking signature and
a sealed Responses reasoning item are the recorded bytes when the Lab that recorded them replays them (the same
secrets; sealing is deterministic), and differ in another Lab — which could not have checked the recorded ones
either. A streamed answer carries the recorded text in one delta, not in the chunks it was sampled in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from polar_lab.types import Generation, ModelCall


@dataclass(frozen=True)
class Divergence:
    """Where a branch's prompt first left the record: call `call_index`, token `token` of its prompt."""

    call_index: int
    token: int
    recorded: int | None  # the recorded prompt's id there (None: the recorded prompt ended)
    sent: int | None  # the branch's


class Script:
    """What a branch replays: `calls` (one session's records) answered until call `live_from`."""

    def __init__(self, calls: list[ModelCall], live_from: int):
        by_index: dict[int, list[ModelCall]] = {}
        for call in calls:
            by_index.setdefault(call.call_index, []).append(call)
        self.calls = {i: sorted(choices, key=lambda c: c.choice_index) for i, choices in by_index.items()}
        self.live_from = live_from
        self.replayed = 0  # calls answered from the record so far
        self.diverged: Divergence | None = None

    def answer(self, call_index: int, prompt_ids: list[int], choices: int) -> list[ModelCall] | None:
        """The recorded choices of call `call_index` if the branch is still on the record there, else None
        (the call goes live). A prompt that differs is the branch's divergence, at its first differing token; a
        request for another number of choices than the record's, at token -1."""
        recorded = self.calls.get(call_index)
        if self.diverged is not None or call_index >= self.live_from or recorded is None:
            return None
        if recorded[0].prompt_ids != prompt_ids:
            self.diverged = divergence(call_index, recorded[0].prompt_ids, prompt_ids)
            return None
        if len(recorded) != choices:
            self.diverged = Divergence(call_index, -1, None, None)
            return None
        self.replayed += 1
        return recorded

    def report(self) -> dict[str, Any]:
        """What the branch replayed, for its session's info."""
        exact = self.diverged is None and self.replayed == min(self.live_from, len(self.calls))
        return {"source": next(iter(self.calls.values()))[0].session_id if self.calls else None,
                "live_from": self.live_from, "replayed": self.replayed, "exact": exact,
                "diverged": asdict(self.diverged) if self.diverged is not None else None}


def divergence(call_index: int, recorded: list[int], sent: list[int]) -> Divergence:
    """The first token where two prompts differ (one may be the other's prefix).

    >>> divergence(1, [5, 6, 7], [5, 6, 9])
    Divergence(call_index=1, token=2, recorded=7, sent=9)
    >>> divergence(0, [5, 6], [5, 6, 7]).recorded is None
    True
    """
    token = next((i for i, (a, b) in enumerate(zip(recorded, sent)) if a != b), min(len(recorded), len(sent)))
    return Divergence(call_index, token, recorded[token] if token < len(recorded) else None,
                      sent[token] if token < len(sent) else None)


def generation(call: ModelCall, tokenizer) -> Generation:
    """A recorded choice as the engine's answer: its ids, logprobs, versions, alternatives and prefix-cache hit; its
    text as vLLM detokenises (special tokens skipped), cut where a stop string matched."""
    text = tokenizer.decode(call.output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if isinstance(call.stop_reason, str) and call.stop_reason in text:
        text = text[:text.index(call.stop_reason)]
    return Generation(output_ids=list(call.output_ids), output_logprobs=list(call.output_logprobs),
                      output_versions=list(call.output_versions), text=text,
                      finish_reason="stop" if call.finish_reason == "tool_calls" else call.finish_reason,  # as parsed
                      stop_reason=call.stop_reason, replica=call.replica, cached_tokens=call.cached_tokens,
                      top_logprobs=[dict(pairs) for pairs in call.top_logprobs] if call.top_logprobs else None)
