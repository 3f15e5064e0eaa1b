"""What is written for one served call: one ModelCall per choice, the token-level record training reads.

Pure (no I/O): `CallService.record` writes what `model_calls` returns, before the response leaves the proxy.
"""

from __future__ import annotations

from typing import Any

from polar_lab.proxy.canonical import CompletedCall
from polar_lab.types import ModelCall


def call_id(session_id: str, call_index: int, choice_index: int) -> str:
    """`<session>-<call index, 4 digits>-<choice>`: sorts in arrival order within a session.

    >>> call_id("s1", 7, 2)
    's1-0007-2'
    """
    return f"{session_id}-{call_index:04d}-{choice_index}"


def model_calls(call: CompletedCall, request: dict[str, Any], response: dict[str, Any], *, responded: float,
                engine_version: int) -> list[ModelCall]:
    """The records of `call`, answered at unix time `responded`. A choice that sampled no token carries
    `engine_version` (the engine's version when it answered) as its policy version."""
    total_s = responded - call.timings["received"]
    timings = {**call.timings, "responded": responded, "total_s": total_s,
               "proxy_s": total_s - call.timings["engine_s"] - call.timings.get("paused_s", 0.0)}
    records = []
    for choice in call.choices:
        gen = choice.generation
        records.append(ModelCall(
            call_id=call_id(call.session.id, call.call_index, choice.index),
            session_id=call.session.id, call_index=call.call_index, request_id=call.request_id,
            choice_index=choice.index, api=call.api, model=call.model, prompt_ids=call.prompt_ids,
            output_ids=gen.output_ids, output_logprobs=gen.output_logprobs, output_versions=gen.output_versions,
            policy_version=gen.output_versions[0] if gen.output_versions else engine_version,
            finish_reason=choice.finish_reason, stop_reason=gen.stop_reason,
            sampling={**call.sampling, "seed": choice.seed},  # each choice's own seed (n > 1: derived)
            request=request, response=response, render=call.render, parse=choice.parsed.info(),
            timings=timings, replica=gen.replica, moved_from=gen.moved_from, delivered=call.delivered,
            replayed=call.replayed, cached_tokens=gen.cached_tokens,
            top_logprobs=[list(alts.items()) for alts in gen.top_logprobs] if gen.top_logprobs else None))
    return records



_ID_FIELDS = ("prompt_token_ids", "input_messages", "output_messages")


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    """The response as recorded and kept (CallService.record): the token ids vLLM's extensions add to it (`return_token_ids`: `prompt_token_ids`
    and each choice's `token_ids`; the Responses API's `enable_response_messages`: `input_messages`,
    `output_messages`) are left out — they are the record's own `prompt_ids` and `output_ids`, and a second copy
    of every prompt would double what a session writes.

    >>> without_ids({"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2]}]})
    {'choices': [{'index': 0}]}
    """
    if not any(name in response for name in _ID_FIELDS):
        return response
    out = {k: v for k, v in response.items() if k not in _ID_FIELDS}
    if "choices" in response:
        out["choices"] = [{k: v for k, v in c.items() if k != "token_ids"} for c in response["choices"]]
    return out
